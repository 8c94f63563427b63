"""The new tokens' K and V written into the cache by the kernel itself, before it reads them.

Without it, a server writes each step's new tokens with a separate scatter (`write_tokens`)
and then runs attention. With `new_keys` and `new_values`, `ragged_paged_attention` hands each
kernel the new tokens in the cache's layout, [max_num_batched_tokens, 2*num_kv_heads,
head_dim] (`combine_kv`), and the cache as an output aliased to its input: the kernel writes
into the very buffer it reads, and XLA makes no copy of it.

The write is a phase of its own, in the first grid step, before the first KV copy starts
(`with_kv_write` wraps the kernel body, which never mentions it):

    for each sequence this kernel attends:
        for each page its new tokens touch:     one DMA, HBM to HBM, of a run of token rows
    wait for all of them (a DMA semaphore counts bytes: one wait takes them all back)

Each of the two kernels writes the sequences it attends (the decode kernel the one-token
ones, the mixed kernel the others), so no kernel reads a token before it is written.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.kernel.config import KernelConfig
from minilib.kernel.walk import SeqTable

__all__: list[str] = []  # used by `pallas_call.rpa_pallas_call`: see `with_kv_write`


def with_kv_write(kernel, config: KernelConfig, seq_table: type[SeqTable] = SeqTable):
    """`kernel` (`plain.rpa_kernel`, its refs by name) taking the new tokens, `new_kv_hbm_ref`,
    the cu_q_lens of their rows, `new_kv_cu_q_lens_ref` (the batch's: the mixed kernel's q has
    its own layout), the aliased cache output, `kv_pages_out_ref`, and a DMA semaphore,
    `write_sem`; it writes the tokens in the first grid step, then reads the cache from the
    output. `seq_table` (the kernel's point) says which sequences this kernel serves, and so
    writes."""

    def writing_kernel(
        *, new_kv_hbm_ref, new_kv_cu_q_lens_ref, kv_pages_out_ref, write_sem, **refs
    ):
        del refs["kv_pages_hbm_ref"]  # the same buffer as kv_pages_out_ref: read that one
        batch = seq_table(
            refs["kv_lens_ref"],
            refs["page_indices_ref"],
            new_kv_cu_q_lens_ref,
            refs["num_seqs_ref"],
            config,
        )

        @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
        def _write_the_new_tokens():
            write_new_tokens(batch, new_kv_hbm_ref, kv_pages_out_ref, write_sem, config)

        kernel(kv_pages_hbm_ref=kv_pages_out_ref, **refs)

    return writing_kernel


def write_new_tokens(batch: SeqTable, new_kv_hbm_ref, kv_pages_hbm_ref, sem, config):
    """Copy every new token of the sequences this kernel attends to its place in the cache,
    and wait. Sequence s's new tokens are rows cu_q_lens[s].. of `new_kv_hbm_ref`; they end at
    position kv_lens[s] - 1. (A garbage batch, kv_len < q_len, writes its last kv_len rows.)"""
    c = config

    def write_seq(seq, rows_written):
        q_end = batch.q_end(seq)
        kv_len = batch.kv_len(seq)
        q_len = q_end - batch.q_start(seq)
        num_new = batch.tokens_to_write(q_len, jnp.minimum(q_len, kv_len))
        first_pos = kv_len - num_new  # the first new token's position in the sequence

        def write_page(page_pos, _):
            start = jnp.maximum(first_pos, page_pos * c.page_size)
            size = jnp.minimum(kv_len, (page_pos + 1) * c.page_size) - start
            page = page_number(batch, seq, page_pos)
            rows = new_kv_hbm_ref.at[pl.ds(q_end - kv_len + start, size)]
            slots = kv_pages_hbm_ref.at[page, pl.ds(start - page_pos * c.page_size, size)]
            pltpu.make_async_copy(rows, slots, sem.at[0]).start()
            return ()

        first_page = first_pos // c.page_size
        end_page = pl.cdiv(kv_len, c.page_size)
        lax.fori_loop(first_page, jnp.where(num_new > 0, end_page, first_page), write_page, ())
        return rows_written + num_new

    rows = lax.fori_loop(0, batch.num_seqs(), write_seq, jnp.int32(0))
    wait_for_the_writes(new_kv_hbm_ref, rows, sem)


def wait_for_the_writes(new_kv_hbm_ref, rows, sem):
    """One wait for the copies of `rows` token rows in all."""

    @pl.when(rows > 0)
    def _wait_for_all_of_them():
        written = new_kv_hbm_ref.at[pl.ds(0, rows)]  # as many bytes as the copies
        pltpu.make_async_copy(written, written, sem.at[0]).wait()


def page_number(batch: SeqTable, seq, page_pos):
    """Page `page_pos` of `seq`: the table is flat, a row of whole KV blocks a sequence
    (`page_table.block_page_table`), so its pages are at one index plus their position."""
    c = batch.config
    return batch.page_indices_ref[seq * c.blocks_per_seq * c.num_kv_pages_per_block + page_pos]
