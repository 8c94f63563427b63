"""Every Pallas kernel of minilib, compiled by libtpu (XLA's TPU compiler and Mosaic) for the
TPU chips of `minilib.tpu.chips`, on this machine, without a TPU. Marker `tpu_compile`; runs
where libtpu is installed (`.venv-tpu` in `python3 tasks.py test`), and is skipped elsewhere
with the reason. A chip this libtpu does not know (TPU7x with jax 0.7.2's libtpu 0.0.23) is
skipped, saying so.

The matrix (one compile each, 1 to 4 s):

* our kernel on v5e, v6e and TPU7x: MHA, GQA and MQA in bf16; GQA in f32; fp8 KV with and
  without scales; a sliding window with a soft cap; head_dim 256; head_dim 64 in bf16, f32 and
  fp8 KV. On v4 and v5p, one case per way of loading K and V (GQA bf16, fp8 KV, head_dim 256,
  head_dim 64). All with the default block sizes, which are per chip (`minilib.block_sizes`).
* our kernel on v5e and v6e (the chips of Colab's TPU runtimes) with every block size the
  notebooks use: 08's (2 pages, 8 q rows, page_size 8), 09's schedule comparison and 09's VMEM
  table. `bench` uses the default block sizes, compiled above. The other chips get the
  defaults only, to keep the run short.
* `pallas_basics`: `add_vectors` compiles on every chip; the first attention kernel cannot
  compile by design (its BlockSpecs are not tile-aligned), and says so.
* our kernel with attention sinks on v5e, v6e and TPU7x: its KV-block loops as without.
* the harness itself can fail: a bad kernel, and a block too large for VMEM.
* the counting rule on a real listing: a small kernel whose KV-block loop holds a loop over
  compute chunks, where the deepest loop with a matmul is one chunk.
* the three-way comparison (`minilib.tpu.kernel_costs`, `minilib.tpu.comparison`): ours,
  JAX's kernel and vLLM's RPA v3 on v5e, v6e and TPU7x, the table printed; each claim of
  `CLAIMS` asserted on the listing, the longest path and the interior path; each kernel's
  paths read from its own listing (interior <= longest <= listing, every matmul on the
  interior path); v3 and its head_dim-64 kernel loaded from its wheel without vLLM or
  torch; at head_dim 64, ours against v3's head_dim-64 kernel, asserted (not part of `CLAIMS`'
  workload).

Every figure here is a static estimate from the compiled program, never a timing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib import block_sizes
from minilib.pallas_basics import add_vectors, ragged_paged_attention_pallas_basic
from minilib.tpu import dump_reader
from minilib.tpu.bundles import (
    DMA_START,
    MATMUL,
    count_ops,
    kv_block_loop,
    loop_bodies,
    parse_bundles,
)
from minilib.tpu.chips import CHIPS, FACTS
from minilib.tpu.comparison import CLAIMS, cell_record, claimed_as, recorded_comparison
from minilib.tpu.compile import (
    chip_unknown_here,
    chips_here,
    compile_for_tpu,
    dump_folder,
    libtpu_version,
    tpu_compile_available,
)
from minilib.tpu.kernel_costs import (
    COMPARISON_CASE,
    COMPARISON_CHIPS,
    COMPARISON_KV_PAGES_PER_BLOCK,
    COMPARISON_QUERIES_PER_BLOCK,
    COUNTS,
    TARGET_CASE,
    compare_kernels,
    comparison_table,
    compile_rpa,
    kernel_for,
    rpa_specs,
)
from minilib.tpu.loop_paths import PAGE_COPY, kv_block_passes
from minilib.tpu.v3 import v3_available

AVAILABLE, REASON = tpu_compile_available()
pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not AVAILABLE, reason=f"no TPU compile here: {REASON}"),
]


def require_chip(chip):
    """Skip, saying why, when this libtpu has no compile-only device for `chip`."""
    if chip not in chips_here():
        pytest.skip(chip_unknown_here(chip))


# The smallest scoped-VMEM limit of the chips (v5e's default, 16 MiB): every default
# must leave a quarter of it free.
VMEM_HEADROOM_LIMIT = 12 * 1024 * 1024

# A small batch on a large cache: a cache of a few MiB (fp8's 128 pages are 4 MiB) is placed
# in VMEM by XLA, its page copies stop being DMAs, and there is no KV-block loop to count.
SMALL = dict(
    page_size=16, pages_per_seq=16, max_num_seqs=8, max_num_batched_tokens=128, num_pages=8192
)

# name -> (spec options, kernel options)
MATRIX = {
    "mha-bf16": (dict(num_q_heads=8, num_kv_heads=8), {}),
    "gqa-bf16": (dict(num_q_heads=32, num_kv_heads=8), {}),
    "mqa-bf16": (dict(num_q_heads=8, num_kv_heads=1), {}),
    "gqa-f32": (dict(num_q_heads=32, num_kv_heads=8, dtype=jnp.float32), {}),
    "gqa-fp8kv": (dict(num_q_heads=32, num_kv_heads=8, kv_dtype=jnp.float8_e4m3fn), {}),
    "gqa-fp8kv-scales": (
        dict(num_q_heads=32, num_kv_heads=8, kv_dtype=jnp.float8_e4m3fn),
        dict(k_scale=0.5, v_scale=0.25),
    ),
    "gqa-fp8e5m2kv-scales": (
        dict(num_q_heads=32, num_kv_heads=8, kv_dtype=jnp.float8_e5m2),
        dict(k_scale=0.5, v_scale=0.25),
    ),
    "gqa-window-softcap": (
        dict(num_q_heads=32, num_kv_heads=8),
        dict(sliding_window=64, soft_cap=30.0),
    ),
    "gqa-hd256": (dict(num_q_heads=32, num_kv_heads=8, head_dim=256), {}),
    # head_dim 64: the strided load in rows of 64 lanes, from a padded slot (`narrow_rows`)
    "gqa-hd64": (dict(num_q_heads=32, num_kv_heads=8, head_dim=64), {}),
    "gqa-f32-hd64": (dict(num_q_heads=32, num_kv_heads=8, head_dim=64, dtype=jnp.float32), {}),
    "gqa-fp8kv-hd64": (
        dict(num_q_heads=32, num_kv_heads=8, head_dim=64, kv_dtype=jnp.float8_e4m3fn),
        dict(k_scale=0.5, v_scale=0.25),
    ),
}

# name -> (spec options, num_kv_pages_per_block, num_queries_per_block), from the notebooks.
NOTEBOOK_BLOCKS = {
    # 08: the kernel chapter's batch.
    "nb08": (
        dict(num_q_heads=8, num_kv_heads=4, head_dim=128, page_size=8, pages_per_seq=8,
             max_num_seqs=4, max_num_batched_tokens=24, dtype=jnp.float32),
        2, 8,
    ),
    # 09: the block-size trade-off, (q rows, pages) pairs on its mixed batch.
    **{
        f"nb09-trade-off-q{q}-p{p}": (
            dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, pages_per_seq=32,
                 max_num_seqs=16, max_num_batched_tokens=256, dtype=jnp.float32),
            p, q,
        )
        for q, p in [(8, 1), (8, 4), (32, 4), (32, 16), (128, 16)]
    },
    # 09: the VMEM table, GQA in bf16, 32 q rows.
    **{
        f"nb09-vmem-p{p}": (
            dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, pages_per_seq=64),
            p, 32,
        )
        for p in (4, 8, 16, 32, 64)
    },
}  # fmt: skip


def assert_compiled(report):
    assert report.compiled, f"Mosaic/XLA rejected the kernel on {report.chip}:\n{report.error}"
    assert report.total_bundles and report.total_bundles > 0, f"no bundles read: {report}"


# The whole matrix on the chips of Colab's runtimes (v5e, v6e); on the others (v4, v5p and
# TPU7x), one case per way of loading K and V: strided bf16, fp8 four to a word, 128-lane
# blocks (hd 256), rows of 64 lanes (hd 64). TPU7x's headline configs, bf16 and fp8, are
# compiled again by the comparison tests below, against v3.
OTHER_CHIPS_CASES = ("gqa-bf16", "gqa-fp8kv", "gqa-hd256", "gqa-hd64")
KERNEL_CASES = [
    (case, chip)
    for case in MATRIX
    for chip in CHIPS
    if chip in ("v5e", "v6e") or case in OTHER_CHIPS_CASES
]


@pytest.mark.parametrize(("case", "chip"), KERNEL_CASES)
def test_kernel_compiles(case, chip):
    require_chip(chip)
    spec_options, options = MATRIX[case]
    specs = rpa_specs(**{**SMALL, **spec_options})
    report = compile_rpa("ours", specs, chip=chip, **options)
    assert_compiled(report)
    assert report.bundles_per_kv_block and report.bundles_per_kv_block > 0, str(report)
    kernel = report.kernel  # its paths, read from its branches (`PATH_RULES`), or why not
    if kernel.interior_path is None:  # MQA on v6e: XLA puts the small cache in VMEM, no DMAs
        assert any("paths through the KV-block loop not counted" in n for n in report.notes)
    else:
        assert kernel.interior_path <= kernel.longest_path <= kernel.bundles_per_kv_block
    assert report.vmem_bytes <= VMEM_HEADROOM_LIMIT, f"default blocks leave no headroom: {report}"


@pytest.mark.parametrize("chip", COMPARISON_CHIPS)
def test_fp8_kv_costs_no_more_than_v3s_fp8_kv(chip):
    """An fp8 cache (with scales) is read four values to a word and goes to the MXU as fp8
    (`minilib.kernel.fp8`): its KV-block loops, mixed (8 q per block) and decode, take no more
    bundles than v3's on the same fp8 cache and workload, on the listing, the longest path and
    the interior path (through the plain load ours took 4.5 to 14 times v3's; TPU7x's decode
    interior path, which leaves out v3's in-kernel update of the KV cache, was 1.02 times v3's
    until the page copies went without bounds checks, as v3's do: 578 -> 431, v3 568). fp8
    is not held to our bf16 figure: a padded bf16 slot (`padded_slot`: v6e, TPU7x, decode) may
    issue a few bundles fewer than an fp8 cache, whose rows are four words apart and need no
    spare row."""
    from minilib.tpu.kernel_costs import cell_of, compile_v3
    from minilib.tpu.v3 import V3Unavailable

    require_chip(chip)
    fp8 = dict(kv_dtype=jnp.float8_e4m3fn)
    blocks = dict(num_kv_pages_per_block=8, num_queries_per_block=8)
    scales = dict(k_scale=0.5, v_scale=0.5)
    try:
        v3 = compile_v3(chip, **fp8, **blocks, **scales)
    except V3Unavailable as err:
        pytest.skip(str(err))
    ours = compile_rpa("ours", rpa_specs(**COMPARISON_CASE, **fp8), chip=chip, **blocks, **scales)
    for report in (v3, ours):
        assert_compiled(report)
    for config, decode_queries in (("8 q per block", None), ("decode", 8)):
        cells = {name: cell_of(report, name, chip, config, decode_queries)
                 for name, report in (("v3", v3), ("ours", ours))}  # fmt: skip
        for count, label in COUNTS.items():
            mine, theirs = (getattr(cells[name], count) for name in ("ours", "v3"))
            assert mine is not None and theirs is not None, cells
            assert mine <= theirs, f"{chip}, {config}, fp8, {label}: ours {mine} > v3's {theirs}"


@pytest.mark.parametrize("chip", COMPARISON_CHIPS)
def test_attention_sinks_add_nothing_to_the_kv_block_loops(chip):
    """Sinks join the denominator once per output row (`OnlineSoftmax.sink_term`), outside
    the KV-block loops: with them (`python -m minilib compile --sinks`, its cells), both
    kernels' loops, mixed and decode, issue the same vector, MXU, memory and DMA ops as
    without, on the comparison workload, and no more bundles but for the scheduler's placing:
    a scalar op of the loop's bookkeeping more, and one bundle more with the very same ops
    (libtpu 0.0.50.1, page copies with bounds checks: TPU7x 8 q 770 to 771). Fewer is the
    scheduler's placing too, with the very same ops (without bounds checks: v6e 8 q 619 to
    616)."""
    from minilib.__main__ import build_parser

    require_chip(chip)
    assert build_parser().parse_args(["compile", "--sinks"]).attention_sink
    blocks = dict(num_kv_pages_per_block=8, num_queries_per_block=8)
    without = compile_rpa("ours", rpa_specs(**COMPARISON_CASE), chip=chip, **blocks)
    assert_compiled(without)
    cells = compare_kernels(chip, queries_per_block=(8,), attention_sink=True)
    ours = {cell.config: cell for cell in cells if cell.kernel == "ours"}
    assert all(cell.missing for cell in cells if cell.kernel != "ours"), cells
    for config, decode in (("8 q per block", False), ("decode", True)):
        before, after = kernel_for(without, decode=decode), ours[config].stats
        kinds_before, kinds_after = dict(before.loop_op_kinds), dict(after.loop_op_kinds)
        scalar = abs(kinds_after.pop("scalar", 0) - kinds_before.pop("scalar", 0))
        assert kinds_after == kinds_before, (config, kinds_before, kinds_after)
        added = after.bundles_per_kv_block - before.bundles_per_kv_block
        counts = (config, before.bundles_per_kv_block, after.bundles_per_kv_block)
        assert added <= scalar + 1, counts


# Notebook 08's batch on both of Colab's chips; notebook 09's blocks on v5e, the chip it
# compiles for.
NOTEBOOK_BLOCK_CASES = [
    (case, chip) for case in NOTEBOOK_BLOCKS for chip in ("v5e", "v6e")
    if chip == "v5e" or not case.startswith("nb09")
]  # fmt: skip


@pytest.mark.parametrize(("case", "chip"), NOTEBOOK_BLOCK_CASES)
def test_kernel_compiles_with_notebook_block_sizes(case, chip):
    spec_options, pages, queries = NOTEBOOK_BLOCKS[case]
    specs = rpa_specs(**spec_options)
    report = compile_rpa(
        "ours", specs, chip=chip, num_kv_pages_per_block=pages, num_queries_per_block=queries
    )
    assert_compiled(report)


@pytest.mark.parametrize("chip", CHIPS)
def test_add_vectors_compiles(chip):
    require_chip(chip)
    x = jax.ShapeDtypeStruct((4096,), jnp.float32)
    report = compile_for_tpu(
        functools.partial(add_vectors, block_size=1024, interpret=False), x, x, chip=chip
    )
    assert_compiled(report)


@pytest.mark.parametrize("chip", CHIPS)
def test_first_attention_kernel_cannot_compile_by_design(chip):
    """Its BlockSpecs take `group` q heads and one KV head (the last two block dimensions are
    (group, head_dim)), which are not whole (8, 128) tiles. Mosaic refuses, as documented."""
    require_chip(chip)
    specs = rpa_specs(**{**SMALL, "num_q_heads": 8, "num_kv_heads": 2})
    basic = functools.partial(ragged_paged_attention_pallas_basic, interpret=False)
    report = compile_for_tpu(basic, *specs, chip=chip)
    assert not report.compiled
    assert "last two dimensions of your block shape are divisible by 8 and 128" in report.error


def test_a_bad_kernel_fails_to_compile_and_keeps_the_message():
    def unaligned_lanes(x_ref, o_ref):  # 128 lanes from lane 1 or 4: not a whole vreg's
        start = pl.program_id(0) * 3 + 1
        o_ref[...] = x_ref[:, pl.ds(start, 128)]

    def bad(x):
        out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
        return pl.pallas_call(unaligned_lanes, grid=(2,), out_shape=out)(x)

    # (An unsupported reshape, the old example, is one that Mosaic learns to lay out: libtpu
    # 0.0.50.1 compiles [8, 128] -> [2, 512] -> [8, 32], which 0.0.42.1 refused.)
    report = compile_for_tpu(bad, jax.ShapeDtypeStruct((8, 512), jnp.float32), chip="v5e")
    assert not report.compiled
    assert "Mosaic failed to compile TPU kernel" in report.error
    assert "cannot statically prove that index in dimension 1 is a multiple of 128" in report.error
    assert not report.vmem_overflow
    assert "FAILED" in str(report)


def test_a_block_too_large_for_vmem_is_reported_as_a_vmem_overflow():
    # Blocks of 4M float32 (16 MiB), for x, y and the output, double-buffered: 96 MiB.
    x = jax.ShapeDtypeStruct((2 * 4 * 1024 * 1024,), jnp.float32)
    big_blocks = functools.partial(add_vectors, block_size=4 * 1024 * 1024, interpret=False)
    report = compile_for_tpu(big_blocks, x, x, chip="v5e")
    assert not report.compiled
    assert report.vmem_overflow, report.error
    assert "RESOURCE_EXHAUSTED" in report.error


@pytest.mark.parametrize("chip", CHIPS)
def test_default_kv_block_is_the_cost_models_choice(chip):
    """The default KV block is the cost model's best among 8, 16 and 32 pages (or within 10 %
    of it), for the course's GQA case in bf16 with page_size 16 and 32 q rows per block, and
    the compiled kernel leaves a quarter of v5e's VMEM limit free. TPU7x's clock is not
    published: there the model's best is the block with the fewest bundles per KV token,
    whatever the clock (`block_sizes.CHIP_DEFAULTS`), so that is what is compared."""
    require_chip(chip)
    per_token = FACTS[chip].clock_hz is None  # bundles per KV token, in place of microseconds
    specs = rpa_specs(**TARGET_CASE)
    bytes_per_token = 2 * TARGET_CASE["num_kv_heads"] * TARGET_CASE["head_dim"] * 2
    modelled = {}
    reports = {}
    for pages in (8, 16, 32):
        reports[pages] = report = compile_rpa(
            "ours", specs, chip=chip, num_kv_pages_per_block=pages, num_queries_per_block=32
        )
        assert_compiled(report)
        if per_token:
            modelled[pages] = report.bundles_per_kv_block / (pages * 16)
        else:
            modelled[pages] = 1e6 * block_sizes.modelled_seconds(
                chip,
                kv_len=1024,
                kv_tokens_per_block=pages * 16,
                bundles_per_kv_block=report.bundles_per_kv_block,
                kv_bytes_per_token=bytes_per_token,
            )
    default_pages, _ = block_sizes.default_block_sizes(
        page_size=16,
        pages_per_seq=64,
        max_num_batched_tokens=256,
        bytes_per_page=16 * bytes_per_token,
        chip=chip,
    )
    best = min(modelled.values())
    unit = "bundles per KV token" if per_token else "us"
    table = ", ".join(f"{p} pages: {t:.1f} {unit}" for p, t in modelled.items())
    assert modelled[default_pages] <= 1.1 * best, f"{chip}: default {default_pages}; {table}"
    assert reports[default_pages].vmem_bytes <= VMEM_HEADROOM_LIMIT, str(reports[default_pages])


# A small kernel of our own with the loop shape of vLLM's RPA v3: a KV-block loop that starts
# the next block's copy, around a loop over compute chunks (a trip count read at run time, so
# not unrolled) that holds every matmul and starts no copy.
NUM_BLOCKS, BLOCK, CHUNK = 4, 256, 128


def two_loops_kernel(num_chunks_ref, q_ref, k_hbm, o_ref, buffer, sems):
    def copy(block, slot):
        return pltpu.make_async_copy(k_hbm.at[block], buffer.at[slot], sems.at[slot])

    def kv_block(block, acc):
        slot = block % 2

        @pl.when(block + 1 < NUM_BLOCKS)
        def _():
            copy(block + 1, 1 - slot).start()

        copy(block, slot).wait()

        def chunk(c, acc):
            k = buffer[slot, pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK), :]
            return acc + jnp.dot(q_ref[...], k.T, preferred_element_type=jnp.float32)

        return jax.lax.fori_loop(0, jnp.minimum(num_chunks_ref[0], BLOCK // CHUNK), chunk, acc)

    copy(0, 0).start()
    o_ref[...] = jax.lax.fori_loop(0, NUM_BLOCKS, kv_block, jnp.zeros((128, CHUNK), jnp.float32))


def two_loops(num_chunks, q, k):
    return pl.pallas_call(
        two_loops_kernel,
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec(memory_space=pltpu.VMEM),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        out_shape=jax.ShapeDtypeStruct((128, CHUNK), jnp.float32),
        scratch_shapes=[pltpu.VMEM((2, BLOCK, 128), jnp.bfloat16), pltpu.SemaphoreType.DMA((2,))],
        name="two_loops",
    )(num_chunks, q, k)


def test_the_counting_rule_takes_the_kv_loop_around_a_chunk_loop(monkeypatch):
    """On the real listing: the deepest loop with a matmul (the rule before COUNTING_RULE) is
    the chunk loop; the counted loop is the KV-block loop around it, which holds every matmul
    and the next block's copy."""
    from minilib.tpu import dump_reader

    listings = []
    real_kernel_stats = dump_reader.kernel_stats

    def keep_listing(name, bundles_text, allocations_text):
        listings.append(bundles_text)
        return real_kernel_stats(name, bundles_text, allocations_text)

    monkeypatch.setattr(dump_reader, "kernel_stats", keep_listing)
    specs = (
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((128, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK, 128), jnp.bfloat16),
    )
    report = compile_for_tpu(two_loops, *specs, chip="v5e")
    assert_compiled(report)
    (listing,) = listings
    bundles = parse_bundles(listing)
    bodies = loop_bodies(bundles)
    matmuls = count_ops(bundles, MATMUL)
    with_every_matmul = [(s, e) for s, e in bodies if count_ops(bundles[s:e], MATMUL) == matmuls]
    kv_loop = kv_block_loop(bundles)
    chunk_loop = max(with_every_matmul, key=lambda loop: bundles[loop[0]].depth)
    assert matmuls > 0 and kv_loop is not None and chunk_loop != kv_loop
    assert bundles[chunk_loop[0]].depth > bundles[kv_loop[0]].depth
    assert count_ops(bundles[slice(*chunk_loop)], DMA_START) == 0
    assert count_ops(bundles[slice(*kv_loop)], DMA_START) > 0
    assert report.bundles_per_kv_block == kv_loop[1] - kv_loop[0]


