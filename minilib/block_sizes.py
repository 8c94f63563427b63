"""The kernel's default block sizes, per TPU chip, and the static cost model behind them.

Two sizes shape the kernel's work: `num_kv_pages_per_block` (pages per KV block: one batch of
DMAs, one online-softmax update) and `num_queries_per_block` (q rows per grid step).

The cost model (a model, not a measurement). For one sequence of `kv_len` tokens, the kernel
visits `ceil(kv_len / kv_tokens_per_block)` KV blocks. Each block costs the larger of

* its compute: `bundles_per_kv_block` cycles (the TPU core issues one VLIW bundle per cycle
  when nothing stalls; the count is read from the compiled program by `minilib.tpu.compile`),
  divided by the chip's clock, and
* its copy: the KV bytes of the block divided by the chip's HBM bandwidth (from
  `pltpu.get_tpu_info_for_chip` when this JAX has it, else `minilib.chips.FACTS`),

because double buffering overlaps the copy of the next block with the compute of this one.
Bigger blocks amortise the fixed cost of a block (loop control, DMA issue, rescaling the
softmax state) over more tokens, but the last block of a sequence is computed whole however
few of its tokens exist, and both KV buffers must fit in VMEM next to q, the output and the
softmax state. `modelled_seconds` evaluates the model; `tests/tpu/test_tpu_compile.py` compiles
8, 16 and 32 pages of 16 tokens for each chip, and checks that the default is the model's
best, or within 10 % of it, and that the compiled kernel leaves VMEM headroom.

Defaults never call `jax.devices()`: lowering for a TPU on a TPU-less machine must work. The
chip comes from the `chip` argument, else from the abstract mesh that `minilib.tpu.compile`
lowers under, else from the device kind when JAX runs on a TPU; unknown means the
chip-independent defaults.
"""

from __future__ import annotations

import math

from minilib.chips import DEFAULT_SCOPED_VMEM_BYTES, FACTS, current_chip, packing, packing_of_size

__all__ = [
    "default_block_sizes",
    "default_decode_seqs_per_block",
    "default_head_pipeline",
    "default_vmem_limit",
    "hbm_bytes_per_s",
    "kernel_vmem_limit",
    "mixed_kernel_vmem_bytes",
    "modelled_seconds",
    "num_kv_heads_per_block",
]

# Chip-independent defaults: a KV block of about this many tokens keeps the MXU busy, ...
TARGET_KV_TOKENS_PER_BLOCK = 512
# ... with at most this many page copies per block (each is a DMA descriptor, issued by the
# scalar core, whose page number lives in a scalar register) ...
MAX_PAGES_PER_BLOCK = 16
# ... and both KV buffers together within this much VMEM (v5e's default scoped VMEM is 16 MiB,
# v6e's 32 MiB; q, the output and the softmax state need room too).
KV_BUFFERS_VMEM_BUDGET = 4 * 1024 * 1024
DEFAULT_NUM_QUERIES_PER_BLOCK = 32
# The decode kernel's q block (one row per sequence) is kept to about this many bytes: Pallas
# double-buffers it and the output block, so four of them sit in VMEM beside the KV slots.
DECODE_Q_BLOCK_BYTES = 256 * 1024

