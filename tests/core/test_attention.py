"""Parity of minilib's reference and vectorized attention with JAX's own reference, on every
shared case (what every implementation promises is in tests/core/test_implementations.py).

Every batch comes from `make_batch`, so every unused page slot, unused page and q padding row
holds NaN, and the padding sequence slots hold garbage: any leak shows up as NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    CASES,
    assert_close,
    assert_matches_jax,
    case_batch,
    one_case_per_path,
    property_tests,
    random_batches,
)

import minilib
from minilib import make_batch, ragged_paged_attention_jnp, ref_ragged_paged_attention

IMPLEMENTATIONS = [ref_ragged_paged_attention, ragged_paged_attention_jnp]

# Our reference compiles once per sequence shape, like JAX's: run it on a representative subset
# in the fast suite, and on every case in the slow one.
REFERENCE_SUBSET = {"mha", "gqa4-hd128", "mqa", "page1", "sliding", "softcap"}
PARAMS = [
    pytest.param(fn, name, id=f"{name}-{fn.__name__}", marks=marks)
    for name in CASES
    for fn in IMPLEMENTATIONS
    for marks in [
        [pytest.mark.slow]
        if fn is ref_ragged_paged_attention and name not in REFERENCE_SUBSET
        else []
    ]
]
# Every stack runs one case per implementation: the one with every option.
PARAMS = one_case_per_path(PARAMS, "sliding-ref_ragged_paged_attention",
                           "all-ragged_paged_attention_jnp")  # fmt: skip


@pytest.mark.parametrize("fn, name", PARAMS)
def test_matches_jax_reference(fn, name):
    batch, options = case_batch(name)
    assert_matches_jax(fn, batch, **options)


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


def check_jnp_matches_jax_reference(batch_and_options):
    batch, options = batch_and_options
    assert_matches_jax(ragged_paged_attention_jnp, batch, **options)


def check_reference_matches_jnp(batch_and_options):
    batch, options = batch_and_options
    ours = ref_ragged_paged_attention(*batch.args(), **options)
    fast = ragged_paged_attention_jnp(*batch.args(), **options)
    assert_close(ours, fast, batch.q.dtype)


# Each example compiles a JAX reference for new shapes, so the fast suite keeps a few examples
# and the slow suite (pytest -m slow) runs many.
test_property_jnp_matches_jax_reference, test_property_jnp_matches_jax_reference_sweep = (
    property_tests(check_jnp_matches_jax_reference, random_batches(), fast=12, slow=200)
)
# The random batches against JAX's reference run once, in .venv; reference against jnp
# runs everywhere.
test_property_jnp_matches_jax_reference = pytest.mark.matrix(
    test_property_jnp_matches_jax_reference
)
test_property_reference_matches_jnp, test_property_reference_matches_jnp_sweep = property_tests(
    check_reference_matches_jnp, random_batches(), fast=5, slow=100
)