# The listing each kernel's figures were read from: [(its KernelStats, its listing)], kept
# by `comparison` as it compiles (a program compiled again is not read again); the cells hold
# those very KernelStats.
LISTINGS: list[tuple[dump_reader.KernelStats, str]] = []


@functools.cache
def comparison(chip):
    """Every cell of `compare_kernels(chip)`, compiled once per test run; the listings read
    go to `LISTINGS`."""
    real_kernel_stats = dump_reader.kernel_stats

    def keep_listing(name, bundles_text, allocations_text):
        stats, notes = real_kernel_stats(name, bundles_text, allocations_text)
        LISTINGS.append((stats, bundles_text))
        return stats, notes

    folder = dump_folder()
    if folder is not None:  # a program compiled before (by another test) writes no new listing
        folder.reports.clear()
        jax.clear_caches()
    dump_reader.kernel_stats = keep_listing
    try:
        return {(cell.config, cell.kernel): cell for cell in compare_kernels(chip)}
    finally:
        dump_reader.kernel_stats = real_kernel_stats


def test_three_way_table_against_jax_and_v3(capsys):
    """Ours, JAX's kernel and v3 on the comparison workload, per chip and config: every cell of
    ours and JAX's has a figure; v3's too where v3 loads, else it says why not. The table is
    printed (static estimates, not timings)."""
    chips = [chip for chip in COMPARISON_CHIPS if chip in chips_here()]
    v3_ok, v3_reason = v3_available()
    cells = []
    for chip in chips:
        cells += comparison(chip).values()
    for cell in cells:
        where = f"{cell.kernel} ({cell.chip}, {cell.config})"
        if cell.kernel == "v3" and not v3_ok:
            assert cell.missing.startswith("not available") and v3_reason in cell.missing, where
            continue
        assert cell.bundles_per_kv_block and cell.bundles_per_kv_block > 0, f"{where}: {cell}"
        assert cell.spill_bytes is not None, where
    for chip in chips:  # v3's decode figure is its decode kernel's, from the same program
        decode, mixed = comparison(chip)["decode", "v3"], comparison(chip)["8 q per block", "v3"]
        if v3_ok:
            assert decode.stats.name.startswith("RPAd-") and mixed.stats.name.startswith("RPAm-")
    with capsys.disabled():
        print("\n" + comparison_table(cells, libtpu_version=libtpu_version()))


