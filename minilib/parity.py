"""Parity: how far an answer is from a reference's, and how far a right answer may be.

Every implementation of the course computes the attention of JAX's reference, but not with the
same operations in the same order, so a right answer differs from the reference by rounding.
How much depends on where the matmuls run and on the dtype:

* exact float32 matmuls (a CPU): sums taken in another order (blocks, an online softmax), each
  step rounding by float32's relative 1.2e-7. On outputs of size about 1 that stays far
  below `FLOAT32_TOLERANCE`, 1e-4.
* one bfloat16 pass (a TPU at JAX's default precision, or `minilib.tpu.numerics`' emulation
  of it on the CPU): both operands of every float32 matmul rounded to 8 significant bits.
  Two right implementations then differ by up to about 0.009: `BF16_PASS_TOLERANCE`, 2e-2.
* bfloat16 inputs and outputs: between 2 and 4 one step of bfloat16 is 2**-6 = 0.0156, so an
  output that rounds the other way is off by that: `BFLOAT16_TOLERANCE`, 2e-2.

A wrong answer (a key missed, a mask off by one, the soft cap applied before the scale) is off
by 0.1 or more, far above all three. `parity_tolerance(dtype)` gives the one that applies
here; `parity_error(out, expected, tolerance=...)` returns max |out - expected|, and raises an
AssertionError when it is over the tolerance or not finite: a wrong answer, not rounding.

    >>> import numpy as np
    >>> tolerance = parity_tolerance()
    >>> error = parity_error(np.array([0.5, 1.0]), np.array([0.5, 1.0 + 1e-6]), tolerance=tolerance)
    >>> f"max |out - expected| = {error:.1e} (tolerance {tolerance:.0e})"
    'max |out - expected| = 1.0e-06 (tolerance ...)'
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from minilib.tpu.numerics import BF16_PASS_TOLERANCE, one_bf16_pass

__all__ = [
    "BF16_PASS_TOLERANCE",
    "BFLOAT16_TOLERANCE",
    "FLOAT32_TOLERANCE",
    "parity_error",
    "parity_tolerance",
]

# Float32 rounding, with room: the course's float32 errors are about 1e-6 on a CPU.
FLOAT32_TOLERANCE = 1e-4
# One bfloat16 step for outputs below 4, where standard-normal values lie.
BFLOAT16_TOLERANCE = 2e-2


def parity_tolerance(dtype=jnp.float32) -> float:
    """The largest max |error| a right attention output (values of size about 1) may have here
    against a float32 reference, when it is computed in `dtype` (float32 or bfloat16): float32
    rounding where float32 matmuls are exact (a CPU), one bfloat16 pass's error where they are
    one bfloat16 pass (a TPU, or `MINILIB_TPU_NUMERICS=1`), a bfloat16 step for bfloat16.

    >>> parity_tolerance(jnp.bfloat16)
    0.02
    >>> parity_tolerance() == (BF16_PASS_TOLERANCE if one_bf16_pass() else FLOAT32_TOLERANCE)
    True
    >>> from minilib.tpu.numerics import emulate_tpu_matmul_precision
    >>> with emulate_tpu_matmul_precision():
    ...     parity_tolerance()
    0.02
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return BFLOAT16_TOLERANCE
    if dtype != jnp.float32:
        raise ValueError(f"parity_tolerance({dtype=}): give float32 or bfloat16")
    return BF16_PASS_TOLERANCE if one_bf16_pass() else FLOAT32_TOLERANCE


def parity_error(out, expected, *, tolerance: float, what: str = "out - expected") -> float:
    """max |out - expected| over all elements, computed in float64. Raises an AssertionError,
    naming `what` and both numbers, when it is over `tolerance` or not finite (NaN or inf in
    `out`): a wrong answer, not rounding.

    out, expected: arrays of one shape, e.g. [num_tokens, num_q_heads, head_dim] (compare the
    live rows of a padded output: JAX's reference returns only those).

    >>> f"{parity_error(np.array([1.0, 2.0]), np.array([1.0, 2.000002]), tolerance=1e-4):.1e}"
    '2.0e-06'
    >>> parity_error(np.array([1.0, 2.0]), np.array([1.0, 2.65]), tolerance=1e-4, what="ours - JAX")
    Traceback (most recent call last):
    AssertionError: max |ours - JAX| = 6.5e-01 > tolerance 1e-04: a wrong answer, not rounding
    """
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    if out.shape != expected.shape:
        raise AssertionError(
            f"{what}: shapes differ, {out.shape} and {expected.shape} (JAX's reference returns "
            f"only the live rows: compare out[:num_tokens])"
        )
    error = float(np.max(np.abs(out - expected)))
    if not np.isfinite(error):
        raise AssertionError(
            f"max |{what}| = {error}: the answer holds NaN or inf, a wrong answer, not rounding"
        )
    if error > tolerance:
        raise AssertionError(
            f"max |{what}| = {error:.1e} > tolerance {tolerance:.0e}: a wrong answer, not rounding"
        )
    return error