# Per chip: (KV tokens per block, most pages per block, most q rows per block, KV buffers'
# VMEM budget). Chosen with the cost model above on the course's GQA case (32 q heads, 8 KV heads,
# head_dim 128, bf16, page_size 16, kv_len 1024): on all four chips the model ranks 32 pages
# (512 tokens) first, then 16, 8 and 4, because a KV block's fixed cost is large against its
# per-token cost. Both KV buffers at 32 such pages take 4 MiB; the compiled kernel then needs
# about 10 MiB of VMEM, within v5e's 16 MiB default limit. TPU7x has no published clock, so
# the model cannot turn its bundles into seconds; but a block's copy time is the same per KV
# token at any block size, and kv_len 1024 is whole blocks of each, so whatever the clock the
# model ranks first the block that issues the fewest bundles per KV token: 32 pages there too
# (libtpu 0.0.50.1, 32 q rows, per 128 KV tokens: 8 pages 1069, 16 pages 773.5, 32 pages
# 692.75; 9.5 MiB of VMEM). `tests/tpu/test_tpu_compile.py` re-checks the ranking and the headroom
# against the current kernel. A chip without an entry gets the chip-independent defaults.
#
# The q block: as many rows as the mixed kernel's VMEM allows (`mixed_kernel_vmem_bytes`
# within `VMEM_SHARE` of the scoped VMEM it has, `kernel_vmem_limit`), up to the chip's most.
# On v5e the kernels ask for 32 MiB (`KERNEL_VMEM_LIMIT_BYTES`), as v3 asks for all of its 128:
# within the default 16 MiB Llama-3-8B got 64 rows there; at 128, whole program with the write
# fused, ours / v3: prefill 0.94 -> 0.92, gemma 0.86 -> 0.85, mixed 0.80 -> 0.80. More rows
# per block cost fewer bundles per q row in the KV-block loop and fewer grid steps: over the
# workload suite (`python -m minilib compile --workloads`, benchmarks/LEVERS.md), 128 rows
# where they fit, else 64, gave the lowest worst ratio to vLLM's RPA v3 on v5e, v6e and
# TPU7x. v4 and v5p, not measured, keep 32.
#
# The KV buffers' budget bites only where 512 tokens take more than 4 MiB for both buffers:
# head_dim 256 in bf16 (its budget halves, below) or a float32 cache. v5e's was 4 MiB, from
# before the q block was sized by the mixed kernel's VMEM; with that rule guarding the VMEM,
# 8 MiB as on v6e gives Gemma 2's global layer (head_dim 256) 16 pages in place of 8, and its
# mixed workload on v5e 471,472 -> 418,436 bundles (v3: 473,032), the q block 64 rows (the
# compiled kernel: 8.3 MiB of VMEM). v4 and v5p, not measured, keep 4 MiB.
CHIP_DEFAULTS: dict[str, tuple[int, int, int, int]] = {
    "v4": (512, 32, 32, 4 * 1024 * 1024),
    "v5e": (512, 32, 128, 8 * 1024 * 1024),
    "v5p": (512, 32, 32, 4 * 1024 * 1024),
    "v6e": (512, 32, 128, 8 * 1024 * 1024),
    "tpu7x": (512, 32, 128, 8 * 1024 * 1024),
}
# The mixed kernel's VMEM sum may take this share of the scoped VMEM the kernel has: the sum
# is at most 10% under the compiled kernel's (notebook 09, tests/tpu/test_tpu_vmem_model.py).
VMEM_SHARE = 0.9
# The scoped VMEM the kernels ask for (`vmem_limit_bytes`) where libtpu's default is short:
# v5e has 128 MiB of VMEM, and a default scoped limit of 16 MiB. vLLM's RPA v3 asks for the
# chip's whole VMEM.
KERNEL_VMEM_LIMIT_BYTES = {"v5e": 32 << 20}


def num_kv_heads_per_block(num_q_heads: int, num_kv_heads: int, q_dtype, kv_dtype) -> int:
    """The fewest KV heads per heads block that keep every block tile-aligned; else all of them.

    A TPU stores the last two axes of an array in tiles of (8 * packing, 128), where packing is
    how many values share one 32-bit word (1 for f32, 2 for bf16, 4 for fp8). A heads block of
    `kv_pages` (2 * kv heads on the second-to-last axis) and of `q` (q heads there) must fill
    whole tiles, or be the whole axis.

    >>> import jax.numpy as jnp
    >>> num_kv_heads_per_block(16, 8, jnp.float32, jnp.float32)   # 8 K/V slots, 8 q heads
    4
    >>> num_kv_heads_per_block(4, 2, jnp.float32, jnp.float32)    # too few heads to split
    2
    """
    group = num_q_heads // num_kv_heads
    q_tile = 8 * packing(q_dtype)
    kv_tile = 8 * packing(kv_dtype)
    for kv_heads in range(1, num_kv_heads):
        if num_kv_heads % kv_heads:
            continue
        if (2 * kv_heads) % kv_tile == 0 and (kv_heads * group) % q_tile == 0:
            return kv_heads
    return num_kv_heads