@pytest.mark.parametrize("chip", COMPARISON_CHIPS)
def test_paths_follow_each_kernels_own_listing(chip):
    """For every kernel of the comparison, its paths read again from its own listing: the
    interior path <= the longest path <= the listing's loop, and the interior path issues
    every matmul of the loop and a page copy (the next block's), as `PATH_RULES` says."""
    require_chip(chip)
    cells = [cell for cell in comparison(chip).values() if cell.stats is not None]
    listings = {id(stats): text for stats, text in LISTINGS}
    checked = 0
    for cell in cells:
        where = f"{cell.kernel} ({chip}, {cell.config}, {cell.stats.name})"
        text = listings.get(id(cell.stats))
        assert text is not None, f"{where}: its listing was not kept"
        bundles = parse_bundles(text)
        start, end = loop = kv_block_loop(bundles)
        longest, interior = kv_block_passes(bundles, loop)
        assert (len(longest), len(interior)) == (cell.longest_path, cell.interior_path), where
        assert len(interior) <= len(longest) <= cell.bundles_per_kv_block == end - start, where
        assert set(interior) <= set(range(start, end)), where
        on_interior = [bundles[i] for i in interior]
        matmuls = count_ops(bundles[start:end], MATMUL)
        assert matmuls > 0, where
        assert count_ops(on_interior, MATMUL) == matmuls, where
        assert count_ops(on_interior, PAGE_COPY) > 0, where
        checked += 1
    assert checked == len(cells) > 0


