"""A right kernel is never refused for a TPU where its TPU compile cannot be checked.

Each construct a learner may write on traced integers in a kernel body (`//`, `%`, `divmod`,
`jnp.minimum`, Python ints mixed in, `lax.cond`, `lax.while_loop`, `lax.fori_loop`), in a
small right kernel, through `check_kernel`: it passes. Without libtpu (.venv) the TPU step is
JAX's lowering told the chip (`lower_for_tpu`); where the lowering stops only to ask which TPU
it lowers for, the check passes with one line saying the compile was not checked here. With
libtpu (marker `tpu_compile`, .venv-tpu) Mosaic compiles each for v5e. A right rung 6 written
with `//` passes its checker; a kernel that truly does not compile for a TPU is still refused,
with the lowering's own cause.
"""

from __future__ import annotations

from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from ladder_wrong_walks import rung6

import minilib.exercises as ex
from minilib.exercises.checking import FAILED, PASSED, Case
from minilib.exercises.ex08_ragged import _prefill_compile_case, _prefill_live_rows
from minilib.exercises.kernel_checking import (
    asked_which_tpu,
    check_kernel,
    compile_on_tpu,
    described_chip,
    frames_kept,
    lower_for_tpu,
)
from minilib.tpu.compile import tpu_compile_available

AVAILABLE, REASON = tpu_compile_available()
N = 17  # the traced integer: kv_len, a q position


def divmod_both(n):
    q, r = divmod(n, 8)
    return 10 * q + r


def count_down_by_8(n):
    while n >= 8:
        n = n - 8
    return n


