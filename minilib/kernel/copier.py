"""Moving KV blocks: the pages of one KV block, from HBM into one VMEM slot, by DMA.

`kv_pages` stays in HBM (`memory_space=pl.ANY`); the kernel copies the pages a KV block needs
with `pltpu.make_async_copy`, one DMA semaphore per slot. Two slots: while the kernel computes
with one, the other fills with the next KV block (double buffering, `walk`).

One copy per page, one wait per block (`KVBlockCopier.wait`). Waiting page by page, each
behind a branch on whether the sequence has the page, was a serial chain of waits with no
vector work beside it. One wait saves, in bundles per KV block (static estimates, libtpu
0.0.50.1, `python -m minilib compile`; 32 q / 8 q / decode): v5e 1348 / 735 / 482 -> 1325 /
707 / 444, v6e 1176 / 745 / 606 -> 1157 / 729 / 587, TPU7x 1213 / 793 / 618 -> 1191 / 770 /
598. It saves most where blocks are long: at each kernel's own block sizes (`compile
--defaults`), per 128 KV tokens at decode, v5e 363.8 -> 327.5, v6e 402.8 -> 359.2, TPU7x
473.0 -> 421.5 (vLLM's RPA v3: 385.0, 357.8, 354.5).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.kernel.lane_blocks import lane_columns
from minilib.kernel.padded_slot import as_words, pads_slot
from minilib.kernel.table import SeqTable, Work

__all__: list[str] = []  # the kernel body's own: see `KVBlockCopier`


class KVBlockCopier:
    """Starts and waits for the page copies of one KV block into one slot of `kv_bufs`.

    Page i of a KV block goes to `kv_bufs[slot, :, i]`: one copy per page, or per page and
    lane block when head_dim is held in several blocks of 128 lanes (`lane_blocks`). A bf16
    slot read by the strided load is held as words, with a spare row per token (`padded_slot`).
    """

    def __init__(self, kv_pages_hbm_ref, kv_bufs, sems, batch: SeqTable):
        self.kv_pages_hbm_ref = kv_pages_hbm_ref  # [total_num_pages, page_size, 2*kvh, hd]
        # [2, lane_blocks, num_kv_pages_per_block, page_size, 2*kvh_per_blk, hd // lane_blocks]
        self.kv_bufs = kv_bufs
        self.sems = sems  # DMA semaphores [2]
        self.batch = batch
        self.config = batch.config

    def buffer(self, slot):
        """The VMEM buffer of a slot: [lane_blocks, num_kv_pages_per_block, page_size,
        2*kvh_per_blk, head_dim // lane_blocks], or padded (`padded_slot`) [...,
        kvh_per_blk + 1, 1, head_dim // lane_blocks] words."""
        return self.kv_bufs.at[slot]

    def start(self, work: Work, slot):
        """Start the copies of the block's pages, every page of the block: one past the end of
        the sequence is a copy of its last page (the compute masks those tokens), so that every
        block copies the same bytes and one wait takes them all back. The cost: at most one
        block's worth of extra copying per sequence, in its last block."""
        last = jnp.maximum(work.num_pages - 1, 0)
        for i in range(self.config.num_kv_pages_per_block):
            page_pos = work.kv_blk * self.config.num_kv_pages_per_block + i
            self._start_page(work, slot, i, jnp.minimum(page_pos, last))

    def wait(self, work: Work, slot):
        """Wait for every copy of the block at once. A DMA semaphore counts bytes, and a wait
        takes back as many as its copy moves: one wait the size of everything copied into the
        slot (the whole slot; padded, all but the spare rows) stands for all the copies."""
        del work  # every block copies the same bytes
        copied = self.buffer(slot)
        if pads_slot(self.config):
            copied = copied.at[:, :, :, : self.config.num_kv_heads_per_block, 0]
        pltpu.make_async_copy(copied, copied, self.sems.at[slot]).wait()

    def _start_page(self, work: Work, slot, i: int, page_pos):
        """Start the copy of one page into page i of the slot: this heads block's K/V heads of
        every token in it, one copy per lane block."""
        c = self.config
        kv_heads = c.num_kv_heads_per_block
        combined_heads = pl.ds(work.heads_blk * 2 * kv_heads, 2 * kv_heads)
        if c.num_heads_blocks == 1:
            # A static whole axis: Mosaic cannot prove a dynamic offset is tile-aligned when
            # the axis is shorter than a tile (MQA in fp8: 2 combined heads, tiles of 4 rows).
            combined_heads = slice(None)
        page = self.batch.page(work.seq, page_pos)
        for f, lanes in lane_columns(c):
            source = self.kv_pages_hbm_ref.at[page, :, combined_heads, lanes]  # [ps, 2*kvh, width]
            target = self.buffer(slot).at[f, i]  # [page_size, 2*num_kv_heads_per_block, width]
            if pads_slot(c):  # the same bytes, as words, a spare row per token (`padded_slot`)
                source, target = as_words(source, target, c)
            pltpu.make_async_copy(source, target, self.sems.at[slot]).start()
