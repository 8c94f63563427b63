"""The page table as the kernels' page copies read it (`block_page_table`), made once per call
before each kernel: the kernel then finds the pages of a KV block at one index of a flat table
in SMEM, without a clamp or a 2-D index per page copy (benchmarks/LEVERS.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from minilib.kernel.config import KernelConfig

__all__ = ["block_page_table"]


def block_page_table(kv_lens, page_indices, config: KernelConfig):
    """The page table as the kernel's page copies read it: one flat row of whole KV blocks
    per sequence (`blocks_per_seq` blocks of `num_kv_pages_per_block` pages), and past the
    sequence's last page that page again, so that every block copies the same bytes. Block b
    of sequence s is then the pages at one index, (s * blocks_per_seq + b) * pages per block,
    on: a page copy adds a constant to it, where a clamp and a 2-D index in SMEM took eight
    scalar ops a page (what that saved: benchmarks/LEVERS.md).

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(1, 20)], page_size=16, pages_per_seq=3)   # 20 tokens: 2 of 3 pages
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices, num_kv_pages_per_block=2)
    >>> b.page_indices[0].tolist(), block_page_table(b.kv_lens, b.page_indices, config).tolist()
    ([1, 4, 2], [1, 4, 4, 4])
    """
    c = config
    pos = jnp.arange(c.blocks_per_seq * c.num_kv_pages_per_block)
    last = jnp.maximum(pl.cdiv(kv_lens, c.page_size) - 1, 0)  # [max_num_seqs]
    pos = jnp.minimum(pos[None, :], last[:, None])
    return jnp.take_along_axis(page_indices, pos, axis=1, mode="clip").reshape(-1)
