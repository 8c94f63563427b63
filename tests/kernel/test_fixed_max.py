"""The fixed max (`minilib.kernel.fixed_max`): where a soft cap bounds every score, p is taken
against one fixed M, not a running max. Checked in both kernels, in TPU interpret mode (NaN in
uninitialized memory), against JAX's reference on batches with NaN in their unused slots and
pages: with scores spread up to the cap, and with every score at the cap's floor, where a
wrong M would leave p outside float32's range."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, ONE_OF_EACH, assert_close, assert_output_matches_jax

from minilib.batch import make_batch
from minilib.kernel import fixed_max, kernel_config, ragged_paged_attention, split_configs
from minilib.kernel.call import rpa_jit
from minilib.kernel.levers import choose_points
from minilib.reference import ref_ragged_paged_attention


def at_the_floor(batch):
    """`batch` with q all 3 and K all -3 (NaN where they were): every score q . k is -9 *
    head_dim, soft-capped to the cap's floor, and each output row is its keys' mean V."""
    q = jnp.where(jnp.isnan(batch.q), jnp.nan, 3.0).astype(batch.q.dtype)
    k = batch.kv_pages[:, :, 0::2]
    kv_pages = batch.kv_pages.at[:, :, 0::2].set(jnp.where(jnp.isnan(k), jnp.nan, -3.0))
    return dataclasses.replace(batch, q=q, kv_pages=kv_pages)


CASES = [
    pytest.param(
        jnp.bfloat16,
        dict(sm_scale=4.0, soft_cap=50.0),
        False,
        id="bf16, Gemma-2's cap 50 (M 8.1), scores spread up to it",
    ),
    pytest.param(
        jnp.float32,
        dict(sm_scale=4.0, soft_cap=20.0, sliding_window=9),
        False,
        id="f32, cap 20 (M 0), sliding window",
    ),
    pytest.param(
        jnp.bfloat16,
        dict(sm_scale=1.0, soft_cap=50.0),
        True,
        id="bf16, cap 50, every score at the floor",
    ),
]


def run(batch, options, **blocks):
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, **options, **blocks)
    for kernel in split_configs(config):  # as `kernel_config` chooses it, in both kernels
        assert choose_points(kernel).softmax is fixed_max.FixedMaxSoftmax, kernel
    out, _ = rpa_jit(*batch.args(), config=config, interpret=INTERPRET, trace_capacity=0)
    return out


@pytest.mark.parametrize("dtype, options, floor", CASES)
def test_fixed_max_matches_jax_reference(dtype, options, floor):
    batch = make_batch(ONE_OF_EACH, page_size=8, max_num_seqs=6, dtype=dtype)
    batch = at_the_floor(batch) if floor else batch
    blocks = dict(num_kv_pages_per_block=2, num_queries_per_block=8)
    out = run(batch, options, **blocks)
    assert_output_matches_jax(out, batch, **options, **blocks)


def test_an_m_out_of_range_fails_at_the_floor(monkeypatch):
    """The check can fail: M 100 above its value puts every p at the floor below 2**-170,
    zero in float32, and the output rows to zero. (Its own block size: a fresh trace.)"""
    batch = at_the_floor(make_batch(ONE_OF_EACH, page_size=8, max_num_seqs=6, dtype=jnp.bfloat16))
    options = dict(sm_scale=1.0, soft_cap=50.0)
    blocks = dict(num_kv_pages_per_block=2, num_queries_per_block=16)
    right = fixed_max.fixed_max
    monkeypatch.setattr(fixed_max, "fixed_max", lambda *args: right(*args) + 100.0)
    out = run(batch, options, **blocks)
    with pytest.raises(AssertionError):
        assert_output_matches_jax(out, batch, **options, **blocks)


def test_no_fixed_max_where_the_scores_are_not_bounded_enough():
    """No soft cap, a cap above 56.8 (the smallest p would be below 2**-100), or a mask value
    that gives masked keys a weight: the running max."""
    batch = make_batch([(3, 9)])
    for options in (dict(), dict(soft_cap=60.0), dict(soft_cap=20.0, mask_value=-1e4)):
        config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, **options)
        assert not config.levers.fixed_max, options
        assert choose_points(config).softmax is not fixed_max.FixedMaxSoftmax


def test_sinks_with_a_fixed_max_match_the_reference():
    """An attention sink's share of l, taken against M (m is M from the reset on)."""
    batch = make_batch(ONE_OF_EACH, page_size=8, max_num_seqs=6, num_q_heads=8)
    sink = jnp.asarray(2.0 * np.random.default_rng(1).standard_normal(8), jnp.float32)
    options = dict(sm_scale=1.0, soft_cap=50.0, num_kv_pages_per_block=2, num_queries_per_block=8)
    out = ragged_paged_attention(*batch.args(), attention_sink=sink, interpret=INTERPRET, **options)
    options = {k: v for k, v in options.items() if not k.startswith("num_")}
    want = ref_ragged_paged_attention(*batch.args(), attention_sink=sink, **options)
    n = batch.num_tokens
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out)[n:], 0.0)
    assert_close(np.asarray(out)[:n], np.asarray(want)[:n], jnp.float32)