# name -> (the kernel's computation on a traced int32 n, the same in Python on an int)
CONSTRUCTS = {
    "//": (lambda n: n // 8, lambda n: n // 8),
    "// below zero": (lambda n: (n - 20) // 8, lambda n: (n - 20) // 8),  # floor, not trunc
    "// on a vector": (
        lambda n: (n + lax.broadcasted_iota(jnp.int32, (8, 128), 0)) // 8,
        lambda n: (n + np.arange(8)[:, None]) // 8,
    ),
    "%": (lambda n: n % 8, lambda n: n % 8),
    "% below zero": (lambda n: (n - 20) % 8, lambda n: (n - 20) % 8),
    "divmod": (divmod_both, divmod_both),
    "jnp.minimum": (lambda n: jnp.minimum(n, 12), lambda n: min(n, 12)),
    "Python ints": (lambda n: 3 * n + 7 - n, lambda n: 3 * n + 7 - n),
    "lax.cond": (
        lambda n: lax.cond(n > 12, lambda: n - 12, lambda: n + 12),
        lambda n: n - 12 if n > 12 else n + 12,
    ),
    "lax.while_loop": (
        lambda n: lax.while_loop(lambda c: c >= 8, lambda c: c - 8, n),
        count_down_by_8,
    ),
    "lax.fori_loop": (
        lambda n: lax.fori_loop(0, n, lambda i, total: total + i, 0),
        lambda n: sum(range(n)),
    ),
}


def kernel_of(compute):
    """fn(n, x) -> x + compute(n): n [1] int32 in SMEM (traced in the kernel), x [8, 128]."""

    def kernel(n_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] + compute(n_ref[0]).astype(jnp.float32)

    def fn(n, x, *, interpret=False):
        smem, vmem = pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)
        out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return pl.pallas_call(
            kernel, out_shape=out_shape, in_specs=[smem, vmem], interpret=interpret
        )(n, x)

    return fn


def reference_of(in_python):
    def reference(n, x):
        return np.asarray(x) + np.float32(in_python(int(n[0])))

    return reference


CASE = Case(f"n = {N}", (jnp.array([N], jnp.int32), jnp.ones((8, 128), jnp.float32)))


def check_construct(name):
    compute, in_python = CONSTRUCTS[name]
    return check_kernel(
        name,
        kernel_of(compute),
        reference_of(in_python),
        [CASE],
        compile_case=CASE,
        mistakes={},
        verbose=False,
    )


def assert_passes_for_a_tpu(name):
    result = check_construct(name)
    assert result.status == PASSED, result.report
    last = result.report.splitlines()[-1]
    if AVAILABLE:
        assert last == f"Mosaic compiles it for v5e ({CASE.description}).", result.report
    else:  # JAX's lowering, told the chip, lowers every one of them
        assert last.startswith(f"It lowers for v5e ({CASE.description}); "), result.report


@pytest.mark.skipif(AVAILABLE, reason="libtpu is here: the tpu_compile test checks them")
@pytest.mark.parametrize("name", CONSTRUCTS)
def test_a_right_kernel_passes_whatever_it_does_with_traced_integers(name):
    assert_passes_for_a_tpu(name)


@pytest.mark.tpu_compile
@pytest.mark.parametrize("name", CONSTRUCTS)
def test_mosaic_compiles_every_construct_for_v5e(name):
    if not AVAILABLE:
        pytest.skip(f"no TPU compile here: {REASON}")
    assert_passes_for_a_tpu(name)


def lowering_error(fn, case, chip):
    """The error of JAX's lowering of `fn` for TPU (`jax.export`), told `chip` (None: not
    told), its JAX frames kept; None if it lowers."""
    told = jax.sharding.use_abstract_mesh(described_chip(chip)) if chip else nullcontext()
    try:
        with told, frames_kept():
            export.export(jax.jit(fn), platforms=["tpu"])(*case.args)
    except ValueError as err:
        return err
    return None


def floor_division_kernel():
    return kernel_of(CONSTRUCTS["//"][0])


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def misaligned_copy(x, *, interpret=False):
    """A copy in blocks of (8, 64): the lowering for TPU refuses a block's last dimension that
    is neither a multiple of 128 nor the array's."""
    block = pl.BlockSpec((8, 64), lambda i: (0, i))
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    grid = (x.shape[1] // 64,)
    return pl.pallas_call(
        copy_kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[block],
        out_specs=block,
        interpret=interpret,
    )(x)


MISALIGNED = Case("8 x 256", (jnp.arange(8 * 256, dtype=jnp.float32).reshape(8, 256),))
NOT_ASKED = "lowers // in a kernel without asking which TPU"


def test_the_lowering_asking_which_tpu_is_read_from_where_jax_raised():
    asked = lowering_error(floor_division_kernel(), CASE, chip=None)
    if asked is None:
        pytest.skip(f"jax {jax.__version__} {NOT_ASKED}")
    assert asked_which_tpu(asked), asked
    assert lowering_error(floor_division_kernel(), CASE, chip="v5e") is None
    # Its words, raised anywhere else, are not the lowering asking.
    try:
        raise ValueError(str(asked))
    except ValueError as same_words:
        assert not asked_which_tpu(same_words)
    # Nor is a refusal of the kernel.
    refused = lowering_error(misaligned_copy, MISALIGNED, chip="v5e")
    assert refused is not None and not asked_which_tpu(refused), refused


def test_a_lowering_that_asks_which_tpu_is_not_a_refusal_but_one_line():
    if lowering_error(floor_division_kernel(), CASE, chip=None) is None:
        pytest.skip(f"jax {jax.__version__} {NOT_ASKED}")
    status, note = lower_for_tpu(floor_division_kernel(), CASE, REASON, chip=None)
    assert status == PASSED, note
    assert "\n" not in note, note
    assert note.startswith(f"The TPU compile was not checked here ({CASE.description}): ")
    assert "without libtpu" in note and REASON in note and "Colab's TPU runtime" in note


def test_a_kernel_that_does_not_compile_for_a_tpu_is_still_refused_with_its_cause():
    result = check_kernel(
        "misaligned_copy",
        misaligned_copy,
        lambda x: x,
        [MISALIGNED],
        compile_case=MISALIGNED,
        mistakes={},
        verbose=False,
    )
    assert result.status == FAILED, result.report
    assert "right in interpret mode, but not for a TPU" in result.report
    assert "divisible by 8 and 128" in result.report, result.report
    assert "not checked here" not in result.report


@pytest.mark.skipif(AVAILABLE, reason="libtpu is here: the tpu_compile test compiles it")
def test_a_right_rung_6_written_with_floor_division_passes_its_checker():
    result = ex.check_prefill_chunk(rung6("floor_division"), verbose=False)
    assert result.status == PASSED, result.report


@pytest.mark.tpu_compile
def test_mosaic_compiles_a_right_rung_6_written_with_floor_division():
    if not AVAILABLE:
        pytest.skip(f"no TPU compile here: {REASON}")
    fn = _prefill_live_rows(rung6("floor_division"))
    status, note = compile_on_tpu("prefill_chunk", fn, _prefill_compile_case())
    assert status == PASSED and note.startswith("Mosaic compiles it for v5e"), note
