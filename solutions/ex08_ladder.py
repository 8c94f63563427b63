"""Solutions to notebook 08's kernel ladder, rungs 2 to 7.

Each kernel body goes into the rung's `pallas_call` from `minilib.ladder` (the `kernel=`
argument); the names the checkers call are bound at the end. The helpers used here,
`init_online_softmax`, `attend_kv_block`, `write_output`, `next_seq_with_pages`, and for rungs 6
and 7 `KVBlockCopy`, `attend_rows`, `write_rows` and `next_seq_with_rows`, are the ones the
notebook gives.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.ladder import (
    async_copy,
    double_buffer,
    prefetch,
    prefill_chunk,
    ragged,
    scalar_prefetch,
)
from minilib.ladder.flash import init_online_softmax
from minilib.ladder.prefetch import next_seq_with_pages
from minilib.ladder.prefill_chunk import KVBlockCopy, attend_rows, write_rows
from minilib.ladder.ragged import next_seq_with_rows
from minilib.ladder.scalar_prefetch import attend_kv_block, write_output

# --- Rung 2: the index map reads the page table (scalar prefetch) ------------------------------


def page_index_map(seq, i, kv_lens_ref, page_indices_ref, *, page_size):
    # Past the sequence's last page, stay on it: Pallas skips a copy when the block repeats,
    # and the entries past it are garbage. An empty slot (kv_len 0) has no page: use page 0.
    num_pages = pl.cdiv(kv_lens_ref[seq], page_size)
    page = page_indices_ref[seq, jnp.minimum(i, jnp.maximum(num_pages - 1, 0))]
    return (jnp.where(num_pages > 0, page, 0), 0, 0, 0)


def scalar_prefetch_kernel(
    kv_lens_ref, page_indices_ref, q_ref, page_ref, o_ref, m_ref, l_ref, acc_ref, *, sm_scale
):
    seq, i = pl.program_id(0), pl.program_id(1)
    kv_len, page_size = kv_lens_ref[seq], page_ref.shape[0]

    @pl.when(i == 0)
    def _init():
        init_online_softmax(m_ref, l_ref, acc_ref)

    @pl.when(i * page_size < kv_len)  # a page the sequence really has (saves the work)
    def _attend():
        attend_kv_block(page_ref, q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len, sm_scale)

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        write_output(o_ref, l_ref, acc_ref)


# --- Rung 3: one buffer, one async copy ---------------------------------------------------------


def async_copy_kernel(
    kv_lens_ref, page_indices_ref, q_ref, kv_pages_hbm_ref, o_ref, buf, sem, m_ref, l_ref,
    acc_ref, *, sm_scale
):  # fmt: skip
    seq, i = pl.program_id(0), pl.program_id(1)
    kv_len, page_size = kv_lens_ref[seq], buf.shape[0]

    @pl.when(i == 0)
    def _init():
        init_online_softmax(m_ref, l_ref, acc_ref)

    @pl.when(i * page_size < kv_len)
    def _copy_then_attend():
        copy = pltpu.make_async_copy(kv_pages_hbm_ref.at[page_indices_ref[seq, i]], buf, sem)
        copy.start()
        copy.wait()
        attend_kv_block(buf, q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len, sm_scale)

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        write_output(o_ref, l_ref, acc_ref)


# --- Rung 4: two slots, two semaphores -------------------------------------------------------


def double_buffer_kernel(
    kv_lens_ref, page_indices_ref, q_ref, kv_pages_hbm_ref, o_ref, bufs, sems, m_ref, l_ref,
    acc_ref, *, sm_scale
):  # fmt: skip
    seq = pl.program_id(0)
    kv_len, page_size = kv_lens_ref[seq], bufs.shape[1]

    def page_copy(i, slot):
        page = page_indices_ref[seq, i]
        return pltpu.make_async_copy(kv_pages_hbm_ref.at[page], bufs.at[slot], sems.at[slot])

    def body(i, _):
        slot = i % 2

        @pl.when(i + 1 < pl.cdiv(kv_len, page_size))
        def _():
            page_copy(i + 1, 1 - slot).start()  # into the slot nobody reads now

        page_copy(i, slot).wait()
        attend_kv_block(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len,
                        sm_scale)  # fmt: skip

    init_online_softmax(m_ref, l_ref, acc_ref)

    @pl.when(kv_len > 0)  # an empty slot has no page 0
    def _():
        page_copy(0, 0).start()

    lax.fori_loop(0, pl.cdiv(kv_len, page_size), body, None)
    write_output(o_ref, l_ref, acc_ref)


# --- Rung 5: next_work, in Python and in the kernel -----------------------------------------


def next_work(seq, page, kv_lens, num_seqs, page_size):
    if (page + 1) * page_size < kv_lens[seq]:  # this sequence has another page
        return seq, page + 1
    seq += 1
    while seq < num_seqs and kv_lens[seq] == 0:  # an empty slot has no page
        seq += 1
    if seq < num_seqs:  # the first page of the next sequence with pages
        return seq, 0
    return None  # the very last page of the batch


def prefetch_kernel(
    kv_lens_ref, page_indices_ref, q_ref, kv_pages_hbm_ref, o_ref, bufs, sems, slot_ref, m_ref,
    l_ref, acc_ref, *, sm_scale
):  # fmt: skip
    seq, num_seqs = pl.program_id(0), pl.num_programs(0)
    kv_len, page_size = kv_lens_ref[seq], bufs.shape[1]

    def page_copy(seq, i, slot):
        page = page_indices_ref[seq, i]
        return pltpu.make_async_copy(kv_pages_hbm_ref.at[page], bufs.at[slot], sems.at[slot])

    @pl.when(seq == 0)
    def _first():
        slot_ref[0] = 0
        first = next_seq_with_pages(0, kv_lens_ref, num_seqs)

        @pl.when(first < num_seqs)
        def _():
            page_copy(first, 0, 0).start()

    def body(i, slot):
        more_pages = (i + 1) * page_size < kv_len  # next_work, on traced scalars
        later = next_seq_with_pages(seq + 1, kv_lens_ref, num_seqs)
        next_seq = jnp.where(more_pages, seq, later)
        next_page = jnp.where(more_pages, i + 1, 0)

        @pl.when(more_pages | (later < num_seqs))
        def _():
            page_copy(next_seq, next_page, 1 - slot).start()

        page_copy(seq, i, slot).wait()
        attend_kv_block(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len,
                        sm_scale)  # fmt: skip
        return 1 - slot

    init_online_softmax(m_ref, l_ref, acc_ref)
    slot_ref[0] = lax.fori_loop(0, pl.cdiv(kv_len, page_size), body, slot_ref[0])
    write_output(o_ref, l_ref, acc_ref)


# --- Rung 6: a prefill chunk, KV blocks of several pages --------------------------------------


def kv_block(page_indices_ref, kv_pages_hbm_ref, bufs, sems, seq, kv_len, b, slot):
    """The copies of KV block b of sequence seq into `slot`: its pages, clamped to the last."""
    page_size = kv_pages_hbm_ref.shape[1]
    pages_per_block, last = bufs.shape[1] // page_size, pl.cdiv(kv_len, page_size) - 1
    pages = [page_indices_ref[seq, jnp.minimum(b * pages_per_block + p, last)]
             for p in range(pages_per_block)]  # fmt: skip
    return KVBlockCopy(kv_pages_hbm_ref, bufs, sems, pages, slot)


def prefill_chunk_kernel(
    kv_lens_ref, page_indices_ref, q_lens_ref, q_ref, kv_pages_hbm_ref, o_ref, bufs, sems,
    m_ref, l_ref, acc_ref, *, sm_scale
):  # fmt: skip
    seq, i = pl.program_id(0), pl.program_id(1)
    kv_len, q_len = kv_lens_ref[seq], q_lens_ref[seq]
    block_q, block_kv = q_ref.shape[0], bufs.shape[1]
    first_row = i * block_q
    q_pos = kv_len - q_len + first_row + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    last_row = jnp.minimum(first_row + block_q, q_len) - 1  # KV blocks past it: not seen
    num_kv_blocks = jnp.where(
        first_row < q_len, pl.cdiv(kv_len - q_len + last_row + 1, block_kv), 0
    )

    def copy(b, slot):
        return kv_block(page_indices_ref, kv_pages_hbm_ref, bufs, sems, seq, kv_len, b, slot)

    def body(b, _):
        slot = b % 2

        @pl.when(b + 1 < num_kv_blocks)
        def _():
            copy(b + 1, 1 - slot).start()

        copy(b, slot).wait()
        attend_rows(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, b * block_kv, q_pos, kv_len,
                    sm_scale)  # fmt: skip

    init_online_softmax(m_ref, l_ref, acc_ref)

    @pl.when(num_kv_blocks > 0)  # a q block with no live row copies nothing
    def _():
        copy(0, 0).start()

    lax.fori_loop(0, num_kv_blocks, body, None)
    write_rows(o_ref, l_ref, acc_ref)


# --- Rung 7: the ragged batch ---------------------------------------------------------------


def ragged_kernel(
    kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, q_ref, kv_pages_hbm_ref, o_ref,
    bufs, sems, slot_ref, m_ref, l_ref, acc_ref, *, sm_scale, mask_value
):  # fmt: skip
    q_blk, num_q_blks, num_seqs = pl.program_id(0), pl.num_programs(0), num_seqs_ref[0]
    block_q, block_kv = q_ref.shape[0], bufs.shape[1]
    first_row, end_row = q_blk * block_q, (q_blk + 1) * block_q
    cu = cu_q_lens_ref

    def num_kv_blocks(seq):  # up to the last row of seq in this q block
        last_row = jnp.minimum(cu[seq + 1], end_row) - 1
        q_len = cu[seq + 1] - cu[seq]
        return pl.cdiv(kv_lens_ref[seq] - q_len + last_row - cu[seq] + 1, block_kv)

    def copy(seq, b, slot):
        return kv_block(page_indices_ref, kv_pages_hbm_ref, bufs, sems, seq, kv_lens_ref[seq],
                        b, slot)  # fmt: skip

    def next_work(seq, b):
        more = b + 1 < num_kv_blocks(seq)  # the next KV block of this sequence
        later = next_seq_with_rows(seq + 1, cu[seq + 1], cu, num_seqs)  # skips q_len 0
        later_here = (later < num_seqs) & (cu[jnp.minimum(later, num_seqs)] < end_row)
        next_blk = next_seq_with_rows(seq, end_row, cu, num_seqs)  # maybe seq itself
        has_next = more | later_here | ((q_blk + 1 < num_q_blks) & (next_blk < num_seqs))
        next_seq = jnp.where(more, seq, jnp.where(later_here, later, next_blk))
        return has_next, next_seq, jnp.where(more, b + 1, 0)

    def attend_seq(seq, slot):
        q_start, kv_len = cu[seq], kv_lens_ref[seq]
        q_len = cu[seq + 1] - q_start
        row = first_row + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        rows = (q_start <= row) & (row < q_start + q_len)
        q_pos = kv_len - q_len + row - q_start

        def body(b, slot):
            has_next, next_seq, next_b = next_work(seq, b)

            @pl.when(has_next)
            def _():
                copy(next_seq, next_b, 1 - slot).start()

            copy(seq, b, slot).wait()
            attend_rows(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, b * block_kv, q_pos,
                        kv_len, sm_scale, mask_value)  # fmt: skip
            return 1 - slot

        init_online_softmax(m_ref, l_ref, acc_ref)  # every sequence starts its own softmax
        slot = lax.fori_loop(0, num_kv_blocks(seq), body, slot)
        write_rows(o_ref, l_ref, acc_ref, rows)  # only this sequence's rows
        return slot

    @pl.when(q_blk == 0)
    def _():
        slot_ref[0] = 0
        first = next_seq_with_rows(0, 0, cu, num_seqs)

        @pl.when(first < num_seqs)
        def _():
            copy(first, 0, 0).start()

    def has_rows_here(carry):
        seq, _ = carry
        return (seq < num_seqs) & (cu[jnp.minimum(seq, num_seqs)] < end_row)

    def walk(carry):
        seq, slot = carry
        slot = attend_seq(seq, slot)
        return next_seq_with_rows(seq + 1, cu[seq + 1], cu, num_seqs), slot

    first = next_seq_with_rows(0, first_row, cu, num_seqs)
    _, slot_ref[0] = lax.while_loop(has_rows_here, walk, (first, slot_ref[0]))


# --- What the checkers call ------------------------------------------------------------------

paged_decode_attention = functools.partial(
    scalar_prefetch.paged_decode_attention,
    kernel=scalar_prefetch_kernel,
    index_map=page_index_map,
)
paged_decode_async_copy = functools.partial(
    async_copy.paged_decode_attention_async_copy, kernel=async_copy_kernel
)
double_buffered_decode = functools.partial(
    double_buffer.paged_decode_attention_double_buffered, kernel=double_buffer_kernel
)
prefetching_decode = functools.partial(
    prefetch.paged_decode_attention_prefetch, kernel=prefetch_kernel
)
prefill_chunk_attention = functools.partial(
    prefill_chunk.prefill_chunk_attention, kernel=prefill_chunk_kernel
)
ragged_paged_attention = functools.partial(
    ragged.ragged_paged_attention_ladder, kernel=ragged_kernel
)
