"""The plain kernel: what runs with every speed lever off, in one sitting.

It is the production shape of what the learner writes in the ladder's last rung. A grid step
takes a block of q rows and a block of heads, and walks the sequences that own those rows:

    for each sequence with rows in this q block:            QBlockWalker.attend_seq
        for each KV block those rows can see:               QBlockWalker.attend_kv_block
            start copying the next KV block into the other slot (`next_work`)
            wait for this KV block
            for each KV head: K and V, then the online softmax of its q heads

The levers plug in at its `Points`, chosen per configuration (`levers.choose_points`): the KV
slot, K and V to the MXU, the heads' order, q's fold, the output's unfold and division, p's max,
the walk, which sequences the kernel serves; and the copier, which the tests replace.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib import masking
from minilib.kernel.config import LANES, KernelConfig
from minilib.kernel.walk import (
    SeqTable,
    Work,
    first_seq_in_q_block,
    first_work,
    next_live_seq,
    next_work,
    seq_kv_blocks,
    work_after_seq,
)
from minilib.reference import apply_soft_cap

__all__: list[str] = []  # the kernel body's own: see `rpa_kernel`

# Scores in units of log2 (q . k * score_scale * LOG2_E): p = 2**(s - m), no multiply in exp.
LOG2_E = math.log2(math.e)
# m starts finite, above every vanishing mask value: a row seeing only masked keys (another
# sequence's, NaN padding) keeps m, l and acc exactly. No real score is this low.
M_START = -1e29


def rpa_kernel(
    kv_lens_ref,  # i32[max_num_seqs], SMEM, as are the next three
    page_indices_ref,  # i32[max_num_seqs * blocks_per_seq * pages per block]: block_page_table
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    num_seqs_ref,  # i32[1]
    q_ref,  # [num_queries_per_block, num_q_heads_per_block, head_dim], VMEM
    kv_pages_hbm_ref,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim], HBM
    o_ref,  # [num_queries_per_block, num_q_heads_per_block, head_dim], VMEM
    kv_bufs,  # [2, num_kv_pages_per_block, page_size, 2*num_kv_heads_per_block, head_dim]
    sems,  # DMA semaphores [2], one per slot
    m_ref,  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
    l_ref,  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
    acc_ref,  # f32[num_kv_heads_per_block, rows_per_kv_head, head_dim]
    q_fold_ref,  # [num_kv_heads_per_block, rows_per_kv_head, head_dim], q's dtype
    slot_ref,  # i32[1], SMEM: the slot the next KV block is loading into, across steps
    *,
    sink_ref=None,  # f32[num_kv_heads_per_block, group, LANES], VMEM: attention sinks
    config: KernelConfig,
    points: Points,
):
    batch = points.seq_table(kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, config)
    dma = points.copier(
        kv_pages_hbm_ref=kv_pages_hbm_ref,
        kv_bufs=kv_bufs,
        sems=sems,
        batch=batch,
        layout=points.slot,
    )
    softmax = points.softmax(
        m_ref=m_ref,
        l_ref=l_ref,
        acc_ref=acc_ref,
        config=config,
        dtype=q_fold_ref.dtype,
        sink_ref=sink_ref,
        lanes=points.slot.output_lanes(config),
        divide=points.divide,
    )
    step = (pl.program_id(0), pl.program_id(1))  # (heads_blk, q_blk)

    @pl.when((step[0] == 0) & (step[1] == 0))
    def _start_the_first_copy():
        slot_ref[0] = 0
        first = first_work(batch)

        @pl.when(first.seq < batch.num_seqs())
        def _():
            dma.start(first, 0)

    walker = points.walker(
        step=step,
        q_ref=q_ref,
        q_fold_ref=q_fold_ref,
        o_ref=o_ref,
        softmax=softmax,
        batch=batch,
        dma=dma,
        config=config,
        points=points,
    )
    walker.attend_grid_step(slot_ref)


class QBlockWalker:
    """One grid step: the sequences with rows in the q block, and the KV blocks they see."""

    def __init__(self, step, q_ref, q_fold_ref, o_ref, softmax, batch, dma, config, points):
        self.heads_blk, self.q_blk = step
        self.q_ref = q_ref
        self.q_fold_ref = q_fold_ref
        self.o_ref = o_ref
        self.softmax: OnlineSoftmax = softmax
        self.batch = batch
        self.dma = dma
        self.config = config
        self.points = points
        self.q_blk_start = self.q_blk * config.num_queries_per_block
        self.q_blk_end = self.q_blk_start + config.num_queries_per_block
        self.first_live = next_live_seq(batch, 0)  # where the next heads block starts

    def attend_grid_step(self, slot_ref):
        """Reset the softmax once per q block (no masked stores), fold q, walk, write out."""
        self.softmax.init()

        @pl.when(self.q_blk_start < self.batch.total_q_len())
        def _attend_this_q_block():
            self.points.fold_q(self.q_ref, self.q_fold_ref, self.config)
            slot_ref[0] = self.run(slot_ref[0])

        self.points.write_output(self.softmax, self.o_ref, self.q_fold_ref)

    def run(self, slot):
        _, slot = lax.while_loop(self.has_rows_here, self.attend_seq, (self.first_seq(), slot))
        return slot

    def first_seq(self):
        return next_live_seq(self.batch, first_seq_in_q_block(self.batch, self.q_blk_start))

    def has_rows_here(self, carry):
        seq, _ = carry
        return (seq < self.batch.num_seqs()) & (self.batch.q_start(seq) < self.q_blk_end)

    def attend_seq(self, carry):
        seq, slot = carry
        first_kv_blk, end_kv_blk = seq_kv_blocks(self.batch, seq, self.q_blk)
        following = next_live_seq(self.batch, seq + 1)
        span = SeqSpan(self.batch.q_start(seq), self.batch.q_end(seq), self.batch.kv_len(seq))
        seq_work = Work(self.heads_blk, seq, first_kv_blk)
        after_seq = work_after_seq(self.batch, self.q_blk, seq_work, following, self.first_live)
        attend = functools.partial(self.attend_kv_block, seq_work, end_kv_blk, span, after_seq)
        return following, self.walk_kv_blocks(first_kv_blk, end_kv_blk, span, attend, slot)

    def walk_kv_blocks(self, first_kv_blk, end_kv_blk, span: SeqSpan, attend, slot):
        return lax.fori_loop(first_kv_blk, end_kv_blk, attend, slot)  # each block masked

    def attend_kv_block(self, seq_work, end_kv_blk, span, after_seq, kv_blk, slot, masked=True):
        here = dataclasses.replace(seq_work, kv_blk=kv_blk)
        nxt = next_work(here, end_kv_blk, after_seq)
        other = other_slot(slot)

        @pl.when(nxt.heads_blk < self.config.num_heads_blocks)
        def _prefetch_the_next_block():
            self.dma.start(nxt, other)

        self.dma.wait(here, slot)
        self.compute(here, slot, span, masked)
        return other

    def compute(self, here: Work, slot, span: SeqSpan, masked=True):
        mask = self.score_mask(span, here.kv_blk) if masked else None  # None: every key seen
        kv_buf = self.dma.buffer(slot)
        kv_len = span.kv_len if masked else None  # None: no token of the block is past kv_len
        self.points.attend_heads(
            kv_buf=kv_buf,
            q_fold_ref=self.q_fold_ref,
            softmax=self.softmax,
            mask=mask,
            kv_blk=here.kv_blk,
            kv_len=kv_len,
            config=self.config,
            load_kv=self.points.load_kv,
        )

    def score_mask(self, span: SeqSpan, kv_blk) -> ScoreMask:
        return score_mask(span, self.q_blk, kv_blk, self.config)


def fold_q_heads(q_ref, q_fold_ref, config: KernelConfig):
    """Row r*group + g of q_fold_ref[kv_head] is q row r, head g. Once per grid step: the fold
    moves rows between (8, 128) tiles, a quarter of the KV loop's cost if done in it."""
    c = config
    group = c.num_q_heads_per_kv_head
    for kv_head in range(c.num_kv_heads_per_block):
        q = q_ref[:, kv_head * group : (kv_head + 1) * group, :]  # [num_queries, group, hd]
        q_fold_ref[kv_head] = q.reshape(c.rows_per_kv_head, c.head_dim)


