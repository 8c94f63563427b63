"""Notebook 03's exercises: the causal mask with its offset, and which sequence owns a row."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from minilib.batch import seq_kind
from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, as_int, compare_masks, expected_vs_got
from minilib.masking import causal_mask

__all__ = ["check_causal_mask", "check_seq_for_row", "describe_seq"]


def describe_seq(q_len: int, kv_len: int) -> str:
    """One sequence's q_len and kv_len in words, for the checkers' case names.

    >>> describe_seq(3, 7)
    'q_len=3, kv_len=7: a prefill chunk, 3 new tokens after 4 cached ones'
    >>> describe_seq(1, 5)
    'q_len=1, kv_len=5: a decode, 1 new token after 4 cached ones'
    """
    kind = seq_kind(q_len, kv_len)
    what = {
        "prefill": "a prefill, every token new",
        "decode": f"a decode, 1 new token after {kv_len - 1} cached ones",
        "chunk": f"a prefill chunk, {q_len} new tokens after {kv_len - q_len} cached ones",
        "idle": "idle, no new tokens",
    }[kind]
    return f"q_len={q_len}, kv_len={kv_len}: {what}"


def _mask_without_offset(q_len, kv_len):  # rows taken as the first q_len tokens
    return jnp.arange(kv_len)[None, :] > jnp.arange(q_len)[:, None]


def _mask_without_diagonal(q_len, kv_len):  # a row may not see itself
    q_pos = kv_len - q_len + jnp.arange(q_len)[:, None]
    return jnp.arange(kv_len)[None, :] >= q_pos


def check_causal_mask(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(q_len, kv_len) -> bool[q_len, kv_len]`, True where q row i may NOT see key j.

    The q rows are the sequence's newest q_len tokens, so row i sits at position
    kv_len - q_len + i.

    >>> from minilib.masking import causal_mask
    >>> check_causal_mask(causal_mask)
    Passed: causal_mask matches the reference on all 9 cases.
    CheckResult('causal_mask', status='passed')
    """
    rng = np.random.default_rng(400 + seed)
    pairs = [(3, 7), (1, 6), (4, 4)]
    for _ in range(3):
        kv_len = int(rng.integers(2, 10))
        pairs.append((int(rng.integers(1, kv_len + 1)), kv_len))
    pairs += [(1, 1), (2, 9), (5, 6)]
    cases = [Case(describe_seq(q, kv), (q, kv)) for q, kv in pairs]
    mistakes = {
        "True must mean *masked* (may not see); your mask is the opposite.": (
            lambda q_len, kv_len: ~causal_mask(q_len, kv_len)
        ),
        "the q rows are the *last* q_len tokens of the sequence, not the first: row i sits at "
        "position kv_len - q_len + i, and sees every key up to it.": _mask_without_offset,
        "off by one: a row sees its own token (the diagonal), so mask only keys with "
        "position > the row's position.": _mask_without_diagonal,
    }
    compare = diagnose(lambda want, got, case: compare_masks(want, got, "mask"), mistakes)
    return run_check("causal_mask", fn, causal_mask, cases, compare, verbose=verbose)


def _seq_for_row(cu_q_lens, num_seqs, row: int) -> int:
    n = int(np.asarray(num_seqs)[0])
    return int(np.searchsorted(np.asarray(cu_q_lens)[1 : n + 1], row, side="right"))


def check_seq_for_row(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(cu_q_lens, num_seqs, row) -> int`: the sequence i whose q rows
    [cu_q_lens[i], cu_q_lens[i+1]) hold `row`. Every live row of each batch is tried.

    Idle sequences (q_len 0) own no row; entries past num_seqs are padding garbage, sometimes
    larger than every row and sometimes not, so a search that reads them shows.

    >>> check_seq_for_row(_seq_for_row)
    Passed: seq_for_row matches the reference on all 7 cases.
    CheckResult('seq_for_row', status='passed')
    """
    rng = np.random.default_rng(410 + seed)
    # (q_lens, the padding slots' garbage)
    batches = [
        ([3, 1, 1, 4], [99, 99]),  # garbage larger than every row
        ([2, 0, 3], [1, 0]),  # garbage smaller than the rows, not in order
        ([0, 1, 2, 0, 2], [2, 4, 1]),  # garbage inside the rows' range
        ([5], [0, 3]),
        ([1, 1, 1], [1, 1]),
        ([2, 0, 0, 3, 0], []),  # idle sequences in a row, and last; no padding slot
    ]
    random_lens = [int(x) for x in rng.integers(0, 4, size=4)]
    batches.append((random_lens, [int(x) for x in rng.integers(0, sum(random_lens) + 2, size=2)]))
    cases = []
    for q_lens, garbage in batches:
        n = len(q_lens)
        cu = np.asarray([0, *np.cumsum(q_lens), *garbage], np.int32)
        cu_q_lens, num_seqs = jnp.asarray(cu), jnp.asarray([n], jnp.int32)
        cases.append(
            Case(
                f"q_lens={q_lens}: cu_q_lens={cu.tolist()} (past num_seqs: padding), "
                f"num_seqs=[{n}], every live row",
                (cu_q_lens, num_seqs),
            )
        )

    def every_row(f):
        def rows(cu_q_lens, num_seqs):
            total = int(cu_q_lens[int(num_seqs[0])])
            return [as_int(f(cu_q_lens, num_seqs, r)) for r in range(total)]

        return rows

    def compare(want, got, case):
        n = int(np.asarray(case.args[1])[0])
        for r, (w, g) in enumerate(zip(want, got, strict=True)):
            if w != g:
                past = isinstance(g, int) and not 0 <= g < n
                raise Mismatch(
                    f"row {r}: expected sequence {w}, got {g}\n"
                    + expected_vs_got(f"sequence of rows 0..{len(want) - 1}", want, got)
                    + (
                        f"\nLikely cause: sequence {g} is not live (num_seqs={n}): past "
                        "num_seqs, cu_q_lens holds padding garbage, which may be <= the row or "
                        "out of order. Look only at cu_q_lens[:num_seqs + 1]."
                        if past
                        else ""
                    )
                )

    def live(cu, n):
        return np.asarray(cu)[: int(np.asarray(n)[0]) + 1]

    def without_idle_sequences(cu, n, r):  # counts only the sequences that have rows
        starts = np.unique(live(cu, n))
        return int(np.searchsorted(starts[1:], r, side="right"))

    mistakes = {
        "a row equal to cu_q_lens[i+1] already belongs to the next sequence: the rows of "
        "sequence i are [cu_q_lens[i], cu_q_lens[i+1]), end excluded. (With searchsorted: "
        "side='right' on cu_q_lens[1:num_seqs + 1].)": every_row(
            lambda cu, n, r: int(np.searchsorted(live(cu, n)[1:], r))
        ),
        "an idle sequence (q_len 0) owns no row, but it keeps its place: the answer is the "
        "index of the sequence in the batch, idle ones counted.": every_row(without_idle_sequences),
        "only cu_q_lens[:num_seqs + 1] holds the batch: the entries past it are padding, "
        "garbage that need not be sorted nor larger than every row. Search only the live "
        "part.": every_row(
            lambda cu, n, r: int(np.searchsorted(np.asarray(cu)[1:], r, side="right"))
        ),
    }
    return run_check(
        "seq_for_row",
        every_row(fn),
        every_row(_seq_for_row),
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )
