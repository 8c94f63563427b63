"""Notebook 02's exercises: find a token in the paged cache, then read a whole sequence."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minilib.batch import make_batch
from minilib.exercises.checking import (
    Case,
    CheckResult,
    Mismatch,
    as_int,
    compare_arrays,
    diagnose,
    expected_vs_got,
    run_check,
)
from minilib.reference import gather_kv


def _token_location(t: int, pages, page_size: int) -> tuple[int, int]:
    return int(pages[t // page_size]), t % page_size


def check_token_location(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(t, pages, page_size) -> (page, slot)`: where token t of a sequence whose
    pages, in token order, are `pages` (its row of page_indices) is stored in kv_pages.

    Every token of each sequence is tried.

    >>> check_token_location(lambda t, pages, page_size: (pages[t // page_size], t % page_size))
    Passed: token_location matches the reference on all 5 cases.
    CheckResult('token_location', status='passed')
    """
    rng = np.random.default_rng(300 + seed)
    cases = []
    for page_size, num_pages in [(4, 3), (8, 2), (2, 5), (16, 1), (1, 4)]:
        pages = [int(p) for p in rng.choice(24, size=num_pages, replace=False)]
        cases.append(
            Case(f"pages={pages}, page_size={page_size}, every token t", (pages, page_size))
        )

    def every_token(f):
        return lambda pages, page_size: [
            _pair(f(t, pages, page_size)) for t in range(len(pages) * page_size)
        ]

    def compare(want, got, case):
        for t, (w, g) in enumerate(zip(want, got, strict=True)):
            if w != g:
                raise Mismatch(
                    f"token t={t}: expected (page, slot) = {w}, got {g}\n"
                    + expected_vs_got("(page, slot) of tokens 0..", want[: t + 3], got[: t + 3])
                )

    mistakes = {
        "t // page_size is the token's page *column*, its index into `pages`; the page number "
        "in kv_pages is pages[t // page_size].": every_token(
            lambda t, pages, page_size: (t // page_size, t % page_size)
        ),
        "(page, slot) are swapped: the page comes from t // page_size, the slot from "
        "t % page_size.": every_token(
            lambda t, pages, page_size: (t % page_size, pages[t // page_size])
        ),
    }
    return run_check(
        "token_location",
        every_token(fn),
        every_token(_token_location),
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )


def check_gather_kv(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(kv_pages, pages, kv_len) -> (k, v)`, one sequence's keys and values in
    token order, each [kv_len, num_kv_heads, head_dim].

    The cache comes from `make_batch`: unused slots and pages hold NaN, so reading past
    kv_len shows.

    >>> from minilib.reference import gather_kv
    >>> check_gather_kv(gather_kv)
    Passed: gather_kv matches the reference on all 5 cases.
    CheckResult('gather_kv', status='passed')
    """
    cases = []
    configs = [  # (seq_lens, num_kv_heads, page_size)
        ([(1, 7), (3, 12)], 2, 4),
        ([(5, 5)], 1, 8),
        ([(1, 9), (2, 16)], 3, 2),
    ]
    for k, (seq_lens, num_kv_heads, page_size) in enumerate(configs):
        batch = make_batch(
            seq_lens,
            num_q_heads=num_kv_heads,
            num_kv_heads=num_kv_heads,
            head_dim=4,
            page_size=page_size,
            seed=310 + seed + k,
        )
        for i, (_, kv_len) in enumerate(seq_lens):
            pages = batch.page_indices[i]
            cases.append(
                Case(
                    f"kv_pages.shape={batch.kv_pages.shape} (num_kv_heads={num_kv_heads}), "
                    f"pages={np.asarray(pages).tolist()}, kv_len={kv_len}",
                    (batch.kv_pages, pages, kv_len),
                )
            )

    def compare(want, got, case):
        if not isinstance(got, tuple | list) or len(got) != 2:
            raise Mismatch(f"expected a pair (k, v), got {type(got).__name__}")
        compare_arrays(want[0], got[0], "k")
        compare_arrays(want[1], got[1], "v")

    def slots_0_to_n(kv_pages, pages, kv_len):  # K = first half of the head axis
        tokens = _all_tokens(kv_pages, pages)[:kv_len]
        half = tokens.shape[1] // 2
        return tokens[:, :half], tokens[:, half:]

    mistakes = {
        "K and V are swapped: K of KV head h is in combined slot 2*h (even, [:, 0::2]), V in "
        "slot 2*h + 1 (odd, [:, 1::2]).": lambda *a: gather_kv(*a)[::-1],
        "K and V are interleaved, not in two halves: K of KV head h is slot 2*h, V is slot "
        "2*h + 1. Take [:, 0::2] and [:, 1::2].": slots_0_to_n,
        "the last page is only partly used: keep the first kv_len tokens, not whole pages.": (
            lambda kv_pages, pages, kv_len: _split(
                _all_tokens(kv_pages, pages)[: -(-kv_len // kv_pages.shape[1]) * kv_pages.shape[1]]
            )
        ),
    }
    return run_check(
        "gather_kv", fn, gather_kv, cases, diagnose(compare, mistakes), verbose=verbose
    )


def _pair(out):
    """(page, slot) as two ints, or what came back if it is not a pair of integers."""
    try:
        page, slot = out
    except (TypeError, ValueError):
        return out
    return as_int(page), as_int(slot)


def _all_tokens(kv_pages, pages):
    _, page_size, combined, head_dim = kv_pages.shape
    return kv_pages[np.asarray(pages)].reshape(-1, combined, head_dim)


def _split(tokens):
    return tokens[:, 0::2], tokens[:, 1::2]
