"""The online softmax of one KV block: scores, mask, running max and sum, and P·V.

`OnlineSoftmax` holds m, l and acc of every row of the q block, per KV head, in VMEM scratch,
and folds one KV block at a time into them, in two halves (`scores_and_stats`, then
`accumulate`) so that several KV heads can be in flight (`heads_in_flight`). `score_mask` says
which scores a KV block hides (causal, sliding window, past kv_len) and which rows it may change.

Attention sinks (`attention_sink`: a learned logit per q head that joins every softmax
denominator and carries no value) join once, when the output is written (`normalized`): the
loop over KV blocks is the same with and without them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from minilib.kernel.config import LANES, KernelConfig
from minilib.masking import apply_mask_value, is_masked, mask_value_vanishes, q_position
from minilib.reference import apply_soft_cap

__all__: list[str] = []  # the kernel body's own: see `OnlineSoftmax`


@dataclasses.dataclass(frozen=True)
class SeqSpan:
    """One sequence's rows [q_start, q_end) and kv_len, read from the table once per sequence
    rather than in every KV-block iteration."""

    q_start: jax.Array
    q_end: jax.Array
    kv_len: jax.Array


@dataclasses.dataclass(frozen=True)
class ScoreMask:
    """Which scores of a KV block are hidden, and which rows the block may change."""

    masked: jax.Array  # bool[rows, kv_tokens_per_block]: `is_masked` (causal, sliding window)
    # bool[rows, kv_tokens_per_block]: the padding slots, keys that do not exist; None when
    # the mask value vanishes (then `masked` covers them).
    past_kv_len: jax.Array | None
    # bool[rows, LANES]: the rows of the walked sequence (rows of other sequences, or
    # padding, must not change); None when every row is the sequence's.
    in_seq: jax.Array | None


def score_mask(span: SeqSpan, q_blk, kv_blk, config: KernelConfig) -> ScoreMask:
    """The `ScoreMask` of KV block `kv_blk` for the rows of the sequence `span` in q block
    `q_blk` (rows: rows_per_kv_head)."""
    c = config
    shape = (c.rows_per_kv_head, c.kv_tokens_per_block)
    q_pos = q_position(q_row(shape, q_blk, c), span.q_end, span.kv_len)
    k_pos = kv_blk * c.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, shape, 1)
    masked = is_masked(q_pos, k_pos, c.sliding_window)
    # With the default mask_value a padding slot (a future key of every row) is masked like
    # any other; a small one would give it a weight, so it is named apart (`apply_mask_value`).
    past_kv_len = None if mask_value_vanishes(c.mask_value) else k_pos >= span.kv_len
    row = q_row((c.rows_per_kv_head, LANES), q_blk, c)
    in_seq = (row >= span.q_start) & (row < span.q_end)
    return ScoreMask(masked, past_kv_len, in_seq)


def q_row(shape, q_blk, config: KernelConfig):
    """i32[shape]: the q row (in the whole batch) of each row of the folded q matrix."""
    first = q_blk * config.num_queries_per_block
    return first + lax.broadcasted_iota(jnp.int32, shape, 0) // config.num_q_heads_per_kv_head


def widen(x, width: int):  # x: [rows, LANES], every lane the same -> [rows, width]
    """A lane-replicated column, as wide as `width` columns.

    A multiple of 128 columns is copies of its vector registers, fewer its first lanes (free);
    anything else takes one lane and broadcasts it (a cross-lane permute on the chip).
    """
    if width % LANES == 0:
        return jnp.concatenate([x] * (width // LANES), axis=1) if width > LANES else x
    return x[:, :width] if width < LANES else jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def keep_other_rows(in_seq, new, old):  # in_seq: bool[rows, LANES]; new, old: [rows, width]
    """`new` in the rows of the walked sequence, `old` elsewhere: rows of other sequences, and
    padding rows (which may be NaN), keep their state. Nothing to select when every row is
    the sequence's (in_seq None)."""
    if in_seq is None:
        return new
    return jnp.where(widen(in_seq, new.shape[1]), new, old)


