"""Where the rows and pages are: scalar arithmetic on the prefetched tables, in SMEM.

The kernel walks sequences and their KV blocks by reading `kv_lens`, `page_indices`,
`cu_q_lens` and `num_seqs`. `SeqTable` reads them; `next_live_seq`, `seq_kv_blocks` and
`work_after_seq` say where the walk goes next; `next_work` names the KV block whose copy starts
while this one is computed (`Work`).

The tables are clamped once, before the kernel (`clamp_tables`, in the jitted wrapper), so that
a garbage batch under `jit` neither hangs a loop nor sends a copy outside `kv_pages`: inside
the kernel the values are read as they are, and the page copies are not bounds-checked
(`call.rpa_pallas_call`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minilib.kernel.config import KernelConfig
from minilib.masking import kv_blocks_to_visit, mask_value_vanishes, q_position

__all__ = ["clamp_tables"]


def clamp_tables(kv_lens, page_indices, cu_q_lens, num_seqs, config: KernelConfig, total_num_pages):
    """The batch tables, clamped to what the shapes allow: run once, before the kernel.

    Under `jit` nothing has validated these values, and a bad one must not send a loop or a
    copy astray: a hang, or a copy from outside `kv_pages`. So each value is clamped, which
    changes nothing for a valid batch:
      num_seqs     to [0, max_num_seqs], and cut before the first sequence whose
                   cu_q_lens go backwards (`count_seqs_in_order`);
      cu_q_lens    to [0, max_num_batched_tokens];
      kv_lens      to [0, pages_per_seq * page_size];
      page numbers to [0, total_num_pages).
    Every loop over sequences in the kernel then ends by max_num_seqs, and every loop over
    pages or KV blocks by pages_per_seq (see also `seq_kv_blocks`).

    Why here, not in the kernel: a few vector ops on small tables, once per call, in place of
    a clamp on every read of them in the kernel's loops.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(3, 3), (1, 9)])
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices)
    >>> kv_lens, _, cu_q_lens, num_seqs = clamp_tables(
    ...     b.kv_lens.at[0].set(10**6), b.page_indices, b.cu_q_lens, b.num_seqs + 5, config,
    ...     total_num_pages=b.kv_pages.shape[0])
    >>> int(kv_lens[0]) == config.pages_per_seq * config.page_size, int(num_seqs[0])
    (True, 2)
    """
    c = config
    cu_q_lens = jnp.clip(cu_q_lens, 0, c.max_num_batched_tokens)
    return (
        jnp.clip(kv_lens, 0, c.pages_per_seq * c.page_size),
        jnp.clip(page_indices, 0, total_num_pages - 1),
        cu_q_lens,
        count_seqs_in_order(cu_q_lens, num_seqs, c)[None],
    )


def count_seqs_in_order(cu_q_lens, num_seqs, config: KernelConfig):
    """num_seqs clamped to [0, max_num_seqs], and cut before the first sequence whose
    cu_q_lens go backwards: the walk relies on the rows of sequence s + 1 following those of s.

    cu_q_lens: i32[max_num_seqs + 1]; num_seqs: i32[1]
    """
    n = jnp.clip(num_seqs[0], 0, config.max_num_seqs)
    seq = jnp.arange(config.max_num_seqs, dtype=jnp.int32)
    stops = (seq >= n) | (cu_q_lens[1:] < cu_q_lens[:-1])  # [max_num_seqs]
    return jnp.min(jnp.where(stops, seq, config.max_num_seqs)).astype(jnp.int32)


class SeqTable:
    """Read access to the scalar-prefetched batch description (SMEM refs), clamped before the
    kernel by `clamp_tables`: read here as it is."""

    def __init__(self, kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, config):
        self.kv_lens_ref = kv_lens_ref  # i32[max_num_seqs]
        self.page_indices_ref = page_indices_ref  # i32[max_num_seqs, pages_per_seq]
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

    def total_q_len(self):
        """The rows the sequences own: up to the end of the last one (0 if there is none)."""
        n = self.num_seqs()
        return jnp.where(n > 0, self.q_end(jnp.maximum(n - 1, 0)), 0)

    def num_pages(self, seq):
        """Pages holding the sequence's kv_len tokens (never more than pages_per_seq)."""
        return pl.cdiv(self.kv_len(seq), self.config.page_size)

    def page(self, seq, page_pos):
        return self.page_indices_ref[seq, page_pos]


def next_live_seq(batch: SeqTable, seq):
    """The first sequence from `seq` on that has q rows (idle ones, q_len 0, have no work);
    `num_seqs` if there is none. In the mixed kernel of `split_configs` a one-token sequence
    is idle too: the decode kernel serves it (and the prefetch chain skips it as well)."""
    n = batch.num_seqs()

    def is_idle(s):
        s_safe = seq_or_last(batch, s)
        q_len = batch.q_end(s_safe) - batch.q_start(s_safe)
        no_work = (q_len == 0) | (q_len == 1) if batch.config.leaves_decode else q_len == 0
        return (s < n) & no_work

    return lax.while_loop(is_idle, lambda s: s + 1, seq)


