"""minilib.engine's sampling: seeded draws, stop tokens, logprobs and vLLM's defaults, under the
precision policy of tests/engine/test_engine.py."""

from __future__ import annotations

import dataclasses

import engine_runs
import jax.numpy as jnp
import numpy as np
import pytest
from engine_runs import (
    BF16_MARGIN,
    CONFIG,
    MAX_NEW,
    PARAMS,
    PROMPTS,
    assert_all_pages_free,
    engine,
    run_checked,
)

from minilib.engine import EngineError, ModelConfig, SamplingParams, dense_generate, init_params
from minilib.engine.model import dense_forward, dense_generate_with_margins

dense_tokens = engine_runs.dense_tokens  # the fixture


# --- sampling --------------------------------------------------------------------------------

SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=5)


def test_sampled_tokens_do_not_depend_on_the_batch_or_preemption():
    prompt = PROMPTS[2]
    want = dense_generate(PARAMS, CONFIG, prompt, sampling_params=SAMPLED)
    assert want != dense_generate(PARAMS, CONFIG, prompt, MAX_NEW), "sampling changed nothing"
    other_seed = dense_generate(PARAMS, CONFIG, prompt, sampling_params=SAMPLED.with_seed(6))
    assert want != other_seed, "the seed changed nothing"
    alone = engine().generate([prompt], sampling_params=SAMPLED)[0]
    others = [SamplingParams(max_tokens=8, temperature=0.7, seed=s) for s in range(len(PROMPTS))]
    first = engine().generate([prompt] + PROMPTS, sampling_params=[SAMPLED] + others)
    eng = engine(num_pages=13)  # last in line, and so the newest when the pool runs short
    ids = [eng.add_request(p, sampling_params=sp) for p, sp in zip(PROMPTS, others, strict=True)]
    ours = eng.add_request(prompt, sampling_params=SAMPLED)
    run_checked(eng)
    assert eng.requests[ours].num_preemptions > 0, "make the pool smaller"
    assert alone == first[0] == eng.output(ours) == want
    assert (
        [eng.output(i) for i in ids]
        == first[1:]
        == [
            dense_generate(PARAMS, CONFIG, p, sampling_params=sp)
            for p, sp in zip(PROMPTS, others, strict=True)
        ]
    )


def test_requests_without_a_seed_get_one_from_the_engine():
    params = SamplingParams(max_tokens=6, temperature=1.0)
    runs = []
    for engine_seed in (3, 3, 4):
        eng = engine(seed=engine_seed)
        ids = [eng.add_request(p, sampling_params=params) for p in PROMPTS[:3]]
        run_checked(eng)
        seeds = [eng.requests[i].sampling_params.seed for i in ids]
        tokens = [eng.output(i) for i in ids]
        assert len(set(seeds)) == 3, "each request gets a seed of its own"
        assert tokens == [
            dense_generate(PARAMS, CONFIG, p, sampling_params=params.with_seed(s))
            for p, s in zip(PROMPTS[:3], seeds, strict=True)
        ]
        runs.append(tokens)
    assert runs[0] == runs[1] != runs[2]


def test_bfloat16_sampling_matches_dense_up_to_near_ties():
    config = ModelConfig(
        vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="bfloat16"
    )
    params = init_params(config, seed=0)
    sampling = [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=i) for i in range(6)]
    dense = [
        dense_generate_with_margins(params, config, p, sampling_params=sp)
        for p, sp in zip(PROMPTS, sampling, strict=True)
    ]
    eng = engine(params=params, config=config, num_pages=10)
    outputs = eng.generate(PROMPTS, sampling_params=sampling)
    compared = 0
    for got, (want, margins) in zip(outputs, dense, strict=True):
        # Equal before the first draw that won by less than rounding; from it on, free.
        clear = next((i for i, m in enumerate(margins) if m < BF16_MARGIN), len(want))
        assert got[:clear] == want[:clear], (got, want, margins)
        compared += clear
    assert compared >= 0.5 * len(PROMPTS) * MAX_NEW, f"only {compared} tokens compared"


def test_stop_tokens_end_a_request_with_stop_and_max_tokens_with_length(dense_tokens):
    i = next(i for i, t in enumerate(dense_tokens) if t[2] not in t[:2])
    stop = dense_tokens[i][2]
    greedy_stop = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop])
    j = next(j for j, t in enumerate(dense_tokens) if stop not in t)
    sampled = dense_generate(PARAMS, CONFIG, PROMPTS[i], sampling_params=SAMPLED)
    k = next(k for k in range(1, MAX_NEW) if sampled[k] not in sampled[:k])
    sampled_stop = dataclasses.replace(SAMPLED, stop_token_ids=(sampled[k],))
    eng = engine()
    ids = [
        eng.add_request(PROMPTS[i], sampling_params=greedy_stop),
        eng.add_request(PROMPTS[j], sampling_params=greedy_stop),
        eng.add_request(PROMPTS[i], sampling_params=sampled_stop),
    ]
    run_checked(eng)
    outputs = [eng.request_output(r) for r in ids]
    assert (list(outputs[0].token_ids), outputs[0].finish_reason) == (dense_tokens[i][:3], "stop")
    assert (list(outputs[1].token_ids), outputs[1].finish_reason) == (dense_tokens[j], "length")
    assert (list(outputs[2].token_ids), outputs[2].finish_reason) == (sampled[: k + 1], "stop")
    assert (
        dense_generate(PARAMS, CONFIG, PROMPTS[i], sampling_params=sampled_stop) == sampled[: k + 1]
    )
    assert_all_pages_free(eng)


