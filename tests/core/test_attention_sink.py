"""Attention sinks (`attention_sink`, f32[num_q_heads]) in every implementation.

A sink is a learned logit per q head that joins every softmax denominator and carries no value
(gpt-oss; vLLM's head_dim-64 kernel takes it under this name and shape):

    out_i = sum_j exp(s_ij - m) v_j / (exp(sink_h - m) + sum_j exp(s_ij - m)),

m the max over the scores and the sink. `dense_with_sink` writes that formula out in NumPy,
one sequence and one q row at a time, and every implementation is checked against it on
batches whose unused page slots, pages and q rows are NaN (`make_batch`). The kernel runs in
TPU interpret mode (both kernels: the batches hold decodes), and on its compiled path's
strided loads with several KV heads in flight (plain `interpret=True`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    IMPLEMENTATIONS,
    INTERPRET,
    MIXED,
    ONE_OF_EACH,
    TOLERANCE,
    one_case_per_path,
    padded_batch,
)

from minilib.batch import make_batch
from minilib.errors import RPAInputError
from minilib.kernel import kernel_config, rpa_jit, split_configs
from minilib.kv_cache import cdiv

RUN = {name: fn for name, fn in IMPLEMENTATIONS.items() if name != "kernel"}
RUN["kernel"] = functools.partial(IMPLEMENTATIONS["kernel"], interpret=INTERPRET)
SM_SCALE = 0.125


def dense_with_sink(
    batch, sink, *, sm_scale, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None
) -> np.ndarray:
    """The formula above, in float64, per sequence and per q row: causal (row r of a sequence
    of q_len rows over kv_len keys sits at position kv_len - q_len + r), with the sliding
    window and soft cap of JAX's reference. Padding rows are 0."""
    q = np.asarray(batch.q.astype(jnp.float32), np.float64)
    kv = np.asarray(batch.kv_pages.astype(jnp.float32), np.float64)
    sink = np.asarray(sink, np.float64)
    page_size, num_kv_heads = kv.shape[1], kv.shape[2] // 2
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for i, (q_len, kv_len) in enumerate(batch.seq_lens):
        start = int(batch.cu_q_lens[i])
        pages = np.asarray(batch.page_indices[i])[: cdiv(kv_len, page_size)]
        tokens = kv[pages].reshape(-1, *kv.shape[2:])[:kv_len]  # [kv_len, 2*num_kv_heads, hd]
        k = np.repeat(tokens[:, 0::2], group, axis=1) * (k_scale or 1.0)  # [kv_len, heads, hd]
        v = np.repeat(tokens[:, 1::2], group, axis=1) * (v_scale or 1.0)
        for r in range(q_len):
            position = kv_len - q_len + r
            keys = np.arange(kv_len)
            seen = keys <= position
            if sliding_window is not None:
                seen &= keys > position - sliding_window
            s = np.einsum("hd,khd->hk", q[start + r], k[seen]) * sm_scale  # [heads, seen]
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            m = np.maximum(s.max(axis=1), sink)  # [heads]
            e = np.exp(s - m[:, None])
            denominator = np.exp(sink - m) + e.sum(axis=1)
            out[start + r] = np.einsum("hk,khd->hd", e, v[seen]) / denominator[:, None]
    return out


def random_sinks(num_q_heads: int, seed: int = 1) -> jax.Array:
    """Sinks of the size of the scores here (standard deviation 2): some heads' sinks win,
    some lose, so a dropped or misplaced sink shows."""
    return jnp.asarray(2.0 * np.random.default_rng(seed).standard_normal(num_q_heads), jnp.float32)


def assert_close_to(out, want, dtype):
    error = float(np.max(np.abs(np.asarray(out, np.float64) - want)))
    assert error <= TOLERANCE[jnp.dtype(dtype)], f"max abs error {error}"


def mixed_batch():
    """MIXED (decodes, a prefill, an idle sequence, a chunk), with padding rows and slots."""
    return padded_batch(MIXED, num_q_heads=8, num_kv_heads=2, page_size=8)


