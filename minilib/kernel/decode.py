"""Lever: the one-token sequences in a kernel of their own, each attended alone, in place of the
rows they fill in the plain kernel's q blocks, computed against every KV block with the rest of
the block and thrown away (benchmarks/LEVERS.md). `levers.split_configs` gives both configs.

`ragged_paged_attention` runs this kernel first, on the one-token sequences gathered into a
batch of their own (`decode_batch`), a few per grid step; then the mixed kernel, which treats
them as idle. The walk, the copies and the softmax are the plain kernel's: `DecodeWalker`
changes what a grid step walks (a block of sequences, one row each), `decode_score_mask` the
mask (no row selects).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minilib.kernel.config import KernelConfig
from minilib.kernel.plain import OnlineSoftmax, QBlockWalker, ScoreMask, SeqSpan
from minilib.kernel.walk import SeqTable
from minilib.masking import is_masked, mask_value_vanishes

__all__ = ["decode_batch"]


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """The one-token sequences of a batch, as a batch of their own: decode sequence i is
    sequence `seqs[i]` of the batch, and owns row i of the decode kernel's q (row `rows[i]`
    of the batch's q). Slots past `num_seqs` hold no sequence (their `rows` point past q)."""

    seqs: jax.Array  # i32[max_num_seqs]: sequence ids, then max_num_seqs
    rows: jax.Array  # i32[max_num_seqs]: q rows, then max_num_batched_tokens
    kv_lens: jax.Array  # i32[max_num_seqs]
    page_indices: jax.Array  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array  # i32[max_num_seqs + 1]: 0, 1, 2, ..., num_seqs, num_seqs, ...
    num_seqs: jax.Array  # i32[1]

    def tables(self):
        """The decode kernel's scalar prefetch: (kv_lens, page_indices, cu_q_lens, num_seqs)."""
        return self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs


def decode_batch(kv_lens, page_indices, cu_q_lens, num_seqs, config: KernelConfig) -> DecodeBatch:
    """Gather the one-token sequences (q_len == 1) of the first num_seqs, in order.

    The tables are a valid batch's, or clamped by `call.clamp_tables` (as the jitted wrapper
    does), so the decode tables are clamped too: a garbage batch sends the decode kernel only
    rows, pages and sequences that exist.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(3, 3), (1, 9), (0, 4), (1, 5)])
    >>> d = decode_batch(*b.args()[2:], kernel_config(b.q, b.kv_pages, b.page_indices))
    >>> d.seqs.tolist(), d.rows.tolist(), d.kv_lens[:2].tolist(), d.cu_q_lens.tolist()
    ([1, 3, 4, 4], [3, 4, 5, 5], [9, 5], [0, 1, 2, 2, 2])
    """
    max_num_seqs = config.max_num_seqs
    rows = config.max_num_batched_tokens
    cu = cu_q_lens
    live = jnp.arange(max_num_seqs) < num_seqs[0]
    is_decode = live & (cu[1:] - cu[:-1] == 1)
    (seqs,) = jnp.nonzero(is_decode, size=max_num_seqs, fill_value=max_num_seqs)
    count = jnp.sum(is_decode, dtype=jnp.int32)
    gathered = jnp.minimum(seqs, max_num_seqs - 1)  # a real slot to read for the empty ones
    return DecodeBatch(
        seqs=seqs.astype(jnp.int32),
        rows=jnp.where(seqs < max_num_seqs, cu[gathered], rows).astype(jnp.int32),
        kv_lens=kv_lens[gathered],
        page_indices=page_indices[gathered],
        cu_q_lens=jnp.minimum(jnp.arange(max_num_seqs + 1, dtype=jnp.int32), count),
        num_seqs=count[None],
    )


class MixedSeqTable(SeqTable):
    """The mixed kernel's batch beside the decode kernel: a one-token sequence has no work
    here (the decode kernel serves it)."""

    def is_idle(self, q_len):
        return (q_len == 0) | (q_len == 1)

    def tokens_to_write(self, q_len, num_new):
        return jnp.where(q_len == 1, 0, num_new)  # the decode kernel writes those


class DecodeWalker(QBlockWalker):
    """A grid step of the decode kernel: a block of one-token sequences (decode sequence i
    owns row i of q), walked one after another, each attended alone.

    Each sequence has its own softmax state: reset, q folded (its row's q heads, a row per
    q head), its KV blocks walked as in `QBlockWalker` (the prefetch chain runs on from one
    sequence to the next, and into the next grid step), its output row written. So a KV
    block meets rows_per_kv_head = group rows, not a whole q block's, and no row select is
    needed (`decode_score_mask`).
    """

    def attend_grid_step(self, slot_ref):
        @pl.when(self.q_blk_start < self.batch.total_q_len())
        def _attend_these_sequences():
            seq, slot_ref[0] = lax.while_loop(
                self.has_rows_here, self.attend_seq, (self.first_seq(), slot_ref[0])
            )
            write_output_row(self.softmax, self.o_ref, seq - 1 - self.q_blk_start)

    def first_seq(self):
        return self.q_blk_start  # every decode sequence is live, one row each

    def attend_seq(self, carry):
        seq, _ = carry
        row = seq - self.q_blk_start  # the sequence's row in the q block

        # The sequence before left its state: write its row now. (Written right after its
        # KV loop instead, the compiler moves the write into the loop's last bundles, where
        # it takes issue slots in every iteration.)
        @pl.when(row > 0)
        def _write_the_previous_row():
            write_output_row(self.softmax, self.o_ref, row - 1)

        self.softmax.init()
        fold_decode_q(self.q_ref, row, self.q_fold_ref, self.config)
        return super().attend_seq(carry)

    def score_mask(self, span: SeqSpan, kv_blk) -> ScoreMask:
        return decode_score_mask(span, kv_blk, self.config)


def fold_decode_q(
    q_ref,  # [decode_seqs_per_block, num_q_heads_per_block, head_dim]: a row per sequence
    row,  # the sequence's row in the q block
    q_fold_ref,  # [num_kv_heads_per_block, num_q_heads_per_kv_head, head_dim]
    config: KernelConfig,
):
    """`fold_q_heads` for one sequence of the decode kernel: the q heads of its row that
    share each KV head, as rows. Once per sequence, before its KV blocks."""
    group = config.num_q_heads_per_kv_head
    for kv_head in range(config.num_kv_heads_per_block):
        q_fold_ref[kv_head] = q_ref[row, kv_head * group : (kv_head + 1) * group, :]


def decode_score_mask(span: SeqSpan, kv_blk, config: KernelConfig) -> ScoreMask:
    """`score_mask` for the decode kernel's one row: its position is the sequence's last,
    kv_len - 1, so the causal mask is exactly "past kv_len" (and the window counts back from
    there)."""
    c = config
    shape = (c.rows_per_kv_head, c.kv_tokens_per_block)
    k_pos = kv_blk * c.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, shape, 1)
    masked = is_masked(span.kv_len - 1, k_pos, c.sliding_window)
    past_kv_len = None if mask_value_vanishes(c.mask_value) else k_pos >= span.kv_len
    return ScoreMask(masked, past_kv_len)


def write_output_row(softmax: OnlineSoftmax, o_ref, row):
    """The decode kernel's output of one sequence: row `row` of o_ref, from `softmax`."""
    group = softmax.config.num_q_heads_per_kv_head
    for kv_head in range(softmax.config.num_kv_heads_per_block):
        out = softmax.normalized(kv_head)  # [group, head_dim]
        o_ref[row, kv_head * group : (kv_head + 1) * group, :] = out.astype(o_ref.dtype)