@pytest.mark.parametrize(("chip", "config"), list(CLAIMS))
def test_ours_meets_each_claim(chip, config):
    """Where `CLAIMS` says ours is at most another kernel, the compiled figures say so."""
    require_chip(chip)
    cells = comparison(chip)
    ours = cells[config, "ours"]
    missed = []
    for other, claimed in CLAIMS[chip, config]:
        theirs = cells[config, other]
        for figure in [f for f in (*COUNTS, "spill_bytes") if claimed_as(f) == claimed]:
            a, b = getattr(ours, figure), getattr(theirs, figure)
            assert a is not None and b is not None, (
                f"{figure} not measured: {ours.missing or ours.note} / "
                f"{theirs.missing or theirs.note}"
            )
            if a > b:
                missed.append(f"{chip}, {config}: ours {figure} {a:,} > {other}'s {b:,}")
    assert not missed, "\n".join(missed)


@pytest.mark.parametrize("chip", COMPARISON_CHIPS)
def test_every_kv_block_loop_exponentiates_on_the_eup(chip):
    """Every kernel's KV-block loop computes the softmax's exp (and JAX's and ours 1/l at the
    end, outside it): the op classifier must count EUP ops in every loop, and the MXU's only
    for the matmuls' pushes, matmuls and result pops (an EUP result is popped too)."""
    require_chip(chip)
    for (config, kernel), cell in comparison(chip).items():
        if cell.stats is None:
            continue
        kinds = dict(cell.stats.loop_op_kinds)
        assert kinds.get(dump_reader.EUP, 0) > 0, (kernel, chip, config, kinds)
        assert kinds["MXU"] > 0, (kernel, chip, config, kinds)


