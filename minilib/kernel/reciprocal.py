"""Lever: the output's acc / l as acc times 1 / l, the chip's approximate reciprocal refined by
Newton's method, in place of the plain division (`plain.OnlineSoftmax.normalized`), which
Mosaic lowers to an exact division of every vector register of acc, about 17 vector ops each
(benchmarks/LEVERS.md).

Each Newton step r <- r * (2 - l * r) squares the relative error of r: from the approximate
reciprocal's (a few bits short of float32's, on any chip), two steps leave float32's own
rounding, so the output is the plain kernel's to within a float32 rounding, before its cast to
q's dtype. (vLLM's RPA v3 takes the approximate reciprocal alone, for outputs below float32.)
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__: list[str] = []  # the kernel body's own: see `divide`

# The chip's approximate reciprocal: Pallas TPU's since jax 0.8, Pallas' own (now deprecated) in
# Colab's jax 0.7.2.
approximate_reciprocal = pltpu.reciprocal if hasattr(pltpu, "reciprocal") else pl.reciprocal

NEWTON_STEPS = 2
# Where `kernel_config` sets `KernelConfig.newton_reciprocal`. On v6e and TPU7x Mosaic's division
# is already a reciprocal and a multiply; the steps there only add (benchmarks/LEVERS.md).
NEWTON_CHIPS = ("v5e",)


def divide(numerator, denominator):
    """numerator / denominator, as numerator times the refined reciprocal of the denominator
    (a column, [rows, 1]: one reciprocal per row, broadcast along the row).

    >>> import jax, jax.numpy as jnp   # in a kernel: the reciprocal is a Pallas op
    >>> def kernel(n_ref, d_ref, o_ref):
    ...     o_ref[...] = divide(n_ref[...], d_ref[...])
    >>> n, d = jnp.array([[3.0, 6.0], [1.0, 7.0]]), jnp.array([[3.0], [7.0]])
    >>> out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(n.shape, n.dtype), interpret=True)(n, d)
    >>> out.tolist()[0], bool(jnp.allclose(out, n / d, rtol=2**-23, atol=0))  # one float32 step
    ([1.0, 2.0], True)
    """
    r = approximate_reciprocal(denominator, approx=True)
    for _ in range(NEWTON_STEPS):
        r = r * (2.0 - denominator * r)
    return numerator * r
