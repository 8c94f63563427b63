"""What every attention implementation promises, checked the same way for each: bf16 q, fp8 KV
with scales, an empty batch, zero padding rows, one compile for all lengths and live counts,
and a traced `num_seqs`.

Each implementation's own file tests what only it has (block windows, DMAs, races, memory).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    DTYPES,
    IMPLEMENTATIONS,
    INTERPRET,
    MIXED,
    assert_matches_jax,
    assert_output_matches_jax,
    one_case_per_path,
    padded_batch,
)

from minilib import make_batch
from minilib.blockwise import _rpa_blockwise
from minilib.kernel import _rpa_jit
from minilib.pallas_basics import _rpa_pallas_basic
from minilib.vectorized import _rpa_jnp

# Options that make the checks below harder for some implementations.
HARDER = {
    # 3 KV pages per block do not divide pages_per_seq: the last block is partly past the table.
    "blockwise": dict(num_kv_pages_per_block=3),
    "kernel": dict(interpret=INTERPRET),  # scratch memory starts NaN
}
# The jitted core of each implementation, whose compiles we count. Our reference has none: it
# loops over sequences in Python, like JAX's, and compiles per sequence shape.
JITTED_CORES = {
    "jnp": _rpa_jnp,
    "blockwise": _rpa_blockwise,
    "pallas_basic": _rpa_pallas_basic,
    "kernel": _rpa_jit,
}


def implementation(name):
    return functools.partial(IMPLEMENTATIONS[name], **HARDER.get(name, {}))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_bf16(name):
    fn = implementation(name)
    batch = padded_batch(MIXED, num_q_heads=8, num_kv_heads=2, page_size=8, dtype=jnp.bfloat16)
    assert_matches_jax(fn, batch, sm_scale=0.125)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", one_case_per_path(
    [pytest.param(d, id=jnp.dtype(d).name) for d in DTYPES], "bfloat16"))  # fmt: skip
def test_fp8_kv_with_scales(name, dtype):
    fn = implementation(name)
    batch = padded_batch(
        MIXED, num_q_heads=8, num_kv_heads=2, page_size=8, dtype=dtype,
        kv_dtype=jnp.float8_e4m3fn,
    )  # fmt: skip
    assert batch.kv_pages.dtype == jnp.float8_e4m3fn
    assert_matches_jax(fn, batch, sm_scale=0.125, k_scale=0.5, v_scale=2.0)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_empty_batch_gives_zeros(name):
    fn = implementation(name)
    batch = make_batch([], max_num_seqs=3, max_num_batched_tokens=8, pages_per_seq=4)
    out = fn(*batch.args())
    assert out.shape == batch.q.shape
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_padding_rows_are_zero(name):
    fn = implementation(name)
    batch = make_batch(MIXED, max_num_batched_tokens=40, max_num_seqs=8)
    out = np.asarray(fn(*batch.args()))
    assert batch.num_tokens < len(out)
    np.testing.assert_array_equal(out[batch.num_tokens :], 0.0)


@pytest.mark.parametrize("name", JITTED_CORES)
def test_compiles_once_for_new_lengths_and_num_seqs(name):
    fn, core = implementation(name), JITTED_CORES[name]
    shapes = dict(max_num_batched_tokens=48, max_num_seqs=6, pages_per_seq=6, total_num_pages=40)
    first = make_batch([(1, 30), (12, 12)], seed=1, **shapes)
    second = make_batch([(5, 9), (1, 3), (20, 41), (0, 4)], seed=2, **shapes)
    fn(*first.args())
    compiled = core._cache_size()  # private, but in every jax version we support
    out = fn(*second.args())
    assert core._cache_size() == compiled
    assert_output_matches_jax(out, second)


@pytest.mark.parametrize("name", JITTED_CORES)
def test_accepts_traced_num_seqs(name):
    fn = implementation(name)
    batch = make_batch(MIXED, max_num_seqs=7, max_num_batched_tokens=60)
    eager = fn(*batch.args(), sm_scale=0.3)
    jitted = jax.jit(lambda *args: fn(*args, sm_scale=0.3))
    # The same program traced twice: only the order of float operations may differ.
    np.testing.assert_allclose(np.asarray(jitted(*batch.args())), np.asarray(eager), atol=1e-6)
    # Fewer live sequences, same compile: the rows of the dropped ones come out zero.
    fewer = jitted(*batch.args()[:-1], jnp.array([2], jnp.int32))
    rows = MIXED[0][0] + MIXED[1][0]
    np.testing.assert_allclose(np.asarray(fewer[:rows]), np.asarray(eager[:rows]), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(fewer[rows:]), 0.0)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "mask_value",  # every stack: -5.0, a small mask value, which leaves masked keys a weight
    one_case_per_path([pytest.param(v, id=str(v)) for v in (-1.0, -5.0, -40.0, None)], "-5.0"),
)
def test_mask_value_means_what_jax_means(name, mask_value):
    """JAX adds mask_value to the masked scores; a small one leaves the masked keys a weight.
    A prefill split into q blocks (whose later KV blocks the kernel may skip), a chunk, and a
    sliding window, on a NaN-padded batch: every implementation equals JAX's reference."""
    fn = implementation(name)
    batch = padded_batch([(20, 20), (6, 30), (1, 17)], num_q_heads=4, num_kv_heads=2,
                         page_size=4)  # fmt: skip
    blocks = dict(num_queries_per_block=8, num_kv_pages_per_block=2)
    options = {**blocks} if name in ("blockwise", "kernel") else {}
    for window in (None, 6):
        assert_matches_jax(fn, batch, sm_scale=0.3, mask_value=mask_value,
                           sliding_window=window, **options)  # fmt: skip
