"""The first Pallas kernels, run in interpret mode: vector add, and attention over K/V that jnp
gathered. Parity with JAX's reference on NaN-padded batches, one compile per shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches_jax

from minilib.batch import make_batch
from minilib.pallas_basics import (
    _rpa_pallas_basic,
    add_vectors,
    q_by_sequence,
    ragged_paged_attention_pallas_basic,
)

# The lengths of tests/test_blockwise.py and tests/test_attention.py.
DECODE = [(1, 17), (1, 5), (1, 40), (1, 1)]
PREFILL = [(9, 9), (23, 23), (1, 1)]
MIXED = [(1, 30), (12, 12), (0, 7), (5, 33), (1, 64)]


def case_batch(seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, **kwargs):
    return make_batch(
        seq_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_num_batched_tokens=sum(q for q, _ in seq_lens) + 5,
        max_num_seqs=len(seq_lens) + 2,
        **kwargs,
    )


def assert_pallas_matches_jax(batch, num_queries_per_block=None, **options):
    blocks = (
        {} if num_queries_per_block is None else {"num_queries_per_block": num_queries_per_block}
    )
    fn = lambda *args, **kw: ragged_paged_attention_pallas_basic(*args, **kw, **blocks)
    err = assert_matches_jax(fn, batch, **options)
    out = np.asarray(fn(*batch.args(), **options), np.float32)
    np.testing.assert_array_equal(out[batch.num_tokens :], 0.0)  # padding rows are zero
    return err


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
    "case",
    [
        (MIXED, 8, 2, 64, 8, {"sliding_window": 6, "num_queries_per_block": 5}),
        (DECODE, 4, 1, 128, 32, {"sliding_window": 9, "soft_cap": 5.0}),
        (PREFILL, 4, 4, 64, 16, {"num_queries_per_block": 16}),
    ],
    ids=["gqa4-mixed-sliding", "mqa-decode-softcap", "mha-prefill"],
)
def test_matches_jax_reference(case):
    *shape, options = case
    assert_pallas_matches_jax(case_batch(*shape), **options)


def test_bf16_q_and_fp8_kv():
    batch = case_batch(MIXED, 8, 2, 64, 8, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)
    assert_pallas_matches_jax(batch, sm_scale=0.125, k_scale=0.5, v_scale=2.0)


def test_compiles_once_and_accepts_traced_num_seqs():
    shapes = dict(max_num_batched_tokens=24, max_num_seqs=4, pages_per_seq=5, total_num_pages=24)
    first = make_batch([(1, 30), (12, 12)], page_size=8, seed=1, **shapes)
    second = make_batch([(5, 9), (1, 3), (0, 4)], page_size=8, seed=2, **shapes)
    ragged_paged_attention_pallas_basic(*first.args())
    compiled = _rpa_pallas_basic._cache_size()
    eager = ragged_paged_attention_pallas_basic(*second.args())
    assert _rpa_pallas_basic._cache_size() == compiled
    # Under an outer jit num_seqs is a tracer; with 1 live sequence, the others' rows are 0.
    jitted = jax.jit(ragged_paged_attention_pallas_basic)
    one = jitted(*second.args()[:-1], jnp.array([1], jnp.int32))
    np.testing.assert_allclose(np.asarray(one[:5]), np.asarray(eager[:5]), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(one[5:]), 0.0)
