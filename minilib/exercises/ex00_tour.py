"""Notebook 00's exercise: read a batch's sequences back out of its index arrays."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minilib.batch import make_batch
from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, as_int, expected_vs_got

__all__ = ["check_live_seq_lens"]


def _live_seq_lens(kv_lens, cu_q_lens, num_seqs) -> list[tuple[int, int]]:
    kv_lens, cu_q_lens = np.asarray(kv_lens), np.asarray(cu_q_lens)
    return [
        (int(cu_q_lens[i + 1] - cu_q_lens[i]), int(kv_lens[i])) for i in range(int(num_seqs[0]))
    ]


def check_live_seq_lens(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(kv_lens, cu_q_lens, num_seqs) -> [(q_len, kv_len), ...]`: the `(q_len,
    kv_len)` pair of every live sequence, in order, read from a padded batch's index arrays.

      kv_lens:   i32[max_num_seqs]      tokens in the cache per sequence, new ones included
      cu_q_lens: i32[max_num_seqs + 1]  where each sequence's rows start in q
      num_seqs:  i32[1]                 how many sequence slots are live

    The batches come from `make_batch` padded to more sequence slots than they use: the
    slots past `num_seqs[0]` hold garbage. The answer is the `seq_lens` they were made from.

    >>> check_live_seq_lens(_live_seq_lens)
    Passed: live_seq_lens matches the reference on all 6 cases.
    CheckResult('live_seq_lens', status='passed')
    """
    rng = np.random.default_rng(100 + seed)
    batches = [
        ([(5, 5), (1, 12), (3, 9)], 5),
        ([(1, 30), (4, 4)], 4),
        ([(2, 7), (0, 6), (1, 1)], 3),  # an idle sequence: q_len 0
        ([(6, 6)], 3),
    ]
    for _ in range(2):
        kv = [int(k) for k in rng.integers(1, 40, size=int(rng.integers(1, 5)))]
        pairs = [(int(rng.integers(0, k + 1)), k) for k in kv]
        batches.append((pairs, len(pairs) + int(rng.integers(1, 3))))
    cases = []
    for pairs, max_num_seqs in batches:
        b = make_batch(pairs, num_q_heads=1, num_kv_heads=1, head_dim=4, page_size=4,
                       max_num_seqs=max_num_seqs)  # fmt: skip
        cases.append(
            Case(
                f"kv_lens={b.kv_lens.tolist()}, cu_q_lens={b.cu_q_lens.tolist()}, "
                f"num_seqs={b.num_seqs.tolist()}",
                (b.kv_lens, b.cu_q_lens, b.num_seqs),
            )
        )

    def pairs_of(f):
        def run(*args):
            out = f(*args)
            try:
                return [(as_int(q), as_int(kv)) for q, kv in out]
            except (TypeError, ValueError):
                return out

        return run

    def compare(want, got, case):
        if not isinstance(got, list | tuple):
            raise Mismatch(f"expected a list of (q_len, kv_len) pairs, got {type(got).__name__}")
        if len(got) != len(want):
            raise Mismatch(
                f"expected {len(want)} sequences, got {len(got)}\n"
                + expected_vs_got("(q_len, kv_len)", want, got)
            )
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            if w != g:
                raise Mismatch(
                    f"sequence {i}: expected (q_len, kv_len) = {w}, got {g}\n"
                    + expected_vs_got("(q_len, kv_len)", want, got)
                )

    def every_slot(kv_lens, cu_q_lens, num_seqs):
        return _live_seq_lens(kv_lens, cu_q_lens, [len(kv_lens)])

    def cached_not_total(kv_lens, cu_q_lens, num_seqs):
        return [(q, kv - q) for q, kv in _live_seq_lens(kv_lens, cu_q_lens, num_seqs)]

    def starts_not_lengths(kv_lens, cu_q_lens, num_seqs):
        n = int(num_seqs[0])
        return [(int(cu_q_lens[i]), int(kv_lens[i])) for i in range(n)]

    def ends_not_lengths(kv_lens, cu_q_lens, num_seqs):
        n = int(num_seqs[0])
        return [(int(cu_q_lens[i + 1]), int(kv_lens[i])) for i in range(n)]

    mistakes = {
        "only the first num_seqs[0] slots are live; the slots after them are padding and hold "
        "garbage. Loop over range(num_seqs[0]).": pairs_of(every_slot),
        "kv_len counts every token in the cache, this step's new ones included: it is "
        "kv_lens[i] itself, not kv_lens[i] - q_len.": pairs_of(cached_not_total),
        "cu_q_lens holds where each sequence's rows *start*; q_len is the difference "
        "cu_q_lens[i+1] - cu_q_lens[i].": pairs_of(starts_not_lengths),
        "cu_q_lens[i+1] is where sequence i's rows end, counted from row 0 of q; subtract "
        "cu_q_lens[i] to get q_len.": pairs_of(ends_not_lengths),
    }
    return run_check(
        "live_seq_lens",
        pairs_of(fn),
        _live_seq_lens,
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )
