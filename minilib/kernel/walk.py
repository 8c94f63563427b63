"""The plain kernel's walk in scalar code: which sequences have rows in a q block, which KV
blocks their rows see, and which KV block comes next (the one whose copy starts now).

Read after `plain`: `QBlockWalker` walks the grid step with these, and `KVBlockCopier` copies
the `Work` they name. The tables are the scalar-prefetched ones, in SMEM (`SeqTable`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minilib import masking
from minilib.kernel.config import KernelConfig

__all__: list[str] = []  # the kernel body's own: see `plain.rpa_kernel`


class SeqTable:
    """The scalar-prefetched batch description (SMEM refs)."""

    def __init__(self, kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, config):
        self.kv_lens_ref = kv_lens_ref  # i32[max_num_seqs]
        self.page_indices_ref = page_indices_ref  # `page_table.block_page_table`'s, flat
        self.cu_q_lens_ref = cu_q_lens_ref  # i32[max_num_seqs + 1]
        self.num_seqs_ref = num_seqs_ref  # i32[1]
        self.config: KernelConfig = config

    def num_seqs(self):
        return self.num_seqs_ref[0]

    def q_start(self, seq):
        return self.cu_q_lens_ref[seq]

    def q_end(self, seq):
        return self.cu_q_lens_ref[seq + 1]

    def kv_len(self, seq):
        return self.kv_lens_ref[seq]

    def is_idle(self, q_len):
        """Whether a sequence of `q_len` rows has no work in this kernel: no rows."""
        return q_len == 0

    def tokens_to_write(self, q_len, num_new):
        """How many of a sequence's `num_new` new tokens this kernel writes (`kv_write`): all."""
        return num_new

    def total_q_len(self):
        """The rows the sequences own (0 if there is none)."""
        n = self.num_seqs()
        return jnp.where(n > 0, self.q_end(jnp.maximum(n - 1, 0)), 0)


def next_live_seq(batch: SeqTable, seq):
    """The first sequence from `seq` on with work in this kernel (`SeqTable.is_idle`), or
    `num_seqs`."""
    n = batch.num_seqs()

    def is_idle(s):
        s_safe = seq_or_last(batch, s)
        q_len = batch.q_end(s_safe) - batch.q_start(s_safe)
        return (s < n) & batch.is_idle(q_len)

    return lax.while_loop(is_idle, lambda s: s + 1, seq)


def first_seq_in_q_block(batch: SeqTable, q_blk_start):
    """The sequence owning row `q_blk_start`: the first whose rows end after it."""
    last = batch.num_seqs() - 1
    return lax.while_loop(
        lambda s: (s < last) & (batch.q_end(s) <= q_blk_start), lambda s: s + 1, 0
    )


def seq_kv_blocks(batch: SeqTable, seq, q_blk):
    """The KV blocks [first, end) that the rows of `seq` in q block `q_blk` can see."""
    c = batch.config
    q_start = batch.q_start(seq)
    q_end = batch.q_end(seq)
    kv_len = batch.kv_len(seq)
    first_row = jnp.maximum(q_start, q_blk * c.num_queries_per_block)
    last_row = jnp.minimum(q_end, (q_blk + 1) * c.num_queries_per_block) - 1
    if masking.mask_value_vanishes(c.mask_value):  # masked keys weigh exactly 0: skip their blocks
        first_pos = masking.q_position(first_row, q_end, kv_len)
        last_pos = masking.q_position(last_row, q_end, kv_len)
        window = c.sliding_window
        first, end = masking.kv_blocks_to_visit(first_pos, last_pos, c.kv_tokens_per_block, window)
    else:  # a small mask_value gives masked keys a weight (JAX's rule): visit every block
        first = 0
        end = pl.cdiv(kv_len, c.kv_tokens_per_block)
    # At least one block, all within pages_per_seq: a garbage batch (kv_len < q_len) must
    # neither loop long nor leave a prefetched block without its compute.
    max_kv_blks = c.blocks_per_seq
    first = jnp.clip(first, 0, max_kv_blks - 1)
    end = jnp.clip(end, first + 1, max_kv_blks)
    return first, end


@dataclasses.dataclass(frozen=True)
class Work:  # one KV block's worth of work
    heads_blk: jax.Array
    seq: jax.Array
    kv_blk: jax.Array


def first_work(batch: SeqTable) -> Work:
    """The first KV block of the first live sequence (`seq` is `num_seqs` if none is)."""
    seq = next_live_seq(batch, 0)
    seq_q_blk = batch.q_start(seq_or_last(batch, seq)) // batch.config.num_queries_per_block
    first_kv_blk, _ = seq_kv_blocks(batch, seq_or_last(batch, seq), seq_q_blk)
    return Work(jnp.int32(0), seq, first_kv_blk)


def seq_or_last(batch: SeqTable, seq):
    return jnp.clip(seq, 0, jnp.maximum(batch.num_seqs() - 1, 0))


def work_after_seq(batch: SeqTable, q_blk, seq_work: Work, following, first_live):
    """The work after the last KV block of `seq_work.seq` in q block `q_blk`: the same sequence
    in the next q block if its rows go on; else the next live sequence (`following`); else the
    first live sequence of the next heads block (after the last: `num_heads_blocks`)."""
    bq = batch.config.num_queries_per_block
    rows_go_on = batch.q_end(seq_work.seq) > (q_blk + 1) * bq
    heads_done = following >= batch.num_seqs()
    seq = jnp.where(heads_done, first_live, following)
    seq = jnp.where(rows_go_on, seq_work.seq, seq)
    seq_q_blk = jnp.where(rows_go_on, q_blk + 1, batch.q_start(seq) // bq)
    first_kv_blk, _ = seq_kv_blocks(batch, seq, seq_q_blk)
    heads_blk = jnp.where(heads_done & ~rows_go_on, seq_work.heads_blk + 1, seq_work.heads_blk)
    return Work(heads_blk, seq, first_kv_blk)


def next_work(here: Work, end_kv_blk, after_seq: Work) -> Work:
    """The KV block after `here`: the next of this sequence, or else `after_seq`."""
    more_kv = here.kv_blk + 1 < end_kv_blk
    return Work(
        jnp.where(more_kv, here.heads_blk, after_seq.heads_blk),
        jnp.where(more_kv, here.seq, after_seq.seq),
        jnp.where(more_kv, here.kv_blk + 1, after_seq.kv_blk),
    )
