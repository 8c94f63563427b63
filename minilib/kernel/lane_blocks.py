"""Lever: head_dim held in blocks of 128 lanes, in place of one block of head_dim lanes in the
plain slot, so that head_dim 256 takes the strided load too (rows of exactly 128 lanes), and
the output is written 128 lanes at a time, without spills (benchmarks/LEVERS.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.kernel.config import KernelConfig

__all__: list[str] = []  # the kernel body's own: see `LaneBlocks`, `each_lane_block`


class LaneBlocks:
    """A slot of `inner`'s layout, head_dim split into `lane_blocks` blocks: lane block f of
    page i is `slot[f, i]`. Each block is whole tiles: still one plain DMA per page and block."""

    def __init__(self, inner):
        self.inner = inner

    def scratch(self, config: KernelConfig, kv_dtype):
        whole = self.inner.scratch(config, kv_dtype)  # [2, ..., head_dim]
        blocks = config.lane_blocks
        return pltpu.VMEM((2, blocks, *whole.shape[1:-1], whole.shape[-1] // blocks), whole.dtype)

    def page_copies(self, kv_pages_hbm_ref, page, heads, slot_buf, i: int, config: KernelConfig):
        return [self.inner.as_copied(kv_pages_hbm_ref.at[page, :, heads, lanes], slot_buf.at[f, i],
                                     config) for f, lanes in lane_columns(config)]  # fmt: skip

    def copied(self, slot_buf, config: KernelConfig):
        return self.inner.copied(slot_buf, config)

    def output_lanes(self, config: KernelConfig) -> tuple[slice, ...]:
        return config.lane_slices


def lane_columns(config: KernelConfig):  # -> [(f, the columns of head_dim in kv_pages)]
    width = config.head_dim // config.lane_blocks
    return [(f, pl.ds(f * width, width)) for f in range(config.lane_blocks)]


def each_lane_block(read):
    """`read` (K and V of one KV head from one block of lanes) on each lane block of a slot,
    the results side by side as head_dim."""

    def read_lane_blocks(kv_buf, kv_head: int, kv_blk, kv_len, config: KernelConfig):
        blocks = [read(kv_buf.at[f], kv_head, kv_blk, kv_len, config)
                  for f in range(config.lane_blocks)]  # fmt: skip
        return side_by_side(blocks)

    return read_lane_blocks


def side_by_side(blocks):  # [(k, v): [kv_tokens_per_block, width]] -> k, v: [tokens, hd]
    k = jnp.concatenate([k for k, _ in blocks], axis=1)
    v = jnp.concatenate([v for _, v in blocks], axis=1)
    return k, v
