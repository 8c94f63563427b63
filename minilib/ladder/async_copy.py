"""Rung 3 of the kernel ladder: the kernel copies the pages itself.

Same grid and same answer as rung 2 (`scalar_prefetch`), but `kv_pages` is passed with
`pl.BlockSpec(memory_space=pl.ANY)`: Pallas leaves it where it is (in HBM) and hands the kernel
a ref to the whole array, which the kernel cannot read directly. The kernel owns one VMEM
buffer of one page and one DMA semaphore (`scratch_shapes`), and for each page:

    copy = pltpu.make_async_copy(kv_pages_hbm_ref.at[page], buf, sem)
    copy.start()   # the DMA engine starts copying, HBM -> VMEM
    copy.wait()    # block until the semaphore says all of it has arrived
    ... compute with buf ...

Nothing overlaps yet: the core waits for every copy. Rung 4 fixes that.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.ladder.scalar_prefetch import attend_kv_block, decode_pallas_call, page_grid_step

__all__ = ["paged_decode_attention_async_copy"]


def paged_decode_attention_async_copy(
    q, kv_pages, kv_lens, page_indices, *, sm_scale: float, interpret=False, kernel=None
) -> jax.Array:  # the arrays of rung 2 (`scalar_prefetch.paged_decode_attention`)
    """Paged decode attention; grid step (seq, i) copies page i of seq itself, then attends.

    `kernel` (default `async_copy_kernel`) may be replaced by a kernel body with the same arguments.

    >>> from minilib.batch import make_batch
    >>> from minilib.ladder.scalar_prefetch import paged_decode_attention
    >>> b = make_batch([(1, 5), (1, 9)], page_size=8, head_dim=128)
    >>> args, interpret = (b.q, b.kv_pages, b.kv_lens, b.page_indices), pltpu.InterpretParams()
    >>> out = paged_decode_attention_async_copy(*args, sm_scale=0.1, interpret=interpret)
    >>> bool((out == paged_decode_attention(*args, sm_scale=0.1, interpret=interpret)).all())
    True
    """
    return decode_pallas_call(
        functools.partial(kernel or async_copy_kernel, sm_scale=sm_scale),
        q, kv_pages, kv_lens, page_indices,
        grid=(q.shape[0], page_indices.shape[1]),  # (num_seqs, pages_per_seq), as in rung 2
        kv_spec=pl.BlockSpec(memory_space=pl.ANY),  # kv_pages stays in HBM
        scratch_shapes=[
            pltpu.VMEM(kv_pages.shape[1:], kv_pages.dtype),  # buf: one page
            pltpu.SemaphoreType.DMA(()),  # sem: counts the bytes of the copy into buf
        ],
        dimension_semantics=("parallel", "arbitrary"),
        interpret=interpret,
    )  # fmt: skip


def async_copy_kernel(
    kv_lens_ref, page_indices_ref, q_ref, kv_pages_hbm_ref, o_ref, buf, sem, m_ref, l_ref,
    acc_ref, *, sm_scale: float
):  # fmt: skip
    """Grid step (seq, i): copy page i of the sequence into buf, wait, fold it in.

    The refs of rung 2's kernel, but kv_pages_hbm_ref is all of `kv_pages`, in HBM; buf:
    [page_size, 2*num_kv_heads, head_dim], VMEM; sem: a DMA semaphore."""
    seq, i = pl.program_id(0), pl.program_id(1)
    kv_len, page_size = kv_lens_ref[seq], buf.shape[0]

    def copy_and_attend():
        page = page_indices_ref[seq, i]
        copy = pltpu.make_async_copy(kv_pages_hbm_ref.at[page], buf, sem)
        copy.start()
        copy.wait()
        attend_kv_block(buf, q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len, sm_scale)

    # Rung 2's grid step, with the copy in the step that attends (only pages the sequence has).
    page_grid_step(i, kv_len, page_size, copy_and_attend, o_ref, m_ref, l_ref, acc_ref)
