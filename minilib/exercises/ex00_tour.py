"""Notebook 00's warm-up: how many pages hold a sequence."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minilib.exercises.checking import Case, CheckResult, compare_values, diagnose, run_check
from minilib.kv_cache import pages_needed


def check_pages_needed(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(kv_len, page_size) -> int`, the number of pages that hold kv_len tokens.

    >>> check_pages_needed(lambda kv_len, page_size: -(-kv_len // page_size))
    Passed: pages_needed matches the reference on all 14 cases.
    CheckResult('pages_needed', status='passed')
    """
    rng = np.random.default_rng(100 + seed)
    pairs = [(int(rng.integers(1, 300)), int(rng.choice([4, 8, 16, 32]))) for _ in range(6)]
    pairs += [(1, 16), (16, 16), (17, 16), (32, 16), (33, 16), (5, 1), (0, 16), (128, 128)]
    cases = [Case(f"kv_len={kv_len}, page_size={page_size}", (kv_len, page_size)) for
             kv_len, page_size in pairs]  # fmt: skip
    mistakes = {
        "kv_len // page_size + 1 is one too many when page_size divides kv_len exactly "
        "(and gives 1 page for 0 tokens). Round up instead: -(-kv_len // page_size).": (
            lambda kv_len, page_size: kv_len // page_size + 1
        ),
        "kv_len // page_size rounds down: the last, partly filled page needs a page too.": (
            lambda kv_len, page_size: kv_len // page_size
        ),
    }
    compare = diagnose(lambda want, got, case: compare_values(want, got, "pages"), mistakes)
    return run_check("pages_needed", fn, pages_needed, cases, compare, verbose=verbose)
