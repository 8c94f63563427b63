"""Rung 5 of the kernel ladder: prefetching across grid steps.

In rung 4 each grid step waits for its first page: nothing overlaps that copy. Here the last
page of sequence s already starts the copy of the first page of sequence s + 1, in the
*previous* grid step. So the whole batch is one stream of work, (seq, page) after (seq, page),
and every step of it starts the copy of the next one:

    grid step 0 starts the copy of the very first work into slot 0
    in every grid step, for each page of its sequence, with `slot` carried along:
        nxt = next_work(seq, page)
        if there is one: start the copy of nxt into slot 1 - slot
        wait for (seq, page) in slot;  compute;  slot = 1 - slot

A sequence slot with kv_len 0 (an empty slot) has no pages, so no work: the stream skips it,
and the very first work is page 0 of the first sequence that has pages, as in the full
kernel, which skips the sequences with no q rows.

`next_work` is the whole difficulty, so it is written in plain Python first (`next_work`) and
checked event by event against `minilib.schedule.plan_schedule`, the plan of the full kernel,
which does exactly this on a decode batch with one page per KV block. Then the same function in
jnp (`next_work_in_kernel`, with `next_seq_with_pages`) runs inside the kernel.

A copy started in one grid step is waited for in the next, and the slot to use next is kept in
SMEM scratch between them: the grid steps are no longer independent, so the axis is
"arbitrary", never "parallel" (on a megacore chip a "parallel" axis may be split over two cores,
and core 1 would wait for a copy that core 0 started).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.kv_cache import pages_needed
from minilib.ladder.flash import init_online_softmax
from minilib.ladder.scalar_prefetch import attend_kv_block, decode_pallas_call, write_output

__all__ = [
    "decode_schedule",
    "first_seq_with_pages",
    "next_work",
    "paged_decode_attention_prefetch",
    "planned_decode_schedule",
]


def next_work(seq: int, page: int, kv_lens, num_seqs: int, page_size: int):
    """The (seq, page) the kernel works on after page `page` of sequence `seq`: the next page of
    this sequence, else page 0 of the next sequence that has pages (kv_len 0: none); None after
    the last page of the last such sequence.

    >>> [next_work(0, 0, [20, 5], 2, 8), next_work(0, 2, [20, 5], 2, 8),
    ...  next_work(1, 0, [20, 5], 2, 8), next_work(0, 0, [3, 0, 9], 3, 8)]
    [(0, 1), (1, 0), None, (2, 0)]
    """
    if page + 1 < pages_needed(int(kv_lens[seq]), page_size):
        return seq, page + 1
    later = first_seq_with_pages(seq + 1, kv_lens, num_seqs)
    return None if later is None else (later, 0)


def first_seq_with_pages(seq: int, kv_lens, num_seqs: int):
    """The first sequence from `seq` on whose kv_len is not 0, or None.

    >>> first_seq_with_pages(0, [0, 0, 4], 3), first_seq_with_pages(1, [5, 0], 2)
    (2, None)
    """
    while seq < num_seqs and int(kv_lens[seq]) == 0:
        seq += 1
    return seq if seq < num_seqs else None


def decode_schedule(next_work_fn, kv_lens, page_size: int, num_seqs: int | None = None):
    """The events (kind, seq, page, slot) of a decode batch, as `next_work_fn` orders the work.

    The same events, in the same order, as `plan_schedule` lists for this kernel:
    one start of the first work (page 0 of the first sequence with pages), then per work:
    start the next one (if any) into the other slot, wait for this one, compute it.
    `num_seqs` (default: all of kv_lens) are live; the slots past them are padding.

    >>> decode_schedule(next_work, [9, 3], page_size=8)[:4]
    [('start', 0, 0, 0), ('start', 0, 1, 1), ('wait', 0, 0, 0), ('compute', 0, 0, 0)]
    """
    num_seqs = len(kv_lens) if num_seqs is None else num_seqs
    first = first_seq_with_pages(0, kv_lens, num_seqs)
    if first is None:  # no sequence has a page: no work at all
        return []
    events, here, slot = [("start", first, 0, 0)], (first, 0), 0
    limit = 2 + sum(pages_needed(int(n), page_size) for n in kv_lens)  # work items, and some slack
    while here is not None and len(events) < 3 * limit:
        nxt = next_work_fn(*here, kv_lens, num_seqs, page_size)
        if nxt is not None:
            nxt = tuple(_index_or_repr(x) for x in nxt)
            events.append(("start", *nxt, 1 - slot))
        events += [("wait", *here, slot), ("compute", *here, slot)]
        here, slot = nxt, 1 - slot
    return events


def _index_or_repr(x):
    """An integer as a Python int; anything else ("1", [1], 1.0) as its repr, so that it shows
    in the events and never equals the planned number."""
    try:
        return operator.index(x)
    except TypeError:
        return repr(x)


def planned_decode_schedule(kv_lens, page_size: int, num_seqs: int | None = None) -> list:
    """`plan_schedule`'s events for a decode batch with these kv_lens, as (kind, seq, page,
    slot): one page per KV block, one q row (one sequence) per q block. Only the first
    `num_seqs` (default: all) are live.

    >>> planned_decode_schedule([9, 3], 8) == decode_schedule(next_work, [9, 3], 8)
    True
    """
    from minilib.batch import make_batch
    from minilib.schedule import plan_schedule

    # An empty slot (kv_len 0) is an idle sequence with no q row: no work in the full kernel.
    live = list(kv_lens)[: len(kv_lens) if num_seqs is None else num_seqs]
    seq_lens = [(1, int(n)) if int(n) > 0 else (0, 0) for n in live]
    batch = make_batch(seq_lens, num_q_heads=1, num_kv_heads=1, head_dim=8, page_size=page_size,
                       max_num_seqs=max(len(kv_lens), 1))  # fmt: skip
    plan = plan_schedule(*batch.args(), num_kv_pages_per_block=1, num_queries_per_block=1)
    return [(e.kind, e.seq, e.kv_blk, e.slot) for e in plan.events]


def next_seq_with_pages(seq, kv_lens_ref, num_seqs):
    """`first_seq_with_pages` on traced scalars: the first sequence from `seq` on with
    kv_len > 0, or `num_seqs` if there is none. (kv_lens_ref is read at `num_seqs - 1` at
    most: `&` evaluates both sides.)"""

    def empty(s):
        return (s < num_seqs) & (kv_lens_ref[jnp.minimum(s, num_seqs - 1)] == 0)

    return lax.while_loop(empty, lambda s: s + 1, seq)


def next_work_in_kernel(seq, page, kv_lens_ref, num_seqs, page_size: int):
    """`next_work` on traced scalars: returns (has_next, next_seq, next_page)."""
    more_pages = (page + 1) * page_size < kv_lens_ref[seq]
    later = next_seq_with_pages(seq + 1, kv_lens_ref, num_seqs)
    next_seq = jnp.where(more_pages, seq, later)
    next_page = jnp.where(more_pages, page + 1, 0)
    return more_pages | (later < num_seqs), next_seq, next_page


def paged_decode_attention_prefetch(
    q, kv_pages, kv_lens, page_indices, *, sm_scale: float, interpret=False, kernel=None
) -> jax.Array:  # the arrays of rung 2 (`scalar_prefetch.paged_decode_attention`)
    """Paged decode attention; the copy of each sequence's first page starts in the grid step
    before it.

    `kernel` (default `prefetch_kernel`) may be replaced by a kernel body with the same arguments.

    >>> from minilib.batch import make_batch
    >>> from minilib.ladder.double_buffer import paged_decode_attention_double_buffered
    >>> b = make_batch([(1, 5), (1, 20), (1, 3)], page_size=8, head_dim=128)
    >>> args, interpret = (b.q, b.kv_pages, b.kv_lens, b.page_indices), pltpu.InterpretParams()
    >>> out = paged_decode_attention_prefetch(*args, sm_scale=0.1, interpret=interpret)
    >>> rung_4 = paged_decode_attention_double_buffered(*args, sm_scale=0.1, interpret=interpret)
    >>> bool((out == rung_4).all())  # the same pages in the same order: the same answer
    True
    """
    return decode_pallas_call(
        functools.partial(kernel or prefetch_kernel, sm_scale=sm_scale),
        q, kv_pages, kv_lens, page_indices,
        grid=(q.shape[0],),  # (num_seqs,)
        kv_spec=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[
            pltpu.VMEM((2, *kv_pages.shape[1:]), kv_pages.dtype),  # bufs: two slots of a page
            pltpu.SemaphoreType.DMA((2,)),  # sems: one per slot
            pltpu.SMEM((1,), jnp.int32),  # slot_ref: the slot the next work is loading into
        ],
        # "arbitrary": a step waits for the copy the step before it started.
        dimension_semantics=("arbitrary",),
        interpret=interpret,
    )  # fmt: skip


def prefetch_kernel(
    kv_lens_ref, page_indices_ref, q_ref, kv_pages_hbm_ref, o_ref, bufs, sems, slot_ref, m_ref,
    l_ref, acc_ref, *, sm_scale: float
):  # fmt: skip
    """Grid step seq: the pages of sequence seq; the last one starts the next sequence's copy.

    The refs of rung 4's kernel, and slot_ref: i32[1], SMEM, kept from one grid step to the
    next."""
    seq, num_seqs = pl.program_id(0), pl.num_programs(0)
    kv_len, page_size = kv_lens_ref[seq], bufs.shape[1]

    def page_copy(seq, i, slot):
        page = page_indices_ref[seq, i]
        return pltpu.make_async_copy(kv_pages_hbm_ref.at[page], bufs.at[slot], sems.at[slot])

    @pl.when(seq == 0)
    def _start_the_very_first_copy():
        slot_ref[0] = 0
        first = next_seq_with_pages(0, kv_lens_ref, num_seqs)

        @pl.when(first < num_seqs)  # some sequence has a page
        def _():
            page_copy(first, 0, 0).start()

    def attend_page(i, slot):
        has_next, next_seq, next_page = next_work_in_kernel(
            seq, i, kv_lens_ref, num_seqs, page_size
        )

        @pl.when(has_next)
        def _prefetch_the_next_work():
            page_copy(next_seq, next_page, 1 - slot).start()

        page_copy(seq, i, slot).wait()
        attend_kv_block(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len,
                        sm_scale)  # fmt: skip
        return 1 - slot

    init_online_softmax(m_ref, l_ref, acc_ref)
    slot_ref[0] = lax.fori_loop(0, pl.cdiv(kv_len, page_size), attend_page, slot_ref[0])
    write_output(o_ref, l_ref, acc_ref)
