"""Lever: the KV blocks that no row of a pass needs masked, walked in a loop of their own that
computes no mask and zeroes no V past kv_len (none of their tokens is), in place of the plain
walk (`QBlockWalker.walk_kv_blocks`: every block through `score_mask`).

A sequence's rows in a q block see every key of the KV blocks before their first row's
position, when every row of the q block is the sequence's and there is no sliding window
(`masking.open_kv_blocks_end`). In a prefill chunk that is every block but the one on the
diagonal; in the decode kernel, whose one row sits at kv_len - 1, every block that ends by
kv_len (`walk_open_blocks_first`, which `levers.DecodeOpenBlocksWalker` calls). Their scores
need no mask, and the mask is what costs: built once per block, it is spilled and loaded
again for each KV head, a load, a conversion and a select per score register; nor does their
V (a select per register, `plain.zero_tokens_past_kv_len`). The first blocks go through a
loop without either, the rest through the masked one, in the same order, so the copies and
the schedule are the plain kernel's. The compiled kernel has two KV-block loops, and the
static count counts each by its own passes (`minilib.tpu.bundles.kv_block_loops`;
benchmarks/LEVERS.md for what it saves).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from minilib import masking
from minilib.kernel.plain import QBlockWalker, SeqSpan

__all__ = ["OpenBlocksWalker", "walk_open_blocks_first"]


class OpenBlocksWalker(QBlockWalker):
    """`QBlockWalker`, its open KV blocks first, in a loop that computes no mask: the mixed
    kernel's walk (`levers.walker_class`) where there is no sliding window.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config, split_configs
    >>> b = make_batch([(40, 40)], page_size=8)
    >>> mixed, _ = split_configs(kernel_config(b.q, b.kv_pages, b.page_indices))
    >>> mixed.levers.open_blocks
    True
    """

    def walk_kv_blocks(self, first_kv_blk, end_kv_blk, span: SeqSpan, attend, slot):
        c = self.config
        rows = (self.q_blk_start, self.q_blk_end)
        seq_rows = (span.q_start, span.q_end)
        open_end = masking.open_kv_blocks_end(
            rows, seq_rows, span.kv_len, c.kv_tokens_per_block, c.sliding_window
        )
        return walk_open_blocks_first(first_kv_blk, open_end, end_kv_blk, attend, slot)


def walk_open_blocks_first(first_kv_blk, open_end, end_kv_blk, attend, slot):
    """KV blocks [first, end): those before `open_end` in a loop of their own, unmasked (`attend`
    with masked=False), then the rest, masked.

    >>> seen = []
    >>> def attend(kv_blk, slot, masked=True):
    ...     seen.append((kv_blk, masked))
    ...     return slot
    >>> _ = walk_open_blocks_first(0, 2, 3, attend, 0)  # each loop's body traced once
    >>> [masked for _, masked in seen]
    [False, True]
    """
    open_end = jnp.clip(open_end, first_kv_blk, end_kv_blk)
    slot = lax.fori_loop(first_kv_blk, open_end, functools.partial(attend, masked=False), slot)
    return lax.fori_loop(open_end, end_kv_blk, attend, slot)
