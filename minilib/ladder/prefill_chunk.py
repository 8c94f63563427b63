"""Rung 6 of the kernel ladder: a prefill chunk, q blocks against KV blocks of several pages.

A prefill chunk is q_len > 1 new tokens of one sequence, the last q_len of its kv_len: row r
of the chunk sits at position `kv_len - q_len + r` and sees the keys at positions up to its
own (causal). Here q comes one chunk per sequence, padded to the longest:
q[num_seqs, max_q_len, num_q_heads, head_dim], row r of sequence s live when r < q_lens[s].

The grid is (num_seqs, max_q_len // block_q): one step per q block of one sequence's chunk.
A KV block is `num_kv_pages_per_block` pages, block_kv = num_kv_pages_per_block * page_size
tokens, copied into one VMEM slot one DMA per page, and waited for once:

    first_row = i * block_q;  rows of this step: first_row ... first_row + block_q - 1
    q_pos = kv_len - q_len + first_row + r                  # r = 0 .. block_q - 1
    last_q_pos = q_pos of the last *live* row (r < q_len):  KV blocks past it are skipped
    num_kv_blocks = cdiv(last_q_pos + 1, block_kv)          # 0 if no row is live
    start the pages of KV block 0 into slot 0
    for b in range(num_kv_blocks):
        if b + 1 < num_kv_blocks: start the pages of KV block b + 1 into slot 1 - slot
        wait for slot b % 2 (one wait, the size of the whole slot)
        attend_rows(slot, ...)                               # the causal mask per row

Page p of KV block b is page `b * num_kv_pages_per_block + p` of the sequence, clamped to its
last page: a block past the sequence's end copies that last page again (its tokens are past
kv_len, masked), so that every block copies the same bytes and one wait the size of the
slot takes them all back. Every copy a grid step starts it waits for: the axes are
"parallel".

The softmax state is kept per q head: m, l [num_q_heads, block_q, 1], acc [num_q_heads,
block_q, head_dim]. `attend_rows` and `write_rows` are given; the walk, the positions and
the copies are the rung.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.kv_cache import pages_needed
from minilib.ladder.flash import init_online_softmax, online_softmax_update, zero_rows_past
from minilib.options import DEFAULT_MASK_VALUE

__all__ = [
    "KVBlockCopy",
    "prefill_chunk_attention",
    "prefill_chunk_reference",
    "prefill_copy_plan",
    "row_softmax_scratch",
]


def prefill_chunk_reference(q, kv_pages, kv_lens, page_indices, q_lens, *, sm_scale,
                            **block_sizes_and_interpret):  # fmt: skip
    """Causal attention of each sequence's chunk in plain jnp (JAX's reference, one sequence
    at a time), with the signature of `prefill_chunk_attention`; rows past q_len are 0.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(3, 3), (2, 9)], page_size=8)
    >>> q = jnp.zeros((2, 8, 4, 64))
    >>> prefill_chunk_reference(q, b.kv_pages, b.kv_lens, b.page_indices, jnp.array([3, 2]),
    ...                         sm_scale=0.1).shape
    (2, 8, 4, 64)
    """
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention,
    )

    lens = [int(n) for n in np.asarray(q_lens)]
    out = np.zeros(q.shape, np.float32)
    live = [s for s, n in enumerate(lens) if n > 0]
    if not live:
        return jnp.asarray(out, q.dtype)
    rows = jnp.concatenate([q[s, : lens[s]] for s in live])
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum([lens[s] for s in live])]), jnp.int32)
    table = jnp.asarray(np.asarray(page_indices)[live])
    with jax.default_matmul_precision("highest"):  # exact float32, on any platform
        got = ref_ragged_paged_attention(
            rows, kv_pages, jnp.asarray(np.asarray(kv_lens)[live]), table, cu_q_lens,
            jnp.array([len(live)], jnp.int32), sm_scale=sm_scale,
        )  # fmt: skip
    got = np.asarray(got, np.float32)
    for k, s in enumerate(live):
        out[s, : lens[s]] = got[int(cu_q_lens[k]) : int(cu_q_lens[k + 1])]
    return jnp.asarray(out, q.dtype)


def prefill_chunk_attention(
    q: jax.Array,  # [num_seqs, max_q_len, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[num_seqs]
    page_indices: jax.Array,  # i32[num_seqs, pages_per_seq]
    q_lens: jax.Array,  # i32[num_seqs], each <= kv_len and <= max_q_len
    *,
    sm_scale: float,
    block_q: int = 8,
    num_kv_pages_per_block: int = 2,
    interpret=False,
    kernel=None,
) -> jax.Array:  # [num_seqs, max_q_len, num_q_heads, head_dim]
    """Prefill chunks: grid step (seq, i) attends q block i of sequence seq's chunk to the KV
    blocks its rows can see. `block_q` must divide max_q_len. `kernel` (default
    `prefill_chunk_kernel`) may be replaced by a body with the same arguments.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(5, 5), (3, 20)], page_size=8, head_dim=128)
    >>> q = jnp.zeros((2, 8, 4, 128))
    >>> prefill_chunk_attention(q, b.kv_pages, b.kv_lens, b.page_indices, jnp.array([5, 3]),
    ...     sm_scale=0.1, interpret=pltpu.InterpretParams()).shape
    (2, 8, 4, 128)
    """
    num_seqs, max_q_len, num_q_heads, head_dim = q.shape
    page_size, num_combined_heads = kv_pages.shape[1:3]
    if max_q_len % block_q:
        raise ValueError(f"{block_q=} must divide {max_q_len=} (q's axis 1)")
    block_kv = num_kv_pages_per_block * page_size
    q_spec = pl.BlockSpec((None, block_q, num_q_heads, head_dim), lambda s, i, *_: (s, i, 0, 0))
    return pl.pallas_call(
        functools.partial(kernel or prefill_chunk_kernel, sm_scale=sm_scale),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,  # kv_lens, page_indices, q_lens: SMEM
            grid=(num_seqs, max_q_len // block_q),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],  # kv_pages stays in HBM
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, block_kv, num_combined_heads, head_dim), kv_pages.dtype),  # bufs
                pltpu.SemaphoreType.DMA((2,)),  # sems: one per slot
                *row_softmax_scratch(num_q_heads, block_q, head_dim),
            ],
        ),
        # Each step waits for every copy it starts: the steps are independent.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(kv_lens, page_indices, q_lens, q, kv_pages)  # fmt: skip


def row_softmax_scratch(num_q_heads: int, block_q: int, head_dim: int) -> list:
    """m, l and acc of every row of a q block, per q head (VMEM scratch).

    >>> [s.shape for s in row_softmax_scratch(num_q_heads=4, block_q=8, head_dim=128)]
    [(4, 8, 1), (4, 8, 1), (4, 8, 128)]
    """
    return [
        pltpu.VMEM((num_q_heads, block_q, 1), jnp.float32),  # m
        pltpu.VMEM((num_q_heads, block_q, 1), jnp.float32),  # l
        pltpu.VMEM((num_q_heads, block_q, head_dim), jnp.float32),  # acc
    ]


def prefill_chunk_kernel(
    kv_lens_ref,  # i32[num_seqs], SMEM
    page_indices_ref,  # i32[num_seqs, pages_per_seq], SMEM
    q_lens_ref,  # i32[num_seqs], SMEM
    q_ref,  # [block_q, num_q_heads, head_dim]
    kv_pages_hbm_ref,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim], HBM
    o_ref,  # [block_q, num_q_heads, head_dim]
    bufs,  # [2, block_kv, 2*num_kv_heads, head_dim], VMEM: slots 0 and 1
    sems,  # DMA semaphores [2]
    m_ref,  # f32[num_q_heads, block_q, 1]
    l_ref,  # f32[num_q_heads, block_q, 1]
    acc_ref,  # f32[num_q_heads, block_q, head_dim]
    *,
    sm_scale: float,
):
    """Grid step (seq, i): q block i of the chunk against the KV blocks its rows can see."""
    seq, i = pl.program_id(0), pl.program_id(1)
    kv_len, q_len = kv_lens_ref[seq], q_lens_ref[seq]
    block_q, block_kv, page_size = q_ref.shape[0], bufs.shape[1], kv_pages_hbm_ref.shape[1]
    first_row = i * block_q
    q_pos = kv_len - q_len + first_row + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    last_row = jnp.minimum(first_row + block_q, q_len) - 1  # the last live row
    num_kv_blocks = jnp.where(
        first_row < q_len, pl.cdiv(kv_len - q_len + last_row + 1, block_kv), 0
    )
    pages_per_block = block_kv // page_size

    def copy(b, slot):  # KV block b of this sequence, into `slot`
        pages = block_pages(page_indices_ref, seq, kv_len, b, pages_per_block, page_size)
        return KVBlockCopy(kv_pages_hbm_ref, bufs, sems, pages, slot)

    def attend_block(b, _):
        slot = b % 2

        @pl.when(b + 1 < num_kv_blocks)
        def _prefetch_the_next_block():
            copy(b + 1, 1 - slot).start()

        copy(b, slot).wait()
        attend_rows(bufs.at[slot], q_ref, m_ref, l_ref, acc_ref, b * block_kv, q_pos, kv_len,
                    sm_scale)  # fmt: skip

    init_online_softmax(m_ref, l_ref, acc_ref)

    @pl.when(num_kv_blocks > 0)
    def _start_the_first_block():
        copy(0, 0).start()

    lax.fori_loop(0, num_kv_blocks, attend_block, None)
    write_rows(o_ref, l_ref, acc_ref)


def block_pages(page_indices_ref, seq, kv_len, b, pages_per_block: int, page_size: int) -> list:
    """The pages of KV block b of sequence seq, one per place of a slot: page
    `b * pages_per_block + p` of the sequence, clamped to its last page (a block that runs
    past the sequence's end copies its last page again; those tokens are past kv_len)."""
    last = pl.cdiv(kv_len, page_size) - 1
    return [page_indices_ref[seq, jnp.minimum(b * pages_per_block + p, last)]
            for p in range(pages_per_block)]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KVBlockCopy:
    """The copies of one KV block into `slot`: page p of `pages` into place p of the slot
    (tokens p * page_size ...). `start()` starts them all; `wait()` waits for all of them
    at once: one wait the size of the whole slot, since a DMA semaphore counts bytes and
    every block fills every place of its slot.

    >>> [f.name for f in dataclasses.fields(KVBlockCopy)]   # start() and wait() run in a kernel
    ['kv_pages_hbm_ref', 'bufs', 'sems', 'pages', 'slot']
    """

    kv_pages_hbm_ref: object  # [total_num_pages, page_size, 2*num_kv_heads, head_dim], HBM
    bufs: object  # [2, block_kv, 2*num_kv_heads, head_dim], VMEM
    sems: object  # DMA semaphores [2]
    pages: list  # the block's page numbers, one per place
    slot: object

    def start(self):
        page_size = self.kv_pages_hbm_ref.shape[1]
        for p, page in enumerate(self.pages):
            place = self.bufs.at[self.slot, pl.ds(p * page_size, page_size)]
            source = self.kv_pages_hbm_ref.at[page]
            pltpu.make_async_copy(source, place, self.sems.at[self.slot]).start()

    def wait(self):
        whole = self.bufs.at[self.slot]
        pltpu.make_async_copy(whole, whole, self.sems.at[self.slot]).wait()


def attend_rows(
    kv_ref,  # [block_kv, 2*num_kv_heads, head_dim]: K/V of consecutive positions
    q_ref,  # [block_q, num_q_heads, head_dim]
    m_ref,  # f32[num_q_heads, block_q, 1]
    l_ref,  # f32[num_q_heads, block_q, 1]
    acc_ref,  # f32[num_q_heads, block_q, head_dim]
    first_pos,  # position of the block's first token in its sequence
    q_pos,  # i32[block_q, 1]: the position of each row in its sequence
    kv_len,
    sm_scale: float,
    mask_value: float = DEFAULT_MASK_VALUE,
):
    """Fold a KV block into the softmax of every row and q head: row r sees the keys at
    positions <= q_pos[r] and < kv_len (the causal mask); q head j reads KV head j // group."""
    tokens, num_q_heads = kv_ref.shape[0], q_ref.shape[1]
    group = num_q_heads // (kv_ref.shape[1] // 2)
    k_pos = first_pos + lax.broadcasted_iota(jnp.int32, (1, tokens), 1)
    masked = (k_pos > q_pos) | (k_pos >= kv_len)  # [block_q, tokens]
    for h in range(num_q_heads // group):
        k = kv_ref[:, 2 * h, :]  # [tokens, head_dim]
        v = zero_rows_past(kv_ref[:, 2 * h + 1, :], first_pos, kv_len)
        for j in range(h * group, (h + 1) * group):
            update = functools.partial(
                online_softmax_update, m_ref.at[j], l_ref.at[j], acc_ref.at[j]
            )
            update(q_ref[:, j, :], k, v, masked, sm_scale, mask_value)


def write_rows(o_ref, l_ref, acc_ref, rows=None):
    """o = acc / l for every q head (0 where l is 0: a row that saw no key); only the rows
    where `rows` (bool[block_q, 1], default all) is True."""
    for j in range(o_ref.shape[1]):
        l = l_ref[j]
        out = (acc_ref[j] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)
        o_ref[:, j, :] = out if rows is None else jnp.where(rows, out, o_ref[:, j, :])


def prefill_copy_plan(kv_lens, q_lens, page_indices, *, block_q: int, max_q_len: int,
                      num_kv_pages_per_block: int, page_size: int) -> dict:  # fmt: skip
    """The copies each grid step (seq, i) should start, in order: (slot, pages of the block).

    >>> plan = prefill_copy_plan([20], [12], [[7, 3, 9]], block_q=8, max_q_len=16,
    ...                          num_kv_pages_per_block=2, page_size=8)
    >>> plan[(0, 0)]   # rows 0..7 at positions 8..15: the first KV block of 16 tokens only
    [(0, (7, 3))]
    >>> plan[(0, 1)]   # rows 8..11 at 16..19: both blocks, the second's page 9 twice
    [(0, (7, 3)), (1, (9, 9))]
    """
    plan, block_kv = {}, num_kv_pages_per_block * page_size
    for seq, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=True)):
        kv_len, q_len = int(kv_len), int(q_len)
        for i in range(max_q_len // block_q):
            last_row = min((i + 1) * block_q, q_len) - 1
            blocks = -(-(kv_len - q_len + last_row + 1) // block_kv) if i * block_q < q_len else 0
            pages = functools.partial(kv_block_pages, page_indices, seq, kv_len)
            plan[(seq, i)] = [(b % 2, pages(b, num_kv_pages_per_block, page_size))
                              for b in range(blocks)]  # fmt: skip
    return plan


def kv_block_pages(page_indices, seq, kv_len, b, num_kv_pages_per_block, page_size) -> tuple:
    """The pages KV block b of a sequence copies, in Python: clamped to its last page.

    >>> kv_block_pages([[7, 3, 9]], 0, 20, 1, 2, 8)
    (9, 9)
    """
    last = pages_needed(int(kv_len), page_size) - 1
    first = b * num_kv_pages_per_block
    return tuple(
        int(page_indices[seq][min(first + p, last)]) for p in range(num_kv_pages_per_block)
    )