def write_output(softmax, o_ref, q_fold_ref):  # q_fold_ref, free now: a lever's scratch
    c = softmax.config
    group = c.num_q_heads_per_kv_head  # unfolded as q was folded
    for kv_head in range(c.num_kv_heads_per_block):
        heads = slice(kv_head * group, (kv_head + 1) * group)
        for lanes in softmax.output_lanes:
            out = softmax.normalized(kv_head, lanes)  # [rows, width]
            out = out.reshape(c.num_queries_per_block, group, out.shape[1])
            o_ref[:, heads, lanes] = out.astype(o_ref.dtype)


def in_log2_units(mask_value: float) -> float:  # one that vanishes stays as it is
    return mask_value if masking.mask_value_vanishes(mask_value) else mask_value * LOG2_E


def other_slot(slot):
    """A select, not `1 - slot`: Mosaic then knows it is 0 or 1 (no bounds check)."""
    return jnp.where(slot == 0, 1, 0)


class KVBlockCopier:
    """Starts and waits for the page copies of one KV block into one slot of `kv_bufs`."""

    def __init__(self, kv_pages_hbm_ref, kv_bufs, sems, batch: SeqTable, layout: PlainSlot):
        self.kv_pages_hbm_ref = kv_pages_hbm_ref
        self.kv_bufs = kv_bufs
        self.sems = sems
        self.batch = batch
        self.config = batch.config
        self.layout = layout

    def buffer(self, slot):
        return self.kv_bufs.at[slot]

    def start(self, work: Work, slot):
        """Every page of the block, past the sequence's end its last page again (the compute
        masks it; `page_table.block_page_table`): the same bytes each block, one wait for all.
        The block's first index once, plus i: fewer scalar ops than an index per page."""
        c = self.config
        first = (work.seq * c.blocks_per_seq + work.kv_blk) * c.num_kv_pages_per_block
        hbm = self.kv_pages_hbm_ref
        heads = pl.ds(work.heads_blk * 2 * c.num_kv_heads_per_block, 2 * c.num_kv_heads_per_block)
        if c.num_heads_blocks == 1:  # static: a dynamic offset may not be provably tile-aligned
            heads = slice(None)
        for i in range(c.num_kv_pages_per_block):
            page = self.batch.page_indices_ref[first + i]
            buf = self.buffer(slot)
            for source, target in self.layout.page_copies(hbm, page, heads, buf, i, c):
                pltpu.make_async_copy(source, target, self.sems.at[slot]).start()

    def wait(self, work: Work, slot):
        del work  # every block copies the same bytes: a DMA semaphore counts bytes
        copied = self.layout.copied(self.buffer(slot), self.config)
        pltpu.make_async_copy(copied, copied, self.sems.at[slot]).wait()


