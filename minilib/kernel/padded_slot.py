"""Speed lever: a bf16 KV slot held as rows of 32-bit words with a spare row after each token,
so that a KV head's strided load reads eight VMEM banks at once.

What it saves. In bf16 a token's combined heads are 2*kvh rows, kvh rows of 32-bit words (K
and V of one KV head share each word: `strided`), so the words of one KV head are kvh rows
apart: 8 apart with 8 KV heads per block. The strided load puts eight of them in a vector
register, and rows 8 apart fall on only four of VMEM's banks: the compiler splits each load in
two half loads of four rows and an OR (`vld ... ss:$8 sm:$0xf`, twice, then `vor`: three ops
per vector register). With a spare row after each token the stride is kvh + 1, odd, and every
load is whole (`ss:$9 sm:$0xff`), as in vLLM's RPA v3, whose KV buffer has the same spare row.
Loading is then cheap enough that V is loaded again for its P·V at decode too
(`block_sizes.default_head_pipeline`, `padded`). Bundles per KV block, static estimates
(`python -m minilib compile`, libtpu 0.0.50.1, 32 q / 8 KV heads, head_dim 128, 128 tokens per
KV block; 32 q per block / 8 q per block / decode; v5e with the padded slot forced):
* v5e   1348 / 735 / 549 -> 1249 / 640 / 482
* v6e   1329 / 846 / 676 -> 1176 / 745 / 606
* TPU7x 1360 / 884 / 703 -> 1213 / 793 / 618 (vLLM's RPA v3: 1440 / 856 / 704)
Spills fall too (KiB: v5e 896 / 136 / 316 -> 636 / 88 / 0, v6e 916 / 192 / 260 -> 904 / 120 / 0,
TPU7x 900 / 192 / 256 -> 964 / 124 / 0: up at TPU7x 32 q). The cost: 1/8 more VMEM for the two
slots (the spare rows).
On which chips: v6e and TPU7x (`PADDED_SLOT_CHIPS`), every chip at head_dim 64 (`narrow_rows`,
where the spare rows cost less VMEM than a plain slot at head_dim 128), and the decode kernel
on every chip (`decode.split_configs`: its loop is mostly loads, v5e 549 -> 482 bundles at 128
KV tokens per block, 2504 -> 1455 at 512), for a bf16 cache on the strided load (`pads_slot`).
v5e's mixed kernel issues fewer bundles with it too (above), but keeps the plain slot at other
head sizes: there the spare rows cost VMEM that v5e lacks (64 pages per KV block, notebook 09's
largest block, no longer fit its 16 MiB of scoped VMEM). On v6e, whose interior path at decode
was 9 bundles above v3's (676 to 667, `loop_paths`), the padded slot takes it to 606. An f32
cache (a row per combined head) and an fp8 one (four values to a word, `fp8`: kvh / 2 rows of
words per token, four apart, eight banks already) keep the plain slot everywhere; a padded bf16
slot may then issue a few bundles fewer than an fp8 cache (v6e 8 q per block: 745 to 750; v5e
decode: 482 to 523), and both fewer than v3's.

How the slot is held. The spare row must cost one row, not a whole (8, 128) tile: a TPU tiles
the last two axes of a VMEM array, so the slot is [..., page_size, kvh + 1, 1, width] words,
whose tiles are one row each, and a token's kvh + 1 rows follow each other. A page is copied
as it is in HBM, seen as words ([page_size, kvh, width]), into the first kvh rows of each of
its tokens: one DMA per page still; the spare rows are never written and never read.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from minilib.chips import installed_libtpu
from minilib.kernel.config import KernelConfig

__all__: list[str] = []  # the kernel body's own: see `pads_slot`

PADDED_SLOT_CHIPS = ("v6e", "tpu7x")  # where `kernel_config` sets `KernelConfig.padded_slot`


# The oldest libtpu checked to compile a page's DMA into the padded slot. Older ones refuse it
# ("Mosaic failed to compile TPU kernel: Failed to update target tile strides"): 0.0.21.1,
# Colab's with jax 0.7.2, and 0.0.23, jax 0.7.2's own; 0.0.42.1 and 0.0.50.1 compile it.
# (The same ones refuse `narrow_rows`' strided load of 64-lane rows.)
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
    """Whether the installed libtpu compiles the padded slot (`libtpu_pads`): `kernel_config`
    and the decode kernel's config ask for it only then."""
    return libtpu_pads(installed_libtpu())


def pads_slot(config: KernelConfig, strided: bool | None = None) -> bool:
    """Whether a KV slot is held as rows of words with a spare row per token: where the config
    asks for it, for a bf16 cache read by the strided load (`strided`: whether it is; default
    `config.strided_kv_loads`)."""
    strided = config.strided_kv_loads if strided is None else strided
    return config.padded_slot and strided and config.kv_itemsize == 2


def slots_scratch(config: KernelConfig, kv_dtype):
    """The VMEM scratch of the two KV slots, head_dim in lane blocks (`lane_blocks`):
    [2, lane_blocks, kv pages per block, page_size, 2*kvh_per_blk, hd // lane_blocks] of the
    cache's dtype, or, padded, [..., page_size, kvh_per_blk + 1, 1, hd // lane_blocks] words."""
    c = config
    leading = (2, c.lane_blocks, c.num_kv_pages_per_block, c.page_size)
    width = c.head_dim // c.lane_blocks
    if pads_slot(c):
        return pltpu.VMEM((*leading, c.num_kv_heads_per_block + 1, 1, width), jnp.uint32)
    return pltpu.VMEM((*leading, 2 * c.num_kv_heads_per_block, width), kv_dtype)


def as_words(
    source,  # [page_size, 2*kvh_per_blk, width] of kv_pages, bf16, in HBM
    target,  # [page_size, kvh_per_blk + 1, 1, width] words: one page of a padded slot
    config: KernelConfig,
):  # -> source, target: [page_size, kvh_per_blk, width] words each
    """The two ends of one page's copy into a padded slot: the page seen as words, and the
    first kvh rows of each of its tokens in the slot."""
    return source.bitcast(jnp.uint32), target.at[:, : config.num_kv_heads_per_block, 0]


def word_rows(
    kv_lanes,  # [num_kv_pages_per_block, page_size, kvh_per_blk + 1, 1, width]: one lane block
    config: KernelConfig,
):  # -> [kv_tokens_per_block * (kvh_per_blk + 1), width] words, and the rows per token
    """One lane block of a padded slot as a flat matrix of words, and its rows per token."""
    rows_per_token = config.num_kv_heads_per_block + 1
    width = kv_lanes.shape[-1]
    return kv_lanes.reshape(config.kv_tokens_per_block * rows_per_token, width), rows_per_token
