"""Rung 4 of the kernel ladder: double buffering within one sequence.

One grid step per sequence. The kernel loops over the sequence's pages itself, with two VMEM
slots and one DMA semaphore per slot. Page i lives in slot i % 2:

    start the copy of page 0 into slot 0 (if the sequence has a page: not in an empty slot)
    for i in range(num_pages):
        if i + 1 < num_pages: start the copy of page i + 1 into slot (i + 1) % 2
        wait for page i (slot i % 2)
        compute with slot i % 2          # meanwhile the DMA engine fills the other slot

The copy of page i + 1 may only start once nobody reads its slot any more: that slot last held
page i - 1, whose compute finished in the previous iteration. Start it into the slot being read
and it overwrites the page before it is used; give both slots one semaphore and a wait may
return for the wrong copy. Interpret mode lands copies at once, so neither shows as a race:
the checkers' ledger of copies and waits (`minilib.ladder.watch`) reports both.

Every copy a grid step starts, it also waits for, so the grid steps are independent again:
the sequence axis is "parallel".
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.ladder.flash import init_online_softmax
from minilib.ladder.scalar_prefetch import attend_kv_block, decode_pallas_call, write_output

__all__ = ["paged_decode_attention_double_buffered"]


def paged_decode_attention_double_buffered(
    q, kv_pages, kv_lens, page_indices, *, sm_scale: float, interpret=False, kernel=None
) -> jax.Array:  # the arrays of rung 2 (`scalar_prefetch.paged_decode_attention`)
    """Paged decode attention, one grid step per sequence, pages double-buffered.

    `kernel` (default `double_buffer_kernel`) may be replaced by a kernel body with the same
    arguments.

    >>> from minilib.batch import make_batch
    >>> from minilib.ladder.interpret import races_found, strict_interpret_params
    >>> b = make_batch([(1, 20)], page_size=8, head_dim=128)  # 3 pages: a copy in flight
    >>> out = paged_decode_attention_double_buffered(b.q, b.kv_pages, b.kv_lens, b.page_indices,
    ...     sm_scale=0.1, interpret=strict_interpret_params())
    >>> out.shape, races_found()
    ((1, 4, 128), False)
    """
    return decode_pallas_call(
        functools.partial(kernel or double_buffer_kernel, sm_scale=sm_scale),
        q, kv_pages, kv_lens, page_indices,
        grid=(q.shape[0],),  # (num_seqs,): the kernel loops over the pages itself
        kv_spec=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[
            pltpu.VMEM((2, *kv_pages.shape[1:]), kv_pages.dtype),  # bufs: two slots of a page
            pltpu.SemaphoreType.DMA((2,)),  # sems: one per slot
        ],
        dimension_semantics=("parallel",),
        interpret=interpret,
    )  # fmt: skip


def double_buffer_kernel(
    kv_lens_ref, page_indices_ref, q_ref, kv_pages_hbm_ref, o_ref, bufs, sems, m_ref, l_ref,
    acc_ref, *, sm_scale: float
):  # fmt: skip
    """Grid step seq: all pages of the sequence, page i + 1 copied while page i computes.

    The refs of rung 3's kernel, but two slots: bufs: [2, page_size, 2*num_kv_heads,
    head_dim], VMEM; sems: DMA semaphores [2], one per slot."""
    seq = pl.program_id(0)
    kv_len, page_size = kv_lens_ref[seq], bufs.shape[1]
    num_pages = pl.cdiv(kv_len, page_size)

    def page_copy(i, slot):
        """The copy of page i of this sequence into `slot`: the same for start and wait."""
        page = page_indices_ref[seq, i]
        return pltpu.make_async_copy(kv_pages_hbm_ref.at[page], bufs.at[slot], sems.at[slot])

    def attend_page(i, _):
        slot = i % 2

        @pl.when(i + 1 < num_pages)
        def _prefetch_the_next_page():
            page_copy(i + 1, 1 - slot).start()

        page_copy(i, slot).wait()
        attend_kv_block(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len,
                        sm_scale)  # fmt: skip

    init_online_softmax(m_ref, l_ref, acc_ref)

    @pl.when(num_pages > 0)  # an empty slot (kv_len 0) has no page 0 to copy
    def _start_the_first_page():
        page_copy(0, 0).start()

    lax.fori_loop(0, num_pages, attend_page, None)
    write_output(o_ref, l_ref, acc_ref)
