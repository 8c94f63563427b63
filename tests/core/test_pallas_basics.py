"""The first Pallas kernels, run in interpret mode: vector add, and attention over K/V that jnp
gathered. Parity with JAX's reference on NaN-padded batches (one compile per shape, bf16 and
fp8: tests/core/test_implementations.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches_jax, case_batch

from minilib.pallas_basics import add_vectors, q_by_sequence, ragged_paged_attention_pallas_basic


def test_add_vectors():
    x = jnp.arange(256, dtype=jnp.float32)
    y = jnp.linspace(-1.0, 1.0, 256)
    np.testing.assert_array_equal(np.asarray(add_vectors(x, y, block_size=32)), x + y)


def test_add_vectors_explains_a_bad_block_size():
    with pytest.raises(ValueError, match=r"n=100 must be a multiple of block_size=32"):
        add_vectors(jnp.zeros(100), jnp.zeros(100), block_size=32)


def test_q_by_sequence_unpacks_rows_and_zeroes_the_rest():
    q = jnp.arange(6.0).reshape(6, 1, 1)
    q_seq = q_by_sequence(q, jnp.array([0, 2, 0]), jnp.array([2, 3, 0]), 4)
    assert q_seq[:, :, 0, 0].tolist() == [[0, 1, 0, 0], [2, 3, 4, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize(
    "name, blocks",
    [
        ("sliding-page8", {"num_queries_per_block": 5}),
        ("mqa-sliding-softcap", {}),
        ("mha-prefill", {"num_queries_per_block": 16}),
    ],
    ids=["gqa4-mixed-sliding", "mqa-decode-softcap", "mha-prefill"],
)
def test_matches_jax_reference(name, blocks):
    batch, options = case_batch(name)
    assert_matches_jax(ragged_paged_attention_pallas_basic, batch, **options, **blocks)