def test_recorded_comparison_is_what_compiles_here():
    """The figures notebook 09 shows where nothing can be compiled
    (`minilib/tpu/recorded_comparison.json`) are those this stack compiles now, every field
    of every cell (bundles, paths, total bundles, VMEM, spills, the loop's ops by kind, the
    notes): a kernel change that moves one fails here until they are recorded again."""
    cells, record = recorded_comparison()
    here = (jax.__version__, libtpu_version())
    if (record["jax"], record["libtpu"]) != here:
        pytest.skip(f"recorded with jax {record['jax']}, libtpu {record['libtpu']}; here {here}")
    stale = []
    for cell in cells:
        require_chip(cell.chip)
        recorded = cell_record(cell)
        fresh = cell_record(comparison(cell.chip)[cell.config, cell.kernel])
        moved = {k: (recorded[k], fresh[k]) for k in recorded if recorded[k] != fresh[k]}
        if moved:
            stale.append(f"{cell.kernel} ({cell.chip}, {cell.config}): " + ", ".join(
                f"{field} recorded {was}, compiled {now}" for field, (was, now) in moved.items()
            ))  # fmt: skip
    assert not stale, "run `python -m minilib compile --record`:\n" + "\n".join(stale)


V3_ALONE_SCRIPT = """
import sys
from minilib.tpu.v3 import HD64_OLDEST_JAX, V3Unavailable, jax_version, load_v3, load_v3_hd64
kernel = load_v3()
loaded = sorted(name for name in sys.modules if name.startswith("tpu_inference"))
package = kernel.__name__[:-len("kernel")]
assert loaded[-2:] == [package + "kernel", package + "util"], loaded
assert len(loaded) == 6, loaded  # four bare parents, kernel and util
if jax_version() < HD64_OLDEST_JAX:  # too old for the head_dim-64 kernel: said, not loaded
    try:
        load_v3_hd64()
    except V3Unavailable as err:
        assert "needs jax" in str(err), err
    else:
        raise AssertionError("load_v3_hd64 must say this jax is too old for it")
    print("v3 alone ok")
    sys.exit(0)
hd64 = load_v3_hd64()
loaded = sorted(name for name in sys.modules if name.startswith("tpu_inference"))
assert loaded[-4:] == [package + name for name in
                       ("kernel", "kernel_hd64", "tuned_block_sizes_hd64", "util")], loaded
assert len(loaded) == 8, loaded  # and head_dim 64's kernel, its tuned sizes a stand-in
try:
    hd64.get_tuned_block_sizes()
except ValueError as err:
    assert "pass num_kv_pages_per_block and num_queries_per_block" in str(err), err
else:
    raise AssertionError("the stand-in for the tuned block sizes must ask for block sizes")
assert "vllm" not in sys.modules and "torch" not in sys.modules
print("v3 alone ok")
"""