def test_sampling_params_have_vllms_defaults():
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (16, 1.0, 0, 1.0)
    assert (params.seed, params.stop_token_ids) == (None, ())
    assert (params.min_tokens, params.logprobs) == (0, None)
    assert SamplingParams(temperature=0.0).greedy and not params.greedy
    # vLLM: a temperature below 1e-5 is greedy.
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy


def test_a_tiny_temperature_is_greedy(dense_tokens):
    """Below 1e-5 the logits are not divided by the temperature (1e-38 would make them
    overflow to inf): the tokens are the greedy ones, in the engine and in dense_generate."""
    tiny = [SamplingParams(max_tokens=MAX_NEW, temperature=t, seed=3) for t in (1e-6, 1e-38)]
    for params in tiny:
        assert engine().generate(PROMPTS, sampling_params=params) == dense_tokens
        assert (
            dense_generate(PARAMS, CONFIG, PROMPTS[0], sampling_params=params) == (dense_tokens[0])
        )


def dense_logprobs(prompt: list[int], output: list[int]) -> np.ndarray:
    """log_softmax of the model's logits at each output token, written out: the whole
    sequence in one dense pass, the row before each output token."""
    tokens = prompt + output
    max_len = 64
    padded = np.zeros(max_len, np.int32)
    padded[: len(tokens)] = tokens
    cache = jnp.zeros((CONFIG.num_layers, max_len, CONFIG.num_kv_heads, CONFIG.head_dim))
    logits, _, _ = dense_forward(PARAMS, CONFIG, padded, 0, cache, cache)
    rows = np.asarray(logits, np.float64)[len(prompt) - 1 : len(tokens) - 1]
    top = rows.max(axis=1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))


def test_logprobs_are_the_log_softmax_of_the_models_logits():
    """Each token's entry: the sampled token's log-probability and the k most likely
    tokens', of the raw logits (not of the temperature-scaled or top-k-cut ones)."""
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
        dataclasses.replace(SAMPLED, max_tokens=6, logprobs=5),
        SamplingParams(max_tokens=6, temperature=0.7, seed=1, logprobs=0),
        SamplingParams(max_tokens=6, temperature=0.7, seed=2),  # no logprobs asked
    ]
    eng = engine(num_pages=13)  # a small pool: requests wait, and may be preempted
    ids = [eng.add_request(p, sampling_params=sp) for p, sp in zip(PROMPTS, params, strict=False)]
    run_checked(eng)
    assert eng.request_output(ids[3]).logprobs is None
    for request_id, sp in zip(ids[:3], params, strict=False):
        out = eng.request_output(request_id)
        want = dense_logprobs(list(out.prompt_token_ids), list(out.token_ids))
        assert len(out.logprobs) == len(out.token_ids) == len(want)
        for token, entry, row in zip(out.token_ids, out.logprobs, want, strict=True):
            assert token in entry and len(entry) in (sp.logprobs, sp.logprobs + 1)
            for t, logprob in entry.items():
                assert logprob == pytest.approx(row[t], abs=1e-4), (t, entry)
            k_best = sorted(entry.values(), reverse=True)[: sp.logprobs]
            np.testing.assert_allclose(k_best, sorted(row, reverse=True)[: sp.logprobs], atol=1e-4)


def test_min_tokens_keeps_stop_tokens_out_until_then(dense_tokens):
    """A stop token that greedy decoding would draw at token 1 cannot be drawn before
    min_tokens tokens: written out here as a dense greedy loop whose stop logits are -inf
    until then."""
    i = next(i for i, t in enumerate(dense_tokens) if t[1] not in t[:1])
    stop, min_tokens = dense_tokens[i][1], 5
    params = SamplingParams(
        max_tokens=MAX_NEW, min_tokens=min_tokens, temperature=0.0, stop_token_ids=[stop]
    )
    want = []
    while len(want) < MAX_NEW:
        row = dense_logprobs(PROMPTS[i], want + [0])[-1]  # the row after the last token
        if len(want) < min_tokens:
            row[stop] = -np.inf
        want.append(int(np.argmax(row)))
        if want[-1] == stop:
            break
    assert want[:2] != dense_tokens[i][:2], "min_tokens changed nothing"
    eng = engine()
    ours = eng.add_request(PROMPTS[i], sampling_params=params)
    plain = eng.add_request(PROMPTS[i], sampling_params=dataclasses.replace(params, min_tokens=0))
    run_checked(eng)
    assert (
        eng.output(ours)
        == want
        == dense_generate(PARAMS, CONFIG, PROMPTS[i], sampling_params=params)
    )
    assert eng.output(plain) == dense_tokens[i][:2]  # without it, the stop token ends it at once


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"max_tokens": 2.0}, "max_tokens=2.0"),
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_k": -2}, "top_k=-2"),
        ({"top_k": 1.5}, "top_k=1.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"seed": -1}, "seed=-1"),
        ({"seed": 2**64}, "seed="),
        ({"stop_token_ids": 3}, "stop_token_ids=3"),
        ({"stop_token_ids": [1, -4]}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens=-1"),
        ({"min_tokens": 2.0}, "min_tokens=2.0"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens=5 must be <= max_tokens=4"),
        ({"logprobs": -1}, "logprobs=-1"),
        ({"logprobs": 1.5}, "logprobs=1.5"),
        ({"logprobs": True}, "logprobs=True"),
    ],
)
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(EngineError, match=words) as err:
        SamplingParams(**kwargs)
    assert "Hint:" in str(err.value)
