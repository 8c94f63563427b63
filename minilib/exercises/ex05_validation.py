"""Notebook 05's exercise: a dynamic check, every page a live sequence uses is in the pool."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from minilib.batch import make_batch
from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch
from minilib.kv_cache import pages_needed

__all__ = ["check_validate_page_indices"]

RETURNED = "returned"


def _first_bad_page(
    kv_pages,
    kv_lens,
    page_indices,
    num_seqs,
    *,
    live_only=True,
    used_only=True,
    pages_of=None,
    allow_end=False,
    allow_negative=False,
):
    """(sequence, column, page) of the first used page outside the pool, or None.

    The keywords switch on the mistakes the checker recognises."""
    total_num_pages, page_size = kv_pages.shape[:2]
    kv_lens, table = np.asarray(kv_lens), np.asarray(page_indices)
    pages_of = pages_of or pages_needed
    n = int(np.asarray(num_seqs)[0]) if live_only else table.shape[0]
    for i in range(n):
        used = pages_of(int(kv_lens[i]), page_size) if used_only else table.shape[1]
        for j in range(min(used, table.shape[1])):
            page = int(table[i, j])
            low = page < 0 and not allow_negative
            high = page > total_num_pages or (page == total_num_pages and not allow_end)
            if low or high:
                return i, j, page
    return None


def _outcome(fn: Callable) -> Callable:
    """Run a validator; say whether it raised ValueError (and with what) or returned.

    Any other exception propagates, and the checker reports it as the learner's bug."""

    def run(kv_pages, kv_lens, page_indices, num_seqs):
        try:
            fn(kv_pages, kv_lens, page_indices, num_seqs)
        except ValueError as err:
            return ("raised", f"{type(err).__name__}: {err}")
        except AssertionError as err:
            return ("asserted", str(err))
        return (RETURNED, None)

    return run


def _verdict(**mistake) -> Callable:
    """The reference's outcome, or that of a validator making `mistake`."""

    def verdict(kv_pages, kv_lens, page_indices, num_seqs):
        bad = _first_bad_page(kv_pages, kv_lens, page_indices, num_seqs, **mistake)
        return (RETURNED, None) if bad is None else ("raised", _entry(*bad))

    return verdict


