"""The kernel body: one grid step's walk over sequences and their KV blocks.

    for each sequence with rows in this q block:            QBlockWalker.attend_seq
        for each KV block those rows can see:               QBlockWalker.attend_kv_block
            start copying the next KV block into the other slot
            wait for this KV block
            attend: fold it into the online softmax of the sequence's rows

The copy of the next KV block (`table.next_work`) runs while this one is computed: two slots,
one DMA semaphore each, the slot in flight carried from one grid step to the next.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minilib.kernel.config import KernelConfig
from minilib.kernel.copier import KVBlockCopier
from minilib.kernel.heads_in_flight import attend_kv_heads
from minilib.kernel.softmax import OnlineSoftmax, ScoreMask, SeqSpan, score_mask
from minilib.kernel.table import (
    SeqTable,
    Work,
    first_seq_in_q_block,
    first_work,
    next_live_seq,
    next_work,
    seq_kv_blocks,
    work_after_seq,
)

__all__: list[str] = []  # the kernel body's own: see `rpa_kernel`


def rpa_kernel(
    # Scalar prefetch, in SMEM, clamped before the kernel (`table.clamp_tables`):
    kv_lens_ref,  # i32[max_num_seqs]
    page_indices_ref,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    num_seqs_ref,  # i32[1]
    # Inputs:
    q_ref,  # [num_queries_per_block, num_q_heads_per_block, head_dim], VMEM
    kv_pages_hbm_ref,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim], HBM
    sink_ref,  # f32[num_kv_heads_per_block, group, LANES], VMEM; None without attention sinks
    # Output:
    o_ref,  # [num_queries_per_block, num_q_heads_per_block, head_dim], VMEM
    # Scratch:
    kv_bufs,  # [2, lane_blocks, kv pages per block, page_size, 2*kvh_per_blk, hd // lane_blocks]
    sems,  # DMA semaphores [2], one per slot
    m_ref,  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
    l_ref,  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
    acc_ref,  # f32[num_kv_heads_per_block, rows_per_kv_head, head_dim]
    q_fold_ref,  # [num_kv_heads_per_block, rows_per_kv_head, head_dim], q's dtype
    slot_ref,  # i32[1], SMEM: the slot the next KV block is loading into, kept across steps
    *,
    config: KernelConfig,
    copier_class: type[KVBlockCopier],
    walker_class: type[QBlockWalker],
):
    """One grid step: one block of q rows, one block of heads (`walker_class` walks it; in the
    decode kernel, `decode.DecodeWalker`: one block of one-token sequences, a row each)."""
    batch = SeqTable(kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, config)
    dma = copier_class(kv_pages_hbm_ref, kv_bufs, sems, batch)
    softmax = OnlineSoftmax(m_ref, l_ref, acc_ref, config, q_fold_ref.dtype, sink_ref)
    step = (pl.program_id(0), pl.program_id(1))  # (heads_blk, q_blk)

    @pl.when((step[0] == 0) & (step[1] == 0))
    def _start_the_first_copy():
        slot_ref[0] = 0
        first = first_work(batch)

        @pl.when(first.seq < batch.num_seqs())
        def _():
            dma.start(first, 0)

    walker = walker_class(step, q_ref, q_fold_ref, o_ref, softmax, batch, dma, config)
    walker.attend_grid_step(slot_ref)


class QBlockWalker:
    """Walks one grid step's work: the sequences owning rows of the q block, and for each the
    KV blocks its rows can see. `run` returns the slot the next KV block is loading into."""

    def __init__(self, step, q_ref, q_fold_ref, o_ref, softmax, batch, dma, config):
        self.heads_blk, self.q_blk = step
        self.q_ref = q_ref  # [num_queries_per_block, num_q_heads_per_block, head_dim]
        self.q_fold_ref = q_fold_ref  # [num_kv_heads_per_block, rows_per_kv_head, head_dim]
        self.o_ref = o_ref  # [num_queries_per_block, num_q_heads_per_block, head_dim]
        self.softmax = softmax
        self.batch = batch
        self.dma = dma
        self.config: KernelConfig = config
        self.q_blk_start = self.q_blk * config.num_queries_per_block
        self.q_blk_end = self.q_blk_start + config.num_queries_per_block
        self.first_live = next_live_seq(batch, 0)  # where the next heads block starts

    def attend_grid_step(self, slot_ref):
        """The softmax state is reset once per q block (so no masked stores are needed), q is
        folded once, the walk runs if any sequence has rows here, and the output is written.
        `slot_ref` carries the slot of the copy in flight from one grid step to the next."""
        self.softmax.init()

        @pl.when(self.q_blk_start < self.batch.total_q_len())
        def _attend_this_q_block():
            fold_q_heads(self.q_ref, self.q_fold_ref, self.config)
            slot_ref[0] = self.run(slot_ref[0])

        self.softmax.write_output(self.o_ref)

    def run(self, slot):
        _, slot = lax.while_loop(self.has_rows_here, self.attend_seq, (self.first_seq(), slot))
        return slot

    def first_seq(self):
        """The first live sequence with rows in this q block."""
        return next_live_seq(self.batch, first_seq_in_q_block(self.batch, self.q_blk_start))

    def has_rows_here(self, carry):
        seq, _ = carry
        return (seq < self.batch.num_seqs()) & (self.batch.q_start(seq) < self.q_blk_end)

    def attend_seq(self, carry):
        seq, slot = carry
        first_kv_blk, end_kv_blk = seq_kv_blocks(self.batch, seq, self.q_blk)
        following = next_live_seq(self.batch, seq + 1)
        span = SeqSpan(self.batch.q_start(seq), self.batch.q_end(seq), self.batch.kv_len(seq))
        num_pages = pl.cdiv(span.kv_len, self.config.page_size)
        seq_work = Work(self.heads_blk, seq, first_kv_blk, num_pages)
        after_seq = work_after_seq(self.batch, self.q_blk, seq_work, following, self.first_live)
        attend = functools.partial(self.attend_kv_block, seq_work, end_kv_blk, span, after_seq)
        slot = lax.fori_loop(first_kv_blk, end_kv_blk, attend, slot)
        return following, slot

    def attend_kv_block(
        self, seq_work: Work, end_kv_blk, span: SeqSpan, after_seq: Work, kv_blk, slot
    ):
        """Start copying the next KV block into the other slot, wait for this one, and fold
        it into the softmax of the sequence's rows, one KV head at a time.

        `seq_work` is the sequence's work here (at its first KV block), `end_kv_blk` the end of
        its KV blocks, `after_seq` the work after them, and `span` its rows and kv_len: all
        worked out once per sequence, in `attend_seq`."""
        here = dataclasses.replace(seq_work, kv_blk=kv_blk)
        nxt = next_work(here, end_kv_blk, after_seq)
        other = other_slot(slot)

        @pl.when(nxt.heads_blk < self.config.num_heads_blocks)
        def _prefetch_the_next_block():
            self.dma.start(nxt, other)

        self.dma.wait(here, slot)
        self.compute(here, slot, span)
        return other

    def compute(self, here: Work, slot, span: SeqSpan):
        """Fold the KV block `here`, waited for in `slot`, into the softmax of the rows."""
        mask = self.score_mask(span, here.kv_blk)
        attend_kv_heads(self.dma.buffer(slot), self.q_fold_ref, self.softmax, mask, here.kv_blk,
                        span.kv_len, self.config)  # fmt: skip

    def score_mask(self, span: SeqSpan, kv_blk) -> ScoreMask:
        return score_mask(span, self.q_blk, kv_blk, self.config)


def fold_q_heads(
    q_ref,  # [num_queries_per_block, num_q_heads_per_block, head_dim]
    q_fold_ref,  # [num_kv_heads_per_block, rows_per_kv_head, head_dim]
    config: KernelConfig,
):
    """The q heads that share each KV head, folded into rows: row r*group + g of
    q_fold_ref[kv_head] is q row r, head g. Done once per grid step, before the walk.

    Why once, into scratch: the fold moves rows between (8, 128) tiles (a token's q heads
    sit side by side in one tile, its group must go down a column of rows), which Mosaic
    does with strided stores and shuffled loads through VMEM. Every KV block of the q block
    meets the same folded q, so redoing it per KV block (inside the loop) costs as much as a
    quarter of the loop at 32 rows per q block; here it costs one fold per grid step.
    """
    c = config
    group = c.num_q_heads_per_kv_head
    for kv_head in range(c.num_kv_heads_per_block):
        q = q_ref[:, kv_head * group : (kv_head + 1) * group, :]  # [num_queries, group, hd]
        q_fold_ref[kv_head] = q.reshape(c.rows_per_kv_head, c.head_dim)


def other_slot(slot):
    """The slot the next KV block goes into. A select of constants, not `1 - slot`: then
    Mosaic knows the slot is 0 or 1, and needs no run-time bounds check of the copy."""
    return jnp.where(slot == 0, 1, 0)