def test_v3_loads_from_its_wheel_without_vllm_or_torch():
    """With jax 0.10.2 or newer, v3 must load (`python3 tasks.py test` fetches its wheel):
    only its kernel and util modules, under bare parent packages, then (with jax 0.12 or
    newer; older, it says why not) its head_dim-64 kernel (whose table of tuned block sizes
    would import vLLM and torch), with no vLLM or torch."""
    import os
    import subprocess
    import sys

    ok, reason = v3_available()
    if not ok and "needs jax" in reason:
        pytest.skip(reason)
    assert ok, reason
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", V3_ALONE_SCRIPT], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and "v3 alone ok" in done.stdout, done.stderr[-3000:]


def test_v3_hd64_kernel_compiles_and_the_rule_finds_its_kv_loop_per_branch():
    """v3's kernel for head_dim 64, which vLLM calls when head_dim is 64, compiles for v5e, and
    the counting rule, applied per branch, finds its three KV-block loops in v3's order
    (decode, prefill, mixed): decode's, one q token per sequence, with the fewest MXU ops;
    prefill's and mixed's the same code. Its cells read the mixed one, and the decode one."""
    from minilib.tpu.kernel_costs import V3_HD64_BRANCHES, cell_of, compile_v3
    from minilib.tpu.v3 import V3Unavailable, load_v3_hd64

    require_chip("v5e")
    try:
        load_v3_hd64()
    except V3Unavailable as err:
        pytest.skip(str(err))
    case = dict(COMPARISON_CASE, head_dim=64)
    report = compile_v3("v5e", num_queries_per_block=8, case=case, hd64=True)
    assert_compiled(report)
    (kernel,) = report.kernels
    assert kernel.name.startswith("RPA-HD_64-") and kernel.bundles_per_kv_block is None
    assert len(kernel.branches) == len(V3_HD64_BRANCHES), kernel.branches
    decode, prefill, mixed = kernel.branches
    mxu = [dict(branch.loop_op_kinds)["MXU"] for branch in kernel.branches]
    assert mxu[0] < mxu[1] == mxu[2], mxu
    assert 0 < decode.bundles_per_kv_block < mixed.bundles_per_kv_block
    assert prefill.bundles_per_kv_block == mixed.bundles_per_kv_block
    assert cell_of(report, "v3", "v5e", "8 q per block").stats == mixed
    assert cell_of(report, "v3", "v5e", "decode", 8).stats == decode


