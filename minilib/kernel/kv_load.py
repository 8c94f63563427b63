"""K and V of one KV head, from a slot into vector registers, ready for the MXU.

The plain load indexes the slot and reshapes the value: it runs everywhere, TPU interpret mode
included. Where refs can be viewed (the chip), `strided` reads each KV head with one strided
load instead; a head_dim of several 128-lane blocks is read one block at a time (`lane_blocks`),
head_dim 64 in rows of 64 lanes (`narrow_rows`).
V is zeroed past kv_len (`zero_tokens_past_kv_len`). An fp8 cache is read four values to a
word where refs can be viewed (`fp8`); fp8 values are never scaled here: k_scale and v_scale
are applied to the scores and the output (`fp8` says why).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from minilib.kernel.config import KernelConfig
from minilib.kernel.fp8 import for_the_mxu, load_kv_head_fp8
from minilib.kernel.lane_blocks import side_by_side
from minilib.kernel.strided import load_kv_head_strided

__all__: list[str] = []  # the kernel body's own: see `load_kv_for_mxu`


def load_kv_for_mxu(kv_buf, kv_head: int, kv_blk, kv_len, dtype, config: KernelConfig):
    """K and V of one KV head, ready for the MXU: V zeroed past kv_len, both in `dtype`, or
    fp8 as stored (the MXU's matmuls take it as it is: `fp8`), never scaled.
    [kv_tokens_per_block, head_dim] each."""
    fp8 = config.kv_itemsize == 1
    if fp8 and config.strided_kv_loads:  # four values to a word, V zeroed on the words
        blocks = [
            load_kv_head_fp8(kv_buf.at[f], kv_head, kv_blk, kv_len, config)
            for f in range(config.lane_blocks)
        ]
        k, v = side_by_side(blocks)
        return for_the_mxu(k, dtype), for_the_mxu(v, dtype)
    k, v = load_kv_head(kv_buf, kv_head, config)
    if fp8:  # K as stored; V cast before it is zeroed (a cast back to fp8 is slow)
        v = zero_tokens_past_kv_len(v.astype(dtype), kv_blk, kv_len, config)
        return for_the_mxu(k, dtype), v
    v = zero_tokens_past_kv_len(v, kv_blk, kv_len, config)
    return dequantize_kv(k, v, dtype)


def load_kv_head(
    kv_buf,  # [lane_blocks, num_kv_pages_per_block, page_size, 2*kvh_per_blk, hd // lane_blocks]
    kv_head: int,  # within the heads block
    config: KernelConfig,
):  # -> k, v: [kv_tokens_per_block, head_dim], kv dtype, bf16 or float32
    """K and V of one KV head from a slot, as [tokens, head_dim] matrices: each lane block
    loaded on its own (`load_kv_lane_block`), side by side (`lane_blocks`; at head_dim 128 there
    is one).

    K sits in combined slot 2*kv_head and V in 2*kv_head + 1 of every token. Tokens at or past
    kv_len hold anything (NaN padding, stale or never-written memory): see
    `zero_tokens_past_kv_len`.
    """
    blocks = [load_kv_lane_block(kv_buf.at[f], kv_head, config) for f in range(config.lane_blocks)]
    return side_by_side(blocks)


def load_kv_lane_block(
    kv_lanes,  # [num_kv_pages_per_block, page_size, 2*kvh_per_blk, width]: one lane block
    kv_head: int,
    config: KernelConfig,
):  # -> k, v: [kv_tokens_per_block, width]
    """K and V of one KV head in one lane block of a slot."""
    if config.strided_kv_loads:
        return load_kv_head_strided(kv_lanes, kv_head, config)
    # Index the ref and reshape the *value*: TPU interpret mode cannot reshape refs. On the chip
    # this reads one vector register per token and reassembles the rows: slow.
    tokens, width = config.kv_tokens_per_block, kv_lanes.shape[-1]
    k = kv_lanes[:, :, 2 * kv_head, :].reshape(tokens, width)
    v = kv_lanes[:, :, 2 * kv_head + 1, :].reshape(tokens, width)
    return k, v


def dequantize_kv(
    k,  # [kv_tokens_per_block, head_dim], kv dtype or float32
    v,  # [kv_tokens_per_block, head_dim], kv dtype or float32
    dtype,
):  # -> k, v: [kv_tokens_per_block, head_dim], dtype
    """K and V in the compute dtype: a plain cast. (k_scale and v_scale are applied to the
    scores and the output, not here: see `fp8`.)"""
    return k.astype(dtype), v.astype(dtype)


def zero_tokens_past_kv_len(x, kv_blk, kv_len, config: KernelConfig):  # x: [kv_tokens, hd]
    """Zero the token rows at or past kv_len; needed for V only.

    Those rows hold NaN padding, or stale or never-written memory where pages were not copied.
    K needs nothing: no row can see past kv_len, so `score_mask` replaces those scores (NaN
    included) and p is exactly 0 there. But 0 * NaN = NaN in p @ v, so V must be finite.
    (The select runs in float32: v5e has no bf16 vector unit.)
    """
    pos = kv_blk * config.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where(pos < kv_len, x.astype(jnp.float32), 0.0).astype(x.dtype)
