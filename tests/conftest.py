"""Shared test helpers: compare any attention function with JAX's own reference."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    ref_ragged_paged_attention as jax_reference,
)

from minilib.batch import RaggedBatch

os.environ.setdefault("MPLBACKEND", "Agg")

# Absolute tolerance by the dtype of q (the compute dtype).
TOLERANCE = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 3e-2}


def assert_matches_jax(fn, batch: RaggedBatch, **options) -> float:
    """Run `fn` and JAX's reference on `batch`; check the live rows agree and the padding rows
    are finite. Returns the max abs error."""
    out = fn(*batch.args(), **options)
    if batch.seq_lens:
        expected = jax_reference_jitted(batch, **options)
    else:  # JAX's reference cannot concatenate zero sequences
        expected = jnp.zeros((0, *batch.q.shape[1:]), batch.q.dtype)
    n = batch.num_tokens
    assert out.shape == batch.q.shape
    assert out.dtype == batch.q.dtype
    got = np.asarray(out[:n], np.float32)
    want = np.asarray(expected, np.float32)
    assert np.isfinite(want).all(), "the reference itself produced NaN: bad test batch"
    assert np.isfinite(np.asarray(out, np.float32)).all(), "NaN/inf leaked into the output"
    err = float(np.max(np.abs(got - want))) if n else 0.0
    assert err <= TOLERANCE[jnp.dtype(batch.q.dtype)], f"max abs error {err}"
    return err


def jax_reference_jitted(batch: RaggedBatch, **options):
    """JAX's reference, traced once as a whole under jit with the lengths as constants.

    JAX's reference loops over sequences in Python; called eagerly it compiles every op for
    every sequence shape (seconds per batch). Under jit the loop unrolls into one program.
    """
    lengths = [np.asarray(a) for a in batch.args()[2:]]
    fn = jax.jit(lambda q, kv_pages: jax_reference(q, kv_pages, *lengths, **options))
    return fn(batch.q, batch.kv_pages)


def property_test(check, strategy, max_examples: int):
    """`check` as a hypothesis test over examples drawn from `strategy`, with this many
    examples and no deadline (each new shape compiles)."""
    relaxed = settings(
        max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    return relaxed(given(strategy)(check))
