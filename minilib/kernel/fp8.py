"""Lever: an fp8 cache given to the MXU as stored, its scales moved to the scores and the
output, in place of the plain load's cast of every value; on the strided load, read four values
to a 32-bit word (benchmarks/LEVERS.md).

How K and V are read. Four combined heads of a token share each 32-bit word of a slot: K(2j),
V(2j), K(2j+1), V(2j+1), from the low byte up. Seen as a flat [tokens * kvh / 2, 128] matrix of
words, KV head h of every token is one strided load; K and V are its bytes 2 * (h % 2) and
2 * (h % 2) + 1, taken out by a shift and a truncation to 8 bits.

Where they are dequantized. JAX's reference reads K as `(k.astype(float32) * k_scale)
.astype(q.dtype)`: a cast and a multiply per value. Here every fp8 value is exactly a bf16, f16
or f32 value, so the matmuls take K and V as fp8 (Mosaic converts them on their way into the
MXU); and a scale on every key is a scale on every score, one on every value a scale on the
output:

    (q . k_scale k) sm_scale = (q . k) (sm_scale k_scale)
    sum_t p_t (v_scale v_t) / l = v_scale (sum_t p_t v_t) / l

so k_scale joins `KernelConfig.score_scale` and v_scale multiplies the output once per q block
(`plain.OnlineSoftmax.normalized`). The result is the reference up to rounding.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minilib.chips import FACTS, current_chip
from minilib.kernel.config import KernelConfig
from minilib.kernel.plain import zero_tokens_past_kv_len

__all__: list[str] = []  # the kernel body's own: see `load_kv_from_words`, `load_kv_as_stored`

# fp8 values per 32-bit word: K and V of two KV heads.
KV_HEADS_PER_WORD = 2


def load_kv_from_words(kv_buf, kv_head: int, kv_blk, kv_len, dtype, config: KernelConfig, read):
    """K and V as the MXU takes them, from `read_kv_words` (V zeroed on the words)."""
    k, v = read(kv_buf=kv_buf, kv_head=kv_head, kv_blk=kv_blk, kv_len=kv_len, config=config)
    return for_the_mxu(k, dtype), for_the_mxu(v, dtype)


def load_kv_as_stored(kv_buf, kv_head: int, kv_blk, kv_len, dtype, config: KernelConfig, read):
    """K as stored; V cast before it is zeroed (a cast back to fp8 is slow)."""
    k, v = read(kv_buf=kv_buf, kv_head=kv_head, kv_blk=kv_blk, kv_len=kv_len, config=config)
    v = v.astype(dtype)
    v = v if kv_len is None else zero_tokens_past_kv_len(v, kv_blk, kv_len, config)
    return for_the_mxu(k, dtype), v


def read_kv_words(
    kv_buf,  # [num_kv_pages_per_block, page_size, 2*kvh_per_blk, width], fp8
    kv_head: int,
    kv_blk,
    kv_len,
    config: KernelConfig,
):  # -> k, v: [kv_tokens_per_block, width], fp8 as stored; V zeroed past kv_len
    """K and V of one KV head with one strided load of 32-bit words: row `token * kvh/2 +
    kv_head // 2` of the slot seen as [tokens * kvh / 2, width] words (width 128, or 64:
    `narrow_rows`). (Where V is loaded again for its P·V, `reload_v`, this V is never used,
    and its select is dropped by the compiler.)"""
    c = config
    tokens = c.kv_tokens_per_block
    flat = kv_buf.reshape(tokens * 2 * c.num_kv_heads_per_block, kv_buf.shape[-1])
    words = flat.bitcast(jnp.uint32)  # [tokens * kvh / 2, width]
    stride = c.num_kv_heads_per_block // KV_HEADS_PER_WORD
    word = words[pl.ds(kv_head // KV_HEADS_PER_WORD, tokens, stride=stride), :]  # [tokens, width]
    k_shift = 16 * (kv_head % KV_HEADS_PER_WORD)  # K's lowest bit in the word; V's is 8 above
    k = byte_as_fp8(word, k_shift, kv_buf.dtype)
    if kv_len is not None:  # None: an open block, no token past kv_len (`open_blocks`)
        word = zero_words_past_kv_len(word, kv_blk, kv_len, c)
    v = byte_as_fp8(word, k_shift + 8, kv_buf.dtype)
    return k, v


def for_the_mxu(x, dtype):
    """fp8 `x` as the MXU's matmuls take it: as it is from v5 on; cast to `dtype` before (v4's
    Mosaic has no fp8 matmul operand). Off a TPU (interpret mode), as it is."""
    chip = current_chip()
    return x if chip is None or FACTS[chip].generation >= 5 else x.astype(dtype)


def byte_as_fp8(word, shift: int, fp8_dtype):  # word: u32[tokens, 128] -> fp8[tokens, 128]
    """The byte of each word that starts at bit `shift`, as the fp8 value it holds."""
    byte = (word >> shift if shift else word).astype(jnp.uint8)
    return lax.bitcast_convert_type(byte, fp8_dtype)


def zero_words_past_kv_len(word, kv_blk, kv_len, config: KernelConfig):  # u32[tokens, 128]
    """Zero the words of tokens at or past kv_len: V there is NaN padding or stale memory, and
    0 * NaN = NaN in p @ v (see `plain.zero_tokens_past_kv_len`). A zero word is four fp8
    zeros: one select per word, nothing unpacked."""
    pos = kv_blk * config.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, word.shape, 0)
    return jnp.where(pos < kv_len, word, jnp.uint32(0))