class PlainSlot:
    """A KV slot as `kv_pages` holds a page: [pages per block, page_size, 2*kvh_per_blk, hd]."""

    def scratch(self, config: KernelConfig, kv_dtype):  # both slots
        c = config
        shape = (c.num_kv_pages_per_block, c.page_size, 2 * c.num_kv_heads_per_block, c.head_dim)
        return pltpu.VMEM((2, *shape), kv_dtype)

    def page_copies(self, kv_pages_hbm_ref, page, heads, slot_buf, i: int, config: KernelConfig):
        """The (source, target) of each copy that brings a page into page i of the slot."""
        return [self.as_copied(kv_pages_hbm_ref.at[page, :, heads], slot_buf.at[i], config)]

    def as_copied(self, source, target, config: KernelConfig):
        return source, target

    def copied(self, slot_buf, config: KernelConfig):  # what one wait counts the bytes of
        return slot_buf

    def output_lanes(self, config: KernelConfig) -> tuple[slice, ...]:
        return (slice(None),)


def read_kv_head(kv_buf, kv_head: int, kv_blk, kv_len, config: KernelConfig):
    """K (combined head 2*kv_head) and V (2*kv_head + 1), [tokens, hd]. The ref indexed, the
    value reshaped (interpret mode cannot reshape refs): on the chip a register per token."""
    tokens = config.kv_tokens_per_block
    width = kv_buf.shape[-1]
    k = kv_buf[:, :, 2 * kv_head, :].reshape(tokens, width)
    v = kv_buf[:, :, 2 * kv_head + 1, :].reshape(tokens, width)
    return k, v


def load_kv(kv_buf, kv_head: int, kv_blk, kv_len, dtype, config: KernelConfig, read=read_kv_head):
    k, v = read(kv_buf=kv_buf, kv_head=kv_head, kv_blk=kv_blk, kv_len=kv_len, config=config)
    v = v if kv_len is None else zero_tokens_past_kv_len(v, kv_blk, kv_len, config)
    return k.astype(dtype), v.astype(dtype)