def first_seq_in_q_block(batch: SeqTable, q_blk_start):
    """The sequence owning row `q_blk_start`: the first whose rows end after it."""
    last = batch.num_seqs() - 1
    return lax.while_loop(
        lambda s: (s < last) & (batch.q_end(s) <= q_blk_start), lambda s: s + 1, 0
    )


def seq_kv_blocks(batch: SeqTable, seq, q_blk):
    """The KV blocks [first, end) that the rows of `seq` in q block `q_blk` visit:
    `kv_blocks_to_visit` of the positions of their first and last row. Blocks outside that
    range are skipped: their copy and their compute would be thrown away.
    """
    c = batch.config
    q_start, q_end, kv_len = batch.q_start(seq), batch.q_end(seq), batch.kv_len(seq)
    first_row = jnp.maximum(q_start, q_blk * c.num_queries_per_block)
    last_row = jnp.minimum(q_end, (q_blk + 1) * c.num_queries_per_block) - 1
    if mask_value_vanishes(c.mask_value):  # masked keys weigh exactly 0: skip their blocks
        first, end = kv_blocks_to_visit(
            q_position(first_row, q_end, kv_len),
            q_position(last_row, q_end, kv_len),
            c.kv_tokens_per_block,
            c.sliding_window,
        )
    else:  # a small mask_value gives masked keys a weight (JAX's rule): visit every block
        first, end = 0, pl.cdiv(kv_len, c.kv_tokens_per_block)
    # Clamped to at least one block, all within pages_per_seq: a garbage batch (kv_len < q_len)
    # must neither loop long nor leave a prefetched block without its compute.
    max_kv_blks = pl.cdiv(c.pages_per_seq, c.num_kv_pages_per_block)
    first = jnp.clip(first, 0, max_kv_blks - 1)
    end = jnp.clip(end, first + 1, max_kv_blks)
    return first, end


@dataclasses.dataclass(frozen=True)
class Work:
    """One KV block's worth of work: which heads, which sequence, which KV block; and how
    many pages the sequence has (for the copies), worked out once per sequence."""

    heads_blk: jax.Array
    seq: jax.Array
    kv_blk: jax.Array
    num_pages: jax.Array


def first_work(batch: SeqTable) -> Work:
    """The first KV block of the first live sequence, in the q block of its first row.
    `seq` is `num_seqs` if there is no live sequence."""
    seq = next_live_seq(batch, 0)
    seq_q_blk = batch.q_start(seq_or_last(batch, seq)) // batch.config.num_queries_per_block
    first_kv_blk, _ = seq_kv_blocks(batch, seq_or_last(batch, seq), seq_q_blk)
    num_pages = batch.num_pages(seq_or_last(batch, seq))
    return Work(jnp.int32(0), seq, first_kv_blk, num_pages)


def seq_or_last(batch: SeqTable, seq):
    """`seq`, or the last sequence if it is past them: never read past the live entries."""
    return jnp.clip(seq, 0, jnp.maximum(batch.num_seqs() - 1, 0))


def work_after_seq(batch: SeqTable, q_blk, seq_work: Work, following, first_live):
    """The KV block the kernel will attend to after the last one of `seq_work.seq` in q block
    `q_blk`. After the very last one, `heads_blk` is `num_heads_blocks`.

    In order: the same sequence in the next q block (if its rows go on); else the next live
    sequence (`following`); else the first live sequence of the next heads block. Each starts
    at its first visible KV block. It depends on the sequence only, not on the KV block, so
    it is worked out once per sequence, outside the loop over KV blocks.
    """
    bq = batch.config.num_queries_per_block
    rows_go_on = batch.q_end(seq_work.seq) > (q_blk + 1) * bq
    heads_done = following >= batch.num_seqs()

    # From the last resort to the first choice, each overriding the one before: the first live
    # sequence of the next heads block, the next live sequence, this sequence ...
    seq = jnp.where(heads_done, first_live, following)
    seq = jnp.where(rows_go_on, seq_work.seq, seq)
    # ... each in the q block holding its first row, except this one, which goes on in the next.
    seq_q_blk = jnp.where(rows_go_on, q_blk + 1, batch.q_start(seq) // bq)
    first_kv_blk, _ = seq_kv_blocks(batch, seq, seq_q_blk)
    heads_blk = jnp.where(heads_done & ~rows_go_on, seq_work.heads_blk + 1, seq_work.heads_blk)
    return Work(heads_blk, seq, first_kv_blk, batch.num_pages(seq))


def next_work(here: Work, end_kv_blk, after_seq: Work) -> Work:
    """The KV block to attend to after `here`, so that its copy can start now: the next KV
    block of this sequence, or else `after_seq` (from `work_after_seq`)."""
    more_kv = here.kv_blk + 1 < end_kv_blk
    return Work(
        jnp.where(more_kv, here.heads_blk, after_seq.heads_blk),
        jnp.where(more_kv, here.seq, after_seq.seq),
        jnp.where(more_kv, here.kv_blk + 1, after_seq.kv_blk),
        jnp.where(more_kv, here.num_pages, after_seq.num_pages),
    )
