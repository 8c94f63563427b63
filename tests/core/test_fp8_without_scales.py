"""An fp8 KV cache without k_scale and v_scale, against the formula in float64.

minilib reads such a cache as scale 1, and its outputs are within `parity_tolerance` of the
formula computed in float64 from the stored values (`float64_attention`). JAX's reference
(`jax_reference`, no scales) is about 0.2 away (0.3-0.4 for e5m2), and the tests below pin
down why: without scales it leaves K and V in fp8, so its softmax probabilities are cast to
V's dtype, fp8, and its P·V, a product of two fp8 arrays, gives an fp8 result. Those two
roundings, and nothing else, make its output: it is the float64 formula with the probabilities
rounded to fp8 and the output rounded to fp8 (bit for bit on jax 0.12's CPU, the output by way
of float16, as its XLA converts the float32 result of an fp8 matmul; within two fp8 steps at
under 1% of the outputs on jax 0.7.2's). With k_scale = v_scale = 1 JAX's reference
casts K and V to q's dtype first, and is as close to float64 as ours.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import IMPLEMENTATIONS, INTERPRET, jax_reference_jitted

from minilib import make_batch
from minilib.parity import float64_attention, parity_error, parity_tolerance

FP8_TYPES = [pytest.param(t, id=jnp.dtype(t).name) for t in (jnp.float8_e4m3fn, jnp.float8_e5m2)]
Q_DTYPES = [pytest.param(t, id=jnp.dtype(t).name) for t in (jnp.float32, jnp.bfloat16)]
# A prefill, a decode over three pages, a chunk and a longer chunk: 25 q rows, GQA.
SEQ_LENS = [(5, 5), (1, 33), (3, 10), (16, 40)]
SM_SCALE = 128**-0.5
# JAX's reference without scales is at least this far from float64 on these batches (0.19 to
# 0.39 measured): ten times any parity tolerance, so the two cannot be confused.
FAR = 0.1


def fp8_batch(q_dtype, kv_dtype):
    return make_batch(
        SEQ_LENS,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=16,
        dtype=q_dtype,
        kv_dtype=kv_dtype,
        max_num_batched_tokens=32,
    )


def as_float64(x) -> np.ndarray:
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def rounded(x, dtype) -> np.ndarray:
    """x rounded to `dtype` (from float32), back in float64."""
    return as_float64(np.asarray(x, np.float32).astype(dtype))


@pytest.mark.parametrize("kv_dtype", FP8_TYPES)
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("name", ["kernel", "jnp", "reference"])
def test_ours_is_the_float64_formula_up_to_rounding(name, q_dtype, kv_dtype):
    """Ours within `parity_tolerance(q's dtype)` of float64: 1e-4 for float32 q (about 1e-6
    measured), a bfloat16 step for bfloat16 q (about 0.01 measured)."""
    batch = fp8_batch(q_dtype, kv_dtype)
    options = dict(interpret=INTERPRET) if name == "kernel" else {}
    out = IMPLEMENTATIONS[name](*batch.args(), sm_scale=SM_SCALE, **options)
    exact = float64_attention(*batch.args(), sm_scale=SM_SCALE)
    tolerance = parity_tolerance(q_dtype)
    parity_error(
        as_float64(out[: batch.num_tokens]), exact, tolerance=tolerance, what=f"{name} - float64"
    )


@pytest.mark.parametrize("kv_dtype", FP8_TYPES)
def test_jax_reference_rounds_probabilities_and_output_to_fp8(kv_dtype):
    """JAX's reference without scales is far from float64, and is float64 with its
    probabilities rounded to fp8 and its output rounded to fp8 (then to q's dtype): equal at
    99% of the outputs or more, and at most two fp8 steps of the output away elsewhere, where
    a probability or an output near halfway between two fp8 values went the other way. How
    XLA converts float32 to fp8 decides those: directly, or through float16 first (`routes`).
    On jax 0.12's CPU one route (the probabilities directly, the output through float16)
    replays it bit for bit; jax 0.7.2's differs from the nearest route at 0.4-0.6% of the
    outputs, by one or two steps (measured). Either
    rounding alone is far, and equal at 70% of the outputs or fewer. (bfloat16 q: its matmuls
    take no float32 operand, so TPU numerics' emulation changes nothing here.)"""
    batch = fp8_batch(jnp.bfloat16, kv_dtype)
    jax_out = as_float64(jax_reference_jitted(batch, sm_scale=SM_SCALE))
    exact = float64_attention(*batch.args(), sm_scale=SM_SCALE)
    assert np.max(np.abs(jax_out - exact)) > FAR
    routes = [kv_dtype, (jnp.float16, kv_dtype)]  # directly, or through float16

    def formula(probs_dtype, out_dtype):  # float64 with these roundings, as q's dtype
        out = float64_attention(
            *batch.args(), sm_scale=SM_SCALE, probs_dtype=probs_dtype, out_dtype=out_dtype
        )
        return rounded(out, jnp.bfloat16)

    both = [formula(p, o) for p, o in itertools.product(routes, routes)]
    best = max(both, key=lambda replay: np.mean(replay == jax_out))
    assert np.mean(best == jax_out) >= 0.99
    steps = np.abs(best - jax_out) / fp8_step(np.maximum(abs(best), abs(jax_out)), kv_dtype)
    assert np.max(steps) <= 2
    for route in routes:
        for alone in (formula(route, None), formula(None, route)):
            assert np.mean(alone == jax_out) <= 0.7
            assert np.max(np.abs(alone - jax_out)) > FAR / 2


def fp8_step(magnitude, fp8_dtype):
    """The spacing of `fp8_dtype`'s values at each `magnitude` (its smallest normal's below)."""
    info = jnp.finfo(fp8_dtype)
    exponent = np.floor(np.log2(np.maximum(magnitude, float(info.smallest_normal))))
    return 2.0 ** (exponent - info.nmant)


@pytest.mark.parametrize("kv_dtype", FP8_TYPES)
def test_jax_reference_with_scales_of_one_is_the_float64_formula(kv_dtype):
    """Given k_scale = v_scale = 1, JAX's reference casts K and V to q's dtype before the
    matmuls, and is as close to float64 as ours: the fp8 roundings come from leaving the scales
    out, not from the values."""
    batch = fp8_batch(jnp.bfloat16, kv_dtype)
    jax_out = jax_reference_jitted(batch, sm_scale=SM_SCALE, k_scale=1.0, v_scale=1.0)
    exact = float64_attention(*batch.args(), sm_scale=SM_SCALE)
    parity_error(
        as_float64(jax_out),
        exact,
        tolerance=parity_tolerance(jnp.bfloat16),
        what="JAX's reference with scales 1 - float64",
    )
