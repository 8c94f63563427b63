"""Notebook 08's exercise in plain Python: `next_work`, the order rung 5 prefetches in.

Rung 5 prefetches across grid steps: when a grid step computes the last page of its sequence,
it starts the copy of the next sequence's first page. `next_work(seq, page, kv_lens, num_seqs,
page_size)` says which work comes after page `page` of sequence `seq`; it must skip the empty
slots (kv_len 0, no page at all) and stop at `num_seqs`.

`check_next_work` checks the schedule the learner's `next_work` makes, event by event, against
the full kernel's plan, and names the usual mistakes: no next sequence, a page count off by one,
a step into an empty slot, a sequence past `num_seqs`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, expected_vs_got
from minilib.ladder.prefetch import decode_schedule, planned_decode_schedule

__all__ = ["check_next_work"]


def _schedule_of(next_work_fn: Callable) -> Callable:
    def run(kv_lens, page_size, num_seqs):
        return decode_schedule(_plain_work(next_work_fn), kv_lens, page_size, num_seqs)

    return run


def _plain_work(next_work_fn: Callable) -> Callable:
    """`next_work_fn` with its answer as Python ints: NumPy and JAX integers, 0-d arrays and
    a 2-element array are as good as a tuple of ints; anything else is kept as it is, for the
    events to show."""

    def plain(*args):
        nxt = next_work_fn(*args)
        if nxt is None or isinstance(nxt, str | bytes) or np.ndim(nxt) != 1:
            return nxt
        try:
            return tuple(_int_or_same(x) for x in nxt)
        except TypeError:
            return nxt

    return plain


def _int_or_same(x):
    if isinstance(x, bool | np.bool_) or np.ndim(x) != 0:
        return x
    try:
        return operator.index(np.asarray(x).item() if np.ndim(x) == 0 else x)
    except TypeError:
        return x


def _compare_events(expected, got, case: Case) -> None:
    if got == expected:
        return
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            raise Mismatch(
                f"event {i} (as (kind, seq, page, slot)) differs:\n"
                + expected_vs_got("  event", want, have)
            )
    shorter = "fewer" if len(got) < len(expected) else "more"
    raise Mismatch(
        f"{len(got)} events, {shorter} than the plan's {len(expected)}; the first "
        f"{min(len(got), len(expected))} agree. "
        + (
            f"Next planned: {expected[len(got)]}"
            if len(got) < len(expected)
            else f"Extra: {got[len(expected)]}"
        )  # fmt: skip
    )


def check_next_work(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(seq, page, kv_lens, num_seqs, page_size) -> (seq, page) or None`: the work after
    page `page` of sequence `seq` in a decode batch (a sequence with kv_len 0 has no page, so
    no work), None after the very last.

    The schedule it gives (`minilib.ladder.prefetch.decode_schedule`: start the first copy, then
    for each work start the next one into the other slot, wait, compute) must be, event by
    event, the full kernel's plan (`plan_schedule`, one page per KV block). kv_lens come as a
    list, a NumPy array or a JAX array.

    >>> from minilib.ladder.prefetch import next_work
    >>> check_next_work(next_work)
    Passed: next_work matches the reference on all 8 cases.
    CheckResult('next_work', status='passed')
    """
    rng = np.random.default_rng(880 + seed)
    # (kv_lens, page_size, num_seqs): the slots past num_seqs are padding, with garbage
    specs = [
        ([20, 5], 8, 2),
        ([8, 8, 8], 8, 3),  # whole pages, every sequence
        ([1], 16, 1),
        ([3, 17, 1, 9], 4, 4),
        ([16, 0, 0, 7, 0], 8, 5),  # empty slots after a whole-page sequence, and at the end
        ([0, 4, 0], 4, 3),  # an empty slot first
        ([9, 3, 77, 5], 8, 2),  # two padding slots past num_seqs
    ]
    random_lens = [int(n) for n in rng.integers(0, 30, size=4)]
    specs.append((random_lens, int(rng.choice([4, 8])), 4))
    as_given = [list, np.asarray, jnp.asarray]
    cases = [
        Case(
            f"kv_lens={kv_lens} (as {('a list', 'a NumPy array', 'a JAX array')[i % 3]}), "
            f"num_seqs={num_seqs}, page_size={page_size}",
            (as_given[i % 3](kv_lens), page_size, num_seqs),
        )
        for i, (kv_lens, page_size, num_seqs) in enumerate(specs)
    ]

    def no_next_sequence(seq, page, kv_lens, num_seqs, page_size):
        return (seq, page + 1) if (page + 1) * page_size < kv_lens[seq] else None

    def page_count_off_by_one(seq, page, kv_lens, num_seqs, page_size):
        if page + 1 <= kv_lens[seq] // page_size:
            return seq, page + 1
        return (seq + 1, 0) if seq + 1 < num_seqs else None

    def into_empty_slots(seq, page, kv_lens, num_seqs, page_size):
        if (page + 1) * page_size < kv_lens[seq]:
            return seq, page + 1
        return (seq + 1, 0) if seq + 1 < num_seqs else None

    def past_num_seqs(seq, page, kv_lens, num_seqs, page_size):
        if (page + 1) * page_size < kv_lens[seq]:
            return seq, page + 1
        return (seq + 1, 0) if seq + 1 < len(kv_lens) else None

    mistakes = {
        "after a sequence's last page comes page 0 of the next sequence: prefetching across "
        "grid steps means the last page of one sequence starts the copy of the next one's "
        "first page.": _schedule_of(no_next_sequence),
        "the number of pages is ceil(kv_len / page_size): a sequence of kv_len=16 and "
        "page_size=8 has pages 0 and 1, kv_len=17 has pages 0, 1 and 2.": _schedule_of(
            page_count_off_by_one
        ),
        "a sequence with kv_len 0 (an empty slot) has no page 0: skip it, to the next "
        "sequence that has pages (its page-table row is garbage).": _schedule_of(into_empty_slots),
        "only the first num_seqs sequences are live: the slots past them are padding, with "
        "garbage in them (use num_seqs, not len(kv_lens)).": _schedule_of(past_num_seqs),
    }
    return run_check(
        "next_work",
        _schedule_of(fn),
        planned_decode_schedule,
        cases,
        diagnose(_compare_events, mistakes),
        verbose=verbose,
    )
