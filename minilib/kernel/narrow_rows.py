"""Speed lever: head_dim 64 read by the strided load, in rows of 64 lanes, from a padded slot.

What it saves. The strided load (`strided`) was written for rows of 128 lanes, so head_dim 64
took the plain load (`kv_load.load_kv_lane_block`: a vector register per token, reassembled).
But Mosaic's strided load takes rows of 64 lanes as well, and in bf16 the rows of K and V of
one KV head still share each 32-bit word of the slot, K in the low half, V in the high half:
`strided.load_kv_head_strided` runs unchanged on them. Two more steps make it pay. The softmax
widens its lane-replicated columns (alpha, the row selects) to 64 lanes by taking the first 64
(`softmax.widen`), not by broadcasting lane 0 (a cross-lane op per vector register). And the
slot is padded (`padded_slot`) on every chip: whole loads, as on TPU7x at head_dim 128; the
spare rows cost less VMEM here than the plain slot does at head_dim 128, which v5e fits.
Bundles per KV block, static estimates (`python -m minilib compile --head-dim 64`, libtpu
0.0.50.1, 32 q / 8 KV heads, head_dim 64, 128 tokens per KV block; 32 q per block / 8 q per
block / decode):
* the plain load (before):                v5e 2864 / 2026 / 1746, v6e 2823 / 1972 / 1807,
  TPU7x 2885 / 1975 / 1827;
* the strided load in rows of 64 lanes:   v5e 1753 / 912 / 589, v6e 1838 / 932 / 719,
  TPU7x (padded already) 1788 / 876 / 659;
* and `widen` taking the first 64 lanes:  v5e 1354 / 761 / 573, v6e 1334 / 868 / 692,
  TPU7x 1233 / 827 / 647;
* and the padded slot on v5e and v6e too: v5e 1263 / 656 / 495, v6e 1191 / 783 / 620.
vLLM's RPA v3, its own kernel for head_dim 64 (`minilib.tpu.v3.rpa_v3_hd64`): v5e 1353 / 958 /
641, v6e 1592 / 1008 / 797, TPU7x 1584 / 988 / 745.
An fp8 cache (four values to a word, `fp8`) is read in rows of 64 lanes the same way (never
padded: `padded_slot`); with k_scale = v_scale = 0.5, 32 q / 8 q / decode, the plain load then
this: v5e 4563 / 3552 / 4227 -> 1376 / 664 / 516, v6e 4044 / 3231 / 2562 -> 1195 / 751 / 602,
TPU7x 2732 / 2023 / 1699 -> 1171 / 739 / 596 (v3's head_dim-64 kernel: v5e 1370 / 834 / 627,
v6e 1235 / 954 / 721, TPU7x 1172 / 881 / 643).
On which chips: all (v5e, v6e, TPU7x measured; v4 and v5p issue fewer bundles too, bf16 and
fp8), at head_dim 64, where the libtpu compiles it (`reads_narrow_rows`).
Not in TPU interpret mode, which cannot view a ref as another shape or dtype.
"""

from __future__ import annotations

from minilib.kernel.config import LANES, KernelConfig
from minilib.kernel.padded_slot import PADDED_SLOT_CHIPS, padding_compiles

__all__: list[str] = []  # the kernel body's own: see `reads_narrow_rows`

NARROW_HEAD_DIM = 64  # the one head_dim under 128 lanes the strided load was measured at


def slot_levers(head_dim: int, chip: str | None) -> dict[str, bool]:
    """The lever flags of `KernelConfig` that `kernel_config` sets from head_dim and the chip:
    `narrow_rows` at head_dim 64, and `padded_slot` on the chips of `PADDED_SLOT_CHIPS`, or on
    every chip at head_dim 64; neither where the installed libtpu is too old for them
    (`padded_slot.padding_compiles`: 0.0.21.1, Colab's, and 0.0.23 refuse the padded slot and
    a strided load of 64-lane rows alike, "The last dim size is not 128 in original base
    memref"; there head_dim 64 takes the plain load).

    >>> slot_levers(64, "v5e"), slot_levers(128, "v5e")["padded_slot"]  # no libtpu, or new
    ({'narrow_rows': True, 'padded_slot': True}, False)
    """
    narrow = head_dim == NARROW_HEAD_DIM
    compiles = padding_compiles()
    return {"narrow_rows": narrow and compiles,
            "padded_slot": (narrow or chip in PADDED_SLOT_CHIPS) and compiles}  # fmt: skip


def strided_rows_fit(config: KernelConfig) -> bool:
    """Whether a slot's rows suit Mosaic's strided load: whole blocks of 128 lanes (`lane_blocks`)
    or, with `KernelConfig.narrow_rows`, one row of 64 lanes at head_dim 64."""
    if config.head_dim % LANES == 0:
        return True
    return reads_narrow_rows(config)


def reads_narrow_rows(config: KernelConfig) -> bool:
    """Whether the config asks for rows of 64 lanes and its head_dim is 64 (a cache of any
    dtype: f32 and bf16 through `strided`, fp8 through `fp8`)."""
    return config.narrow_rows and config.head_dim == NARROW_HEAD_DIM