def default_block_sizes(
    *,
    page_size: int,
    pages_per_seq: int,
    max_num_batched_tokens: int,
    bytes_per_page: int,
    head_dim: int = 128,
    chip: str | None = None,
    num_q_heads_per_block: int | None = None,
    q_itemsize: int = 2,
    vmem_limit_bytes: int | None = None,
    sliding_window: int | None = None,
) -> tuple[int, int]:  # (num_kv_pages_per_block, num_queries_per_block)
    """Default block sizes for `chip` ("v4", "v5e", "v5p", "v6e", "tpu7x"; None:
    `current_chip()`, and chip-independent sizes when that is unknown).

    A KV block of the chip's target tokens (at most the chip's most pages, 16 when the chip
    is unknown, and the sequence's pages), halved until both KV buffers fit the VMEM budget;
    q blocks of the chip's most rows (fewer if the batch has fewer), halved while the mixed
    kernel's VMEM (`mixed_kernel_vmem_bytes`, of `num_q_heads_per_block` q heads in
    `q_itemsize` bytes) exceeds `VMEM_SHARE` of the scoped VMEM the kernel has
    (`vmem_limit_bytes`; default `kernel_vmem_limit(chip)`); without
    `num_q_heads_per_block`, or on an unknown chip, 32 rows. Pass both block sizes to tune by
    hand.

    The budgets are set for head_dim 128. A wider head widens q, the output and acc too, and
    head_dim 256 takes the kernel's general K/V load, which spills more: the budget and the
    target tokens shrink in proportion (an fp8 cache at head_dim 256, whose 512 tokens fit
    the budget, costs less at 256 over the workload suite: benchmarks/LEVERS.md). (Measured
    with `python -m minilib compile --chip v4 --head-dim 256 --num-kv-pages-per-block 16`: GQA
    in bf16 with head_dim 256 and 16 pages per block needed 12.2 MiB of v4's 16 MiB of VMEM,
    4.1 MiB of it spills; 8 pages leave a quarter free, as `tests/tpu/test_tpu_compile.py`
    asks.)

    Under a `sliding_window`, a row sees at most that many keys: the KV block's target is at
    most the window rounded up to a power of two, and at least one register's 128 lanes. A
    block of 512 tokens under gpt-oss's window of 128 copies and computes four times the keys
    a decode row sees: at 128 tokens its whole program per call is a fifth shorter
    (benchmarks/LEVERS.md).

    >>> default_block_sizes(page_size=16, pages_per_seq=64, max_num_batched_tokens=512,
    ...                     bytes_per_page=16 * 16 * 128 * 2)   # chip unknown
    (16, 32)
    >>> default_block_sizes(page_size=16, pages_per_seq=64, max_num_batched_tokens=512,
    ...                     bytes_per_page=16 * 16 * 128 * 2, chip="v5e",
    ...                     num_q_heads_per_block=32)   # Llama-3-8B's 32 q heads, bf16
    (32, 128)
    >>> default_block_sizes(page_size=16, pages_per_seq=64, max_num_batched_tokens=512,
    ...                     bytes_per_page=16 * 16 * 128 * 2, chip="v5e",
    ...                     num_q_heads_per_block=32, vmem_limit_bytes=16 << 20)  # v5e's default
    (32, 64)
    >>> default_block_sizes(page_size=16, pages_per_seq=64, max_num_batched_tokens=512,
    ...                     bytes_per_page=16 * 16 * 128 * 2, chip="v6e",
    ...                     num_q_heads_per_block=32)
    (32, 128)
    >>> default_block_sizes(page_size=16, pages_per_seq=64, max_num_batched_tokens=512,
    ...                     bytes_per_page=16 * 16 * 128 * 2, chip="v6e",
    ...                     num_q_heads_per_block=32, sliding_window=128)   # 128 tokens
    (8, 128)
    """
    chip = current_chip() if chip is None else chip
    if chip is not None and chip not in FACTS:
        raise ValueError(f"{chip=} is not a TPU chip minilib knows; use one of {list(FACTS)}.")
    target_tokens, max_pages, queries, budget = CHIP_DEFAULTS.get(
        chip,
        (
            TARGET_KV_TOKENS_PER_BLOCK,
            MAX_PAGES_PER_BLOCK,
            DEFAULT_NUM_QUERIES_PER_BLOCK,
            KV_BUFFERS_VMEM_BUDGET,
        ),
    )
    budget = budget * min(1, 128 / head_dim)
    target_tokens = int(target_tokens * min(1, 128 / head_dim))
    if sliding_window is not None:  # no more than the window needs, in whole registers
        window_tokens = 1 << (sliding_window - 1).bit_length()  # a power of two
        target_tokens = min(target_tokens, lane_width(window_tokens))
    pages = max(1, min(target_tokens // page_size, max_pages))
    pages = min(pages, pages_per_seq)
    while pages > 1 and 2 * pages * bytes_per_page > budget:
        pages //= 2
    if chip is None or num_q_heads_per_block is None:
        queries = min(queries, DEFAULT_NUM_QUERIES_PER_BLOCK)
    else:
        vmem = VMEM_SHARE * (vmem_limit_bytes or kernel_vmem_limit(chip))
        shapes = dict(kv_tokens=pages * page_size, num_q_heads_per_block=num_q_heads_per_block,
                      head_dim=head_dim, q_itemsize=q_itemsize)  # fmt: skip
        slots = 2 * pages * bytes_per_page * lane_width(head_dim) // head_dim
        while queries > 8 and slots + mixed_kernel_vmem_bytes(queries, **shapes) > vmem:
            queries //= 2
    return pages, min(queries, max_num_batched_tokens)


def kernel_vmem_limit(chip: str) -> int:
    """The scoped VMEM the kernels have on `chip`: what they ask for
    (`KERNEL_VMEM_LIMIT_BYTES`), else libtpu's default scoped limit.

    >>> kernel_vmem_limit("v5e") >> 20, kernel_vmem_limit("v6e") >> 20   # MiB
    (32, 32)
    """
    return KERNEL_VMEM_LIMIT_BYTES.get(chip, DEFAULT_SCOPED_VMEM_BYTES[chip])


def default_vmem_limit(num_kv_pages_per_block: int | None, num_queries_per_block: int | None,
                       chip: str | None = None) -> int | None:  # fmt: skip
    """The scoped VMEM a kernel asks for when `vmem_limit_bytes` is not given: on a chip of
    `KERNEL_VMEM_LIMIT_BYTES` (v5e; None: `current_chip()`), its limit there if a block size
    is left to the defaults, which are sized for it; else None, libtpu's default limit.

    >>> default_vmem_limit(None, None, "v5e") >> 20, default_vmem_limit(8, None, "v5e") >> 20
    (32, 32)
    >>> default_vmem_limit(8, 32, "v5e"), default_vmem_limit(None, None, "v6e")
    (None, None)
    """
    if num_kv_pages_per_block and num_queries_per_block:
        return None
    return KERNEL_VMEM_LIMIT_BYTES.get(current_chip() if chip is None else chip)


def mixed_kernel_vmem_bytes(
    q_rows: int, *, kv_tokens: int, num_q_heads_per_block: int, head_dim: int, q_itemsize: int
) -> int:
    """The mixed kernel's VMEM for one heads block beside its two KV slots, as notebook 09
    adds it up (exercise 9.2's `kernel_vmem_bytes` less the slots): the q and output blocks,
    double-buffered; q folded; m and l (128 lanes a row) and acc in float32; and as spills,
    one float32 score matrix per KV head. Every q head of a q row is a row of these, and
    every row takes whole 128-lane tiles (`lane_width`).

    >>> mixed_kernel_vmem_bytes(32, kv_tokens=512, num_q_heads_per_block=32, head_dim=128,
    ...                         q_itemsize=2) / 2**20   # MiB, Llama-3-8B's 32 q heads in bf16
    4.75
    """
    rows, width = q_rows * num_q_heads_per_block, lane_width(head_dim)
    q_blocks = (2 * 2 + 1) * rows * width * q_itemsize  # q and out, 2 buffers each; folded q
    state = rows * (2 * 128 + width) * 4  # m, l, acc
    spills = rows * lane_width(kv_tokens) * 4
    return q_blocks + state + spills


def lane_width(n: int) -> int:
    """n values along the last axis take whole 128-lane tiles in VMEM: head_dim 64 takes 128."""
    return math.ceil(n / 128) * 128


def default_decode_seqs_per_block(max_num_seqs: int, bytes_per_seq: int) -> int:
    """Sequences per grid step of the decode kernel: as many as fit `DECODE_Q_BLOCK_BYTES` of
    q (`bytes_per_seq`: one row of one heads block), at most max_num_seqs. A grid step has a
    fixed cost (its set-up, its output block), which the sequences it walks share.

    >>> default_decode_seqs_per_block(16, bytes_per_seq=32 * 128 * 2)   # GQA 32 q heads, bf16
    16
    >>> default_decode_seqs_per_block(256, bytes_per_seq=32 * 128 * 2)
    32
    """
    return max(1, min(max_num_seqs, DECODE_Q_BLOCK_BYTES // bytes_per_seq))


# The software pipeline over KV heads (`minilib.kernel.heads_in_flight`): how many heads'
# P·V wait behind later heads' Q·K (one in flight: each head's P·V after the next head's Q·K;
# the plain order, each P·V before the next Q·K, is the plain kernel's), and whether V is
# loaded again for its P·V. Chosen by the static bundle counts per KV block
# (`minilib.tpu.compile`, libtpu 0.0.42.1; bf16, 8 KV heads of 4 q heads, head_dim 128, KV
# blocks of 128 tokens; spilled KiB in brackets):
#
#                        one head in flight   all 8 heads, V kept   all 8 heads, V reloaded
#   v4, 32 q rows           2426 (604)            2472 (900)           2884 (628)
#   v4, 8 q rows            1313 (504)            1290 (488)           1646 (308)
#   v4, decode              1057 (360)            1047 (332)           1366 (32)
#   v5e, 32 q rows          1391 (916)            1573 (1136)          1595 (816)
#   v5e, 8 q rows            921 (252)             746 (468)            761 (172)
#   v5e, decode              645 (164)             572 (316)            618 (0)
#   v5p, 32 q rows          1466 (896)            1635 (1152)          1635 (808)
#   v5p, 8 q rows           1011 (252)             800 (468)            815 (176)
#   v5p, decode              689 (156)             632 (316)            669 (0)
#   v6e, 32 q rows          1587 (952)            1259 (1068)          1324 (900)
#   v6e, 8 q rows           1054 (204)             840 (420)            873 (212)
#   v6e, decode              778 (4)               695 (260)            756 (0)
#
# All heads in flight pays, except on v4, v5e and v5p (the chips with 128 x 128 MXUs) where one
# head's p takes 16 vector registers (of 64: 32 q rows): there one head in flight is fastest
# (measured; the listing does not say why). Keeping V pays when V and p of the heads in flight take
# little more than the register file (decode at head_dim 128: 8 x (1 + 8) = 72 registers), and only
# on the strided load: the general load of other head sizes gathers K and V a register per token,
# and holding V on top of that spills (head_dim 64, decode on v5e: 2306 bundles with V kept, 2024
# reloaded). Beyond that, loading V again costs fewer bundles and far fewer spills (and keeps the
# spills within JAX's kernel's at 8 q rows), except on v4, where the second load costs more than any
# spill. On TPU7x a bf16 cache on the strided load sits in a padded slot
# (`minilib.kernel.padded_slot`), whose loads are whole: there loading V again pays wherever
# reloading pays at all, V kept or not above (libtpu 0.0.50.1, decode: TPU7x 675 -> 618, no
# spills; with the padded slot forced, v5e 518 -> 482, v6e 652 -> 606).
#
# At the large q blocks of the workload suite (128 q rows: 512 score rows per KV head), all
# heads in flight costs on v6e and TPU7x too: eight heads' p, 256 registers each, go to VMEM and
# back. Mixed kernel, KV block 512 tokens, bundles (one in flight / all 8, V reloaded; libtpu
# 0.0.50.1): v6e 128 q rows 6572 / 7126, gpt-oss (64 q of 8 heads, head_dim 64) 7017 / 7671,
# Gemma (128 q of 2 heads, head_dim 256, KV 256 tokens: 64 registers) 2968 / 3007; TPU7x 128 q
# rows 6743 / 7321. At 32 q rows all 8 still pay on v6e: KV 128 tokens (16 registers) 1136 /
# 891, 256 tokens (32 registers) 1382 / 1327 (V as `default_head_pipeline` chose).
SCORE_REGISTERS_FOR_ALL_HEADS = {"v4": 8, "v5e": 8, "v5p": 8, "v6e": 32, "tpu7x": 32}
RELOADING_V_PAYS = {"v4": False}  # chips not named: True
KEEP_V_REGISTERS = 72


def default_head_pipeline(
    *, rows: int, kv_tokens: int, head_dim: int, num_kv_heads: int, itemsize: int,
    strided: bool = True, padded: bool = False, chip: str | None = None,
) -> tuple[int, bool]:  # fmt: skip
    """(heads in flight, reload V) for a KV head's `rows` of scores against `kv_tokens` keys
    (see the table above). `itemsize`: bytes per value of the compute dtype (V's on the MXU);
    `strided`: whether K and V come from the strided load; `padded`: whether from a padded slot
    (`minilib.kernel.padded_slot`), whose loads are whole: there V is loaded again wherever
    reloading pays at all (see the table's last lines). `chip` None: `current_chip()`.

    >>> default_head_pipeline(rows=4, kv_tokens=128, head_dim=128, num_kv_heads=8,
    ...                       itemsize=2, chip="v6e")        # decode: all heads, V kept
    (8, False)
    >>> default_head_pipeline(rows=4, kv_tokens=128, head_dim=128, num_kv_heads=8,
    ...                       itemsize=2, padded=True, chip="v6e")   # ... V reloaded, padded
    (8, True)
    >>> default_head_pipeline(rows=32, kv_tokens=128, head_dim=128, num_kv_heads=8,
    ...                       itemsize=2, chip="v6e")        # 8 q rows: all heads, V reloaded
    (8, True)
    >>> default_head_pipeline(rows=128, kv_tokens=128, head_dim=128, num_kv_heads=8,
    ...                       itemsize=2, chip="v5e")        # 32 q rows on v5e: one in flight
    (1, False)
    """
    chip = current_chip() if chip is None else chip
    score_registers = math.ceil(rows / 8) * math.ceil(kv_tokens / 128)  # p: f32[rows, tokens]
    v_rows_per_register = 8 * packing_of_size(itemsize)
    v_registers = math.ceil(kv_tokens / v_rows_per_register) * math.ceil(head_dim / 128)
    limit = SCORE_REGISTERS_FOR_ALL_HEADS.get(chip)
    heads = num_kv_heads if limit is None or score_registers <= limit else 1
    v_fits = strided and not padded and heads * (score_registers + v_registers) <= KEEP_V_REGISTERS
    return heads, RELOADING_V_PAYS.get(chip, True) and not v_fits


def hbm_bytes_per_s(chip: str) -> float:
    """The chip's HBM bandwidth: JAX's own table when it has one (jax >= 0.8), else ours.

    >>> hbm_bytes_per_s("v6e") / 1e9   # GB/s
    1640.0
    """
    try:
        from jax.experimental.pallas import tpu as pltpu

        info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(FACTS[chip].jax_chip_version), 1)
        return float(info.mem_bw_bytes_per_second)
    except (AttributeError, ValueError):
        return FACTS[chip].hbm_bytes_per_s


def modelled_seconds(
    chip: str, *, kv_len: int, kv_tokens_per_block: int, bundles_per_kv_block: int,
    kv_bytes_per_token: int
) -> float:  # fmt: skip
    """The model's time for one sequence's KV blocks in one grid step (a model, not a
    measurement): blocks visited x max(bundles / clock, block bytes / HBM bandwidth).

    >>> round(modelled_seconds("v5e", kv_len=1024, kv_tokens_per_block=128,
    ...                        bundles_per_kv_block=1500, kv_bytes_per_token=4096) * 1e6, 1)
    8.0
    """
    clock_hz = FACTS[chip].clock_hz
    if clock_hz is None:
        raise ValueError(f"{chip=} has no published clock, so bundles cannot become seconds.")
    blocks = math.ceil(kv_len / kv_tokens_per_block)
    compute = bundles_per_kv_block / clock_hz
    copy = kv_tokens_per_block * kv_bytes_per_token / hbm_bytes_per_s(chip)
    return blocks * max(compute, copy)
