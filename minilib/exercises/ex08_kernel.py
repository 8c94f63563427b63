"""Notebook 08's exercise: which KV blocks a block of q rows must visit (and so copy)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import as_int, compare_values
from minilib.kv_cache import cdiv
from minilib.masking import kv_blocks_to_visit

__all__ = ["check_kv_blocks_to_visit"]


def _reference(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
    first, end = kv_blocks_to_visit(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window)
    return int(first), int(end)


def _as_ints(fn: Callable) -> Callable:
    def run(*args):
        out = fn(*args)
        try:
            first, end = out
        except (TypeError, ValueError):
            return out
        return as_int(first), as_int(end)  # unchanged when not whole numbers

    return run


def check_kv_blocks_to_visit(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window) -> (first, end)`:
    the KV blocks [first, end) of a sequence that hold a key some row of a q block can see.
    The kernel (`seq_kv_blocks`), the blockwise version and the schedule all use
    `minilib.masking.kv_blocks_to_visit`, which this checks against.

    The q block's rows sit at positions first_q_pos..last_q_pos (inclusive) of the sequence;
    KV block b holds keys [b * kv_tokens_per_block, (b + 1) * kv_tokens_per_block); the row at
    position p sees keys 0..p, and with a sliding window w only keys p - w + 1..p.
    sliding_window may be None.

    >>> check_kv_blocks_to_visit(_reference)
    Passed: kv_blocks_to_visit matches the reference on all 15 cases.
    CheckResult('kv_blocks_to_visit', status='passed')
    """
    rng = np.random.default_rng(900 + seed)
    # (q_len, kv_len, rows of the q block within the sequence [r0, r1), kv_tokens_per_block,
    #  sliding_window)
    specs = [
        (1, 41, (0, 1), 16, None),  # a decode: the last key is in block 2
        (1, 48, (0, 1), 16, None),  # ... exactly at the end of a block
        (1, 33, (0, 1), 16, None),  # ... alone at the start of a block
        (8, 8, (0, 8), 4, None),  # a prefill, all its rows in one q block
        (32, 40, (8, 16), 8, None),  # a middle q block of a chunk
        (3, 20, (0, 3), 16, None),
        (1, 41, (0, 1), 16, 8),  # decode with a window: early blocks are skipped
        (1, 25, (0, 1), 16, 9),  # ... the window's first key starts a block (key 16)
        (16, 64, (0, 8), 8, 5),
        (6, 6, (2, 6), 2, 3),
        (4, 6, (0, 4), 4, 10),  # the window reaches back past key 0: block 0, not below
    ]
    for _ in range(4):
        kv_len = int(rng.integers(2, 80))
        q_len = int(rng.integers(1, kv_len + 1))
        r0 = int(rng.integers(0, q_len))
        r1 = int(rng.integers(r0 + 1, q_len + 1))
        window = None if rng.random() < 0.5 else int(rng.integers(1, 20))
        specs.append((q_len, kv_len, (r0, r1), int(rng.choice([4, 8, 16])), window))
    cases = []
    for q_len, kv_len, (r0, r1), tokens, window in specs:
        first_q_pos, last_q_pos = kv_len - q_len + r0, kv_len - q_len + r1 - 1
        cases.append(
            Case(
                f"rows at positions {first_q_pos}..{last_q_pos} of a sequence with "
                f"kv_len={kv_len}; KV blocks of kv_tokens_per_block={tokens}; "
                f"sliding_window={window}",
                (first_q_pos, last_q_pos, tokens, window),
            )
        )

    def ignoring_the_window(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
        return 0, last_q_pos // kv_tokens_per_block + 1

    def window_off_by_one(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
        end = last_q_pos // kv_tokens_per_block + 1
        if sliding_window is None:
            return 0, end
        return max(first_q_pos - sliding_window, 0) // kv_tokens_per_block, end

    def window_of_the_last_row(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
        end = last_q_pos // kv_tokens_per_block + 1
        if sliding_window is None:
            return 0, end
        return max(last_q_pos - sliding_window + 1, 0) // kv_tokens_per_block, end

    def window_not_clamped(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
        end = last_q_pos // kv_tokens_per_block + 1
        if sliding_window is None:
            return 0, end
        return (first_q_pos - sliding_window + 1) // kv_tokens_per_block, end

    def end_exclusive_wrong(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
        first, _ = _reference(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window)
        return first, cdiv(last_q_pos, kv_tokens_per_block)

    def end_of_the_first_row(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
        first, _ = _reference(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window)
        return first, first_q_pos // kv_tokens_per_block + 1

    # A case where two mistakes give the same answer is named after the first that matches:
    # the window off by one comes first, as ignoring the window fails an earlier case.
    mistakes = {
        "the window's first key: a row at position p sees keys p - sliding_window + 1 .. p, "
        "so the first block is max(first_q_pos - sliding_window + 1, 0) // "
        "kv_tokens_per_block.": _as_ints(window_off_by_one),
        "the sliding window: no row sees a key before first_q_pos - sliding_window + 1, so the "
        "blocks before the one holding it are never needed (copying them would waste "
        "bandwidth).": _as_ints(ignoring_the_window),
        "the window reaches back past key 0: first_q_pos - sliding_window + 1 is negative, "
        "and a negative block would copy pages through entries before the sequence's page "
        "table row. Clamp the first key at 0: max(first_q_pos - sliding_window + 1, 0).": (
            _as_ints(window_not_clamped)
        ),
        "the window of the *first* row reaches back furthest: start from first_q_pos, not "
        "last_q_pos.": _as_ints(window_of_the_last_row),
        "end is exclusive: the block holding key last_q_pos is last_q_pos // "
        "kv_tokens_per_block, so end = last_q_pos // kv_tokens_per_block + 1 (rounding "
        "last_q_pos up misses it when it starts a block).": _as_ints(end_exclusive_wrong),
        "the *last* row sees furthest: end comes from last_q_pos, not first_q_pos.": (
            _as_ints(end_of_the_first_row)
        ),
    }
    compare = diagnose(lambda want, got, case: compare_values(want, got, "(first, end)"), mistakes)
    return run_check(
        "kv_blocks_to_visit", _as_ints(fn), _reference, cases, compare, verbose=verbose
    )