@pytest.mark.parametrize("chip", COMPARISON_CHIPS)
def test_ours_at_head_dim_64_issues_no_more_bundles_than_v3s_hd64_kernel(chip):
    """At head_dim 64 (the comparison workload otherwise), ours issues no more bundles per KV
    block than v3's own kernel for head_dim 64, at 32 q per block, 8 q per block and decode, on
    the listing, the longest path and the interior path: the strided load in rows of 64 lanes,
    from a padded slot (`minilib.kernel.narrow_rows`), and page copies without bounds checks,
    as v3's. One cell is left out, v5e's 32 q on the interior path, which leaves out v3's
    in-kernel update of the KV cache: there ours is 1174 to v3's 1171 (libtpu 0.0.50.1; no
    heads-in-flight setting reaches it, the best is 1173). Through the plain load ours took 2
    to 2.7 times as many. (Not in `CLAIMS`, whose workload is head_dim 128; `python -m
    minilib compile --head-dim 64` prints the table.)"""
    from minilib.tpu.kernel_costs import cell_of, compile_v3
    from minilib.tpu.v3 import V3Unavailable, load_v3_hd64

    require_chip(chip)
    try:
        load_v3_hd64()
    except V3Unavailable as err:
        pytest.skip(str(err))
    case = dict(COMPARISON_CASE, head_dim=64)
    specs = rpa_specs(**case)
    cells = {}
    for queries in COMPARISON_QUERIES_PER_BLOCK:
        blocks = dict(num_kv_pages_per_block=COMPARISON_KV_PAGES_PER_BLOCK,
                      num_queries_per_block=queries)  # fmt: skip
        programs = {
            "v3": compile_v3(chip, case=case, hd64=True, **blocks),
            "ours": compile_rpa("ours", specs, chip=chip, **blocks),
        }
        configs = [f"{queries} q per block"]
        if queries == min(COMPARISON_QUERIES_PER_BLOCK):
            configs.append("decode")
        for kernel, report in programs.items():
            assert_compiled(report)
            for config in configs:
                decode_queries = queries if config == "decode" else None
                cells[config, kernel] = cell_of(report, kernel, chip, config, decode_queries)
    for config in ("32 q per block", "8 q per block", "decode"):
        for count in COUNTS:
            if (chip, config, count) == ("v5e", "32 q per block", "interior_path"):
                continue  # 1174 to 1171: not claimed (see the docstring)
            ours, v3 = (getattr(cells[config, kernel], count) for kernel in ("ours", "v3"))
            assert ours is not None and v3 is not None, (cells[config, "ours"], cells[config, "v3"])
            assert ours <= v3, f"{chip}, {config}, hd64, {count}: ours {ours:,} > v3-hd64's {v3:,}"


def test_doctor_compiles_the_kernel_for_v5e(capsys):
    from minilib.doctor import tpu_compile_check

    assert tpu_compile_check()
    out = capsys.readouterr().out
    assert "TPU compile:  PASS" in out and "bundles per KV block" in out, out


def test_static_targets_judge_every_claim_from_real_compiles():
    from minilib.tpu.comparison import static_targets

    chips = [chip for chip in COMPARISON_CHIPS if chip in chips_here()]
    results = static_targets(chips, compare=lambda chip: list(comparison(chip).values()))
    judged = [(name, passed, detail) for name, passed, detail in results if passed is not None]
    claims = [figure for key in CLAIMS if key[0] in chips for _, figure in CLAIMS[key]]
    counts_per_claim = {claimed_as(f): 0 for f in (*COUNTS, "spill_bytes")}
    for figure in (*COUNTS, "spill_bytes"):
        counts_per_claim[claimed_as(figure)] += 1  # bundles per KV block: its three counts
    assert len(judged) == sum(counts_per_claim[figure] for figure in claims)
    for name, _, detail in results:  # every figure measured, v3's included
        assert detail.startswith("ours "), f"{name}: {detail}"
    # A change that costs bundles or spills where a claim is made fails here, with the numbers.
    missed = [f"{name}: {detail}" for name, passed, detail in judged if not passed]
    assert not missed, "static targets missed:\n" + "\n".join(missed)


FALLBACK_SCRIPT = """
import functools, jax, jax.numpy as jnp
from jax.experimental import topologies
topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu",
                             chips_per_host_bounds=(1, 1, 1))  # libtpu starts without dumps
from minilib.tpu import compile as tpu_compile
from minilib.pallas_basics import add_vectors
assert tpu_compile.libtpu_started() and not tpu_compile.dump_here()
x = jax.ShapeDtypeStruct((4096,), jnp.float32)
add = functools.partial(add_vectors, block_size=1024, interpret=False)
report = tpu_compile.compile_for_tpu(add, x, x, chip="v5e")
assert report.compiled and report.total_bundles > 0, report
try:
    tpu_compile.compile_for_tpu(lambda a: a + 1, x)
except ValueError as err:
    assert "cannot be sent there" in str(err), err
else:
    raise AssertionError("a lambda cannot go to a fresh process: expected a ValueError")
print("fallback ok")
"""


