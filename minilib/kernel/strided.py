"""Speed lever: each KV head read with one strided load, K and V split from 32-bit words.

What it saves. The plain load (`kv_load.load_kv_lane_block`) indexes a KV head out of the slot,
which on the chip reads one vector register per token and reassembles the rows. Here the slot
is viewed as a flat [tokens * 2*kvh, 128] matrix and a KV head's rows are one strided load; in
bf16 K and V share each 32-bit word, so one load brings both, and K comes out by truncation to
16 bits (one pack, no shift). Bundles per KV block, static estimates (`python -m minilib
compile`, 32 q / 8 KV heads, head_dim 128, 128 tokens per KV block):
* K by truncation rather than by shift and pack: v5e 1408 -> 1391 at 32 q per block, 950 -> 921
  at 8 q; v6e 1585 -> 1587 (+2), 1065 -> 1054.
* At head_dim 256, read in 128-lane blocks (`lane_blocks`) instead of by the plain load: v5e
  4847 -> 1830 at 32 q, 4237 -> 1396 at 8 q; v6e 4751 -> 1678, 4215 -> 1369.
On which chips: every chip Mosaic compiles for (v5e, v6e, TPU7x measured), for f32 and bf16
K/V whose combined heads fill whole tiles and head_dim a multiple of 128 (`can_load_kv_strided`),
or 64 (`narrow_rows`); for fp8 K/V, four values to a word, see `fp8`.
Not in TPU interpret mode, which cannot view a ref as another shape or dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.chips import packing, packing_of_size
from minilib.kernel.config import KernelConfig
from minilib.kernel.fp8 import KV_HEADS_PER_WORD
from minilib.kernel.narrow_rows import strided_rows_fit
from minilib.kernel.padded_slot import pads_slot, word_rows

__all__: list[str] = []  # the kernel body's own: see `load_kv_head_strided`


def can_load_kv_strided(config: KernelConfig, interpret=False) -> bool:
    """Whether `load_kv_head_strided` applies: refs can be viewed (the chip, or plain
    `interpret=True`; not TPU interpret mode), head_dim is a multiple of 128 (rows of 128
    lanes: a slot's lane blocks) or 64 (`narrow_rows`: rows of 64 lanes), and either the KV
    dtype is f32 or bf16 and the combined heads of a token fill whole (8 * packing, 128)
    tiles (so the flat view is free), or it is fp8 and the KV heads pair up into whole words
    (`fp8.load_kv_head_fp8`)."""
    if isinstance(interpret, pltpu.InterpretParams):
        return False
    kv_packing = packing_of_size(config.kv_itemsize)
    if not strided_rows_fit(config):
        return False
    if kv_packing == 4:  # fp8: whole words of two KV heads each (`fp8`)
        return config.num_kv_heads_per_block % KV_HEADS_PER_WORD == 0
    tiles_whole = (2 * config.num_kv_heads_per_block) % (8 * kv_packing) == 0
    return kv_packing in (1, 2) and tiles_whole


def load_kv_head_strided(kv_lanes, kv_head: int, config: KernelConfig):
    """`load_kv_lane_block` with one strided load: row `token * 2*kvh + 2*kv_head` of the lane
    block seen as a flat [tokens * 2*kvh, width] matrix (width 128, or 64: `narrow_rows`), for
    every token.

    In bf16 two rows share each 32-bit word (K in the low half, V in the high half), so one
    load of 32-bit words brings K and V together. K is the low half: truncating each word to
    16 bits keeps it, already bf16 (one pack). V is the high half: masked off its low half, a
    word is the float32 of V's bf16 value, exactly; it stays float32 until `dequantize_kv`
    casts it.
    """
    c = config
    tokens = c.kv_tokens_per_block
    if pads_slot(c):  # words already, a spare row per token (`padded_slot`)
        words, rows_per_token = word_rows(kv_lanes, c)
    else:
        flat = kv_lanes.reshape(tokens * 2 * c.num_kv_heads_per_block, kv_lanes.shape[-1])
        if packing(kv_lanes.dtype) == 1:  # f32: one row per combined head
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