def zero_tokens_past_kv_len(x, kv_blk, kv_len, config: KernelConfig):  # x: [kv_tokens, hd]
    """Tokens past kv_len hold NaN padding or stale memory. K needs nothing (the mask replaces
    its scores), V does: 0 * NaN = NaN in p @ v. In float32: v5e has no bf16 vector unit."""
    pos = kv_blk * config.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where(pos < kv_len, x.astype(jnp.float32), 0.0).astype(x.dtype)


def attend_heads(kv_buf, q_fold_ref, softmax, mask, kv_blk, kv_len, config, load_kv):
    """One KV head at a time, with its group of q heads: Q·K, softmax, P·V."""
    for kv_head in range(config.num_kv_heads_per_block):
        k, v = load_kv(
            kv_buf=kv_buf,
            kv_head=kv_head,
            kv_blk=kv_blk,
            kv_len=kv_len,
            dtype=q_fold_ref.dtype,
            config=config,
        )
        p, alpha = softmax.scores_and_stats(kv_head, q_fold_ref[kv_head], k, mask)
        softmax.accumulate(kv_head, v, p, alpha)


@dataclasses.dataclass(frozen=True)
class SeqSpan:  # one sequence's rows [q_start, q_end) and kv_len, read once per sequence
    q_start: jax.Array
    q_end: jax.Array
    kv_len: jax.Array


@dataclasses.dataclass(frozen=True)
class ScoreMask:  # once per KV block, for every KV head
    masked: jax.Array  # bool[rows, kv_tokens_per_block]: causal and sliding window
    hidden: jax.Array | None  # bool[rows, kv tokens]: past kv_len, other rows; None: in `masked`


def score_mask(span: SeqSpan, q_blk, kv_blk, config: KernelConfig) -> ScoreMask:
    """The keys each row may not see. Rows of other sequences see none of this one's: their
    m, l and acc stay as they are (`M_START`), with no select of their own."""
    c = config
    shape = (c.rows_per_kv_head, c.kv_tokens_per_block)
    row = q_row(shape, q_blk, c)
    q_pos = masking.q_position(row, span.q_end, span.kv_len)
    k_pos = kv_blk * c.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, shape, 1)
    masked = masking.is_masked(q_pos, k_pos, c.sliding_window)
    other_rows = (row < span.q_start) | (row >= span.q_end)
    if masking.mask_value_vanishes(c.mask_value):
        return ScoreMask(masked | other_rows, None)
    # A small mask_value gives masked keys a weight: keys past kv_len are named apart.
    return ScoreMask(masked, (k_pos >= span.kv_len) | other_rows)


def q_row(shape, q_blk, config: KernelConfig):  # the batch's q row of each folded row
    first = q_blk * config.num_queries_per_block
    return first + lax.broadcasted_iota(jnp.int32, shape, 0) // config.num_q_heads_per_kv_head


