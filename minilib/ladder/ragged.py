"""Rung 7 of the kernel ladder: the ragged batch, with JAX's signature.

q is JAX's: [max_num_batched_tokens, num_q_heads, head_dim], the rows of sequence s being
`cu_q_lens[s] ... cu_q_lens[s + 1] - 1`, of the first `num_seqs[0]` sequences (the slots past
it are padding, their table entries garbage). A sequence may have q_len 0 (idle: no row, no
work), 1 (a decode) or more (a prefill chunk), at positions `kv_len - q_len + r` as in rung 6.

The grid is (max_num_batched_tokens // block_q,): one step per q block of `block_q` rows, and
a q block's rows may belong to several sequences, while one sequence's rows may run over
several q blocks. A grid step walks the sequences that own rows of its q block, in order:

    for each sequence s with rows in this q block:         (q_len 0: no rows, skipped)
        rows of s here: the mask cu_q_lens[s] <= row < cu_q_lens[s + 1]
        reset m, l, acc
        for each KV block b those rows can see:            (rung 6: up to the last row's)
            start the copy of next_work into the other slot
            wait for this KV block;  attend_rows
        write the rows of s (only those: the other rows belong to other sequences)

As in rung 5, the whole batch is one stream of work, (q block, sequence, KV block), and each
work starts the copy of the next: the next KV block of this sequence, else KV block 0 of the
next sequence with rows in this q block, else KV block 0 of the first sequence of the next q
block (which may be this same sequence, when its rows run on). Grid step 0 starts the very
first copy; the slot carries over in SMEM, and the axis is "arbitrary".

`next_seq_with_rows` is given: the first sequence from s on that has a row at or after a row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.ladder.flash import init_online_softmax
from minilib.ladder.prefill_chunk import (
    KVBlockCopy,
    attend_rows,
    block_pages,
    kv_block_pages,
    row_softmax_scratch,
    write_rows,
)
from minilib.options import DEFAULT_MASK_VALUE

__all__ = [
    "ragged_copy_plan",
    "ragged_ladder_reference",
    "ragged_paged_attention_ladder",
]


def ragged_ladder_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                            sm_scale=1.0, mask_value=None, **ignored):  # fmt: skip
    """JAX's reference (exact float32 on any platform), with the output shaped like q: the
    padding rows past cu_q_lens[num_seqs] are 0. `ignored`: block sizes, interpret.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(3, 3), (1, 9)], max_num_batched_tokens=8)
    >>> ragged_ladder_reference(*b.args(), sm_scale=0.1).shape
    (8, 4, 64)
    """
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention,
    )

    n = int(np.asarray(num_seqs)[0])
    rows = int(np.asarray(cu_q_lens)[n])
    out = jnp.zeros(q.shape, q.dtype)
    if rows == 0:  # no row at all (JAX's reference concatenates nothing)
        return out
    with jax.default_matmul_precision("highest"):
        got = ref_ragged_paged_attention(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
            mask_value=DEFAULT_MASK_VALUE if mask_value is None else mask_value,
        )  # fmt: skip
    return out.at[:rows].set(got)


def ragged_paged_attention_ladder(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                                  sm_scale=1.0, sliding_window=None, soft_cap=None,
                                  mask_value=DEFAULT_MASK_VALUE, k_scale=None, v_scale=None,
                                  num_kv_pages_per_block=2, num_queries_per_block=8,
                                  vmem_limit_bytes=None, interpret=False, kernel=None):  # fmt: skip
    """Ragged paged attention with JAX's signature (the arrays shaped as for
    `minilib.reference.ref_ragged_paged_attention`): grid step i walks the sequences that own
    rows of q block i. Rows past cu_q_lens[num_seqs] are left unwritten (garbage).

    No sliding window, soft cap or fp8 scales (a ValueError names the one given). `kernel`
    (default `ragged_kernel`) may be replaced by a body with the same arguments.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(5, 5), (1, 20), (6, 30)], page_size=8, head_dim=128,
    ...                max_num_batched_tokens=16)
    >>> out = ragged_paged_attention_ladder(*b.args(), sm_scale=0.1, interpret=True)
    >>> expected = ragged_ladder_reference(*b.args(), sm_scale=0.1)
    >>> bool(jnp.allclose(out[:12], expected[:12], atol=1e-5))
    True
    """
    for name, value in (("sliding_window", sliding_window), ("soft_cap", soft_cap),
                        ("k_scale", k_scale), ("v_scale", v_scale)):  # fmt: skip
        if value is not None:
            raise ValueError(
                f"{name}={value!r}: rung 7 has no {name}; leave it None, or use "
                "minilib.kernel.ragged_paged_attention, which has it"
            )
    max_num_batched_tokens, num_q_heads, head_dim = q.shape
    page_size, num_combined_heads = kv_pages.shape[1:3]
    block_q = num_queries_per_block
    if max_num_batched_tokens % block_q:
        raise ValueError(
            f"{num_queries_per_block=} must divide {max_num_batched_tokens=} (q's rows): "
            "pad q, or choose a divisor"
        )
    block_kv = num_kv_pages_per_block * page_size
    num_seqs = jnp.clip(num_seqs, 0, kv_lens.shape[0])  # never walk past the tables
    q_spec = pl.BlockSpec((block_q, num_q_heads, head_dim), lambda i, *_: (i, 0, 0))
    params = dict(dimension_semantics=("arbitrary",))
    if vmem_limit_bytes is not None:
        params["vmem_limit_bytes"] = vmem_limit_bytes
    mask = DEFAULT_MASK_VALUE if mask_value is None else mask_value
    return pl.pallas_call(
        functools.partial(kernel or ragged_kernel, sm_scale=sm_scale, mask_value=mask),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # kv_lens, page_indices, cu_q_lens, num_seqs: SMEM
            grid=(max_num_batched_tokens // block_q,),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, block_kv, num_combined_heads, head_dim), kv_pages.dtype),  # bufs
                pltpu.SemaphoreType.DMA((2,)),  # sems
                pltpu.SMEM((1,), jnp.int32),  # slot_ref: the slot the next work is loading into
                *row_softmax_scratch(num_q_heads, block_q, head_dim),
            ],
        ),
        # "arbitrary": a step waits for the copy the step before it started.
        compiler_params=pltpu.CompilerParams(**params),
        interpret=interpret,
    )(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_pages)  # fmt: skip


def next_seq_with_rows(seq, row, cu_q_lens_ref, num_seqs):
    """The first sequence from `seq` on that has a row at or after `row` (cu_q_lens[s + 1] >
    row), or `num_seqs` if there is none. From seq + 1 with row = cu_q_lens[seq + 1], it skips
    the sequences with q_len 0. (cu_q_lens_ref is read at `num_seqs` at most.)"""

    def before(s):
        return (s < num_seqs) & (cu_q_lens_ref[jnp.minimum(s, num_seqs - 1) + 1] <= row)

    return lax.while_loop(before, lambda s: s + 1, seq)


def ragged_kernel(
    kv_lens_ref,  # i32[max_num_seqs], SMEM
    page_indices_ref,  # i32[max_num_seqs, pages_per_seq], SMEM
    cu_q_lens_ref,  # i32[max_num_seqs + 1], SMEM
    num_seqs_ref,  # i32[1], SMEM
    q_ref,  # [block_q, num_q_heads, head_dim]
    kv_pages_hbm_ref,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim], HBM
    o_ref,  # [block_q, num_q_heads, head_dim]
    bufs,  # [2, block_kv, 2*num_kv_heads, head_dim], VMEM
    sems,  # DMA semaphores [2]
    slot_ref,  # i32[1], SMEM, kept from one grid step to the next
    m_ref,  # f32[num_q_heads, block_q, 1]
    l_ref,  # f32[num_q_heads, block_q, 1]
    acc_ref,  # f32[num_q_heads, block_q, head_dim]
    *,
    sm_scale: float,
    mask_value: float,
):
    """Grid step i: the sequences with rows in q block i, each against its KV blocks."""
    q_blk, num_q_blks, num_seqs = pl.program_id(0), pl.num_programs(0), num_seqs_ref[0]
    block_q, block_kv, page_size = q_ref.shape[0], bufs.shape[1], kv_pages_hbm_ref.shape[1]
    first_row, end_row = q_blk * block_q, (q_blk + 1) * block_q

    def num_kv_blocks(seq, end_row):  # the KV blocks seq's rows before end_row can see
        q_start, q_end, kv_len = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1], kv_lens_ref[seq]
        last_row = jnp.minimum(q_end, end_row) - 1
        return pl.cdiv(kv_len - (q_end - q_start) + (last_row - q_start) + 1, block_kv)

    def copy(seq, b, slot):
        pages = block_pages(page_indices_ref, seq, kv_lens_ref[seq], b, block_kv // page_size,
                            page_size)  # fmt: skip
        return KVBlockCopy(kv_pages_hbm_ref, bufs, sems, pages, slot)

    def next_work(seq, b):  # (there is one, its sequence, its KV block)
        more_blocks = b + 1 < num_kv_blocks(seq, end_row)
        later = next_seq_with_rows(seq + 1, cu_q_lens_ref[seq + 1], cu_q_lens_ref, num_seqs)
        later_here = (later < num_seqs) & (cu_q_lens_ref[jnp.minimum(later, num_seqs)] < end_row)
        next_blk_first = next_seq_with_rows(seq, end_row, cu_q_lens_ref, num_seqs)
        in_next_blk = (q_blk + 1 < num_q_blks) & (next_blk_first < num_seqs)
        next_seq = jnp.where(more_blocks, seq, jnp.where(later_here, later, next_blk_first))
        return (more_blocks | later_here | in_next_blk), next_seq, jnp.where(more_blocks, b + 1, 0)

    def attend_seq(seq, slot):
        q_start, kv_len = cu_q_lens_ref[seq], kv_lens_ref[seq]
        q_len = cu_q_lens_ref[seq + 1] - q_start
        row = first_row + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        rows = (q_start <= row) & (row < q_start + q_len)  # this sequence's rows
        q_pos = kv_len - q_len + row - q_start

        def attend_block(b, slot):
            has_next, next_seq, next_b = next_work(seq, b)

            @pl.when(has_next)
            def _prefetch_the_next_work():
                copy(next_seq, next_b, 1 - slot).start()

            copy(seq, b, slot).wait()
            attend_rows(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, b * block_kv, q_pos,
                        kv_len, sm_scale, mask_value)  # fmt: skip
            return 1 - slot

        init_online_softmax(m_ref, l_ref, acc_ref)
        slot = lax.fori_loop(0, num_kv_blocks(seq, end_row), attend_block, slot)
        write_rows(o_ref, l_ref, acc_ref, rows)
        return slot

    @pl.when(q_blk == 0)
    def _start_the_very_first_copy():
        slot_ref[0] = 0
        first = next_seq_with_rows(0, 0, cu_q_lens_ref, num_seqs)

        @pl.when(first < num_seqs)
        def _():
            copy(first, 0, 0).start()

    def has_rows_here(carry):
        seq, _ = carry
        return (seq < num_seqs) & (cu_q_lens_ref[jnp.minimum(seq, num_seqs)] < end_row)

    def walk(carry):
        seq, slot = carry
        slot = attend_seq(seq, slot)
        return next_seq_with_rows(seq + 1, cu_q_lens_ref[seq + 1], cu_q_lens_ref, num_seqs), slot

    first = next_seq_with_rows(0, first_row, cu_q_lens_ref, num_seqs)
    _, slot_ref[0] = lax.while_loop(has_rows_here, walk, (first, slot_ref[0]))


def ragged_copy_plan(
    kv_lens, page_indices, cu_q_lens, num_seqs: int, *, block_q: int, num_q_blocks: int,
    num_kv_pages_per_block: int, page_size: int,
) -> list:  # fmt: skip
    """The copies the kernel should start, in order, as (q block, seq, KV block, slot,
    pages): the stream of work of the module docstring, in Python.

    >>> plan = ragged_copy_plan([20, 4], [[7, 3, 9], [5, 0, 0]], [0, 6, 10], 2, block_q=8,
    ...     num_q_blocks=2, num_kv_pages_per_block=2, page_size=8)
    >>> [(blk, seq, b, slot) for blk, seq, b, slot, _ in plan]
    [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 0), (1, 1, 0, 1)]
    """
    block_kv, work = num_kv_pages_per_block * page_size, []
    cu = [int(x) for x in cu_q_lens]
    for blk in range(num_q_blocks):
        first_row, end_row = blk * block_q, (blk + 1) * block_q
        for seq in range(num_seqs):
            if cu[seq + 1] <= first_row or cu[seq] >= end_row or cu[seq + 1] == cu[seq]:
                continue  # no row of seq in this q block
            kv_len, q_len = int(kv_lens[seq]), cu[seq + 1] - cu[seq]
            last_row = min(cu[seq + 1], end_row) - 1
            blocks = -(-(kv_len - q_len + last_row - cu[seq] + 1) // block_kv)
            work += [(blk, seq, b) for b in range(blocks)]
    return [(blk, seq, b, k % 2, kv_block_pages(page_indices, seq, kv_lens[seq], b,
                                                num_kv_pages_per_block, page_size))
            for k, (blk, seq, b) in enumerate(work)]  # fmt: skip