# ---------------------------------------------------------------------------------------------
# Against the dense formula.
# ---------------------------------------------------------------------------------------------

OPTIONS = {
    "causal": {},
    "sliding window and soft cap": dict(sliding_window=6, soft_cap=20.0),
}


@pytest.mark.parametrize(
    "name, options",
    one_case_per_path(
        [
            pytest.param(name, options, id=f"{name}-{options}")
            for name in RUN
            for options in OPTIONS
        ],
        *[f"{name}-causal" for name in RUN if name != "kernel"],
        "kernel-sliding window and soft cap",
    ),
)
def test_matches_the_dense_formula(name, options):
    batch = mixed_batch()
    sink = random_sinks(8)
    out = RUN[name](*batch.args(), sm_scale=SM_SCALE, attention_sink=sink, **OPTIONS[options])
    want = dense_with_sink(batch, sink, sm_scale=SM_SCALE, **OPTIONS[options])
    assert_close_to(out, want, jnp.float32)
    # The sinks matter here: without them the output is far from the formula.
    assert (
        np.max(
            np.abs(
                want
                - dense_with_sink(batch, jnp.full(8, -1e30), sm_scale=SM_SCALE, **OPTIONS[options])
            )
        )
        > 0.1
    )


STRIDED_CASES = {
    # name: (make_batch options, kernel options)
    "bfloat16, 8 KV heads, 3 in flight": (dict(dtype=jnp.bfloat16), {}),
    "fp8 e4m3fn KV with scales": (
        dict(dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn),
        dict(k_scale=0.25, v_scale=0.5),
    ),
}


@pytest.mark.parametrize(
    "name", one_case_per_path(STRIDED_CASES, "bfloat16, 8 KV heads, 3 in flight")
)
def test_kernel_strided_loads_and_heads_in_flight_match_the_dense_formula(name):
    """The compiled path (strided K/V loads, KV heads in flight), in both kernels, run by
    plain `interpret=True`; ONE_OF_EACH holds a decode, so the decode kernel runs too."""
    batch_options, options = STRIDED_CASES[name]
    batch = make_batch(
        ONE_OF_EACH, num_q_heads=16, num_kv_heads=8, head_dim=128, page_size=8, **batch_options
    )
    options = dict(sm_scale=SM_SCALE, num_kv_pages_per_block=2, num_queries_per_block=8, **options)
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, interpret=True, **options)
    config = dataclasses.replace(config, heads_in_flight=3, reload_v=True)
    assert all(kernel.levers.strided_kv_loads for kernel in split_configs(config))
    sink = random_sinks(16)
    out, _ = rpa_jit(*batch.args(), sink, config=config, interpret=True, trace_capacity=0)
    want = dense_with_sink(
        batch,
        sink,
        sm_scale=SM_SCALE,
        k_scale=options.get("k_scale"),
        v_scale=options.get("v_scale"),
    )
    assert_close_to(out, want, jnp.bfloat16)


