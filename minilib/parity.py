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
`float64_attention` is the formula itself, in float64 from the inputs' exact values: what no
implementation's rounding touches, and what a rounding named on purpose (`probs_dtype`,
`out_dtype`) adds to it.

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
    "float64_attention",
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


def float64_attention(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float = 1.0,
    probs_dtype=None,
    out_dtype=None,
) -> np.ndarray:  # float64[num_tokens, num_q_heads, head_dim]: the live rows only
    """Causal ragged paged attention in NumPy float64, from q and K/V upcast exactly (every
    bfloat16 and fp8 value is a float64 value), with no scale (fp8 read as stored). Nothing
    is rounded but float64's own 2**-53, unless asked: `probs_dtype` rounds the softmax
    probabilities to that dtype (by way of float32) before P·V, `out_dtype` the output after
    it. Either may be a tuple of dtypes, rounded to in turn: `(jnp.float16, jnp.float8_e5m2)`
    rounds twice, as some XLA versions convert float32 to fp8. No sliding window, soft cap or
    sink.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(2, 2), (1, 5)], head_dim=8, page_size=4, kv_dtype=jnp.float8_e4m3fn)
    >>> exact = float64_attention(*b.args(), sm_scale=0.3)
    >>> exact.shape, exact.dtype
    ((3, 4, 8), dtype('float64'))
    >>> rounded = float64_attention(*b.args(), sm_scale=0.3, out_dtype=jnp.float8_e4m3fn)
    >>> bool(np.all(rounded == np.asarray(exact, np.float32).astype(jnp.float8_e4m3fn)))
    True
    """
    probs_dtypes = _dtypes("probs_dtype", probs_dtype)
    out_dtypes = _dtypes("out_dtype", out_dtype)
    q = _as_float64(q)
    kv = _as_float64(kv_pages)
    cu_q_lens, kv_lens, page_indices = (np.asarray(a) for a in (cu_q_lens, kv_lens, page_indices))
    outputs = []
    for s in range(int(np.asarray(num_seqs)[0])):
        seq_q = q[cu_q_lens[s] : cu_q_lens[s + 1]]  # [q_len, num_q_heads, head_dim]
        pages = page_indices[s, : -(-kv_lens[s] // kv.shape[1])]  # the pages it uses
        tokens = kv[pages].reshape(-1, *kv.shape[2:])[: kv_lens[s]]
        k, v = tokens[:, 0::2], tokens[:, 1::2]  # [kv_len, num_kv_heads, head_dim]
        probs = _float64_probs(seq_q, k, sm_scale)  # [num_q_heads, q_len, kv_len]
        probs = _rounded(probs, probs_dtypes)
        group = q.shape[1] // k.shape[1]
        out = np.einsum("hqk,khd->qhd", probs, np.repeat(v, group, axis=1))
        outputs.append(_rounded(out, out_dtypes))
    return np.concatenate(outputs) if outputs else np.zeros((0, *q.shape[1:]))


def _float64_probs(q, k, sm_scale: float):  # q [q_len, heads, d], k [kv_len, kv_heads, d]
    """Softmax of the causal scores q . k * sm_scale: [num_q_heads, q_len, kv_len]."""
    q_len, kv_len = q.shape[0], k.shape[0]
    k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * sm_scale
    q_pos = kv_len - q_len + np.arange(q_len)[:, None]  # the new rows are the last tokens
    scores = np.where(q_pos >= np.arange(kv_len)[None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def _as_float64(x) -> np.ndarray:
    """x's values in float64, exactly (by way of float32, which holds every bf16 and fp8)."""
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def _dtypes(name: str, dtype) -> tuple:
    """`dtype` as a tuple of float dtypes: () for None, (dtype,) for one."""
    if dtype is None:
        return ()
    dtypes = tuple(dtype) if isinstance(dtype, (tuple, list)) else (dtype,)
    for d in dtypes:
        if not jnp.issubdtype(d, jnp.floating):
            raise ValueError(
                f"float64_attention({name}={dtype!r}): give a float dtype, a tuple of them or None"
            )
    return dtypes


def _rounded(x: np.ndarray, dtypes: tuple) -> np.ndarray:
    """x rounded by way of float32 to each of `dtypes` in turn, back in float64."""
    for dtype in dtypes:
        x = _as_float64(np.asarray(x, np.float32).astype(dtype))
    return x
