"""What every attention implementation promises, checked the same way for each: bf16 q, fp8 KV
with scales, an empty batch, zero padding rows, one compile for all lengths and live counts,
and a traced `num_seqs`.

Each implementation's own file tests what only it has (block windows, DMAs, races, memory).
"""

from __future__ import annotations

import dataclasses
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
    assert_close,
    assert_matches_jax,
    assert_output_matches_jax,
    jax_reference_jitted,
    one_case_per_path,
    padded_batch,
)

from minilib import make_batch
from minilib.blockwise import _rpa_blockwise
from minilib.kernel import rpa_jit
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
    "kernel": rpa_jit,
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
def test_docstring_says_fp8_without_scales_is_scale_one(name):
    """Nothing warns when an fp8 cache comes without k_scale and v_scale (JAX's kernel takes
    it too), so every public entry point says so where a learner reads."""
    doc = " ".join(IMPLEMENTATIONS[name].__doc__.split())
    assert "fp8 `kv_pages`" in doc and "taken as scale 1, with no error or warning" in doc


@pytest.mark.parametrize("name", ["reference", "jnp", "blockwise"])
def test_fp8_kv_without_scales_is_read_as_scale_one(name):
    """What those docstrings say: no scales is scale 1. (Not JAX's reference without scales,
    which then also rounds the softmax probabilities and P·V's output to fp8, V's dtype:
    test_fp8_without_scales.py.)"""
    fn = implementation(name)
    batch = padded_batch(MIXED, num_q_heads=4, num_kv_heads=2, page_size=8,
                         kv_dtype=jnp.float8_e4m3fn)  # fmt: skip
    unscaled = np.asarray(fn(*batch.args(), sm_scale=0.125))
    ones = fn(*batch.args(), sm_scale=0.125, k_scale=1.0, v_scale=1.0)
    np.testing.assert_array_equal(unscaled, np.asarray(ones))
    assert_output_matches_jax(ones, batch, sm_scale=0.125, k_scale=1.0, v_scale=1.0)


EMPTY_BATCHES = {
    "no live sequence": dict(seq_lens=[], max_num_seqs=3, max_num_batched_tokens=8,
                             pages_per_seq=4),
    # Live but idle sequences, in the smallest q: 1 row. (3 page columns: HARDER's block.)
    "idle sequences, 1 q row": dict(seq_lens=[(0, 0), (0, 3)], page_size=4, pages_per_seq=3),
}  # fmt: skip


@pytest.mark.parametrize("empty", EMPTY_BATCHES)
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_empty_batch_gives_zeros(name, empty):
    """A step with nothing to attend (zero-size axes are refused: test_validation)."""
    fn = implementation(name)
    batch = make_batch(**EMPTY_BATCHES[empty])
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


@functools.cache
def poisoned_batch(poison: str):
    """A NaN-padded MIXED batch with one bad value in live data, in sequence 3 (a chunk of 5 q
    rows, 13 to 17, at positions 28 to 32 of 33): a NaN in the key at position 10 of KV head 0,
    which every row of the chunk sees; a NaN in q head 0 of row 15; or a key 10 and a q row 16
    so large that their score overflows to inf. Returns the batch and JAX's reference output.

    (The key is one every row sees: JAX's reference *adds* mask_value to a hidden score, so a
    NaN key poisons even the rows that cannot see it; ours replace hidden scores, and the
    blocked versions skip the KV blocks no row of a q block sees.)"""
    batch = padded_batch(MIXED, num_q_heads=4, num_kv_heads=2, page_size=4)
    q, kv_pages = np.array(batch.q), np.array(batch.kv_pages)
    page, slot = int(batch.page_indices[3, 10 // 4]), 10 % 4  # key 10 of sequence 3
    if poison == "NaN in K":
        kv_pages[page, slot, 0, 0] = np.nan  # combined head 0: K of KV head 0
    elif poison == "NaN in q":
        q[15, 0, 0] = np.nan
    else:  # "overflowing score": 1e30 * 1e30 is inf in float32
        kv_pages[page, slot, 0, :] = 1e30
        q[16, 0, :] = 1e30
    batch = dataclasses.replace(batch, q=jnp.asarray(q), kv_pages=jnp.asarray(kv_pages))
    return batch, np.asarray(jax_reference_jitted(batch), np.float32)


@pytest.mark.parametrize("poison", ["NaN in K", "NaN in q", "overflowing score"])
@pytest.mark.parametrize("name", ["reference", "jnp", "blockwise"])
def test_nan_in_live_data_gives_nan_where_jax_does(name, poison):
    """A NaN in live data, or an overflowing score, comes out NaN in the rows where JAX's
    reference gives NaN, and nowhere else: never a silent 0, and the NaN padding of the batch
    still does not leak. (The online softmax of the blockwise version used to turn it into 0.)"""
    batch, expected = poisoned_batch(poison)  # and JAX's reference output, computed once
    n = batch.num_tokens
    out = np.asarray(implementation(name)(*batch.args()), np.float32)
    nan = np.isnan(expected)
    assert nan.any() and not nan.all(), "the bad value must poison some rows, not all"
    np.testing.assert_array_equal(np.isnan(out[:n]), nan)
    assert_close(out[:n][~nan], expected[~nan], batch.q.dtype)
    np.testing.assert_array_equal(out[n:], 0.0, err_msg="rows past cu_q_lens[num_seqs]")
