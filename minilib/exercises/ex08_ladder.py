"""Notebook 08's kernel exercises: rungs 2 to 5 of the ladder, paged decode attention.

Every kernel checker runs the learner's `fn(q, kv_pages, kv_lens, page_indices, *, sm_scale,
interpret)` on decode batches from `make_batch` (NaN in every unused page slot and page) in
strict TPU interpret mode, against plain jnp, then compiles it for v5e when libtpu is installed.
`check_next_work` checks a plain Python function, event by event against the full kernel's
plan (`minilib.schedule.plan_schedule`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.batch import make_batch
from minilib.exercises.checking import (
    Case,
    CheckResult,
    Mismatch,
    diagnose,
    expected_vs_got,
    run_check,
)
from minilib.exercises.kernel_checking import check_kernel
from minilib.ladder.prefetch import decode_schedule, planned_decode_schedule
from minilib.ladder.scalar_prefetch import paged_decode_reference

__all__ = [
    "check_double_buffered_decode",
    "check_next_work",
    "check_paged_decode_async_copy",
    "check_paged_decode_attention",
    "check_prefetching_decode",
]


def _decode_cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(850 + seed)
    random_lens = [int(n) for n in rng.integers(1, 40, size=2)]
    # (kv_lens, page_size, pages_per_seq, num_q_heads, num_kv_heads, head_dim)
    specs = [
        ([5, 20, 1, 16], 8, 4, 4, 2, 128),  # a one-token sequence, a full last page, spare slots
        (random_lens, 16, 3, 4, 1, 64),  # MQA: one KV head for all q heads
    ]
    cases = []
    for i, (kv_lens, page_size, pages_per_seq, num_q_heads, num_kv_heads, head_dim) in enumerate(
        specs
    ):
        batch = make_batch(
            [(1, n) for n in kv_lens],
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            pages_per_seq=pages_per_seq,
            seed=seed * 10 + i,
        )
        what = (
            f"kv_lens={kv_lens}, page_size={page_size}, pages_per_seq={pages_per_seq}, "
            f"num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}; NaN "
            "in unused page slots and pages"
        )
        args = (batch.q, batch.kv_pages, batch.kv_lens, batch.page_indices)
        cases.append(Case(what, args, dict(sm_scale=float(head_dim) ** -0.5)))
    return cases


def _compile_case() -> Case:
    num_seqs, pages_per_seq, page_size, total_num_pages = 8, 8, 16, 64
    num_q_heads, num_kv_heads, head_dim = 8, 2, 128
    i32, bf16 = jnp.int32, jnp.bfloat16
    return Case(
        f"bf16, {num_seqs} sequences, page_size={page_size}, num_q_heads={num_q_heads}, "
        f"num_kv_heads={num_kv_heads}, head_dim={head_dim}",
        (
            jax.ShapeDtypeStruct((num_seqs, num_q_heads, head_dim), bf16),
            jax.ShapeDtypeStruct((total_num_pages, page_size, 2 * num_kv_heads, head_dim), bf16),
            jax.ShapeDtypeStruct((num_seqs,), i32),
            jax.ShapeDtypeStruct((num_seqs, pages_per_seq), i32),
        ),
        dict(sm_scale=head_dim**-0.5),
    )


def _decode_mistakes() -> dict[str, Callable]:
    def k_v_halves(q, kv_pages, kv_lens, page_indices, *, sm_scale):
        # K as the first half of the combined heads, V as the second: not interleaved.
        num_kv_heads = kv_pages.shape[2] // 2
        halves = jnp.concatenate([kv_pages[:, :, :num_kv_heads], kv_pages[:, :, num_kv_heads:]])
        interleaved = jnp.stack([halves[: len(kv_pages)], halves[len(kv_pages) :]], axis=3)
        kv = interleaved.reshape(kv_pages.shape)
        return paged_decode_reference(q, kv, kv_lens, page_indices, sm_scale=sm_scale)

    def pages_by_position(q, kv_pages, kv_lens, page_indices, *, sm_scale):
        # Page i of every sequence taken as kv_pages[i]: the page table ignored.
        positions = jnp.broadcast_to(jnp.arange(page_indices.shape[1]), page_indices.shape)
        return paged_decode_reference(q, kv_pages, kv_lens, positions, sm_scale=sm_scale)

    def no_sm_scale(q, kv_pages, kv_lens, page_indices, *, sm_scale):
        return paged_decode_reference(q, kv_pages, kv_lens, page_indices, sm_scale=1.0)

    return {
        "K and V are interleaved on the combined head axis: K of KV head h is slot 2h, V is "
        "slot 2h + 1 (not the first and second halves).": k_v_halves,
        "the page table is not used: page i of sequence seq is kv_pages[page_indices[seq, i]], "
        "not kv_pages[i].": pages_by_position,
        "sm_scale is not applied to the scores.": no_sm_scale,
    }


def _check_decode_kernel(name: str, fn: Callable, seed: int, verbose: bool) -> CheckResult:
    return check_kernel(
        name,
        fn,
        paged_decode_reference,
        _decode_cases(seed),
        compile_case=_compile_case(),
        mistakes=_decode_mistakes(),
        atol=2e-5,
        verbose=verbose,
    )


def check_paged_decode_attention(
    fn: Callable, *, seed: int = 0, verbose: bool = True
) -> CheckResult:
    """Rung 2: `fn(q, kv_pages, kv_lens, page_indices, *, sm_scale, interpret)`, paged decode
    attention whose index map reads `page_indices` (scalar prefetch).

    q: [num_seqs, num_q_heads, head_dim]; kv_pages: [total_num_pages, page_size,
    2*num_kv_heads, head_dim]; kv_lens: i32[num_seqs]; page_indices: i32[num_seqs,
    pages_per_seq]. Returns [num_seqs, num_q_heads, head_dim].

    >>> from minilib.ladder.scalar_prefetch import paged_decode_attention
    >>> check_paged_decode_attention(paged_decode_attention).status
    Passed: paged_decode_attention matches the reference on all 2 cases...
    'passed'
    """
    return _check_decode_kernel("paged_decode_attention", fn, seed, verbose)


def check_paged_decode_async_copy(
    fn: Callable, *, seed: int = 0, verbose: bool = True
) -> CheckResult:
    """Rung 3: like `check_paged_decode_attention`, for the kernel that copies each page itself
    (`kv_pages` in `pl.ANY`, one buffer, `make_async_copy(...).start()` then `.wait()`).

    >>> from minilib.ladder.async_copy import paged_decode_attention_async_copy as fn
    >>> check_paged_decode_async_copy(fn).status
    Passed: paged_decode_async_copy matches the reference on all 2 cases...
    'passed'
    """
    return _check_decode_kernel("paged_decode_async_copy", fn, seed, verbose)


def check_double_buffered_decode(
    fn: Callable, *, seed: int = 0, verbose: bool = True
) -> CheckResult:
    """Rung 4: like `check_paged_decode_attention`, for the kernel that double-buffers the pages
    of one sequence (two slots, two semaphores). The race detector must find no race.

    >>> from minilib.ladder.double_buffer import paged_decode_attention_double_buffered as fn
    >>> check_double_buffered_decode(fn).status
    Passed: double_buffered_decode matches the reference on all 2 cases...
    'passed'
    """
    return _check_decode_kernel("double_buffered_decode", fn, seed, verbose)


def check_prefetching_decode(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Rung 5: like `check_paged_decode_attention`, for the kernel whose grid steps prefetch the
    next sequence's first page (`next_work` in the kernel, the slot kept in SMEM).

    >>> from minilib.ladder.prefetch import paged_decode_attention_prefetch as fn
    >>> check_prefetching_decode(fn).status
    Passed: prefetching_decode matches the reference on all 2 cases...
    'passed'
    """
    return _check_decode_kernel("prefetching_decode", fn, seed, verbose)


