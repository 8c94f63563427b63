"""Notebook 02's exercises: write a step's new tokens into the paged cache, then read a whole
sequence back."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from minilib.batch import make_batch
from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, compare_arrays
from minilib.kv_cache import gather_kv, pages_needed

__all__ = ["check_gather_kv", "check_write_new_tokens"]


def _write_new_tokens(kv_pages, pages, kv_len, new_k, new_v):
    n = new_k.shape[0]
    page_size = kv_pages.shape[1]
    positions = kv_len - n + jnp.arange(n)  # the new tokens are the sequence's last n
    page, slot = jnp.asarray(pages)[positions // page_size], positions % page_size
    return kv_pages.at[page, slot, 0::2].set(new_k).at[page, slot, 1::2].set(new_v)


def check_write_new_tokens(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(kv_pages, pages, kv_len, new_k, new_v) -> kv_pages`: the cache with a
    sequence's n new tokens written in, every other slot unchanged.

      kv_pages:     [total_num_pages, page_size, 2*num_kv_heads, head_dim]
      pages:        i32[pages_per_seq]  the sequence's row of page_indices, in token order
      kv_len:       the sequence's length *after* this write (it counts the new tokens)
      new_k, new_v: [n, num_kv_heads, head_dim]  so the new tokens are kv_len - n .. kv_len - 1

    The caches come from `make_batch`: slots no sequence uses hold NaN, so a write to the
    wrong slot shows. The sequence already owns every page it needs.

    >>> check_write_new_tokens(_write_new_tokens)
    Passed: write_new_tokens matches the reference on all 7 cases.
    CheckResult('write_new_tokens', status='passed')
    """
    rng = np.random.default_rng(300 + seed)
    specs = [  # (seq_lens, which sequence, n new tokens, num_kv_heads, page_size)
        ([(1, 7), (1, 5)], 0, 1, 1, 4),  # a decode in the middle of a page
        ([(1, 9), (1, 3)], 0, 1, 2, 4),  # a decode that opens a new page
        ([(6, 6), (1, 4)], 0, 6, 2, 4),  # a prefill over two pages
        ([(1, 3), (5, 11)], 1, 5, 1, 4),  # a chunk that crosses a page boundary
        ([(3, 3), (2, 8)], 1, 2, 3, 2),  # three KV heads, pages of two tokens
        ([(4, 4)], 0, 4, 1, 1),  # pages of one token
    ]
    kv_len = int(rng.integers(2, 30))
    specs.append(([(1, 5), (kv_len, kv_len)], 1, int(rng.integers(1, kv_len + 1)), 2, 8))
    cases = []
    for k, (seq_lens, i, n, num_kv_heads, page_size) in enumerate(specs):
        batch = make_batch(seq_lens, num_q_heads=num_kv_heads, num_kv_heads=num_kv_heads,
                           head_dim=4, page_size=page_size, pages_per_seq=4,
                           seed=320 + seed + k)  # fmt: skip
        kv_len = seq_lens[i][1]
        new_k, new_v = (
            jnp.asarray(rng.standard_normal((n, num_kv_heads, 4)), jnp.float32) for _ in "kv"
        )
        pages = batch.page_indices[i]
        cases.append(
            Case(
                f"kv_pages.shape={batch.kv_pages.shape} (num_kv_heads={num_kv_heads}), "
                f"pages={pages.tolist()}, kv_len={kv_len}, {n} new token(s): "
                + (f"token {kv_len - 1}" if n == 1 else f"tokens {kv_len - n}..{kv_len - 1}"),
                (batch.kv_pages, pages, kv_len, new_k, new_v),
            )
        )

    def compare(want, got, case):
        where = _first_wrong_slot(want, got, case.args[1], case.args[0].shape[1])
        try:
            compare_arrays(want, got, "kv_pages")
        except Mismatch as diff:
            raise Mismatch(f"{where}\n{diff}" if where else str(diff)) from None

    def write_at(positions_of):
        def write(kv_pages, pages, kv_len, new_k, new_v):
            page_size = kv_pages.shape[1]
            positions = positions_of(kv_len, new_k.shape[0])
            page, slot = jnp.asarray(pages)[positions // page_size], positions % page_size
            return kv_pages.at[page, slot, 0::2].set(new_k).at[page, slot, 1::2].set(new_v)

        return write

    def page_column(kv_pages, pages, kv_len, new_k, new_v):
        positions = kv_len - new_k.shape[0] + jnp.arange(new_k.shape[0])
        page, slot = positions // kv_pages.shape[1], positions % kv_pages.shape[1]
        return kv_pages.at[page, slot, 0::2].set(new_k).at[page, slot, 1::2].set(new_v)

    def halves(kv_pages, pages, kv_len, new_k, new_v):
        n, num_kv_heads = new_k.shape[:2]
        positions = kv_len - n + jnp.arange(n)
        page = jnp.asarray(pages)[positions // kv_pages.shape[1]]
        slot = positions % kv_pages.shape[1]
        kv_pages = kv_pages.at[page, slot, :num_kv_heads].set(new_k)
        return kv_pages.at[page, slot, num_kv_heads:].set(new_v)

    mistakes = {
        "kv_len already counts the new tokens: they are tokens kv_len - n .. kv_len - 1, not "
        "kv_len .. kv_len + n - 1.": write_at(lambda kv_len, n: kv_len + jnp.arange(n)),
        "the new tokens are the sequence's *last* n tokens, not its first: token kv_len - n + j "
        "for new token j.": write_at(lambda kv_len, n: jnp.arange(n)),
        "t // page_size is the token's page *column*, its index into `pages`; the page in "
        "kv_pages is pages[t // page_size].": page_column,
        "K and V are swapped: K of KV head h goes to combined slot 2*h, V to 2*h + 1.": (
            lambda kv_pages, pages, kv_len, new_k, new_v: _write_new_tokens(
                kv_pages, pages, kv_len, new_v, new_k
            )
        ),
        "K and V are interleaved, not in two halves: K of KV head h goes to slot 2*h, V to "
        "2*h + 1 (kv_pages[page, slot, 0::2] and [page, slot, 1::2]).": halves,
    }
    return run_check(
        "write_new_tokens",
        fn,
        _write_new_tokens,
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )


def _first_wrong_slot(want, got, pages, page_size: int) -> str:
    """'page 5, slot 2 (token 9 of this sequence) differs', or '' if that cannot be said."""
    try:
        want, have = np.asarray(want, np.float64), np.asarray(got, np.float64)
        if want.shape != have.shape:
            return ""
        same = np.isclose(want, have, atol=1e-5, rtol=1e-5, equal_nan=True)
        bad = np.argwhere(~same.all(axis=(2, 3)))
    except Exception:
        return ""
    if not len(bad):
        return ""
    page, slot = (int(x) for x in bad[0])
    columns = [c for c, p in enumerate(np.asarray(pages).tolist()) if p == page]
    owner = (
        f"token {columns[0] * page_size + slot} of this sequence"
        if columns
        else "a page this sequence does not own"
    )
    return f"{len(bad)} (page, slot) pairs differ; the first is page {page}, slot {slot} ({owner})"


def check_gather_kv(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(kv_pages, pages, kv_len) -> (k, v)`, one sequence's keys and values in
    token order, each [kv_len, num_kv_heads, head_dim].

    The cache comes from `make_batch`: unused slots and pages hold NaN, so reading past
    kv_len shows.

    >>> from minilib.kv_cache import gather_kv, pages_needed
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

    def pool_order(kv_pages, pages, kv_len):  # pages 0, 1, 2, ... of the pool
        _, _, combined, head_dim = kv_pages.shape
        return _split(kv_pages.reshape(-1, combined, head_dim)[:kv_len])

    mistakes = {
        "the gather ignores the page table: your tokens are the pool's pages in its own order "
        "(kv_pages[0], kv_pages[1], ...). Page i of this sequence is kv_pages[pages[i]]: "
        "index kv_pages with the page table, `kv_pages[pages]`.": pool_order,
        "K and V are swapped: K of KV head h is in combined slot 2*h (even, [:, 0::2]), V in "
        "slot 2*h + 1 (odd, [:, 1::2]).": lambda *a: gather_kv(*a)[::-1],
        "K and V are interleaved, not in two halves: K of KV head h is slot 2*h, V is slot "
        "2*h + 1. Take [:, 0::2] and [:, 1::2].": slots_0_to_n,
        "the last page is only partly used: keep the first kv_len tokens, not whole pages.": (
            lambda kv_pages, pages, kv_len: _split(
                _all_tokens(kv_pages, pages)[
                    : pages_needed(kv_len, kv_pages.shape[1]) * kv_pages.shape[1]
                ]
            )
        ),
    }
    return run_check(
        "gather_kv", fn, gather_kv, cases, diagnose(compare, mistakes), verbose=verbose
    )


def _all_tokens(kv_pages, pages):
    _, page_size, combined, head_dim = kv_pages.shape
    return kv_pages[np.asarray(pages)].reshape(-1, combined, head_dim)


def _split(tokens):
    return tokens[:, 0::2], tokens[:, 1::2]
