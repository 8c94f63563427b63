"""The switchboard (`minilib.kernel.levers`): `levers=` at the public entry.

`Levers.off()` runs the plain algorithm, one kernel, and matches JAX's reference; each lever on
top of it (with the levers it needs) matches too, and is shown to have applied; the decision
never turns on a lever that was not asked for, and decides the same again from its own answer;
a bad `levers` value is a ValueError that says what to pass.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest
from conftest import INTERPRET, ONE_OF_EACH, assert_output_matches_jax

from minilib.batch import make_batch
from minilib.kernel import (
    Levers,
    Points,
    choose_points,
    kernel_config,
    levers_that_apply,
    ragged_paged_attention,
    rpa_jit,
    split_configs,
)
from minilib.kernel.padded_slot import padding_compiles
from minilib.kernel.strided_fold import interpret_stores_through_views

# Each lever, with the levers it needs to act (the padded slot holds what the strided load
# reads), the head_dim it acts at, and whether it runs in plain `interpret=True`, where refs
# can be viewed as on the chip (the strided loads and fold), or in TPU interpret mode.
LEVER_CASES = {
    # lever: (levers asked, head_dim, plain interpret)
    "decode_kernel": (("decode_kernel",), 128, False),
    "open_blocks": (("open_blocks",), 128, False),
    "strided_kv_loads": (("strided_kv_loads",), 128, True),
    "padded_slot": (("strided_kv_loads", "padded_slot"), 128, True),
    "narrow_rows": (("strided_kv_loads", "narrow_rows"), 64, True),
    "lane_blocks": (("lane_blocks",), 256, False),
    "strided lane_blocks": (("strided_kv_loads", "lane_blocks"), 256, True),
    "whole_rows": (("strided_kv_loads", "padded_slot", "lane_blocks", "whole_rows"), 256, True),
    "strided_fold": (("strided_fold",), 128, True),
    "heads_in_flight": (("heads_in_flight",), 128, False),
    "newton_reciprocal": (("newton_reciprocal",), 128, False),
    "fixed_max": (("fixed_max",), 128, False),
    "fp8_as_stored": (("fp8_as_stored",), 128, False),
    "strided fp8_as_stored": (("strided_kv_loads", "fp8_as_stored"), 128, True),
}
OPTIONS = dict(sm_scale=0.125, soft_cap=20.0, num_kv_pages_per_block=2, num_queries_per_block=8)


def lever_batch(head_dim: int, kv_dtype=None):
    """A prefill, a decode, an idle sequence and a chunk; bf16, 8 KV heads in groups of 2 (so
    the strided load and fold fit), NaN in the unused slots and pages; the cache in `kv_dtype`
    (None: bf16)."""
    return make_batch(
        ONE_OF_EACH,
        num_q_heads=16,
        num_kv_heads=8,
        head_dim=head_dim,
        page_size=8,
        dtype=jnp.bfloat16,
        kv_dtype=kv_dtype,
    )


@pytest.mark.parametrize(
    "head_dim, kv_dtype",
    [(128, None), (256, None), (128, jnp.float8_e4m3fn)],
    ids=["head_dim 128", "head_dim 256", "fp8 cache"],
)
def test_levers_off_runs_the_plain_kernel_and_matches_jax_reference(head_dim, kv_dtype):
    """One kernel with the plain kernel's points, whatever head_dim and the cache's dtype."""
    batch = lever_batch(head_dim, kv_dtype)
    options = OPTIONS if kv_dtype is None else dict(OPTIONS, k_scale=0.5, v_scale=0.5)
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, levers=Levers.off())
    assert split_configs(config) == (config, None)  # one kernel
    assert choose_points(config) == Points()  # the plain kernel's points
    out = ragged_paged_attention(*batch.args(), levers=Levers.off(), interpret=INTERPRET, **options)
    assert_output_matches_jax(out, batch, **options)


@pytest.mark.parametrize("lever", LEVER_CASES)
def test_each_lever_on_the_plain_kernel_matches_jax_reference(lever):
    asked_names, head_dim, plain_interpret = LEVER_CASES[lever]
    if lever in ("padded_slot", "narrow_rows", "whole_rows") and not padding_compiles():
        pytest.skip("this libtpu compiles no padded slot or narrow rows")
    if lever == "strided_fold" and not interpret_stores_through_views():
        pytest.skip("this jax's interpret mode stores through no view of a ref")
    interpret = True if plain_interpret else INTERPRET
    options = OPTIONS
    batch = lever_batch(head_dim)
    if "fp8" in lever:  # with scales: without, JAX's reference rounds p to fp8 (notebook 04)
        batch = lever_batch(head_dim, jnp.float8_e4m3fn)
        options = dict(OPTIONS, k_scale=0.5, v_scale=0.5)
    asked = Levers.only(*asked_names)
    config = kernel_config(
        batch.q, batch.kv_pages, batch.page_indices, levers=asked, interpret=interpret, **options
    )
    mixed, _ = split_configs(config)
    assert mixed.levers == asked, (mixed.levers.on(), asked.on())  # every lever asked applied
    if plain_interpret:  # the public entry's True is TPU interpret mode: the jitted call
        out, _ = rpa_jit(*batch.args(), config=config, interpret=True, trace_capacity=0)
    else:
        out = ragged_paged_attention(*batch.args(), levers=asked, interpret=interpret, **options)
    assert_output_matches_jax(out, batch, **options)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("interpret", [False, True, INTERPRET], ids=["compiled", "plain", "TPU"])
def test_the_decision_turns_on_nothing_unasked_and_stands(head_dim, interpret):
    """For none, every one, every pair, every lever but one, and all of the levers: what
    applies is a subset of what was asked, and asking for exactly that decides it again
    unchanged (one decision, not a drift)."""
    batch = lever_batch(head_dim)
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, **OPTIONS)
    names = Levers.names()
    subsets = [
        *itertools.combinations(names, 0),
        *itertools.combinations(names, 1),
        *itertools.combinations(names, 2),
        *itertools.combinations(names, len(names) - 1),
        names,
    ]
    for subset in subsets:
        asked = Levers.only(*subset)
        applied = levers_that_apply(config, asked, interpret)
        assert set(applied.on()) <= set(subset), (subset, applied.on())
        assert levers_that_apply(config, applied, interpret) == applied, subset


def test_the_strided_levers_do_not_apply_in_tpu_interpret_mode():
    """TPU interpret mode cannot view a ref: the strided load and fold are dropped there, so
    every lever asked for still runs (the others) and the answer is right."""
    batch = lever_batch(128)
    config = kernel_config(
        batch.q, batch.kv_pages, batch.page_indices, levers=Levers.every(), interpret=INTERPRET
    )
    assert not config.levers.strided_kv_loads and not config.levers.strided_fold
    assert config.levers.decode_kernel and config.levers.open_blocks


@pytest.mark.parametrize("bad", ["off", {"fixed_max": True}, 1])
def test_a_bad_levers_value_says_what_to_pass(bad):
    batch = lever_batch(128)
    with pytest.raises(ValueError, match=r"(?s)levers=.* is not a Levers.*Levers\.off\(\)"):
        ragged_paged_attention(*batch.args(), levers=bad, interpret=INTERPRET)


def test_an_unknown_lever_name_is_named():
    with pytest.raises(ValueError, match=r"unknown=\['fast_path'\] are not levers"):
        Levers.only("fixed_max", "fast_path")