def test_compiles_in_a_fresh_process_when_libtpu_started_without_dump_flags():
    """As on a TPU host, where JAX's TPU backend starts libtpu before minilib can set its
    flags: the compile runs in a fresh process and its dump is still read."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and "fallback ok" in done.stdout, done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Each kernel at its own block sizes, and whole programs (`minilib.tpu.at_defaults`).
# ---------------------------------------------------------------------------------------------


def require_v3():
    ok, reason = v3_available()
    if not ok:
        pytest.skip(reason)


def test_each_kernel_runs_at_what_its_own_heuristic_answers():
    """`defaults_rows` compiles ours and v3 at the block sizes their own heuristics answer for
    the chip (asked here, not written down; JAX's is asked for the chip, not the CPU), and per
    128 KV tokens is per block x 128 / the block's KV tokens, with v3's compute-chunk loop
    counted once per chunk of the block."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

    from minilib.tpu import at_defaults
    from minilib.tpu.v3 import load_v3

    chip = "v5e"
    require_chip(chip)
    require_v3()
    case = COMPARISON_CASE | dict(max_num_batched_tokens=64, max_num_seqs=4)  # quick compiles
    rows = {(r.kernel, r.config): r for r in at_defaults.defaults_rows(chip, case, ("ours", "v3"))}
    specs = rpa_specs(**case)
    q, kv_pages, kv_lens, page_indices, _, _ = specs
    kv_heads = block_sizes.num_kv_heads_per_block(32, 8, q.dtype, kv_pages.dtype)
    pages, queries = block_sizes.default_block_sizes(
        page_size=16, pages_per_seq=page_indices.shape[1], max_num_batched_tokens=q.shape[0],
        bytes_per_page=16 * 2 * kv_heads * 128 * 2, chip=chip,
    )  # fmt: skip
    assert (rows["ours", "mixed"].kv_tokens, rows["ours", "mixed"].q_rows) == (16 * pages, queries)
    assert rows["ours", "decode"].kv_tokens == 16 * pages
    with pytest.raises(NotImplementedError):  # JAX's heuristic asks jax.devices(): the CPU
        tuned_block_sizes.get_tuned_block_sizes(q.dtype, kv_pages.dtype, 32, 8, 128, 16, 256, 32)
    assert at_defaults.jax_defaults(chip, specs)["pages"] > 0  # ... so it is asked for the chip
    v3 = load_v3()
    args = (q.dtype, kv_pages.dtype, 32, 8, 128, 16, q.shape[0], kv_lens.shape[0], 32)
    with at_defaults.on_chip(chip):
        mixed = v3.get_default_block_sizes(*args, case=v3.RpaCase.MIXED)
        decode = v3.get_default_block_sizes(*args, case=v3.RpaCase.DECODE)
    assert (rows["v3", "mixed"].kv_tokens, rows["v3", "mixed"].q_rows) == (
        mixed["bkv_sz"], mixed["bq_sz"])  # fmt: skip
    assert rows["v3", "decode"].kv_tokens == decode["bkv_sz"]
    _, kernels, _ = at_defaults.v3_kernels(chip, specs)  # compiled above: read again, not compiled
    assert f"bkv_{mixed['bkv_sz']}_{mixed['bkv_csz']}" in kernels["mixed"].name
    for row in rows.values():
        assert row.per_128_kv_tokens * row.kv_tokens == pytest.approx(
            row.bundles_per_kv_block * 128
        )
    bundles = kernels["mixed"].bundles
    kv = kv_block_loop(bundles)
    chunk = at_defaults.compute_loop(bundles, kv)
    chunks = mixed["bkv_sz"] // mixed["bkv_csz"]
    assert chunks > 1 and chunk is not None
    expected = (kv[1] - kv[0]) + (chunks - 1) * (chunk[1] - chunk[0])
    assert rows["v3", "mixed"].bundles_per_kv_block == expected


@pytest.mark.parametrize("chip", COMPARISON_CHIPS)
def test_our_decode_at_its_own_blocks_issues_no_more_per_kv_token_than_v3s_at_its_own(chip):
    """At each kernel's own block sizes (`python -m minilib compile --defaults`, the comparison
    workload), our decode kernel issues no more bundles per 128 KV tokens than v3's decode
    kernel: the decode ratio holds however the blocks are chosen, not only at the 128 KV tokens
    of `CLAIMS`. libtpu 0.0.50.1: v5e 275.2 to 385.0, v6e 269.0 to 357.8, TPU7x 267.5 to 354.5.
    Until our page copies went without bounds checks, as v3's do, v3 was ahead on v6e (359.2)
    and TPU7x (421.5, in blocks of 256 tokens, ours' default there then)."""
    from minilib.tpu import at_defaults

    require_chip(chip)
    require_v3()
    rows = {
        (row.kernel, row.config): row
        for row in at_defaults.defaults_rows(chip, COMPARISON_CASE, ("ours", "v3"))
    }
    ours, v3 = rows["ours", "decode"], rows["v3", "decode"]
    assert ours.per_128_kv_tokens <= v3.per_128_kv_tokens, (chip, ours, v3)


def test_whole_program_follows_the_batch_as_defined():
    """Two batches of the same shapes (8 decode sequences, 1024-token slots): in the second,
    four sequences hold 512 tokens. Our decode kernel visits fewer KV blocks (of its default
    size), so its whole program is that many KV-block passes smaller and nothing else changes;
    v3's decode block is the whole 1024-token slot (its default): one pass per sequence in
    both."""
    from minilib.tpu import at_defaults

    chip = "v5e"
    require_chip(chip)
    require_v3()
    full = at_defaults.Workload("full", ((1, 1024),) * 8)
    half = at_defaults.Workload("half", ((1, 1024),) * 4 + ((1, 512),) * 4)
    assert full.specs() == half.specs()
    a, b = at_defaults.whole_program(chip, full), at_defaults.whole_program(chip, half)
    decode = at_defaults.ours_kernels(chip, full.specs())[1]["decode"]  # already compiled
    import math

    blocks = at_defaults.ours_defaults(chip, full.specs())["mixed"]
    fewer = 4 * (math.ceil(1024 / blocks["kv_tokens"]) - math.ceil(512 / blocks["kv_tokens"]))
    trips_a = at_defaults.ours_trips(full, blocks["pages"], blocks["q_rows"])["decode"]
    trips_b = at_defaults.ours_trips(half, blocks["pages"], blocks["q_rows"])["decode"]
    assert trips_a[0] - trips_b[0] == fewer > 0 and trips_a[1:] == trips_b[1:]
    totals = {name: (sum(n for _, n, _ in a[name]), sum(n for _, n, _ in b[name])) for name in a}
    assert totals["ours"][0] - totals["ours"][1] == fewer * at_defaults.block_bundles(
        decode.bundles
    )
    assert totals["v3"][0] == totals["v3"][1]
    assert a["ours"][0] == b["ours"][0]  # XLA's own programs: the same shapes, the same bundles


@pytest.mark.parametrize(
    "flags, named",
    [(["--workloads", "--record"], "--record"),
     (["--defaults", "--num-kv-pages-per-block", "16"], "--num-kv-pages-per-block"),
     (["--defaults", "--workloads", "--head-dim", "64"], "--head-dim")],
)  # fmt: skip
def test_defaults_and_workloads_refuse_flags_they_do_not_use(flags, named, capsys):
    """--defaults and --workloads compile each kernel at its own block sizes on fixed shapes:
    any flag but --chip is a usage error (exit 2) that names it, before anything compiles."""
    import argparse

    from minilib.tpu.comparison import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(flags)) == 2
    err = capsys.readouterr().err
    assert named in err and "only --chip goes with it" in err
