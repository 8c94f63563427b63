"""Speed lever: an fp8 KV cache read four values to a 32-bit word, and dequantized where it
costs least: the values go to the MXU as fp8, the scales to the scores and the output.

What it saves. Bundles per KV block, static estimates (the workload of `python -m minilib
compile`: 32 q / 8 KV heads, head_dim 128, 128 tokens per KV block, here with a float8_e4m3fn
cache and k_scale = v_scale = 0.5; 8 q per block, then decode):

    chip    plain load     four to a word    vLLM's RPA v3
    v5e     8178 / 8012       652 / 507         900 / 753
    v6e     4550 / 8428       751 / 598        1005 / 754
    TPU7x   2397 / 2267       733 / 583         771 / 609

In steps, on v5e: the strided load of words alone, values still cast and scaled one by one
and V zeroed in float32, 1642 / 1534; the scales moved off the values and V zeroed on the
words, 1042 / 872 (v6e 1046 / 935, TPU7x 837 / 701); K and V given to the MXU as fp8, the
figures above. An fp8 cache now costs fewer bundles than a bf16 one (v5e 738 / 547), except
at decode on v5e, since the decode kernel's bf16 slot is padded (`padded_slot`): 523 to 482.

How K and V are read. In fp8 (float8_e4m3fn, float8_e5m2) four combined heads of a token
share each 32-bit word of a slot: K(2j), V(2j), K(2j+1), V(2j+1), from the low byte up (a TPU
packs consecutive rows of a tile into one word). Seen as a flat [tokens * kvh / 2, 128]
matrix of words, KV head h of every token is one strided load, as in `strided`; K and V are
its bytes 2 * (h % 2) and 2 * (h % 2) + 1, taken out by a shift and a truncation to 8 bits.

Where they are dequantized, and why there. JAX's reference reads K as
`(k.astype(float32) * k_scale).astype(q.dtype)`, and V the same with v_scale: a cast and a
multiply for every value of every KV block.
* The cast: every fp8 value is exactly a bf16, f16 or f32 value. The matmuls take K and V as
  fp8 (`jnp.einsum` of bf16 q and fp8 K), and Mosaic converts them on their way into the MXU,
  far more cheaply than a `.astype` of its own (chips without fp8 vector units build each
  value from its bits, several vector ops for every 1024 values).
* The scales: one that multiplies every key multiplies every score, and one that multiplies
  every value multiplies the output,

      (q . k_scale k) sm_scale = (q . k) (sm_scale k_scale)
      sum_t p_t (v_scale v_t) / l = v_scale (sum_t p_t v_t) / l

  so k_scale joins the one multiply the scores take anyway (`KernelConfig.score_scale`), and
  v_scale multiplies the output once per q block, after the KV-block loop
  (`softmax.OnlineSoftmax.normalized`). Nothing is left per value.
The result is JAX's reference up to rounding: the reference rounds k * k_scale and v * v_scale
to q's dtype (exact when a scale is a power of two); the kernel rounds sm_scale * k_scale
and the scaled output instead. p is rounded to q's dtype for P·V, as in the reference.

V is zeroed past kv_len on the 32-bit words, before the unpacking (`zero_words_past_kv_len`):
one select per word, and no fp8 value is ever written (a cast to fp8 is slow too).

On which chips: every chip Mosaic compiles for (v5e, v6e, TPU7x measured; on v4, whose Mosaic
takes no fp8 matmul operand, K and V are cast before the matmuls, `for_the_mxu`), where the
strided load applies (`strided.can_load_kv_strided`): head_dim a multiple of 128 (or 64, in
rows of 64 lanes: `narrow_rows`) and an even number of KV heads per heads block. Elsewhere, and
in TPU interpret mode (which cannot view a ref as another shape or dtype), the plain load runs,
with the scales in the same places.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minilib.chips import FACTS, current_chip
from minilib.kernel.config import KernelConfig

__all__: list[str] = []  # the kernel body's own: see `load_kv_head_fp8`

# fp8 values per 32-bit word: K and V of two KV heads.
KV_HEADS_PER_WORD = 2


def load_kv_head_fp8(
    kv_lanes,  # [num_kv_pages_per_block, page_size, 2*kvh_per_blk, width], fp8: one lane block
    kv_head: int,
    kv_blk,
    kv_len,
    config: KernelConfig,
):  # -> k, v: [kv_tokens_per_block, width], fp8 as stored; V zeroed past kv_len
    """K and V of one KV head from an fp8 lane block, with one strided load of 32-bit words:
    row `token * kvh/2 + kv_head // 2` of the block seen as [tokens * kvh / 2, width] words
    (width 128, or 64: `narrow_rows`).

    K needs no cleaning (the score mask replaces its scores past kv_len); V is read from the
    words zeroed past kv_len. (Where V is loaded again for its P·V, `reload_v`, this call's V
    is never used, and its select is dropped by the compiler.)"""
    c = config
    tokens = c.kv_tokens_per_block
    flat = kv_lanes.reshape(tokens * 2 * c.num_kv_heads_per_block, kv_lanes.shape[-1])
    words = flat.bitcast(jnp.uint32)  # [tokens * kvh / 2, width]
    stride = c.num_kv_heads_per_block // KV_HEADS_PER_WORD
    word = words[pl.ds(kv_head // KV_HEADS_PER_WORD, tokens, stride=stride), :]  # [tokens, width]
    k_shift = 16 * (kv_head % KV_HEADS_PER_WORD)  # K's lowest bit in the word; V's is 8 above
    k = byte_as_fp8(word, k_shift, kv_lanes.dtype)
    v = byte_as_fp8(zero_words_past_kv_len(word, kv_blk, kv_len, c), k_shift + 8, kv_lanes.dtype)
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
    0 * NaN = NaN in p @ v (see `kv_load.zero_tokens_past_kv_len`). A zero word is four fp8
    zeros: one select per word, nothing unpacked."""
    pos = kv_blk * config.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, word.shape, 0)
    return jnp.where(pos < kv_len, word, jnp.uint32(0))
