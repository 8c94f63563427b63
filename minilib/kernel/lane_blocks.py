"""Lever: head_dim held in blocks of 128 lanes, in place of one block of head_dim lanes in the
plain slot, so that head_dim 256 takes the strided load too (rows of exactly 128 lanes), and
the output is written 128 lanes at a time, without spills (benchmarks/LEVERS.md).

Two ways to hold the blocks: a slot per lane block (`LaneBlocks`, around the plain or the
padded slot), a copy per page and block; or, on the chips of `WHOLE_ROWS_CHIPS`, the padded
slot with head_dim whole in each token's rows (`WholeRows`), one copy per page, each row of
words seen as `lane_blocks` rows of 128 lanes (`lane_rows`). Mosaic's strided load reads
only from rows of exactly 128 lanes: both give it those.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.kernel.config import LANES, KernelConfig

__all__: list[str] = []  # the kernel body's own: see `LaneBlocks`, `WholeRows`

# Where `levers.chosen_levers` asks for whole rows: a page's copy into the padded slot is a
# `dma.general` whose descriptor the scalar core stores word by word before any vector op of
# the block, so one copy per page, not one per lane block, saves scalar work; on v5e the loop
# grows instead (benchmarks/LEVERS.md has the figures).
WHOLE_ROWS_CHIPS = ("v6e", "tpu7x")


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
        return [
            self.inner.as_copied(
                kv_pages_hbm_ref.at[page, :, heads, lanes], slot_buf.at[f, i], config
            )
            for f, lanes in lane_columns(config)
        ]

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
        blocks = [
            read(kv_buf=kv_buf.at[f], kv_head=kv_head, kv_blk=kv_blk, kv_len=kv_len, config=config)
            for f in range(config.lane_blocks)
        ]
        return side_by_side(blocks)

    return read_lane_blocks


def side_by_side(blocks):  # [(k, v): [kv_tokens_per_block, width]] -> k, v: [tokens, hd]
    k = jnp.concatenate([k for k, _ in blocks], axis=1)
    v = jnp.concatenate([v for _, v in blocks], axis=1)
    return k, v


class WholeRows:
    """`inner`, the padded slot (`padded_slot.PaddedSlot`), with head_dim whole: one copy per
    page, read by the strided load per lane block (`lane_rows`); the output written 128 lanes
    at a time."""

    def __init__(self, inner):
        self.inner = inner

    def scratch(self, config: KernelConfig, kv_dtype):
        return self.inner.scratch(config, kv_dtype)

    def page_copies(self, kv_pages_hbm_ref, page, heads, slot_buf, i: int, config: KernelConfig):
        return self.inner.page_copies(kv_pages_hbm_ref, page, heads, slot_buf, i, config)

    def copied(self, slot_buf, config: KernelConfig):
        return self.inner.copied(slot_buf, config)

    def output_lanes(self, config: KernelConfig) -> tuple[slice, ...]:
        return config.lane_slices


def lane_rows(kv_lanes, config: KernelConfig):  # [pages, page_size, kvh + 1, 1, hd] words
    """`padded_slot.word_rows` of a `WholeRows` slot: [tokens * (kvh + 1) * lane_blocks, 128]
    words (the same bytes), and the rows per token. Lane block f of KV head h is row
    h * lane_blocks + f of its token (`each_lane_row`)."""
    rows_per_token = (config.num_kv_heads_per_block + 1) * config.lane_blocks
    return kv_lanes.reshape(config.kv_tokens_per_block * rows_per_token, LANES), rows_per_token


def each_lane_row(read):
    """`read` (the strided load of one row of each token, through `lane_rows`) on each lane
    block of a KV head, the results side by side as head_dim."""

    def read_lane_rows(kv_buf, kv_head: int, kv_blk, kv_len, config: KernelConfig):
        first = kv_head * config.lane_blocks
        blocks = [
            read(kv_buf=kv_buf, kv_head=first + f, kv_blk=kv_blk, kv_len=kv_len, config=config)
            for f in range(config.lane_blocks)
        ]
        return side_by_side(blocks)

    return read_lane_rows
