"""Notebook 09's VMEM sum against Mosaic's compile: the default scoped VMEM limit of each chip,
the sum from 10% under to 30% over a fresh compile, and the block exercise 9.2 picks fitting
the limit.
Marker `tpu_compile`; runs where libtpu is installed."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from compile_checks import TPU_COMPILE, require_chip
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.chips import CHIPS
from minilib.exercises.ex09_performance import _num_kv_pages_per_block, kernel_vmem_bytes
from minilib.kernel.padded_slot import PADDED_SLOT_CHIPS, padding_compiles
from minilib.tpu.compile import compile_for_tpu
from minilib.tpu.kernel_costs import compile_rpa, kernel_for, rpa_specs
from minilib.tpu.memory import DEFAULT_SCOPED_VMEM_BYTES

pytestmark = TPU_COMPILE


# Notebook 09's VMEM sum (exercise 9.2's `kernel_vmem_bytes`) against our kernel's compiled
# peak VMEM, on the notebook's shapes: GQA 32 q / 8 KV heads (one heads block of 8), head_dim
# 128, bf16, page_size 16, 32 q per block. `tests/tpu/test_tpu_memory.py` holds it against the
# recorded figures.
NOTEBOOK_09 = dict(page_size=16, num_kv_heads_per_block=8, group=4, head_dim=128, itemsize=2,
                   num_queries_per_block=32)  # fmt: skip


def modelled_vmem(chip, pages):
    padded = chip in PADDED_SLOT_CHIPS and padding_compiles()
    return kernel_vmem_bytes(pages, **NOTEBOOK_09, padded_slot=padded)


def largest_block(budget, chip):
    """Exercise 9.2's answer: the model's largest KV block within `budget`."""
    padded = chip in PADDED_SLOT_CHIPS and padding_compiles()
    return _num_kv_pages_per_block(int(budget), pages_per_seq=256, **NOTEBOOK_09,
                                   padded_slot=padded)  # fmt: skip


def compile_notebook_09(chip, pages, *, pages_per_seq=64):
    specs = rpa_specs(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                      pages_per_seq=pages_per_seq)  # fmt: skip
    return compile_rpa("ours", specs, chip=chip, num_kv_pages_per_block=pages,
                       num_queries_per_block=32)  # fmt: skip


def scratch_kernel(x, *, scratch_bytes):
    """A kernel with `scratch_bytes` of VMEM scratch and next to nothing else."""

    def kernel(x_ref, o_ref, scratch_ref):
        scratch_ref[:8] = x_ref[...]
        o_ref[...] = scratch_ref[:8] + scratch_ref[8:16]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((scratch_bytes // 512, 128), jnp.float32)],
    )(x)


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


@pytest.mark.parametrize("chip", CHIPS)
def test_the_vmem_sum_is_at_most_10_percent_under_or_30_over_a_fresh_compile(chip):
    """At the notebook's smallest block (4 pages, 64 tokens: score rows of half a register)
    and at the default one (32 pages, the most spills of the four), on every chip."""
    require_chip(chip)
    for pages in (4, 32):
        compiled = kernel_for(compile_notebook_09(chip, pages), decode=False).vmem_bytes
        modelled = modelled_vmem(chip, pages)
        # Over at larger blocks: the sum counts a score matrix per KV head as spills, more than
        # the kernel spills there (libtpu 0.0.50.1: about 22% over at 32 pages on v6e).
        assert -0.10 <= modelled / compiled - 1 <= 0.30, (pages, modelled, compiled)


# v6e's 128-page compile takes about a minute: it runs with the larger sweeps (`-m slow`).
@pytest.mark.parametrize("chip", ["v5e", pytest.param("v6e", marks=pytest.mark.slow)])
def test_the_block_picked_for_90_percent_of_the_scoped_limit_fits(chip):
    """The sum is at most 10% under the compile, so the block exercise 9.2 picks for 90% of
    the default scoped limit fits the limit. (The block picked for the whole limit overflowed
    while the kernel spilled a score matrix per KV head, as the sum counts; since its softmax
    needs fewer registers, libtpu 0.0.50.1, the sum is over the compile there and that block
    fits too: not asserted either way.)"""
    require_chip(chip)
    limit = DEFAULT_SCOPED_VMEM_BYTES[chip]
    pages, greedy = largest_block(0.9 * limit, chip), largest_block(limit, chip)
    assert pages < greedy < 256
    report = compile_notebook_09(chip, pages, pages_per_seq=256)
    assert report.compiled, report.error
    assert kernel_for(report, decode=False).vmem_bytes <= limit