def check_validate_page_indices(
    fn: Callable, *, seed: int = 0, verbose: bool = True
) -> CheckResult:
    """Check `fn(kv_pages, kv_lens, page_indices, num_seqs)`: it must raise ValueError (or a
    subclass, such as RPAInputError) whose message names the bad page number, when a live
    sequence i < num_seqs[0] uses a page outside the pool, and return quietly otherwise.

    Sequence i uses the first ceil(kv_lens[i] / page_size) columns of page_indices[i]; a used
    page must be in [0, total_num_pages). Its other columns, and every slot past num_seqs,
    may hold anything. (kv_lens[i] fits in the row: that is another check.)

    >>> def validate(kv_pages, kv_lens, page_indices, num_seqs):
    ...     total_num_pages, page_size = kv_pages.shape[:2]
    ...     for i in range(int(num_seqs[0])):
    ...         for j in range(-(-int(kv_lens[i]) // page_size)):
    ...             if not 0 <= page_indices[i, j] < total_num_pages:
    ...                 raise ValueError(f"{i=}, {j=}: page {page_indices[i, j]} is not a page")
    >>> check_validate_page_indices(validate)
    Passed: validate_page_indices matches the reference on all 10 cases.
    CheckResult('validate_page_indices', status='passed')
    """
    rng = np.random.default_rng(600 + seed)
    cases = []

    def add(description, batch, edits=()):
        table = np.asarray(batch.page_indices).copy()
        for (i, j), page in edits:
            table[i, j] = page
        args = (batch.kv_pages, batch.kv_lens, jnp.asarray(table), batch.num_seqs)
        bad = _first_bad_page(*args)
        verdict = "valid" if bad is None else _entry(*bad)
        lens = f"kv_lens={batch.kv_lens.tolist()}, num_seqs={batch.num_seqs.tolist()}"
        cases.append(
            Case(
                f"{description}: total_num_pages={batch.kv_pages.shape[0]}, "
                f"page_size={batch.kv_pages.shape[1]}, {lens}, "
                f"page_indices={table.tolist()} ({verdict})",
                args,
            )
        )

    def batch(seq_lens, page_size=4, max_num_seqs=None, k=0):
        return make_batch(seq_lens, num_q_heads=1, num_kv_heads=1, head_dim=2,
                          page_size=page_size, max_num_seqs=max_num_seqs, pages_per_seq=4,
                          seed=610 + seed + k)  # fmt: skip

    b = batch([(1, 6), (2, 9), (3, 3)], max_num_seqs=5)
    total = b.kv_pages.shape[0]
    add("a valid batch with two padding slots", b)
    add("unused columns hold garbage", b, [((0, 3), -7), ((1, 3), total + 50), ((2, 1), total)])
    add("a used page one past the end", b, [((1, 1), total)])
    add("a negative page (numpy and JAX would read the last page)", b, [((0, 0), -1)])
    add("the last, partly filled page is bad", b, [((1, 2), total + 3)])
    b2 = batch([(1, 6), (1, 8)], k=1)
    add(
        "kv_len=8, a multiple of page_size: the column after its pages is unused",
        b2,
        [((0, 3), b2.kv_pages.shape[0] + 77), ((1, 2), -1)],
    )
    add("the last live sequence's page is bad", b2, [((1, 1), b2.kv_pages.shape[0] + 9)])
    b3 = batch([(1, 3), (0, 0), (2, 2)], page_size=2, max_num_seqs=4, k=2)
    add("a sequence with kv_len=0 uses no page", b3, [((1, 0), -3), ((1, 1), 999)])
    kv_lens = [int(x) for x in rng.integers(1, 17, size=3)]
    b4 = batch([(1, kv) for kv in kv_lens], max_num_seqs=4, k=3)
    i = int(rng.integers(0, 3))
    j = int(rng.integers(0, pages_needed(kv_lens[i], 4)))
    add("random lengths, one bad page", b4, [((i, j), int(rng.choice([-2, 100])))])
    add("random lengths, valid", b4)

    def compare(want, got, case):
        (want_kind, bad), (got_kind, message) = want, got
        if got_kind == "asserted":
            raise Mismatch(
                f"your function failed an assert ({message or 'no message'}). Raise ValueError "
                "instead: `python -O` removes asserts, and an error should name the values."
            )
        if want_kind == RETURNED and got_kind != RETURNED:
            raise Mismatch(
                f"this batch is valid, but your function raised {message}\n"
                "(unused columns of page_indices and slots past num_seqs may hold anything)"
            )
        if want_kind != RETURNED and got_kind == RETURNED:
            raise Mismatch(
                f"{bad} is outside the pool and sequence {_sequence(bad)} uses it, but your "
                "function returned without raising ValueError."
            )
        if want_kind != RETURNED and _page(bad) not in message:
            raise Mismatch(
                f"your error does not name the bad page {_page(bad)} ({bad}): "
                f'{message}\nSay which value is wrong, e.g. with f"{{page=}}".'
            )

    mistakes = {
        "a sequence uses only its first ceil(kv_len / page_size) columns; the others are "
        "unused and may hold anything. Check only those.": _verdict(used_only=False),
        "only the first num_seqs[0] sequence slots are live; the rest is padding and may hold "
        "anything.": _verdict(live_only=False),
        "page numbers run from 0 to total_num_pages - 1: total_num_pages itself is already "
        "outside the pool (use <, not <=).": _verdict(allow_end=True),
        "a negative page is outside the pool too: Python, NumPy and JAX would quietly read a "
        "page from the end.": _verdict(allow_negative=True),
        "kv_len // page_size rounds down and skips the last, partly filled page; round up: "
        "-(-kv_len // page_size).": _verdict(pages_of=lambda kv, ps: kv // ps),
        "kv_len // page_size + 1 counts one page too many when kv_len is a multiple of "
        "page_size; round up instead: -(-kv_len // page_size).": _verdict(
            pages_of=lambda kv, ps: kv // ps + 1
        ),
    }
    return run_check(
        "validate_page_indices",
        _outcome(fn),
        _verdict(),
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )


def _entry(i: int, j: int, page: int) -> str:
    """'page_indices[1, 2]=57': the bad entry, as the verdicts carry it."""
    return f"page_indices[{i}, {j}]={page}"


def _sequence(entry: str) -> str:
    return entry.split("[", 1)[1].split(",", 1)[0]


def _page(entry: str) -> str:
    return entry.rsplit("=", 1)[1]
