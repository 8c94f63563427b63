"""Lever: the KV blocks that no row of a pass needs masked, walked in a loop of their own that
computes no mask, in place of the plain walk (`QBlockWalker.walk_kv_blocks`: every block
through `score_mask`).

A sequence's rows in a q block see every key of the KV blocks before their first row's
position, when every row of the q block is the sequence's and there is no sliding window
(`masking.open_kv_blocks_end`). In a prefill chunk that is every block but the one on the
diagonal. Their scores need no mask, and the mask is what costs: built once per block, it
is spilled and loaded again for each KV head, a load, a conversion and a select per score
register. The first blocks go through a loop without it, the rest through the masked one,
in the same order, so the copies and the schedule are the plain kernel's. The compiled
kernel has two KV-block loops, and the static count counts each by its own passes
(`minilib.tpu.bundles.kv_block_loops`; benchmarks/LEVERS.md for what it saves).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from minilib import masking
from minilib.kernel.plain import QBlockWalker, SeqSpan

__all__ = ["OpenBlocksWalker"]


class OpenBlocksWalker(QBlockWalker):
    """`QBlockWalker`, its open KV blocks first, in a loop that computes no mask: the mixed
    kernel's walk (`levers.walker_class`) where there is no sliding window.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config, split_configs
    >>> b = make_batch([(40, 40)], page_size=8)
    >>> mixed, _ = split_configs(kernel_config(b.q, b.kv_pages, b.page_indices))
    >>> mixed.open_blocks
    True
    """

    def walk_kv_blocks(self, first_kv_blk, end_kv_blk, span: SeqSpan, attend, slot):
        c = self.config
        rows = (self.q_blk_start, self.q_blk_end)
        open_end = masking.open_kv_blocks_end(rows, (span.q_start, span.q_end), span.kv_len,
                                              c.kv_tokens_per_block, c.sliding_window)  # fmt: skip
        open_end = jnp.clip(open_end, first_kv_blk, end_kv_blk)
        slot = lax.fori_loop(first_kv_blk, open_end, functools.partial(attend, masked=False), slot)
        return lax.fori_loop(open_end, end_kv_blk, attend, slot)
