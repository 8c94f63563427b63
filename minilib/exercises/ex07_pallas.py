"""Notebook 07's exercise: the body of a Pallas kernel, a numerically stable row softmax."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import compare_arrays

__all__ = ["check_softmax_kernel"]


def _softmax_kernel(x_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - x.max(axis=-1, keepdims=True))
    o_ref[...] = (e / e.sum(axis=-1, keepdims=True)).astype(o_ref.dtype)


def _on_grid(kernel: Callable) -> Callable:
    """Run `kernel` with one program per block of rows, in interpret mode (any backend)."""
    from jax.experimental import pallas as pl

    def run(x, block_rows):
        rows, cols = x.shape
        spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))  # program i: rows block i
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(rows // block_rows,),
            in_specs=[spec],
            out_specs=spec,
            interpret=True,
        )(x)

    return run


def check_softmax_kernel(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(x_ref, o_ref)`, a Pallas kernel body: write into o_ref the softmax of each
    row of x_ref (over the last axis). x_ref and o_ref are [block_rows, cols] blocks.

    The checker runs it with `pl.pallas_call(..., grid=(rows // block_rows,),
    interpret=True)`: one program per block of rows. Some rows have scores in the hundreds,
    where exp overflows float32 unless the row's max is subtracted first.

    >>> check_softmax_kernel(_softmax_kernel)
    Passed: softmax_kernel matches the reference on all 4 cases.
    CheckResult('softmax_kernel', status='passed')
    """
    rng = np.random.default_rng(800 + seed)
    cases = []
    for rows, cols, block_rows, scale in [(8, 16, 2, 3.0), (4, 8, 4, 1.0), (16, 8, 8, 200.0),
                                          (6, 32, 3, 10.0)]:  # fmt: skip
        x = jnp.asarray(scale * rng.standard_normal((rows, cols)), jnp.float32)
        what = f"x.shape=({rows}, {cols}) in blocks of {block_rows} rows: {rows // block_rows} "
        what += f"programs; values up to {float(jnp.abs(x).max()):.0f}"
        cases.append(Case(what, (x, block_rows)))

    def no_max(x_ref, o_ref):
        e = jnp.exp(x_ref[...])
        o_ref[...] = e / e.sum(axis=-1, keepdims=True)

    def over_columns(x_ref, o_ref):
        x = x_ref[...]
        e = jnp.exp(x - x.max(axis=0, keepdims=True))
        o_ref[...] = e / e.sum(axis=0, keepdims=True)

    mistakes = {
        "exp overflows: subtract each row's max before exp (notebook 06). The result is the "
        "same, and every exponent is <= 0.": _on_grid(no_max),
        "the softmax runs down the columns (axis 0); it should run along each row, over the "
        "last axis (axis=-1), as the keys of one query row.": _on_grid(over_columns),
    }
    compare = diagnose(
        lambda want, got, case: compare_arrays(want, got, "output", atol=1e-5, rtol=1e-4),
        mistakes,
    )
    return run_check(
        "softmax_kernel",
        _on_grid(fn),
        _on_grid(_softmax_kernel),
        cases,
        compare,
        verbose=verbose,
    )
