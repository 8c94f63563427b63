"""Lever: each KV head read with one strided load through a flat view of the slot, in place of
the plain load (`plain.read_kv_head`, a vector register per token, reassembled); in bf16 K and V
come out of one load of 32-bit words (benchmarks/LEVERS.md). Not in TPU interpret mode.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minilib.chips import packing
from minilib.kernel.config import KernelConfig

__all__: list[str] = []  # the kernel body's own: see `read_kv_head`


def read_kv_head(kv_buf, kv_head: int, kv_blk, kv_len, config: KernelConfig, word_rows=None):
    """K and V of one KV head: row `token * 2*kvh + 2*kv_head` of the slot seen as a flat
    [tokens * 2*kvh, width] matrix (width 128, or 64: `narrow_rows`), for every token.

    In bf16 two rows share each 32-bit word (K in the low half, V in the high half), so one
    load of words brings both. K is the low half: truncating each word to 16 bits keeps it,
    already bf16. V is the high half: masked off its low half, a word is the float32 of V's
    bf16 value, exactly. `word_rows`: the words of a padded slot (`padded_slot.word_rows`)."""
    c = config
    tokens = c.kv_tokens_per_block
    if word_rows is not None:
        words, rows_per_token = word_rows(kv_buf, c)
    else:
        flat = kv_buf.reshape(tokens * 2 * c.num_kv_heads_per_block, kv_buf.shape[-1])
        if packing(kv_buf.dtype) == 1:  # f32: one row per combined head
            stride = 2 * c.num_kv_heads_per_block
            k = flat[pl.ds(2 * kv_head, tokens, stride=stride), :]
            v = flat[pl.ds(2 * kv_head + 1, tokens, stride=stride), :]
            return k, v
        words = flat.bitcast(jnp.uint32)  # [tokens * kvh, 128]: one (K, V) pair per row
        rows_per_token = c.num_kv_heads_per_block
    pair = words[pl.ds(kv_head, tokens, stride=rows_per_token), :]  # [tokens, width]
    k = lax.bitcast_convert_type(pair.astype(jnp.uint16), jnp.bfloat16)
    v = lax.bitcast_convert_type(pair & jnp.uint32(0xFFFF0000), jnp.float32)
    return k, v
