"""Notebook 09's exercise: the bytes a decode step must read from HBM."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minilib.exercises.checking import (
    Case,
    CheckResult,
    as_int,
    compare_values,
    diagnose,
    run_check,
)
from minilib.roofline import rpa_cost


def _reference(kv_lens, page_size, num_kv_heads, head_dim, itemsize):
    cost = rpa_cost(
        [(1, int(kv)) for kv in kv_lens],
        num_q_heads=num_kv_heads,  # q heads do not change the KV bytes
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        kv_itemsize=itemsize,
    )
    return int(cost.kv_bytes)


def _as_int(fn: Callable) -> Callable:
    def run(*args):
        return as_int(fn(*args))  # the value unchanged when it is not a whole number

    return run


def check_decode_kv_bytes(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(kv_lens, page_size, num_kv_heads, head_dim, itemsize) -> int`: the bytes of
    KV cache one decode step reads from HBM, for sequences of `kv_lens` tokens each decoding
    one token. K and V of every KV head are read, in whole pages (`itemsize` bytes a value).

    >>> check_decode_kv_bytes(_reference)
    Passed: decode_kv_bytes matches the reference on all 8 cases.
    CheckResult('decode_kv_bytes', status='passed')
    """
    rng = np.random.default_rng(1000 + seed)
    specs = [
        ([1024], 16, 8, 128, 2),  # Llama-3-8B-like, bf16
        ([17, 33, 100], 16, 8, 128, 2),  # partial last pages
        ([1], 128, 1, 64, 4),
        ([64, 64], 16, 4, 128, 1),  # fp8
    ]
    for _ in range(4):
        kv_lens = [int(x) for x in rng.integers(1, 3000, size=int(rng.integers(1, 6)))]
        page_size = int(rng.choice([8, 16, 32, 64]))
        specs.append((kv_lens, page_size, int(rng.choice([1, 2, 8])), 128, int(rng.choice([1, 2]))))
    cases = [
        Case(
            f"kv_lens={kv_lens}, page_size={ps}, num_kv_heads={h}, head_dim={d}, itemsize={i}",
            (kv_lens, ps, h, d, i),
        )
        for kv_lens, ps, h, d, i in specs
    ]

    def k_only(kv_lens, page_size, num_kv_heads, head_dim, itemsize):
        return _reference(kv_lens, page_size, num_kv_heads, head_dim, itemsize) // 2

    def tokens_not_pages(kv_lens, page_size, num_kv_heads, head_dim, itemsize):
        return sum(kv_lens) * 2 * num_kv_heads * head_dim * itemsize

    mistakes = {
        "K and V are both read: 2 * num_kv_heads * head_dim values per token.": _as_int(k_only),
        "the cache is read in whole pages: a sequence of kv_len tokens reads "
        "ceil(kv_len / page_size) * page_size token slots.": _as_int(tokens_not_pages),
    }
    compare = diagnose(lambda want, got, case: compare_values(want, got, "bytes"), mistakes)
    return run_check("decode_kv_bytes", _as_int(fn), _reference, cases, compare, verbose=verbose)