class OnlineSoftmax:
    """The running max m, running sum l and unnormalized output acc of every row of the q block,
    per KV head: softmax(s) @ v computed one KV block at a time.

    m and l are kept 128 lanes wide, every lane holding the row's value: that is how a row's
    value must sit to meet 128 columns of s or acc, so they are never broadcast across lanes.
    """

    def __init__(self, m_ref, l_ref, acc_ref, config: KernelConfig, dtype, sink_ref=None):
        self.m_ref = m_ref  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
        self.l_ref = l_ref  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
        self.acc_ref = acc_ref  # f32[num_kv_heads_per_block, rows_per_kv_head, head_dim]
        self.config = config
        self.dtype = dtype  # the compute dtype, q's: p is rounded to it for P·V
        # f32[num_kv_heads_per_block, num_q_heads_per_kv_head, LANES], VMEM: each q head's
        # attention sink, lane-replicated; None without sinks.
        self.sink_ref = sink_ref

    def init(self):
        self.m_ref[...] = jnp.full(self.m_ref.shape, -jnp.inf, jnp.float32)
        self.l_ref[...] = jnp.zeros(self.l_ref.shape, jnp.float32)
        self.acc_ref[...] = jnp.zeros(self.acc_ref.shape, jnp.float32)

    def scores_and_stats(
        self,
        kv_head: int,
        q,  # [rows, head_dim]
        k,  # [kv_tokens_per_block, head_dim]: q's dtype, or fp8 as stored (`fp8`)
        mask: ScoreMask,
    ):  # -> p: f32[rows, kv_tokens_per_block], alpha: f32[rows, LANES]
        """The first half of one online-softmax step, for one KV head and its q heads: the
        scores s = q k^T, the new running max m and sum l (stored), and what the second
        half needs: the weights p = exp(s - m) and alpha, which rescales the old acc."""
        c = self.config
        s = jnp.einsum("rd,td->rt", q, k, preferred_element_type=jnp.float32) * c.score_scale
        s = apply_soft_cap(s, c.soft_cap)
        s = apply_mask_value(s, mask.masked, c.mask_value, mask.past_kv_len)  # [rows, tokens]
        lanes = (s.shape[0], LANES)

        m_prev = self.m_ref[kv_head]  # [rows, LANES]
        l_prev = self.l_ref[kv_head]  # [rows, LANES]
        m_next = jnp.maximum(m_prev, jnp.broadcast_to(s.max(axis=1, keepdims=True), lanes))
        p = jnp.exp(s - widen(m_next, s.shape[1]))  # [rows, kv_tokens]
        alpha = jnp.exp(m_prev - m_next)  # rescales what was summed under the old max
        l_next = alpha * l_prev + jnp.broadcast_to(p.sum(axis=1, keepdims=True), lanes)
        self.m_ref[kv_head] = keep_other_rows(mask.in_seq, m_next, m_prev)
        self.l_ref[kv_head] = keep_other_rows(mask.in_seq, l_next, l_prev)
        return p, alpha

    def accumulate(
        self,
        kv_head: int,
        v,  # [kv_tokens_per_block, head_dim]: q's dtype, or fp8 as stored (`fp8`)
        p,  # f32[rows, kv_tokens_per_block], from `scores_and_stats`
        alpha,  # f32[rows, LANES], from `scores_and_stats`
        mask: ScoreMask,
    ):
        """The second half: acc = alpha * acc + p v. (p is rounded to the compute dtype for
        the matmul, V's dtype unless V comes as fp8 (`fp8`), which halves the MXU's pushes for
        a bf16 V, at an error of the order of the bf16 output's own rounding: notebook 08
        measures it.)"""
        acc_prev = self.acc_ref[kv_head]  # [rows, head_dim]
        pv = jnp.einsum("rt,td->rd", p.astype(self.dtype), v, preferred_element_type=jnp.float32)
        acc_next = widen(alpha, acc_prev.shape[1]) * acc_prev + pv
        self.acc_ref[kv_head] = keep_other_rows(mask.in_seq, acc_next, acc_prev)

    def normalized(self, kv_head: int, lanes=slice(None)):  # -> f32[rows_per_kv_head, width]
        """out = acc / l for one KV head's group of q heads, in the columns `lanes` of head_dim
        (all of them by default), times v_scale when there is one (V's dequantization, moved
        from every value of V to the output: `fp8`). Rows that no sequence owns have l = 0 and
        acc = 0, and come out as zeros.

        With attention sinks, l gains exp(sink - m) here (`sink_term`)."""
        total = self.l_ref[kv_head][:, :1]  # [rows, 1]
        if self.sink_ref is not None:
            total = total + self.sink_term(kv_head)
        out = self.acc_ref[kv_head, :, lanes] / jnp.where(total == 0.0, 1.0, total)
        return out if self.config.v_scale is None else out * self.config.v_scale

    def sink_term(self, kv_head: int):  # -> f32[rows_per_kv_head, 1]
        """exp(sink - m): the attention sink's share of the denominator, in the scale of l.

        Why at the end, not at the start (m = sink, l = 1, as vLLM's head_dim-64 kernel
        does): the result is the same, since m only scales the numerator and the denominator
        alike, but here the KV-block loop, its first iteration included, stays exactly as
        without sinks, and the cost is one exp per row per output, not per KV block.
        A sink far above m gives exp = inf and the output its limit, 0; a row that saw no
        key (m = -inf, acc = 0) gives 0 / inf = 0, as without sinks.

        Row r * group + g of the folded rows is q head g of the group: the group's sinks,
        [group, LANES], repeated once per q row (once in the decode kernel).
        """
        c = self.config
        sinks = self.sink_ref[kv_head]  # [group, LANES]
        q_rows = c.rows_per_kv_head // c.num_q_heads_per_kv_head
        rows = jnp.concatenate([sinks] * q_rows, axis=0) if q_rows > 1 else sinks
        return jnp.exp(rows[:, :1] - self.m_ref[kv_head][:, :1])

    def write_output(self, o_ref):
        """The q block's output, unfolded back to [q rows, q heads, head_dim], one KV head and
        one lane block of head_dim (`KernelConfig.lane_slices`) at a time.

        Why lane blocks: the unfold moves rows between (8, 128) tiles, with shuffled loads of
        acc, and the compiler issues the loads of every head early. A whole head at head_dim
        256 (128 rows of acc: 32 vector registers) is too much of that: on v5e at 32 q rows
        the unrolled heads spilled 940 KiB of VMEM here, outside the KV-block loop, and none
        when 128 lanes go at a time (static estimates, `minilib.tpu.compile`).

        o_ref: [num_queries_per_block, num_q_heads_per_block, head_dim]
        """
        c = self.config
        group = c.num_q_heads_per_kv_head
        for kv_head in range(c.num_kv_heads_per_block):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            for lanes in c.lane_slices:
                out = self.normalized(kv_head, lanes)  # [rows, width]
                out = out.reshape(c.num_queries_per_block, group, out.shape[1])
                o_ref[:, heads, lanes] = out.astype(o_ref.dtype)
