"""Notebook 07's first attention kernel, changed so that Mosaic compiles it.

`minilib.pallas_basics.attention_pallas_call` gives each program the q heads of one KV head:
a q block of shape (rows, group, head_dim) and a K block of (max_kv_len, 1, head_dim) (the KV
head squeezed). Interpret mode runs that, but the TPU compiler refuses it: a TPU keeps the last
two axes of every VMEM array in (8, 128) tiles of 32-bit words, so the last two axes of a block
must be divisible by 8 and 128, or be the whole axis. `group` (2 of 4 q heads) and 1 (of 2 KV
heads) are neither.

The fix here: block the head axes whole. Program (s, i) gets all q heads, `(rows, num_q_heads,
head_dim)`, and all of K and V, `(max_kv_len, num_kv_heads, head_dim)`, and loops over the KV
heads inside the kernel. The grid loses its head axis. A second rule appears once that is
fixed: a 1-D block must be the whole array or tile it (for 32-bit values, jax 0.10's TPU
lowering takes a multiple of 1024 elements or a power of 2 of at least 128; jax 0.7's a
multiple of 128), so the lengths, (1,) blocks, go to SMEM whole instead, where the kernel
reads them as scalars: what notebook 08 does with scalar prefetch. (The TPU kernel of notebook
08 blocks heads in groups that fill whole tiles instead: `num_kv_heads_per_block`.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.masking import is_masked, q_position

__all__ = ["attention_pallas_call_aligned"]


def attention_pallas_call_aligned(
    q_seq: jax.Array,  # [max_num_seqs, max_q_len, num_q_heads, head_dim]
    k: jax.Array,  # [max_num_seqs, max_kv_len, num_kv_heads, head_dim]
    v: jax.Array,  # [max_num_seqs, max_kv_len, num_kv_heads, head_dim]
    q_lens: jax.Array,  # i32[max_num_seqs]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    *,
    sm_scale: float,
    num_queries_per_block: int,
    interpret=False,
) -> jax.Array:  # [max_num_seqs, max_q_len, num_q_heads, head_dim]
    """Like `pallas_basics.attention_pallas_call` (causal, no window or soft cap), with blocks
    whose last two axes are whole, so that Mosaic accepts them.

    >>> q = jnp.ones((1, 8, 4, 128)); kv = jnp.ones((1, 16, 2, 128)); n = jnp.array([8])
    >>> attention_pallas_call_aligned(q, kv, kv, n, n + 8, sm_scale=0.1,
    ...                               num_queries_per_block=8, interpret=True).shape
    (1, 8, 4, 128)
    """
    max_num_seqs, max_q_len, num_q_heads, head_dim = q_seq.shape
    max_kv_len, num_kv_heads = k.shape[1], k.shape[2]
    rows = num_queries_per_block
    q_spec = pl.BlockSpec((None, rows, num_q_heads, head_dim), lambda s, i: (s, i, 0, 0))
    kv_spec = pl.BlockSpec((None, max_kv_len, num_kv_heads, head_dim), lambda s, i: (s, 0, 0, 0))
    # The lengths are scalars the kernel branches on: whole arrays in SMEM, not (1,) blocks.
    len_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.pallas_call(
        functools.partial(aligned_attention_kernel, sm_scale=sm_scale),
        out_shape=jax.ShapeDtypeStruct(q_seq.shape, q_seq.dtype),
        grid=(max_num_seqs, max_q_len // rows),
        in_specs=[q_spec, kv_spec, kv_spec, len_spec, len_spec],
        out_specs=q_spec,
        interpret=interpret,
    )(q_seq, k, v, q_lens, kv_lens)


def aligned_attention_kernel(
    q_ref,  # [rows, num_q_heads, head_dim]
    k_ref,  # [max_kv_len, num_kv_heads, head_dim], zero past kv_len
    v_ref,  # [max_kv_len, num_kv_heads, head_dim], zero past kv_len
    q_lens_ref,  # i32[max_num_seqs], SMEM
    kv_lens_ref,  # i32[max_num_seqs], SMEM
    o_ref,  # [rows, num_q_heads, head_dim]
    *,
    sm_scale: float,
):
    """Program (s, i): causal attention of q block i of sequence s, one q head at a time."""
    rows, num_q_heads, _ = q_ref.shape
    max_kv_len, num_kv_heads = k_ref.shape[0], k_ref.shape[1]
    group = num_q_heads // num_kv_heads
    seq = pl.program_id(0)
    q_len, kv_len = q_lens_ref[seq], kv_lens_ref[seq]
    q_pos = q_position(pl.program_id(1) * rows, q_len, kv_len)  # the block's first row
    q_pos += jax.lax.broadcasted_iota(jnp.int32, (rows, max_kv_len), 0)
    k_pos = jax.lax.broadcasted_iota(jnp.int32, (rows, max_kv_len), 1)
    masked = is_masked(q_pos, k_pos)  # causal: a future key
    visible = jnp.logical_not(masked) & (k_pos < kv_len)
    for head in range(num_q_heads):
        q = q_ref[:, head, :].astype(jnp.float32)  # [rows, head_dim]
        k = k_ref[:, head // group, :].astype(jnp.float32)  # [max_kv_len, head_dim]
        v = v_ref[:, head // group, :].astype(jnp.float32)
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())))
        scores = jnp.where(visible, scores * sm_scale, -1e30)
        probs = jax.nn.softmax(scores, axis=-1)
        o_ref[:, head, :] = jnp.dot(probs, v).astype(o_ref.dtype)
