"""Speed lever: head_dim held in blocks of 128 lanes, so that a head_dim of 256 (or any
multiple of 128) takes the strided load too.

What it saves. Mosaic's strided load (`strided`) needs rows of exactly 128 lanes. So a slot
holds head_dim as `lane_blocks` blocks of 128 lanes: lane block f of page i is
`kv_bufs[slot, f, i]`, [page_size, 2*kvh, 128], not [page_size, 2*kvh, head_dim] as in
`kv_pages`. Each block of 128 lanes is whole tiles, so it is still one plain DMA per page and
lane block (`lane_columns`); the compute loads each lane block on its own and puts them side by
side (`side_by_side`). The output is written one lane block at a time as well
(`softmax.OnlineSoftmax.write_output`). Bundles per KV block, static estimates (`python -m
minilib compile --head-dim 256`, 32 q / 8 KV heads, 128 tokens per KV block):
* the strided load per lane block, against the plain load, which gathers a vector register
  per token: v5e 4847 -> 1830 at 32 q per block, 4237 -> 1396 at 8 q; v6e 4751 -> 1678,
  4215 -> 1369;
* the output one lane block at a time: on v5e at 32 q rows the unrolled heads spilled 940 KiB
  of VMEM outside the KV-block loop with whole heads, and none with 128 lanes at a time.
On which chips: all (v5e and v6e measured). At head_dim 128 there is one lane block, and this
changes nothing; a head_dim that is not a multiple of 128 keeps one block of head_dim lanes.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from minilib.kernel.config import KernelConfig

__all__: list[str] = []  # the kernel body's own: see `lane_columns`, `side_by_side`


def lane_columns(config: KernelConfig):  # -> [(f, columns of head_dim in kv_pages)]
    """Each lane block f of a slot, with the columns of a `kv_pages` page it is copied from:
    the whole head_dim when there is one block, 128 columns from f * 128 otherwise."""
    width = config.head_dim // config.lane_blocks
    if config.lane_blocks == 1:
        return [(0, slice(None))]
    return [(f, pl.ds(f * width, width)) for f in range(config.lane_blocks)]


def side_by_side(blocks):  # [(k, v): [kv_tokens_per_block, width]] -> k, v: [tokens, hd]
    """K and V of one KV head from its lane blocks, put back side by side as head_dim."""
    if len(blocks) == 1:
        return blocks[0]
    k = jnp.concatenate([k for k, _ in blocks], axis=1)
    v = jnp.concatenate([v for _, v in blocks], axis=1)
    return k, v