def widen(x, width: int):  # x: [rows, LANES], every lane the same -> [rows, width]
    """Copies of whole vector registers, or the first lanes; else a cross-lane broadcast."""
    if width % LANES == 0:
        return jnp.concatenate([x] * (width // LANES), axis=1) if width > LANES else x
    return x[:, :width] if width < LANES else jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def lane_sums(p):  # p: f32[rows, kv_tokens] -> [rows, LANES], the lanes adding up to each row's sum
    """Whole vector registers of p added, no sum across lanes: that waits for the output."""
    if p.shape[1] % LANES == 0:
        return functools.reduce(jnp.add, [p[:, i : i + LANES] for i in range(0, p.shape[1], LANES)])
    first_lane = lax.broadcasted_iota(jnp.int32, (p.shape[0], LANES), 1) == 0
    return jnp.where(first_lane, p.sum(axis=1, keepdims=True), 0.0)


class OnlineSoftmax:
    """Running max m, sum l and unnormalized output acc of every row, per KV head, 128 lanes
    wide: m as a row's value must sit to meet s (every lane the same: never broadcast across
    lanes), l as lane sums (`lane_sums`), a row's sum the sum of its lanes."""

    def __init__(self, m_ref, l_ref, acc_ref, config, dtype, sink_ref, lanes, divide):
        self.m_ref = m_ref
        self.l_ref = l_ref
        self.acc_ref = acc_ref
        self.config: KernelConfig = config
        self.dtype = dtype  # the compute dtype, q's: p is rounded to it for P·V
        self.sink_ref = sink_ref  # f32[kvh_per_blk, group, LANES], or None
        self.output_lanes = lanes
        self.divide = divide  # the output's columns; its acc / l

    def init(self):
        self.m_ref[...] = jnp.full(self.m_ref.shape, M_START, jnp.float32)
        self.l_ref[...] = jnp.zeros(self.l_ref.shape, jnp.float32)
        self.acc_ref[...] = jnp.zeros(self.acc_ref.shape, jnp.float32)

    def scores_and_stats(self, kv_head: int, q, k, mask: ScoreMask | None):  # q: [rows, hd]
        """s = q k^T masked, m and l updated, p = 2**(s - m), alpha = 2**(m_prev - m) (log2)."""
        s = self.scores(q, k, mask)
        lanes = (s.shape[0], LANES)
        m_prev = self.m_ref[kv_head]  # [rows, LANES]
        l_prev = self.l_ref[kv_head]  # [rows, LANES]
        m_next = jnp.maximum(m_prev, jnp.broadcast_to(s.max(axis=1, keepdims=True), lanes))
        p = jnp.exp2(s - widen(m_next, s.shape[1]))  # [rows, kv_tokens]
        alpha = jnp.exp2(m_prev - m_next)
        l_next = alpha * l_prev + lane_sums(p)
        self.m_ref[kv_head] = m_next
        self.l_ref[kv_head] = l_next
        return p, alpha

    def scores(self, q, k, mask: ScoreMask | None):  # -> f32[rows, kv_tokens], in log2 units
        c = self.config
        s = jnp.einsum("rd,td->rt", q, k, preferred_element_type=jnp.float32)
        s = s * (c.score_scale * LOG2_E)
        s = apply_soft_cap(s, None if c.soft_cap is None else c.soft_cap * LOG2_E)
        if mask is None:
            return s
        return masking.apply_mask_value(s, mask.masked, in_log2_units(c.mask_value), mask.hidden)

    def accumulate(self, kv_head: int, v, p, alpha):  # v: [kv_tokens, hd]
        acc_prev = self.acc_ref[kv_head]  # [rows, head_dim]
        pv = jnp.einsum("rt,td->rd", p.astype(self.dtype), v, preferred_element_type=jnp.float32)
        acc_next = widen(alpha, acc_prev.shape[1]) * acc_prev + pv
        self.acc_ref[kv_head] = acc_next

    def normalized(self, kv_head: int, lanes=slice(None)):  # -> f32[rows_per_kv_head, width]
        """acc / l (0 in rows no sequence owns), times v_scale; sinks join l here."""
        total = self.l_ref[kv_head].sum(axis=1, keepdims=True)  # [rows, 1]
        if self.sink_ref is not None:
            total = total + self.sink_term(kv_head)
        out = self.divide(self.acc_ref[kv_head, :, lanes], jnp.where(total == 0.0, 1.0, total))
        return out if self.config.v_scale is None else out * self.config.v_scale

    def sink_term(self, kv_head: int):  # -> f32[rows_per_kv_head, 1]
        """2**(sink * LOG2_E - m): the sink's share of l, once per output row, not per KV block
        (m scales numerator and denominator alike). Folded row r*group + g is q head g's."""
        c = self.config
        sinks = self.sink_ref[kv_head]  # [group, LANES]
        q_rows = c.rows_per_kv_head // c.num_q_heads_per_kv_head
        rows = jnp.concatenate([sinks] * q_rows, axis=0) if q_rows > 1 else sinks
        return jnp.exp2(rows[:, :1] * LOG2_E - self.m_ref[kv_head][:, :1])


@dataclasses.dataclass(frozen=True)
class Points:
    slot: PlainSlot = PlainSlot()  # how a KV slot is laid out and filled
    load_kv: Callable = load_kv  # how K and V of one KV head reach the MXU
    attend_heads: Callable = attend_heads  # the order of the KV heads' Q·K and P·V
    fold_q: Callable = fold_q_heads  # how q's heads are folded into each KV head's rows
    write_output: Callable = write_output  # ... and the output unfolded
    divide: Callable = jnp.divide  # the output's acc / l
    softmax: type[OnlineSoftmax] = OnlineSoftmax  # how p is kept in range: the running max
    walker: type[QBlockWalker] = QBlockWalker  # which sequences and KV blocks a step walks
    seq_table: type[SeqTable] = SeqTable  # which sequences have work here
    copier: type[KVBlockCopier] = KVBlockCopier  # how KV blocks are copied (tests plant bugs)
