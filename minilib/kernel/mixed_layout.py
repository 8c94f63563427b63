"""Lever (with the decode kernel): the mixed kernel's q, each sequence starting on a q block.

A q block costs the same whether a sequence fills it or not, and each (q block, sequence) pair
runs all the KV blocks its rows see: a chunk that starts mid-block pays for one more pair. So
where the decode kernel takes the one-token sequences (`Levers.decode_kernel`), the mixed
kernel gets a q of its own, not the batch's: the one-token sequences take no rows there, and
each other sequence starts on a q block while the padding fits, its padding rows before its
own. `call.run_kernels` gathers q into that layout, and the output back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from minilib.kernel.config import KernelConfig

__all__ = ["mixed_layout"]


@dataclasses.dataclass(frozen=True)
class MixedLayout:
    """The mixed kernel's q rows (`mixed_layout`)."""

    cu_q_lens: jax.Array  # i32[max_num_seqs + 1]: the sequences' rows in the mixed kernel's q
    q_rows: jax.Array  # i32[mixed rows]: the batch's q row each mixed row is gathered from
    out_rows: jax.Array  # i32[max_num_batched_tokens]: each batch row's mixed output row


def mixed_layout(cu_q_lens, num_seqs, config: KernelConfig) -> MixedLayout:
    """The mixed kernel's q: the rows of the sequences it serves, each starting on a q block
    while the padding fits.

    Packed as the batch packs them, a sequence starting mid-block costs one more (q block,
    sequence) pass, and each pass runs every KV block its rows see: 32 decode rows then a
    chunk of 256 rows take 3 + 3 q blocks of 128 where 2 + 2 would do. So here the decode and
    idle sequences take no rows (the decode kernel serves the one-token ones), and each other
    sequence's rows are padded to a multiple of `num_queries_per_block`, the padding BEFORE its
    rows: a row's position is kv_len - (q_end - row), so the real rows keep theirs, the
    padding rows get earlier ones (their q is any row's, their outputs are never read).

    The grid keeps the q blocks of the batch's q, so a sequence is padded only while its
    padding and that of all before it fit in the rows left free (the decode rows, the last
    block's rest), less the last row: no sequence owns it, so the kernel writes it zero, and
    the output rows no sequence owns are gathered from it (the decode rows too, before the
    decode kernel's rows are scattered over them). Later sequences are packed as they come.
    The tables must be clamped (`clamp_tables`).

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(3, 8), (1, 9), (5, 9), (2, 5)], max_num_batched_tokens=12)
    >>> from minilib.kernel import kernel_config
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices, num_queries_per_block=4)
    >>> layout = mixed_layout(b.cu_q_lens, b.num_seqs, config)
    >>> b.cu_q_lens.tolist(), layout.cu_q_lens.tolist()  # 2 rows free: seq 0 padded, 2 not
    ([0, 3, 4, 9, 11], [0, 4, 4, 9, 11])
    >>> layout.q_rows.tolist()      # row 0: seq 0's padding (any row will do)
    [0, 0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]
    >>> layout.out_rows.tolist()    # 11: the zero row (the decode row 3, the unused 11)
    [1, 2, 3, 11, 4, 5, 6, 7, 8, 9, 10, 11]
    """
    c = config
    bq = c.num_queries_per_block
    num_rows = c.max_num_batched_tokens
    mixed_rows = pl.cdiv(num_rows, bq) * bq
    seq = jnp.arange(c.max_num_seqs, dtype=jnp.int32)
    live = seq < num_seqs[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    mixed = live & (q_lens > 1)
    rows = jnp.where(mixed, q_lens, 0)
    padding = jnp.where(mixed, -rows % bq, 0)
    spare = mixed_rows - jnp.sum(rows)
    rows = rows + jnp.where(jnp.cumsum(padding) < spare, padding, 0)
    mixed_cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(rows, dtype=jnp.int32)])
    # Row r of sequence s is row r + shift[s] of the mixed q: its rows end where its mixed end.
    shift = jnp.where(mixed, mixed_cu_q_lens[1:] - cu_q_lens[1:], 0)
    mixed_row = jnp.arange(mixed_rows, dtype=jnp.int32)
    mixed_shift = row_shifts(mixed_row, mixed_cu_q_lens, shift)
    row = jnp.arange(num_rows, dtype=jnp.int32)
    in_mixed = rows_in_seqs(row, cu_q_lens) & mixed  # bool[num_rows, max_num_seqs]
    row_shift = jnp.sum(jnp.where(in_mixed, shift, 0), axis=1)
    return MixedLayout(
        cu_q_lens=mixed_cu_q_lens,
        q_rows=jnp.clip(mixed_row - mixed_shift, 0, num_rows - 1),
        out_rows=jnp.where(jnp.any(in_mixed, axis=1), row + row_shift, mixed_rows - 1),
    )


def rows_in_seqs(rows, cu_q_lens):  # -> bool[len(rows), max_num_seqs]
    """Whether each row is one of each sequence's: a compare per (row, sequence), no gather."""
    return (cu_q_lens[:-1] <= rows[:, None]) & (rows[:, None] < cu_q_lens[1:])


def row_shifts(rows, cu_q_lens, shift):
    """shift[s] of the sequence s that owns each row (0 where none does)."""
    return jnp.sum(jnp.where(rows_in_seqs(rows, cu_q_lens), shift, 0), axis=1)
