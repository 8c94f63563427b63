"""Lever: a bf16 slot held as 32-bit words with a spare row after each token, in place of the
plain slot (`plain.PlainSlot`) under the strided load: the stride between a KV head's words is
odd, so each strided load is whole, not two half loads and an OR (benchmarks/LEVERS.md).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from minilib.chips import installed_libtpu
from minilib.kernel.config import KernelConfig
from minilib.kernel.plain import PlainSlot

__all__: list[str] = []  # the kernel body's own: see `PaddedSlot`

PADDED_SLOT_CHIPS = ("v5e", "v6e", "tpu7x")  # where `levers.chosen_levers` asks for it

# The oldest libtpu checked to compile a page's DMA into the padded slot; 0.0.21.1 (Colab's)
# and 0.0.23 refuse it ("Failed to update target tile strides"), and `narrow_rows`' loads too.
OLDEST_LIBTPU_PADDING = (0, 0, 42)


def libtpu_pads(libtpu_version: str | None) -> bool:
    """Whether a kernel may pad its slot with this libtpu installed (None: none installed, as
    on a CPU, or loaded from elsewhere, as the libtpu of a TPU VM may be).

    >>> libtpu_pads("0.0.21.1"), libtpu_pads("0.0.23"), libtpu_pads("0.0.42.1"), libtpu_pads(None)
    (False, False, True, True)
    """
    if libtpu_version is None:
        return True
    numbers = tuple(int(part) for part in libtpu_version.split(".")[:3] if part.isdigit())
    return numbers >= OLDEST_LIBTPU_PADDING


def padding_compiles() -> bool:
    """Whether the installed libtpu compiles the padded slot (`libtpu_pads`)."""
    return libtpu_pads(installed_libtpu())


class PaddedSlot(PlainSlot):
    """[pages per block, page_size, kvh_per_blk + 1, 1, hd] words: a token's K and V of one KV
    head share a word, and the spare row costs one row, not a tile (the last two axes are tiled).
    A page is copied as it is, seen as words, into the first kvh rows of each of its tokens."""

    def scratch(self, config: KernelConfig, kv_dtype):
        c = config
        shape = (c.num_kv_pages_per_block, c.page_size, c.num_kv_heads_per_block + 1, 1)
        return pltpu.VMEM((2, *shape, c.head_dim), jnp.uint32)

    def as_copied(self, source, target, config: KernelConfig):
        return source.bitcast(jnp.uint32), target.at[:, : config.num_kv_heads_per_block, 0]

    def copied(self, slot_buf, config: KernelConfig):  # all but the spare rows
        leading = (slice(None),) * (len(slot_buf.shape) - 3)
        return slot_buf.at[(*leading, slice(None, config.num_kv_heads_per_block), 0)]


def word_rows(kv_lanes, config: KernelConfig):  # [pages, page_size, kvh + 1, 1, width] words
    """A padded slot as a flat [tokens * (kvh + 1), width] matrix of words, and rows per token."""
    rows_per_token = config.num_kv_heads_per_block + 1
    width = kv_lanes.shape[-1]
    return kv_lanes.reshape(config.kv_tokens_per_block * rows_per_token, width), rows_per_token
