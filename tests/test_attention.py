"""Parity of minilib's reference and vectorized attention with JAX's own reference.

Every batch comes from `make_batch`, so every unused page slot, unused page and q padding row
holds NaN, and the padding sequence slots hold garbage: any leak shows up as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_matches_jax, property_test
from hypothesis import strategies as st

import minilib
from minilib import make_batch, ragged_paged_attention_jnp, ref_ragged_paged_attention
from minilib.vectorized import _rpa_jnp

IMPLEMENTATIONS = [ref_ragged_paged_attention, ragged_paged_attention_jnp]

DECODE = [(1, 17), (1, 5), (1, 40), (1, 1)]
PREFILL = [(9, 9), (23, 23), (1, 1)]
MIXED = [(1, 30), (12, 12), (0, 7), (5, 33), (1, 64)]

# (name, seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, options)
CASES = [
    ("mha", MIXED, 4, 4, 64, 16, {}),
    ("gqa2", MIXED, 8, 4, 64, 8, {}),
    ("gqa4", MIXED, 8, 2, 128, 4, {}),
    ("gqa8", MIXED, 8, 1, 64, 16, {}),  # 8 q heads on 1 kv head is also MQA
    ("mqa", DECODE, 4, 1, 128, 32, {}),
    ("gqa8-16", PREFILL, 16, 2, 64, 2, {}),
    ("page1", MIXED, 4, 2, 64, 1, {}),
    ("decode", DECODE, 8, 2, 128, 16, {}),
    ("prefill", PREFILL, 8, 2, 64, 8, {}),
    ("sliding", MIXED, 8, 2, 64, 4, {"sliding_window": 6}),
    ("softcap", MIXED, 8, 2, 64, 8, {"soft_cap": 2.0, "sm_scale": 0.5}),
    ("mask", MIXED, 4, 2, 64, 8, {"mask_value": -1e4}),
    ("all", MIXED, 8, 4, 128, 16, {"sliding_window": 9, "soft_cap": 5.0, "sm_scale": 0.1}),
]


# Our reference compiles once per sequence shape, like JAX's: run it on a representative subset
# in the fast suite, and on every case in the slow one.
REFERENCE_SUBSET = {"mha", "gqa4", "mqa", "page1", "sliding", "softcap"}
PARAMS = [
    pytest.param(fn, case, id=f"{case[0]}-{fn.__name__}", marks=marks)
    for case in CASES
    for fn in IMPLEMENTATIONS
    for marks in [
        [pytest.mark.slow]
        if fn is ref_ragged_paged_attention and case[0] not in REFERENCE_SUBSET
        else []
    ]
]


@pytest.mark.parametrize("fn, case", PARAMS)
def test_matches_jax_reference(fn, case):
    _, seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, options = case
    batch = make_batch(
        seq_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_num_batched_tokens=sum(q for q, _ in seq_lens) + 5,
        max_num_seqs=len(seq_lens) + 2,
    )
    assert_matches_jax(fn, batch, **options)


@pytest.mark.parametrize("fn", IMPLEMENTATIONS, ids=lambda f: f.__name__)
def test_bf16(fn):
    batch = make_batch(MIXED, num_q_heads=8, num_kv_heads=2, dtype=jnp.bfloat16, page_size=8)
    assert_matches_jax(fn, batch, sm_scale=0.125)


@pytest.mark.parametrize("fn", IMPLEMENTATIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_kv_with_scales(fn, dtype):
    batch = make_batch(
        MIXED, num_q_heads=8, num_kv_heads=2, dtype=dtype, kv_dtype=jnp.float8_e4m3fn
    )
    assert batch.kv_pages.dtype == jnp.float8_e4m3fn
    assert_matches_jax(fn, batch, sm_scale=0.125, k_scale=0.5, v_scale=2.0)


@pytest.mark.parametrize("fn", IMPLEMENTATIONS, ids=lambda f: f.__name__)
def test_empty_batch_gives_zeros(fn):
    batch = make_batch([], max_num_seqs=3, max_num_batched_tokens=4)
    out = fn(*batch.args())
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("fn", IMPLEMENTATIONS, ids=lambda f: f.__name__)
def test_padding_rows_are_zero(fn):
    batch = make_batch(MIXED, max_num_batched_tokens=40, max_num_seqs=8)
    out = np.asarray(fn(*batch.args()))
    np.testing.assert_array_equal(out[batch.num_tokens :], 0.0)


def test_padding_pages_really_are_read_as_nan_when_not_masked():
    """The NaN padding is a real trap: reading a whole last page without masking leaks."""
    batch = make_batch([(1, 3)], page_size=8)  # 5 NaN slots in the last page
    k_pages, _ = minilib.split_kv_pages(batch.kv_pages)
    whole_page = k_pages[batch.page_indices[0, 0]]
    assert np.isnan(np.asarray(whole_page)).any()


def test_causal_offset_matters():
    """The same q rows attend differently with more cached tokens before them."""
    a = make_batch([(4, 4)], seed=1)
    out = np.asarray(ragged_paged_attention_jnp(*a.args()))
    # Row 0 of a prefill sees only key 0, so its output is V[0] of its KV head.
    _, v_pages = minilib.split_kv_pages(a.kv_pages)
    v0 = np.asarray(v_pages[a.page_indices[0, 0], 0])  # [num_kv_heads, head_dim]
    group = a.q.shape[1] // v0.shape[0]
    np.testing.assert_allclose(out[0], np.repeat(v0, group, axis=0), rtol=1e-6)


def test_jnp_compiles_once_for_new_lengths_and_num_seqs():
    shapes = dict(max_num_batched_tokens=48, max_num_seqs=6, pages_per_seq=6, total_num_pages=40)
    first = make_batch([(1, 30), (12, 12)], seed=1, **shapes)
    second = make_batch([(5, 9), (1, 3), (20, 41), (0, 4)], seed=2, **shapes)
    ragged_paged_attention_jnp(*first.args())
    compiled = _rpa_jnp._cache_size()
    ragged_paged_attention_jnp(*second.args())
    assert _rpa_jnp._cache_size() == compiled


def test_jnp_accepts_traced_num_seqs():
    batch = make_batch(MIXED, max_num_seqs=7, max_num_batched_tokens=60)
    jitted = jax.jit(lambda *args: ragged_paged_attention_jnp(*args, sm_scale=0.3))
    eager = ragged_paged_attention_jnp(*batch.args(), sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(jitted(*batch.args())), np.asarray(eager), atol=1e-6)


@st.composite
def random_batches(draw):
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    page_size = draw(st.sampled_from([1, 3, 8, 16]))
    n = draw(st.integers(0, 5))
    seq_lens = []
    for _ in range(n):
        kv_len = draw(st.integers(0, 40))
        seq_lens.append((draw(st.integers(0, kv_len)), kv_len))
    options = {}
    if draw(st.booleans()):
        options["sliding_window"] = draw(st.integers(1, 12))
    if draw(st.booleans()):
        options["soft_cap"] = draw(st.floats(0.5, 30.0))
    batch = make_batch(
        seq_lens,
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        page_size=page_size,
        max_num_batched_tokens=draw(st.integers(1, 8)) + sum(q for q, _ in seq_lens),
        max_num_seqs=n + draw(st.integers(0, 2)) or 1,
        seed=draw(st.integers(0, 2**16)),
    )
    return batch, options


def check_jnp_matches_jax_reference(batch_and_options):
    batch, options = batch_and_options
    assert_matches_jax(ragged_paged_attention_jnp, batch, sm_scale=0.2, **options)


def check_reference_matches_jnp(batch_and_options):
    batch, options = batch_and_options
    ours = ref_ragged_paged_attention(*batch.args(), **options)
    fast = ragged_paged_attention_jnp(*batch.args(), **options)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(fast), atol=2e-5)


# Each example compiles a JAX reference for new shapes, so the fast suite keeps a few examples
# and the slow suite (pytest -m slow) runs many.
test_property_jnp_matches_jax_reference = property_test(
    check_jnp_matches_jax_reference, random_batches(), 12
)
test_property_reference_matches_jnp = property_test(
    check_reference_matches_jnp, random_batches(), 5
)
test_property_jnp_matches_jax_reference_sweep = pytest.mark.slow(
    property_test(check_jnp_matches_jax_reference, random_batches(), 200)
)
test_property_reference_matches_jnp_sweep = pytest.mark.slow(
    property_test(check_reference_matches_jnp, random_batches(), 100)
)
