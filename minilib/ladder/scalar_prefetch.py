"""Rung 2 of the kernel ladder: paged decode attention with scalar prefetch.

A decode batch: one new token per sequence, so q is [num_seqs, num_q_heads, head_dim]. Its keys
and values sit in pages of the paged cache, `kv_pages[page_indices[seq, i]]` for page i of the
sequence. K and V of KV head h are combined slots 2h and 2h + 1 of every token.

The grid is (num_seqs, pages_per_seq): one step per page of a sequence. `kv_lens` and
`page_indices` are *scalar-prefetched* (`pltpu.PrefetchScalarGridSpec`): copied to SMEM before
the grid runs and passed to every index map, so the index map of `kv_pages` can look up which
page grid step (seq, i) needs. Pallas then copies that page into VMEM for us, and already
fetches the next step's page while this one computes (its pipeline is double-buffered).

Steps past a sequence's last page map to that last page again: entries of `page_indices` past
a sequence's last page hold garbage (any number, even one past the end of `kv_pages`), so they
are never read through. Pallas skips the copy when a block index repeats, and the kernel skips
the compute (`pl.when`), which saves work: `attend_kv_block` masks every key at a position
`>= kv_len`, so the answer would be the same. A slot with no sequence in it (kv_len 0) has no
page at all: its steps see page 0 of the pool, which nothing computes with, and its output is 0.

Rungs 3 to 5 keep this call's shape (`decode_pallas_call`: scalar prefetch, one q block per
sequence, the softmax state in scratch) and change only the grid, how `kv_pages` reaches the
kernel, and their own scratch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.ladder.flash import init_online_softmax, online_softmax_update, zero_rows_past

__all__ = [
    "decode_pallas_call",
    "paged_decode_attention",
    "paged_decode_reference",
    "softmax_scratch",
]


def paged_decode_reference(q, kv_pages, kv_lens, page_indices, *, sm_scale, **interpret):
    """Decode attention in plain jnp, with the signature of the kernels
    (`paged_decode_attention` below: its arrays and their shapes; `interpret` is taken and
    ignored). Only a sequence's own pages are read; a sequence with kv_len 0 (an empty slot)
    gives 0.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(1, 5), (1, 9)])
    >>> paged_decode_reference(b.q, b.kv_pages, b.kv_lens, b.page_indices, sm_scale=0.1).shape
    (2, 4, 64)
    """
    page_size, pages_per_seq = kv_pages.shape[1], page_indices.shape[1]
    lens = np.asarray(kv_lens)
    # Every sequence at once, in shapes that depend only on the arrays' shapes (one compile
    # per shape, whatever the lengths): a sequence's page-table entries past its last page
    # are never followed (page 0 stands in for them), and its keys past kv_len are masked.
    used = np.arange(pages_per_seq)[None, :] < np.ceil(lens / page_size)[:, None]
    pages = np.where(used, np.asarray(page_indices), 0)
    return _attend_pages(q, kv_pages, jnp.asarray(pages), jnp.asarray(lens), sm_scale)


@jax.jit
def _attend_pages(q, kv_pages, pages, kv_lens, sm_scale):
    """paged_decode_reference's attention, every sequence at once: `pages` holds only pages
    a sequence has (page 0 for the rest), and the keys past kv_len are masked."""
    (num_seqs, num_q_heads, head_dim), num_kv_heads = q.shape, kv_pages.shape[2] // 2
    kv = kv_pages[pages].reshape(num_seqs, -1, 2 * num_kv_heads, head_dim)
    live = jnp.arange(kv.shape[1])[None, :] < kv_lens[:, None]  # [seq, position]
    group = num_q_heads // num_kv_heads
    k = jnp.repeat(kv[:, :, 0::2], group, axis=2).astype(jnp.float32)
    v = jnp.repeat(kv[:, :, 1::2], group, axis=2).astype(jnp.float32)
    v = jnp.where(live[:, :, None, None], v, 0.0)  # NaN past kv_len: 0 * NaN would be NaN
    # HIGHEST: the float32 answer the checkers compare with, even where a default-precision
    # float32 matmul is one bfloat16 pass (a TPU; minilib.tpu.numerics).
    exact = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("shd,skhd->shk", q.astype(jnp.float32), k, precision=exact) * sm_scale
    p = jax.nn.softmax(jnp.where(live[:, None, :], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("shk,skhd->shd", p, v, precision=exact)
    # An empty slot (kv_len 0): no key to attend to, output 0 (not the softmax's NaN).
    return jnp.where((kv_lens > 0)[:, None, None], out, 0.0).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array,  # [num_seqs, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[num_seqs]
    page_indices: jax.Array,  # i32[num_seqs, pages_per_seq]
    *,
    sm_scale: float,
    interpret=False,
    kernel=None,
    index_map=None,
) -> jax.Array:  # [num_seqs, num_q_heads, head_dim]
    """Paged decode attention: grid step (seq, i) attends to page i of sequence seq.

    `kernel` (default `scalar_prefetch_kernel`) and `index_map` (default `page_index_map`)
    may be replaced by versions with the same arguments.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(1, 5), (1, 9)], page_size=8, head_dim=128)
    >>> out = paged_decode_attention(b.q, b.kv_pages, b.kv_lens, b.page_indices,
    ...                              sm_scale=0.1, interpret=True)
    >>> bool(jnp.allclose(out, paged_decode_reference(b.q, b.kv_pages, b.kv_lens,
    ...                                               b.page_indices, sm_scale=0.1), atol=1e-5))
    True
    """
    page_size, num_combined_heads, head_dim = kv_pages.shape[1:]
    kv_index_map = functools.partial(index_map or page_index_map, page_size=page_size)
    return decode_pallas_call(
        functools.partial(kernel or scalar_prefetch_kernel, sm_scale=sm_scale),
        q, kv_pages, kv_lens, page_indices,
        grid=(q.shape[0], page_indices.shape[1]),  # (num_seqs, pages_per_seq)
        # Pallas copies the page the index map chose into VMEM, one page per grid step.
        kv_spec=pl.BlockSpec((None, page_size, num_combined_heads, head_dim), kv_index_map),
        scratch_shapes=[],
        dimension_semantics=("parallel", "arbitrary"),
        interpret=interpret,
    )  # fmt: skip


def decode_pallas_call(
    kernel,
    q: jax.Array,  # [num_seqs, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[num_seqs]
    page_indices: jax.Array,  # i32[num_seqs, pages_per_seq]
    *,
    grid: tuple,
    kv_spec: pl.BlockSpec,
    scratch_shapes: list,
    dimension_semantics: tuple,
    interpret,
) -> jax.Array:  # [num_seqs, num_q_heads, head_dim]
    """The `pallas_call` of every decode rung: `kv_lens` and `page_indices` scalar-prefetched
    (in SMEM, passed to the index maps and the kernel first), q and the output one block per
    sequence, the rung's own scratch followed by the softmax state (`softmax_scratch`).

    A rung chooses the grid (its first axis is the sequence), how `kv_pages` reaches the
    kernel (`kv_spec`), its scratch and the axes' semantics.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(1, 5), (1, 9)], page_size=8, head_dim=128)
    >>> kv_spec = pl.BlockSpec((None, 8, 4, 128), functools.partial(page_index_map, page_size=8))
    >>> decode_pallas_call(functools.partial(scalar_prefetch_kernel, sm_scale=0.1),
    ...     b.q, b.kv_pages, b.kv_lens, b.page_indices, grid=(2, 2), kv_spec=kv_spec,
    ...     scratch_shapes=[], dimension_semantics=("parallel", "arbitrary"),
    ...     interpret=True).shape
    (2, 4, 128)
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pages.shape[2] // 2
    # Every grid step of sequence seq reads its q block and writes its output block.
    q_spec = pl.BlockSpec((None, num_q_heads, head_dim), lambda seq, *rest: (seq, 0, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,  # kv_lens, page_indices: in SMEM, passed to index maps
            grid=grid,
            in_specs=[q_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[
                *scratch_shapes,
                *softmax_scratch(num_kv_heads, num_q_heads // num_kv_heads, head_dim),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=dimension_semantics),
        interpret=interpret,
    )(kv_lens, page_indices, q, kv_pages)


def page_index_map(seq, i, kv_lens_ref, page_indices_ref, *, page_size: int):
    """The block of `kv_pages` that grid step (seq, i) sees: page i of the sequence, looked up in
    the page table (in SMEM). Steps past the last page see the last page again, which Pallas
    does not copy twice; a sequence with no page (kv_len 0) sees page 0 of the pool: its row of
    the page table is garbage. Returns a block index: (page, 0, 0, 0).
    """
    num_pages = pl.cdiv(kv_lens_ref[seq], page_size)
    page = page_indices_ref[seq, jnp.minimum(i, jnp.maximum(num_pages - 1, 0))]
    return (jnp.where(num_pages > 0, page, 0), 0, 0, 0)


def softmax_scratch(num_kv_heads: int, group: int, head_dim: int) -> list:
    """m, l and acc for every q head, grouped by the KV head it shares (VMEM scratch).

    >>> [scratch.shape for scratch in softmax_scratch(num_kv_heads=2, group=4, head_dim=128)]
    [(2, 4, 1), (2, 4, 1), (2, 4, 128)]
    """
    return [
        pltpu.VMEM((num_kv_heads, group, 1), jnp.float32),  # m
        pltpu.VMEM((num_kv_heads, group, 1), jnp.float32),  # l
        pltpu.VMEM((num_kv_heads, group, head_dim), jnp.float32),  # acc
    ]


def scalar_prefetch_kernel(
    kv_lens_ref,  # i32[num_seqs], SMEM
    page_indices_ref,  # i32[num_seqs, pages_per_seq], SMEM
    q_ref,  # [num_q_heads, head_dim]
    page_ref,  # [page_size, 2*num_kv_heads, head_dim]: the page the index map chose
    o_ref,  # [num_q_heads, head_dim]
    m_ref,  # f32[num_kv_heads, group, 1]
    l_ref,  # f32[num_kv_heads, group, 1]
    acc_ref,  # f32[num_kv_heads, group, head_dim]
    *,
    sm_scale: float,
):
    """Grid step (seq, i): fold page i of the sequence into its online softmax."""
    seq, i = pl.program_id(0), pl.program_id(1)
    kv_len, page_size = kv_lens_ref[seq], page_ref.shape[0]

    def attend_page():
        attend_kv_block(page_ref, q_ref, m_ref, l_ref, acc_ref, i * page_size, kv_len, sm_scale)

    page_grid_step(i, kv_len, page_size, attend_page, o_ref, m_ref, l_ref, acc_ref)


def page_grid_step(i, kv_len, page_size: int, attend_page, o_ref, m_ref, l_ref, acc_ref):
    """Grid step (seq, i) of a grid that walks the pages of a sequence: initialise the softmax
    on page 0, `attend_page()` if the sequence has a page i (the steps past its last page
    compute nothing), write the output on the last step."""

    @pl.when(i == 0)
    def _init():
        init_online_softmax(m_ref, l_ref, acc_ref)

    @pl.when(i * page_size < kv_len)
    def _attend():
        attend_page()

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        write_output(o_ref, l_ref, acc_ref)


def attend_kv_block(
    kv_ref,  # [tokens, 2*num_kv_heads, head_dim]: K/V of consecutive positions
    q_ref,  # [num_q_heads, head_dim]
    m_ref,  # f32[num_kv_heads, group, 1]
    l_ref,  # f32[num_kv_heads, group, 1]
    acc_ref,  # f32[num_kv_heads, group, head_dim]
    first_pos,  # position of the block's first token in its sequence
    kv_len,
    sm_scale: float,
):
    """Fold a block of keys into the softmax of every q head, one KV head (GQA group) at a time.

    A decode token sees every key before it, so the only keys hidden are those past kv_len.
    """
    tokens, num_kv_heads, group = kv_ref.shape[0], m_ref.shape[0], m_ref.shape[1]
    k_pos = first_pos + jax.lax.broadcasted_iota(jnp.int32, (group, tokens), 1)
    for h in range(num_kv_heads):
        k = kv_ref[:, 2 * h, :]  # [tokens, head_dim]
        v = zero_rows_past(kv_ref[:, 2 * h + 1, :], first_pos, kv_len)
        q = q_ref[h * group : (h + 1) * group, :]  # the q heads that share KV head h
        update = functools.partial(online_softmax_update, m_ref.at[h], l_ref.at[h], acc_ref.at[h])
        update(q, k, v, k_pos >= kv_len, sm_scale)


def write_output(o_ref, l_ref, acc_ref):
    """o = acc / l, the q heads of KV head h in rows h * group ... (h + 1) * group.

    A sequence with no keys (kv_len 0, an empty slot) has l = 0 and acc = 0: its output is 0,
    not 0 / 0 = NaN.
    """
    num_kv_heads, group = l_ref.shape[0], l_ref.shape[1]
    for h in range(num_kv_heads):
        l = l_ref[h]
        out = acc_ref[h] / jnp.where(l == 0.0, 1.0, l)
        o_ref[h * group : (h + 1) * group, :] = out.astype(o_ref.dtype)
