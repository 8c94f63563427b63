"""minilib.tpu.memory: each chip's memories come from JAX's own table, never typed in; its
default scoped VMEM limit, and notebook 09's VMEM sum against the compiled kernel's VMEM.

The tests that compile (marker `tpu_compile`) run where libtpu is installed (`.venv-tpu`) and
are skipped elsewhere with the reason."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib import block_sizes
from minilib.exercises.ex09_performance import _num_kv_pages_per_block, kernel_vmem_bytes
from minilib.kernel.padded_slot import PADDED_SLOT_CHIPS, padding_compiles
from minilib.tpu.chips import CHIPS
from minilib.tpu.comparison import recorded_comparison
from minilib.tpu.compile import (
    chip_unknown_here,
    chips_here,
    compile_for_tpu,
    tpu_compile_available,
)
from minilib.tpu.kernel_costs import (
    COMPARISON_KV_PAGES_PER_BLOCK,
    compile_rpa,
    kernel_for,
    rpa_specs,
)
from minilib.tpu.memory import (
    DEFAULT_SCOPED_VMEM_BYTES,
    chip_memories,
    chip_memories_here_or_recorded,
    recorded_chip_memories,
    why_unavailable,
)
from minilib.tpu.recorded import recorded_results


def test_chip_memories_come_from_jaxs_table():
    rows = chip_memories()
    if not hasattr(pltpu, "get_tpu_info_for_chip"):
        assert rows is None and "get_tpu_info_for_chip" in why_unavailable()
        return
    assert [r.chip for r in rows] == list(CHIPS)
    v4, v5e = (pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(c), 1) for c in ("v4", "v5e"))
    assert rows[0].vmem_bytes == v4.vmem_capacity_bytes
    assert rows[1].vmem_bytes == v5e.vmem_capacity_bytes and rows[1].lanes == v5e.num_lanes


def test_the_recorded_table_is_jaxs_table():
    """The figures jax 0.7.2 shows (`minilib/tpu/recorded_chip_table.json`) are every field of
    every chip of this jax's table, where it has one: re-record with
    `python -m minilib.tpu.recorded --chips` when JAX's table moves."""
    recorded, record = recorded_chip_memories()
    live = chip_memories()
    if live is None:
        pytest.skip(f"jax {jax.__version__} has no table to check against")
    if record["jax"] != jax.__version__:
        pytest.skip(f"recorded with jax {record['jax']}; here jax {jax.__version__}")
    assert recorded == live, "run `python -m minilib.tpu.recorded --chips`"


def test_without_a_table_the_recorded_one_is_shown_and_labelled(monkeypatch):
    monkeypatch.delattr(pltpu, "get_tpu_info_for_chip", raising=False)
    rows, source = chip_memories_here_or_recorded(("v6e", "v5e"))
    recorded, record = recorded_chip_memories()
    assert rows == [recorded[3], recorded[1]]
    assert source.startswith(f"Recorded on {record['date']} with jax {record['jax']}")
    assert "python -m minilib.tpu.recorded --chips" in source


# Notebook 09's VMEM sum (`ex09_performance.kernel_vmem_bytes`) against the compiled kernel's
# peak VMEM, on the notebook's shapes: GQA 32 q / 8 KV heads, head_dim 128, bf16, page_size 16,
# 32 q per block (the default). Static figures of the compiled program, not measurements.
KV_HEADS_PER_BLOCK = block_sizes.num_kv_heads_per_block(32, 8, jnp.bfloat16, jnp.bfloat16)
SHAPES = dict(page_size=16, num_kv_heads_per_block=KV_HEADS_PER_BLOCK, group=4, head_dim=128,
              itemsize=2)  # fmt: skip
MODEL_TOLERANCE = 0.10


def modelled_vmem(chip, pages, queries=32, padded=None):
    padded = chip in PADDED_SLOT_CHIPS if padded is None else padded
    return kernel_vmem_bytes(pages, **SHAPES, num_queries_per_block=queries, padded_slot=padded)


def largest_block(budget, chip, *, pages_per_seq=256):
    """The model's largest KV block within `budget` (exercise 9.2's answer)."""
    pages = 0
    while pages < pages_per_seq and modelled_vmem(chip, pages + 1) <= budget:
        pages += 1
    return pages