# ---------------------------------------------------------------------------------------------
# No sink, and a sink that weighs nothing.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", one_case_per_path(RUN, "jnp"))  # one path: the exp underflows
def test_a_very_negative_sink_is_no_sink(name):
    """exp(-1e30 - m) is 0: the sink's share of every denominator vanishes."""
    batch = mixed_batch()
    without = RUN[name](*batch.args(), sm_scale=SM_SCALE)
    with_sink = RUN[name](*batch.args(), sm_scale=SM_SCALE, attention_sink=jnp.full(8, -1e30))
    np.testing.assert_allclose(np.asarray(with_sink), np.asarray(without), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", RUN)
def test_attention_sink_none_is_the_output_without_it(name):
    batch = mixed_batch()
    without = RUN[name](*batch.args(), sm_scale=SM_SCALE)
    none = RUN[name](*batch.args(), sm_scale=SM_SCALE, attention_sink=None)
    assert np.array_equal(np.asarray(none), np.asarray(without), equal_nan=True)


def test_the_kernels_take_a_sink_input_only_with_sinks():
    """Without sinks the kernels are the kernels of before: no input more (and so no code
    more); with them, one input more each, the [num_kv_heads, group, 128] sinks."""
    batch = mixed_batch()
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices)

    def pallas_call_inputs(*sink):
        jaxpr = jax.make_jaxpr(
            functools.partial(rpa_jit, config=config, interpret=INTERPRET, trace_capacity=0)
        )(*batch.args(), *sink)
        calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
        inner = calls[0].params["jaxpr"].jaxpr if calls else jaxpr.jaxpr
        return [
            [v.aval.shape for v in e.invars]
            for e in inner.eqns
            if e.primitive.name == "pallas_call"
        ]

    without, with_sink = pallas_call_inputs(), pallas_call_inputs(random_sinks(8))
    assert [len(inputs) for inputs in without] == [6, 6]  # the decode and mixed kernels
    assert [inputs[:6] for inputs in with_sink] == without
    assert [inputs[6:] for inputs in with_sink] == [[(2, 4, 128)]] * 2


def test_traced_sinks_under_jit():
    """The sink is an array, not an option: traced under jit, where its shape and dtype are
    still checked (its values cannot be)."""
    batch = mixed_batch()
    sink = random_sinks(8)
    fn = IMPLEMENTATIONS["jnp"]
    traced = jax.jit(lambda s: fn(*batch.args(), sm_scale=SM_SCALE, attention_sink=s))(sink)
    eager = fn(*batch.args(), sm_scale=SM_SCALE, attention_sink=sink)
    np.testing.assert_allclose(np.asarray(traced), np.asarray(eager), rtol=0, atol=1e-6)
    with pytest.raises(RPAInputError, match="attention_sink.shape"):
        jax.jit(lambda s: fn(*batch.args(), attention_sink=s))(sink[:4])


# ---------------------------------------------------------------------------------------------
# Bad sinks: one clear error, the same in every implementation.
# ---------------------------------------------------------------------------------------------


def with_one(value, at: int) -> np.ndarray:
    """Eight zero sinks but one."""
    sink = np.zeros(8, np.float32)
    sink[at] = value
    return sink


BAD_SINKS = {
    # name: (the sink, words of the message)
    "one too many": (
        np.zeros(9, np.float32),
        r"attention_sink.shape=\(9,\) must be \(num_q_heads,\) = \(8,\)",
    ),
    "a column": (np.zeros((8, 1), np.float32), r"attention_sink.shape=\(8, 1\)"),
    "bfloat16": (jnp.zeros(8, jnp.bfloat16), "attention_sink.dtype=bfloat16 must be float32"),
    "float64": (np.zeros(8, np.float64), "attention_sink.dtype=float64 must be float32"),
    "int32": (np.zeros(8, np.int32), "attention_sink.dtype=int32 must be float32"),
    "NaN": (with_one(np.nan, 2), r"attention_sink\[2\]=nan must be finite"),
    "inf": (with_one(np.inf, 5), r"attention_sink\[5\]=inf must be finite"),
    "-inf": (with_one(-np.inf, 0), r"attention_sink\[0\]=-inf must be finite"),
    "a list": ([0.0] * 8, "attention_sink must be an array, got list"),
}


@pytest.mark.parametrize("case", BAD_SINKS)
def test_bad_sinks_raise_the_same_clear_error_everywhere(case):
    sink, words = BAD_SINKS[case]
    batch = mixed_batch()
    kept = np.array(sink, copy=True)
    messages = set()
    for name, fn in RUN.items():
        with pytest.raises(RPAInputError, match=words) as err:
            fn(*batch.args(), sm_scale=SM_SCALE, attention_sink=sink)
        assert err.value.hint and "Hint:" in str(err.value), name
        messages.add(str(err.value))
    assert len(messages) == 1, messages
    assert np.array_equal(np.asarray(sink), kept, equal_nan=True)  # the sink is left as it was
