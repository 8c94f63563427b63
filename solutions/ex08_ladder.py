"""Solutions to notebook 08's kernel ladder, rungs 2 to 5.

Each kernel body goes into the rung's `pallas_call` from `minilib.ladder` (the `kernel=`
argument); the names the checkers call are bound at the end. The helpers used here,
`init_online_softmax`, `attend_kv_block`, `write_output` and `next_seq_with_pages`, are the ones
the notebook gives.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.ladder import async_copy, double_buffer, prefetch, scalar_prefetch
from minilib.ladder.flash import init_online_softmax
from minilib.ladder.prefetch import next_seq_with_pages
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