def test_the_vmem_sum_is_within_10_percent_of_the_recorded_compiles():
    """The recorded compiles (libtpu 0.0.50.1): notebook 09's, v5e and v6e at 4 to 32 pages per
    KV block, and the three-way comparison's, v5e, v6e and TPU7x at 8 pages with 32 and 8 q
    per block."""
    record = recorded_results()["results"]["vmem_by_kv_block"]
    figures = [(chip, pages, 32, vmem) for chip, pages, vmem in record]
    cells, _ = recorded_comparison()
    for cell in cells:
        if cell.kernel == "ours" and cell.config != "decode":
            queries = int(cell.config.split()[0])
            figures.append(
                (cell.chip, COMPARISON_KV_PAGES_PER_BLOCK, queries, cell.stats.vmem_bytes)
            )
    assert len(figures) == 8 + 6
    for chip, pages, queries, compiled in figures:
        modelled = modelled_vmem(chip, pages, queries)
        assert abs(modelled / compiled - 1) <= MODEL_TOLERANCE, (chip, pages, queries, modelled,
                                                                  compiled)  # fmt: skip


def test_the_largest_block_for_a_budget_is_the_exercises_answer():
    limit = DEFAULT_SCOPED_VMEM_BYTES["v5e"]
    pages = largest_block(0.9 * limit, "v5e")
    assert modelled_vmem("v5e", pages) <= 0.9 * limit < modelled_vmem("v5e", pages + 1)
    shapes = SHAPES | dict(pages_per_seq=256, num_queries_per_block=32, padded_slot=False)
    assert _num_kv_pages_per_block(int(0.9 * limit), **shapes) == pages


AVAILABLE, REASON = tpu_compile_available()
needs_libtpu = pytest.mark.skipif(not AVAILABLE, reason=f"no TPU compile here: {REASON}")


def require_chip(chip):
    if chip not in chips_here():
        pytest.skip(chip_unknown_here(chip))


def compile_ours(chip, pages, *, pages_per_seq=64):
    """Our kernel compiled for `chip` on notebook 09's shapes, 32 q per block."""
    specs = rpa_specs(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                      pages_per_seq=pages_per_seq)  # fmt: skip
    return compile_rpa("ours", specs, chip=chip, num_kv_pages_per_block=pages,
                       num_queries_per_block=32)  # fmt: skip


def scratch_kernel(x, *, scratch_bytes):
    """A kernel with `scratch_bytes` of VMEM scratch, next to nothing else."""

    def kernel(x_ref, o_ref, scratch_ref):
        scratch_ref[:8] = x_ref[...]
        o_ref[...] = scratch_ref[:8] + scratch_ref[8:16]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((scratch_bytes // 512, 128), jnp.float32)],
    )(x)


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize("chip", CHIPS)
def test_default_scoped_vmem_limit(chip):
    """A kernel whose scratch is 64 KiB under the chip's default scoped limit compiles; at
    64 KiB over it, Mosaic runs out of VMEM."""
    require_chip(chip)
    limit = DEFAULT_SCOPED_VMEM_BYTES[chip]
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    under, over = (compile_for_tpu(functools.partial(scratch_kernel, scratch_bytes=limit + d),
                                   x, chip=chip) for d in (-64 << 10, 64 << 10))  # fmt: skip
    assert under.compiled, under.error
    assert over.vmem_overflow, over.error


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize("chip", CHIPS)
def test_the_vmem_sum_is_within_10_percent_of_a_fresh_compile(chip):
    """At the smallest block of the notebook (4 pages, 64 tokens: scores of half a register)
    and at the default (32 pages, the most spills), on every chip."""
    require_chip(chip)
    padded = chip in PADDED_SLOT_CHIPS and padding_compiles()
    for pages in (4, 32):
        compiled = kernel_for(compile_ours(chip, pages), decode=False).vmem_bytes
        modelled = modelled_vmem(chip, pages, padded=padded)
        assert abs(modelled / compiled - 1) <= MODEL_TOLERANCE, (pages, modelled, compiled)


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_the_block_picked_for_90_percent_of_the_scoped_limit_compiles(chip):
    """The model is within 10% of the compile, so a block picked for 90% of the default scoped
    limit fits the limit. With this margin the next block up still compiles too; what needs the
    margin is the block the model picks for the whole limit, which overflows."""
    require_chip(chip)
    limit = DEFAULT_SCOPED_VMEM_BYTES[chip]
    pages, greedy = largest_block(0.9 * limit, chip), largest_block(limit, chip)
    assert pages < greedy < 256
    report = compile_ours(chip, pages, pages_per_seq=256)
    assert report.compiled, report.error
    assert kernel_for(report, decode=False).vmem_bytes <= limit
    too_big = compile_ours(chip, greedy, pages_per_seq=256)
    assert too_big.vmem_overflow, too_big.error