# --- next_work, in plain Python ---------------------------------------------------------------


def _schedule_of(next_work_fn: Callable) -> Callable:
    def run(kv_lens, page_size):
        return decode_schedule(next_work_fn, kv_lens, page_size)

    return run


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
    page `page` of sequence `seq` in a decode batch, None after the very last.

    The schedule it gives (`minilib.ladder.prefetch.decode_schedule`: start the first copy, then
    for each work start the next one into the other slot, wait, compute) must be, event by
    event, the full kernel's plan (`plan_schedule`, one page per KV block).

    >>> from minilib.ladder.prefetch import next_work
    >>> check_next_work(next_work)
    Passed: next_work matches the reference on all 5 cases.
    CheckResult('next_work', status='passed')
    """
    rng = np.random.default_rng(880 + seed)
    specs = [([20, 5], 8), ([8, 8, 8], 8), ([1], 16), ([3, 17, 1, 9], 4)]
    specs.append(([int(n) for n in rng.integers(1, 30, size=3)], int(rng.choice([4, 8]))))
    cases = [
        Case(f"kv_lens={kv_lens}, page_size={page_size}", (kv_lens, page_size))
        for kv_lens, page_size in specs
    ]

    def no_next_sequence(seq, page, kv_lens, num_seqs, page_size):
        return (seq, page + 1) if (page + 1) * page_size < kv_lens[seq] else None

    def page_count_off_by_one(seq, page, kv_lens, num_seqs, page_size):
        if page + 1 <= kv_lens[seq] // page_size:
            return seq, page + 1
        return (seq + 1, 0) if seq + 1 < num_seqs else None

    mistakes = {
        "after a sequence's last page comes page 0 of the next sequence: prefetching across "
        "grid steps means the last page of one sequence starts the copy of the next one's "
        "first page.": _schedule_of(no_next_sequence),
        "the number of pages is ceil(kv_len / page_size): a sequence of kv_len=16 and "
        "page_size=8 has pages 0 and 1, kv_len=17 has pages 0, 1 and 2.": _schedule_of(
            page_count_off_by_one
        ),
    }
    return run_check(
        "next_work",
        _schedule_of(fn),
        planned_decode_schedule,
        cases,
        diagnose(_compare_events, mistakes),
        verbose=verbose,
    )
