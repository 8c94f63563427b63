"""Blockwise ("flash") ragged paged attention in plain jax.numpy: the kernel's algorithm.

The vectorized version gathers every page of every sequence slot at once, so its working
memory grows with max_num_seqs * pages_per_seq, and it computes every tile over every key,
live or not. This version does what the TPU kernel does, in jnp that runs anywhere:

  for each live sequence                           (a loop up to num_seqs, which may be traced)
    for each block of q rows of that sequence
      state = (m, l, acc) = (-inf, 0, 0)
      for each KV block of num_kv_pages_per_block pages that the rows can see
        k, v  = gather_kv_block(...)                only these pages, via the page table
        s     = block_scores(...)                   q . k * sm_scale, soft cap, masks
        state = online_softmax_update(state, s, v)  rescale the old sums, add the new block
      out[rows] = state.acc / state.l               (+ exp(sink - m) in l, with a sink)

Three ideas make it fast and small:

* Only one KV block is in memory at a time, [num_kv_pages_per_block * page_size, ...], so the
  working memory follows the block sizes, not max_num_seqs * pages_per_seq.
* The loops are `lax.fori_loop`s whose bounds are *values* (num_seqs, q_len, kv_len), so the
  work follows the real tokens, and one compile serves every batch of the same shapes.
* The online softmax (Milakov & Gimelshein 2018; FlashAttention) keeps, for each q row, the
  running max `m`, the running sum of exponentials `l` and the running weighted sum of values
  `acc`. When a new block raises the max, the old sums are rescaled by exp(m_old - m_new), so
  after the last block acc / l is exactly softmax(scores) @ v.

As in the kernel, each KV head meets the `group` q heads that share it as one matrix: the q
block's rows and those heads are folded into [num_queries_per_block * group] rows.

Two differences from the TPU kernel. Here a q block never crosses a sequence boundary (as in
the vectorized version); the kernel's q blocks are fixed windows of q rows that may hold
several sequences. And the q block size follows the sequence: a decode has 1 q row, a prefill
hundreds, and on a CPU one size serves both badly (big blocks are mostly dead rows for a
decode; small ones re-read every KV block for every few rows of a prefill). So sequences with
at most SHORT_Q_BLOCK q rows take blocks of that size, and longer ones num_queries_per_block.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from minilib.kv_cache import cdiv
from minilib.masking import (
    apply_mask_value,
    is_masked,
    kv_blocks_to_visit,
    mask_value_vanishes,
    q_position,
)
from minilib.options import DEFAULT_MASK_VALUE, AttentionOptions
from minilib.reference import apply_soft_cap, dequantize
from minilib.validation import validate_inputs

__all__ = [
    "DEFAULT_NUM_KV_PAGES_PER_BLOCK",
    "DEFAULT_NUM_QUERIES_PER_BLOCK",
    "SHORT_Q_BLOCK",
    "OnlineSoftmax",
    "attend_q_block",
    "attend_sequence",
    "block_scores",
    "clamp_lengths",
    "finish_online_softmax",
    "fold_heads_into_rows",
    "gather_kv_block",
    "init_online_softmax",
    "online_softmax_update",
    "q_block_window",
    "ragged_paged_attention_blockwise",
    "unfold_rows_into_heads",
]

# Default block sizes: a choice, 128 q rows and 16 pages per block. Per KV block step the
# matmuls are then [128 * group, head_dim] x [head_dim, 256] for each KV head: big enough that
# the loop's own cost is small.
DEFAULT_NUM_QUERIES_PER_BLOCK = 128
DEFAULT_NUM_KV_PAGES_PER_BLOCK = 16
# The q block size of short sequences (decodes, small chunks): see the module docstring.
SHORT_Q_BLOCK = 8


class OnlineSoftmax(NamedTuple):
    """The online softmax state of one q block: per KV head, and per row of the folded block
    (q row, q head of the group).

    `l` is the FlashAttention paper's name (ruff's E741 finds it too much like `1`).

    >>> state = init_online_softmax(jnp.zeros((1, 2, 4)))   # 1 KV head, 2 folded rows
    >>> state.m.shape, state.l.shape, state.acc.shape
    ((1, 2), (1, 2), (1, 2, 4))
    """

    m: jax.Array  # f32[num_kv_heads, rows], running max of the scores
    l: jax.Array  # noqa: E741  f32[num_kv_heads, rows], running sum of exp(scores - m)
    acc: jax.Array  # f32[num_kv_heads, rows, head_dim], running sum of exp(scores - m) @ v


def ragged_paged_attention_blockwise(
    q: jax.Array,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    validate: bool = True,
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
) -> jax.Array:  # [max_num_batched_tokens, num_q_heads, head_dim]
    """Ragged paged attention, one q block and one KV block at a time, with online softmax.

    Same signature and result as `ref_ragged_paged_attention` (padding rows come out zero),
    plus the kernel's two block sizes:
      num_kv_pages_per_block: pages per KV block (default 16, at most pages_per_seq);
      num_queries_per_block: q rows per q block (default 128, at most max_num_batched_tokens);
        sequences with at most SHORT_Q_BLOCK (8) q rows use blocks of that size instead.

    An fp8 `kv_pages` without `k_scale` and `v_scale` is taken as scale 1, with no error or
    warning (as in JAX's kernel): pass the scales the cache was quantized with.
    `attention_sink` (f32[num_q_heads], or None): one more softmax logit per q head, with no
    value, as in `ref_ragged_paged_attention`; it joins the denominator once, at the end
    (`finish_online_softmax`), so the loop over KV blocks does not change.

    Compiled once per shape and options; new lengths reuse the compile, and `num_seqs` may be
    a traced value. Called eagerly, it first checks the values of the inputs
    (`dynamic_validate_inputs`); `validate=False` skips that. Under `jax.jit` only the static
    checks can run: validate outside jit, as JAX does. Bad values under jit still return
    quickly, as every loop bound is clamped to the array shapes.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 40)], page_size=8)
    >>> out = ragged_paged_attention_blockwise(*batch.args(), num_kv_pages_per_block=2)
    >>> out.shape
    (4, 4, 64)
    """
    options = AttentionOptions(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
    )
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    validate_inputs(*args, options, validate=validate, attention_sink=attention_sink)
    max_num_batched_tokens = q.shape[0]
    pages_per_seq = page_indices.shape[1]
    # The default block sizes. A q block is a window of q's rows, so it can't be longer than q.
    num_kv_pages = options.num_kv_pages_per_block or min(
        DEFAULT_NUM_KV_PAGES_PER_BLOCK, pages_per_seq
    )
    num_queries = options.num_queries_per_block or DEFAULT_NUM_QUERIES_PER_BLOCK
    options = dataclasses.replace(
        options,
        num_kv_pages_per_block=num_kv_pages,
        num_queries_per_block=min(num_queries, max_num_batched_tokens),
    )
    return _rpa_blockwise(*args, options, attention_sink)


@functools.partial(jax.jit, static_argnames="options")
def _rpa_blockwise(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options: AttentionOptions,
    attention_sink=None,
):  # fmt: skip
    """The outer loop, over the live sequences; each writes its own q rows of `out`.

    The loop bound num_seqs[0] is a traced value, so this is a `while` loop in the compiled
    program, and a batch of few sequences runs few iterations.

    Under jit nothing has checked the values, so every loop bound is clamped to what the
    shapes allow (`clamp_lengths`): a garbage num_seqs or kv_len costs at most the work of a
    full batch, and never hangs.
    """
    num_queries_per_block = options.num_queries_per_block
    short_block = min(SHORT_Q_BLOCK, num_queries_per_block)
    max_num_seqs, pages_per_seq = page_indices.shape
    num_seqs, kv_lens, q_starts, q_ends = clamp_lengths(
        num_seqs, kv_lens, cu_q_lens, max_num_seqs, q.shape[0], pages_per_seq * kv_pages.shape[1]
    )

    def one_sequence(seq, out):
        q_start, q_end = q_starts[seq], q_ends[seq]
        seq_args = (q, kv_pages, page_indices[seq], kv_lens[seq], q_start, q_end)

        def in_blocks_of(rows):
            return lambda out: attend_sequence(
                out, *seq_args, num_queries_per_block=rows, options=options,
                attention_sink=attention_sink,
            )  # fmt: skip

        if short_block == num_queries_per_block:
            return in_blocks_of(num_queries_per_block)(out)
        # Short sequences (decodes) take short q blocks: see the module docstring.
        is_short = q_end - q_start <= short_block
        return jax.lax.cond(
            is_short, in_blocks_of(short_block), in_blocks_of(num_queries_per_block), out
        )

    # Rows no live sequence writes, the padding past cu_q_lens[num_seqs], stay zero.
    return jax.lax.fori_loop(0, num_seqs, one_sequence, jnp.zeros_like(q))


def clamp_lengths(
    num_seqs: jax.Array,  # i32[1]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_kv_len: int,  # pages_per_seq * page_size
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    # num_seqs: i32[], kv_lens: i32[max_num_seqs], q_starts, q_ends: i32[max_num_seqs]
    """The lengths, clamped into the ranges the array shapes allow. Valid inputs are
    unchanged; garbage ones (unchecked under jit) can no longer make a loop run for ever.

    num_seqs to [0, max_num_seqs]; each sequence's q rows to [0, max_num_batched_tokens], and
    never ending before they start; kv_len to [0, pages_per_seq * page_size].

    >>> n, kv, starts, ends = clamp_lengths(jnp.array([2**31 - 1]), jnp.array([-5, 9]),
    ...                                     jnp.array([0, 7, 3]), 2, 4, 8)
    >>> int(n), kv.tolist(), starts.tolist(), ends.tolist()
    (2, [0, 8], [0, 4], [4, 4])
    """
    num_seqs = jnp.clip(num_seqs[0], 0, max_num_seqs)
    q_starts = jnp.clip(cu_q_lens[:-1], 0, max_num_batched_tokens)
    q_ends = jnp.clip(cu_q_lens[1:], q_starts, max_num_batched_tokens)
    return num_seqs, jnp.clip(kv_lens, 0, max_kv_len), q_starts, q_ends


def attend_sequence(
    out: jax.Array,  # [max_num_batched_tokens, num_q_heads, head_dim]
    q: jax.Array,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    pages: jax.Array,  # i32[pages_per_seq], this sequence's row of page_indices
    kv_len: jax.Array,  # i32[]
    q_start: jax.Array,  # i32[], cu_q_lens[seq]
    q_end: jax.Array,  # i32[], cu_q_lens[seq + 1]
    *,
    num_queries_per_block: int,
    options: AttentionOptions,
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
) -> jax.Array:  # out, with this sequence's rows written
    """Cut one sequence's q rows into blocks of num_queries_per_block rows; attend each.

    A prefill chunk of 3 q rows after 2 cached tokens, against the reference:

    >>> from minilib.batch import make_batch
    >>> from minilib.reference import ref_ragged_paged_attention
    >>> b = make_batch([(3, 5)], page_size=4)
    >>> options = AttentionOptions(sm_scale=0.125, num_kv_pages_per_block=1)
    >>> out = attend_sequence(jnp.zeros_like(b.q), b.q, b.kv_pages, b.page_indices[0],
    ...                       b.kv_lens[0], b.cu_q_lens[0], b.cu_q_lens[1],
    ...                       num_queries_per_block=2, options=options)
    >>> ref = ref_ragged_paged_attention(*b.args(), sm_scale=0.125)
    >>> bool(jnp.allclose(out[:3].astype(float), ref[:3].astype(float), atol=1e-2))
    True
    """
    num_q_blocks = cdiv(q_end - q_start, num_queries_per_block)  # 0 for an idle sequence

    def one_q_block(i, out):
        block_start = q_start + i * num_queries_per_block
        return attend_q_block(
            out, q, kv_pages, pages, kv_len, q_end, block_start,
            num_queries_per_block=num_queries_per_block, options=options,
            attention_sink=attention_sink,
        )  # fmt: skip

    return jax.lax.fori_loop(0, num_q_blocks, one_q_block, out)


def attend_q_block(
    out: jax.Array,  # [max_num_batched_tokens, num_q_heads, head_dim]
    q: jax.Array,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    pages: jax.Array,  # i32[pages_per_seq]
    kv_len: jax.Array,  # i32[]
    q_end: jax.Array,  # i32[], one past the sequence's last q row
    block_start: jax.Array,  # i32[], the block's first q row
    *,
    num_queries_per_block: int,  # this block's size (short sequences take short blocks)
    options: AttentionOptions,  # with its num_kv_pages_per_block filled in
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
) -> jax.Array:  # out, with this block's live rows written
    """Attend one q block over the KV blocks it can see, then write its live rows to `out`.

    The block of rows 1-2 of a 3-row prefill chunk (after 2 cached tokens) writes those rows
    as the reference does, and leaves row 0, another block's, alone:

    >>> from minilib.batch import make_batch
    >>> from minilib.reference import ref_ragged_paged_attention
    >>> b = make_batch([(3, 5)], page_size=4)
    >>> ref = ref_ragged_paged_attention(*b.args())
    >>> out = attend_q_block(
    ...     jnp.zeros_like(b.q), b.q, b.kv_pages, b.page_indices[0], b.kv_lens[0],
    ...     q_end=b.cu_q_lens[1], block_start=jnp.int32(1), num_queries_per_block=2,
    ...     options=AttentionOptions(num_kv_pages_per_block=1))
    >>> bool((out[0] == 0).all()), bool(jnp.allclose(out[1:3], ref[1:3], atol=1e-5))
    (True, True)
    """
    num_kv_pages_per_block, sliding_window = options.num_kv_pages_per_block, options.sliding_window
    num_kv_heads = kv_pages.shape[2] // 2
    rows, live = q_block_window(block_start, q_end, num_queries_per_block, q.shape[0])
    q_block = jax.lax.dynamic_slice_in_dim(q, rows[0], num_queries_per_block)
    q_folded = fold_heads_into_rows(q_block.astype(jnp.float32), num_kv_heads)
    q_pos = q_position(rows, q_end, kv_len)  # i32[num_queries_per_block]

    kv_tokens_per_block = num_kv_pages_per_block * kv_pages.shape[1]
    last_row = jnp.minimum(block_start + num_queries_per_block, q_end) - 1
    if mask_value_vanishes(options.mask_value):  # masked keys weigh 0: skip their blocks
        first_block, end_block = kv_blocks_to_visit(
            q_position(block_start, q_end, kv_len),  # position of the block's first live row
            q_position(last_row, q_end, kv_len),  # ... and of its last one
            kv_tokens_per_block,
            sliding_window,
        )
    else:  # a small mask_value: masked keys weigh something, every block before kv_len counts
        first_block, end_block = 0, -(-kv_len // kv_tokens_per_block)

    def one_kv_block(j, state):
        k, v = gather_kv_block(kv_pages, pages, kv_len, j, num_kv_pages_per_block)
        # Dequantize to q's dtype, as the reference does, then compute in float32: exact for
        # bf16 values, and the dtype CPU matmul kernels are built for.
        k = dequantize(k, options.k_scale, q.dtype).astype(jnp.float32)
        v = dequantize(v, options.v_scale, q.dtype).astype(jnp.float32)
        # each key's position in the sequence
        k_pos = j * kv_tokens_per_block + jnp.arange(kv_tokens_per_block)
        scores = block_scores(
            q_folded, k, q_pos, k_pos, sm_scale=options.sm_scale,
            sliding_window=sliding_window, soft_cap=options.soft_cap,
            mask_value=options.mask_value, kv_len=kv_len,
        )  # fmt: skip
        return online_softmax_update(state, scores, v)

    state = init_online_softmax(q_folded)
    state = jax.lax.fori_loop(first_block, end_block, one_kv_block, state)
    sink = None
    if attention_sink is not None:  # each folded row's sink: row q * group + g, head h * group + g
        sink = fold_heads_into_rows(
            jnp.broadcast_to(attention_sink[None, :, None], (num_queries_per_block, q.shape[1], 1)),
            num_kv_heads,
        )[..., 0]  # [num_kv_heads, rows]
    block_out = unfold_rows_into_heads(finish_online_softmax(state, sink), num_queries_per_block)

    # Write only the live rows; the others belong to another block or sequence.
    old = jax.lax.dynamic_slice_in_dim(out, rows[0], num_queries_per_block)
    new = jnp.where(live[:, None, None], block_out.astype(out.dtype), old)
    return jax.lax.dynamic_update_slice_in_dim(out, new, rows[0], axis=0)


def q_block_window(
    block_start: jax.Array,  # i32[]
    q_end: jax.Array,  # i32[]
    num_queries_per_block: int,
    max_num_batched_tokens: int,
) -> tuple[jax.Array, jax.Array]:  # rows: i32[num_queries_per_block], live: bool[same]
    """The q rows a block reads, and which of them are its own.

    A block is num_queries_per_block rows from block_start, but near the end of q that would
    run past the array, and `lax.dynamic_slice` would silently shift the window back. So we
    shift it ourselves, to end at the last row of q, and mark as live only the rows in
    [block_start, q_end): the rows before block_start (an earlier block's) and those past
    q_end (the next sequence's) are read, but not written.

    >>> rows, live = q_block_window(jnp.int32(10), jnp.int32(12), 4, 12)
    >>> rows.tolist(), live.tolist()
    ([8, 9, 10, 11], [False, False, True, True])
    """
    window_start = jnp.minimum(block_start, max_num_batched_tokens - num_queries_per_block)
    rows = window_start + jnp.arange(num_queries_per_block)
    return rows, (rows >= block_start) & (rows < q_end)


def fold_heads_into_rows(
    q_block: jax.Array,  # [num_queries_per_block, num_q_heads, head_dim]
    num_kv_heads: int,
) -> jax.Array:  # [num_kv_heads, num_queries_per_block * group, head_dim]
    """GQA without repeating K: KV head h serves q heads h*group .. h*group + group - 1, so
    those q heads of every q row become the rows of one matrix for KV head h.

    Row q * group + g of KV head h is q row q, q head h * group + g, as in the TPU kernel.

    >>> fold_heads_into_rows(jnp.arange(8).reshape(2, 4, 1), 2)[:, :, 0].tolist()
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    rows, num_q_heads, head_dim = q_block.shape
    group = num_q_heads // num_kv_heads
    q_block = q_block.reshape(rows, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    return q_block.reshape(num_kv_heads, rows * group, head_dim)


def unfold_rows_into_heads(
    x: jax.Array,  # [num_kv_heads, num_queries_per_block * group, head_dim]
    num_queries_per_block: int,
) -> jax.Array:  # [num_queries_per_block, num_q_heads, head_dim]
    """The inverse of `fold_heads_into_rows`: back to q's layout.

    >>> x = jnp.arange(8).reshape(2, 4, 1)
    >>> bool((unfold_rows_into_heads(fold_heads_into_rows(x, 2), 2) == x).all())
    True
    """
    num_kv_heads, folded, head_dim = x.shape
    group = folded // num_queries_per_block
    x = x.reshape(num_kv_heads, num_queries_per_block, group, head_dim).transpose(1, 0, 2, 3)
    return x.reshape(num_queries_per_block, num_kv_heads * group, head_dim)


def gather_kv_block(
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    pages: jax.Array,  # i32[pages_per_seq]
    kv_len: jax.Array,  # i32[]
    block: jax.Array,  # i32[], which KV block of the sequence
    num_kv_pages_per_block: int,
) -> tuple[jax.Array, jax.Array]:  # k, v: [num_kv_pages_per_block * page_size, num_kv_heads,
    #                                       head_dim], in kv_pages' dtype, zero past kv_len
    """Read one KV block, num_kv_pages_per_block pages, from the paged cache.

    Page column c of the sequence is page `pages[c]`. The last block may reach past
    pages_per_seq (when the block size does not divide it), and unused columns may hold any
    page number, so both are clipped into range; every key they give is past kv_len, and is
    zeroed. Zeroing, not just masking the scores, matters: unused slots may hold NaN, and
    0 * NaN = NaN in p @ v.

    >>> kv_pages = jnp.arange(4 * 2 * 2.0).reshape(4, 2, 2, 1)  # 4 pages of 2, 1 KV head
    >>> k, v = gather_kv_block(kv_pages, jnp.array([3, 1]), jnp.int32(3), jnp.int32(0), 2)
    >>> k.ravel().tolist(), v.ravel().tolist()   # keys of page 3, then page 1's first
    ([12.0, 14.0, 4.0, 0.0], [13.0, 15.0, 5.0, 0.0])
    """
    total_num_pages, page_size, combined, head_dim = kv_pages.shape
    pages_per_seq = pages.shape[0]
    columns = block * num_kv_pages_per_block + jnp.arange(num_kv_pages_per_block)
    block_pages = jnp.clip(pages[jnp.minimum(columns, pages_per_seq - 1)], 0, total_num_pages - 1)
    kv_tokens_per_block = num_kv_pages_per_block * page_size
    kv = kv_pages[block_pages].reshape(kv_tokens_per_block, combined, head_dim)
    k_pos = block * kv_tokens_per_block + jnp.arange(kv_tokens_per_block)
    kv = jnp.where((k_pos < kv_len)[:, None, None], kv, jnp.zeros((), kv.dtype))
    return kv[:, 0::2], kv[:, 1::2]  # K in even head slots, V in odd ones


def block_scores(
    q_folded: jax.Array,  # f32[num_kv_heads, rows, head_dim], rows = num_queries_per_block * group
    k: jax.Array,  # f32[kv_tokens_per_block, num_kv_heads, head_dim]
    q_pos: jax.Array,  # i32[num_queries_per_block], each q row's position in the sequence
    k_pos: jax.Array,  # i32[kv_tokens_per_block], each key's position in the sequence
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    kv_len=None,
) -> jax.Array:  # f32[num_kv_heads, rows, kv_tokens_per_block]
    """Scaled, soft-capped and masked scores of a (folded) q block against one KV block.

    A score is masked (`is_masked`) when its key is in the future of its q row, or (with a
    sliding window) sliding_window or more keys back: mask_value is added to it
    (`apply_mask_value`, JAX's rule). A key at or past `kv_len` (if given) is no key: its
    score is dropped, and any NaN computed from its padding slot with it.

    >>> s = block_scores(jnp.ones((1, 2, 4)), jnp.ones((3, 1, 4)), jnp.array([0, 1]),
    ...                  jnp.arange(3), sm_scale=0.5, sliding_window=None, soft_cap=None,
    ...                  mask_value=-1.0)
    >>> s[0].tolist()   # row 0 sees key 0, row 1 keys 0 and 1; the others get 2.0 + -1.0
    [[2.0, 1.0, 1.0], [2.0, 2.0, 1.0]]
    """
    group = q_folded.shape[1] // q_pos.shape[0]
    scores = jnp.einsum("hrd,khd->hrk", q_folded, k, preferred_element_type=jnp.float32)
    scores = apply_soft_cap(scores * sm_scale, soft_cap)
    row_pos = jnp.repeat(q_pos, group)[:, None]  # [rows, 1]: folded row q * group + g is row q
    masked = is_masked(row_pos, k_pos[None, :], sliding_window)
    past_kv_len = None if kv_len is None else k_pos[None, :] >= kv_len
    return apply_mask_value(scores, masked, mask_value, past_kv_len)


def init_online_softmax(
    q_folded: jax.Array,  # [num_kv_heads, rows, head_dim]
) -> OnlineSoftmax:
    """Before any KV block: max -inf, sum 0, accumulator 0.

    >>> state = init_online_softmax(jnp.zeros((1, 1, 2)))
    >>> state.m.tolist(), state.l.tolist(), state.acc.tolist()
    ([[-inf]], [[0.0]], [[[0.0, 0.0]]])
    """
    num_kv_heads, rows, head_dim = q_folded.shape
    return OnlineSoftmax(
        m=jnp.full((num_kv_heads, rows), -jnp.inf, jnp.float32),
        l=jnp.zeros((num_kv_heads, rows), jnp.float32),
        acc=jnp.zeros((num_kv_heads, rows, head_dim), jnp.float32),
    )


def online_softmax_update(
    state: OnlineSoftmax,
    scores: jax.Array,  # f32[num_kv_heads, rows, kv_tokens_per_block]
    v: jax.Array,  # f32[kv_tokens_per_block, num_kv_heads, head_dim]
    p_dtype=jnp.float32,
) -> OnlineSoftmax:
    """Fold one KV block into the running softmax. `p_dtype`: the dtype p is rounded to for
    P·V (the TPU kernel rounds it to V's dtype; notebook 08 measures what that costs).

    With m_new = max(m, max(scores)), the old sums were computed relative to m, so they are
    rescaled by alpha = exp(m - m_new) (which is 0 on the first block, where m = -inf), and
    the new block adds p = exp(scores - m_new). Every block holds a real key, so m_new is
    finite: a masked score (score + mask_value) gets a tiny p, exactly 0 for the default, and
    a padding slot's -inf gets 0.

    Two KV blocks of one key each, with equal scores: the result is the mean of the values,
    as one softmax over both keys would give.

    >>> state = init_online_softmax(jnp.zeros((1, 1, 1)))
    >>> state = online_softmax_update(state, jnp.zeros((1, 1, 1)), jnp.full((1, 1, 1), 2.0))
    >>> state = online_softmax_update(state, jnp.zeros((1, 1, 1)), jnp.full((1, 1, 1), 4.0))
    >>> state.l.tolist(), finish_online_softmax(state).tolist()
    ([[2.0]], [[[3.0]]])
    """
    m_new = jnp.maximum(state.m, scores.max(axis=-1))
    alpha = jnp.exp(state.m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    l_new = alpha * state.l + p.sum(axis=-1)
    pv = jnp.einsum("hrk,khd->hrd", p.astype(p_dtype), v, preferred_element_type=jnp.float32)
    return OnlineSoftmax(m=m_new, l=l_new, acc=alpha[..., None] * state.acc + pv)


def finish_online_softmax(
    state: OnlineSoftmax,
    sink: jax.Array | None = None,  # f32[num_kv_heads, rows]: each row's attention sink
) -> jax.Array:  # f32[num_kv_heads, rows, head_dim]
    """After the last KV block, acc / l is softmax(scores) @ v.

    With an attention sink, the sink joins the denominator here, once: acc / (l +
    exp(sink - m)). m is the max of the scores alone, so the sink's term is scaled like the
    others: the same as starting the softmax from the sink, and nothing added to the loop over
    KV blocks. (A sink far above m gives exp = inf, and the output its limit, 0.)

    A row that saw no key at all (l = 0, acc = 0) gives 0, not 0 / 0 = NaN. Valid inputs
    never have one (every q row sees itself); unchecked garbage under jit may. Only l = 0 is
    special: a NaN in the data (or a score that overflows to inf) makes l NaN, and the row
    comes out NaN, as in JAX's reference and the kernel. A silent 0 would hide the bug.

    >>> state = OnlineSoftmax(m=jnp.zeros((1, 3)), l=jnp.array([[2.0, 0.0, jnp.nan]]),
    ...                       acc=jnp.array([[[6.0], [0.0], [jnp.nan]]]))
    >>> finish_online_softmax(state).tolist()   # 6 / 2; 0 for no key; NaN stays NaN
    [[[3.0], [0.0], [nan]]]
    """
    l = state.l if sink is None else state.l + jnp.exp(sink - state.m)  # noqa: E741
    l = l[..., None]  # noqa: E741
    return state.acc / jnp.where(l == 0.0, 1.0, l)
