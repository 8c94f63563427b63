"""minilib.engine: the engine's tokens equal `dense_generate`'s, token for token.

Exactness is checked for a mix of prompt lengths, chunked prefill (prompts longer than the
step's token budget), a pool small enough to force waiting and preemption, and every attention
implementation (the Pallas kernel in TPU interpret mode, on tiny shapes). The engine's pool
starts as NaN, so a read of any slot no token was written to would show.

Tolerance policy. In float32 the tokens must be equal, with no tolerance: the model's logits
have a spread of about 4, and the smallest top-two gap in these runs is orders of magnitude
above float32 rounding. In bfloat16 the engine and the dense model round differently (other
summation orders, about 3 significant digits), so where the dense model's top two logits are
closer than `BF16_MARGIN` a greedy token may legitimately flip, and from there the two
sequences continue from different text. So in bfloat16 each request's tokens must be equal up
to its first token chosen by a gap below `BF16_MARGIN`; after it they are not compared. The
compared prefixes must cover at least half of all tokens, so the check cannot pass vacuously.

Sampled tokens follow the same policy. A draw is the argmax of logits / temperature plus
Gumbel noise that depends only on the request's seed and the token's index, so a draw's
margin (the gap between its two best scores, in logits) plays the part of the greedy gap:
equal in float32, and in bfloat16 equal up to the first draw with a margin below
`BF16_MARGIN`.

The pool's books (reference counts, the free queue, the cached pages) are checked after every
step of the runs that preempt, share or abort, and after every abort (`accounting_problems`).
"""

from __future__ import annotations

import dataclasses

import engine_runs
import jax.numpy as jnp
import numpy as np
import pytest
from engine_runs import (
    BF16_MARGIN,
    CONFIG,
    IMPLEMENTATIONS,
    MAX_NEW,
    PARAMS,
    PROMPTS,
    assert_all_pages_free,
    engine,
    run_checked,
)

import minilib
from minilib.engine import (
    Engine,
    EngineError,
    ModelConfig,
    SamplingParams,
    dense_generate,
    init_params,
)
from minilib.engine.model import dense_generate_with_margins

dense_tokens = engine_runs.dense_tokens  # the fixture


# --- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_mixed_lengths_and_chunked_prefill_match_dense(name, dense_tokens):
    eng = engine(IMPLEMENTATIONS[name])
    assert eng.generate(PROMPTS, MAX_NEW) == dense_tokens
    longest = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    assert len(PROMPTS[longest]) > eng.max_num_batched_tokens
    chunks = [n for s in eng.stats for i, kind, n in s.batch if i == longest and kind == "prefill"]
    assert len(chunks) >= 2 and sum(chunks) == len(PROMPTS[longest]), "no chunked prefill"
    mixed = [s for s in eng.stats if s.num_prefill_tokens and s.num_decode_tokens]
    assert mixed, "the run should mix prefill chunks and decodes in one step"
    assert all(s.num_tokens <= eng.max_num_batched_tokens for s in eng.stats)
    assert all(len(s.batch) <= eng.max_num_seqs for s in eng.stats)
    assert_all_pages_free(eng)


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_small_pool_waits_and_preempts_without_changing_outputs(name, dense_tokens):
    eng = engine(IMPLEMENTATIONS[name], num_pages=10)
    ids = [eng.add_request(p, MAX_NEW) for p in PROMPTS]
    run_checked(eng)
    assert [eng.output(i) for i in ids] == dense_tokens
    assert any(s.num_waiting for s in eng.stats), "no request ever waited"
    assert sum(s.num_preempted for s in eng.stats) > 0, "no request was preempted"
    assert max(s.num_pages_used for s in eng.stats) <= 10
    assert_all_pages_free(eng)


def test_reference_attention_matches_dense(dense_tokens):
    # JAX's reference compiles per (q_len, kv_len), so three short requests.
    eng = Engine(PARAMS, CONFIG, attention=minilib.ref_ragged_paged_attention, num_pages=6,
                 page_size=4, max_num_batched_tokens=8, max_num_seqs=2)  # fmt: skip
    picked = [0, 2, 4]
    assert eng.generate([PROMPTS[i] for i in picked], 4) == [dense_tokens[i][:4] for i in picked]
    assert_all_pages_free(eng)


def test_pallas_kernel_in_interpret_mode_matches_dense(dense_tokens):
    eng = engine(
        minilib.ragged_paged_attention, num_pages=6, max_num_batched_tokens=8, max_num_seqs=2
    )
    picked = [0, 2]
    assert eng.generate([PROMPTS[i] for i in picked], 3) == [dense_tokens[i][:3] for i in picked]
    assert_all_pages_free(eng)


def test_bfloat16_matches_dense_up_to_near_ties():
    config = ModelConfig(
        vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="bfloat16"
    )
    params = init_params(config, seed=0)
    dense = [dense_generate_with_margins(params, config, p, MAX_NEW) for p in PROMPTS]
    eng = engine(params=params, config=config, num_pages=10)
    assert eng.kv_pages[0].dtype == jnp.bfloat16
    outputs = eng.generate(PROMPTS, MAX_NEW)
    compared = 0
    for got, (want, margins) in zip(outputs, dense, strict=True):
        clear = next((i for i, m in enumerate(margins) if m < BF16_MARGIN), len(want) - 1)
        assert got[: clear + 1] == want[: clear + 1], (got, want, margins)
        compared += clear + 1
    assert compared >= 0.5 * len(PROMPTS) * MAX_NEW, f"only {compared} tokens compared"
    assert_all_pages_free(eng)


def test_a_wrong_attention_is_caught(dense_tokens):
    """The comparison has teeth: attention that forgets the cached tokens (kv_lens = q_lens)
    gives other tokens."""

    def forgets_the_cache(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
        return minilib.ragged_paged_attention_jnp(
            q, kv_pages, q_lens, page_indices, cu_q_lens, num_seqs, **options
        )

    assert engine(forgets_the_cache).generate(PROMPTS, MAX_NEW) != dense_tokens


# --- attention sinks -------------------------------------------------------------------------

SINK_CONFIG = dataclasses.replace(CONFIG, attention_sinks=True)
SINK_PARAMS = init_params(SINK_CONFIG, seed=0)


@pytest.fixture(scope="module")
def dense_sink_tokens():
    return [dense_generate(SINK_PARAMS, SINK_CONFIG, p, MAX_NEW) for p in PROMPTS]


def test_sinks_are_the_only_new_weights_and_change_the_tokens(dense_tokens, dense_sink_tokens):
    """With sinks, every other weight is the same: the tokens differ because of the sinks."""
    for with_sinks, without in zip(SINK_PARAMS["layers"], PARAMS["layers"], strict=True):
        assert set(with_sinks) - set(without) == {"attention_sink"}
        assert all(np.array_equal(with_sinks[k], without[k]) for k in without)
        assert with_sinks["attention_sink"].shape == (CONFIG.num_q_heads,)
    assert dense_sink_tokens != dense_tokens


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_attention_sinks_match_dense(name, dense_sink_tokens):
    eng = engine(IMPLEMENTATIONS[name], params=SINK_PARAMS, config=SINK_CONFIG, num_pages=10)
    assert eng.generate(PROMPTS, MAX_NEW) == dense_sink_tokens  # chunked, preempted too
    assert sum(s.num_preempted for s in eng.stats) > 0
    assert_all_pages_free(eng)


def test_attention_sinks_in_the_pallas_kernel_match_dense(dense_sink_tokens):
    eng = engine(
        minilib.ragged_paged_attention, params=SINK_PARAMS, config=SINK_CONFIG, num_pages=6,
        max_num_batched_tokens=8, max_num_seqs=2,
    )  # fmt: skip
    picked = [0, 2]
    want = [dense_sink_tokens[i][:3] for i in picked]
    assert eng.generate([PROMPTS[i] for i in picked], 3) == want
    assert_all_pages_free(eng)


def bad_sink_params(layer: int, sink) -> dict:
    layers = [dict(x) for x in SINK_PARAMS["layers"]]
    if sink is None:
        del layers[layer]["attention_sink"]
    else:
        layers[layer]["attention_sink"] = sink
    return SINK_PARAMS | {"layers": layers}


@pytest.mark.parametrize(
    "params, config, words",
    [
        (bad_sink_params(1, jnp.zeros(4).at[2].set(jnp.nan)), SINK_CONFIG,
         r"layer 1: attention_sink\[2\]=nan must be finite"),
        (bad_sink_params(0, jnp.zeros(3)), SINK_CONFIG,
         r"layer 0: attention_sink.shape=\(3,\) must be \(num_q_heads,\) = \(4,\)"),
        (bad_sink_params(0, jnp.zeros(4, jnp.bfloat16)), SINK_CONFIG,
         "layer 0: attention_sink.dtype=bfloat16 must be float32"),
        (bad_sink_params(1, None), SINK_CONFIG, "layer 1 has no attention_sink"),
        (SINK_PARAMS, CONFIG, "layer 0 has an attention_sink, but config.attention_sinks is False"),
    ],
)  # fmt: skip
def test_bad_sinks_are_refused_before_anything_runs(params, config, words):
    with pytest.raises(EngineError, match=words):
        engine(params=params, config=config)
    with pytest.raises(EngineError, match=words):
        dense_generate(params, config, PROMPTS[0], MAX_NEW)


# --- the streaming API and the per-step statistics -------------------------------------------


def test_steps_and_statistics(dense_tokens):
    eng = engine(num_pages=10)
    ids = [eng.add_request(p, MAX_NEW) for p in PROMPTS]
    while eng.has_unfinished:
        stats = eng.step()
        assert stats.num_pages_used == sum(bool(o) for o in stats.page_owners)
        assert stats.num_running <= eng.max_num_seqs
    assert [eng.output(i) for i in ids] == dense_tokens
    # every generated token but the last of each request went through the model as a decode,
    # or was recomputed as a prefill after a preemption
    decodes = sum(s.num_decode_tokens for s in eng.stats)
    assert decodes <= len(PROMPTS) * (MAX_NEW - 1)
    assert sorted(i for s in eng.stats for i in s.finished) == ids
    assert sorted(i for s in eng.stats for i in s.admitted) == sorted(
        ids + [i for s in eng.stats for i in s.preempted]
    )
    assert [s.step for s in eng.stats] == list(range(len(eng.stats)))


def test_max_new_tokens_one():
    eng = engine()
    assert eng.generate([[1, 2], [3]], 1) == [
        dense_generate(PARAMS, CONFIG, p, 1) for p in ([1, 2], [3])
    ]
    assert_all_pages_free(eng)


def test_max_new_tokens_zero_is_refused_as_sampling_params_refuses_max_tokens_zero():
    """add_request(p, 0) used to be taken (with SamplingParams(max_tokens=1) stored), while
    SamplingParams(max_tokens=0) raised: both refuse it now, with the same words."""
    eng = engine()
    with pytest.raises(EngineError, match="max_new_tokens=0 must be an int >= 1") as err:
        eng.add_request([1, 2], 0)
    assert "at least one token" in err.value.hint
    with pytest.raises(EngineError, match="max_tokens=0 must be an int >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(EngineError, match=r"prompts\[0\]: max_new_tokens=0"):
        eng.generate([[1, 2]], 0)
    assert not eng.requests and not eng.has_unfinished and eng.num_steps == 0


def test_stats_keep_the_last_max_stats_steps_idle_ones_too():
    eng = engine(max_stats=3)
    eng.generate(PROMPTS[:3], MAX_NEW)
    busy = eng.num_steps
    for _ in range(5):  # idle steps: nothing to run, still steps
        assert eng.step().num_tokens == 0
    assert eng.num_steps == busy + 5 > 3
    assert [s.step for s in eng.stats] == list(range(eng.num_steps - 3, eng.num_steps))


# --- bad requests and settings ---------------------------------------------------------------

BAD_REQUESTS = {
    "empty prompt": ([], 4, "empty"),
    "token id too big": ([1, 64], 4, "outside the vocabulary"),
    "negative token id": ([-1, 3], 4, "outside the vocabulary"),
    "float tokens": ([1.5, 2.0], 4, "int token ids"),
    "nested prompt": ([[1, 2]], 4, "flat list"),
    "longer than the pool": ([1] * 40, 4, "whole pool"),
    "prompt fits, generation does not": ([1] * 30, 20, "whole pool"),
    "negative max_new_tokens": ([1], -1, "max_new_tokens"),
    "max_new_tokens 0": ([1], 0, "max_new_tokens=0 must be an int >= 1"),
    "float max_new_tokens": ([1], 2.0, "max_new_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_the_others_carry_on(case, dense_tokens):
    prompt, max_new, words = BAD_REQUESTS[case]
    eng = engine(num_pages=10)
    first = eng.add_request(PROMPTS[1], MAX_NEW)
    eng.step()
    before = (dict(eng.requests), list(eng.scheduler.waiting), list(eng.scheduler.running))
    with pytest.raises(EngineError, match=words) as err:
        eng.add_request(prompt, max_new)
    assert "Hint:" in str(err.value)
    assert before == (dict(eng.requests), list(eng.scheduler.waiting), list(eng.scheduler.running))
    second = eng.add_request(PROMPTS[0], MAX_NEW)
    while eng.has_unfinished:
        eng.step()
    assert [eng.output(first), eng.output(second)] == [dense_tokens[1], dense_tokens[0]]
    assert_all_pages_free(eng)


def test_generate_with_a_bad_prompt_names_it_and_queues_nothing(dense_tokens):
    eng = engine()
    with pytest.raises(EngineError, match=r"prompts\[1\]:.*outside the vocabulary"):
        eng.generate([PROMPTS[0], [99], PROMPTS[2]], MAX_NEW)
    assert not eng.requests and not eng.has_unfinished
    assert eng.generate([PROMPTS[0]], MAX_NEW) == [dense_tokens[0]]


def test_dense_generate_refuses_bad_prompts():
    for prompt, max_new, words in BAD_REQUESTS.values():
        if words == "whole pool":
            continue  # the dense model has no pool
        with pytest.raises(EngineError, match=words):
            dense_generate(PARAMS, CONFIG, prompt, max_new)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_pages": 0}, "num_pages=0"),
        ({"page_size": 2.5}, "page_size=2.5"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens=-1"),
        ({"max_num_seqs": True}, "max_num_seqs=True"),
        ({"attention": "jnp"}, "not callable"),
        ({"config": "tiny"}, "ModelConfig"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching='yes'"),
        ({"seed": -1}, "seed=-1"),
        ({"max_stats": 0}, "max_stats=0"),
    ],
)
def test_bad_engine_settings(kwargs, words):
    with pytest.raises(EngineError, match=words):
        engine(**kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_q_heads": 6, "num_kv_heads": 4}, "divisible"),
        ({"head_dim": 33}, "even"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"dtype": "float16"}, "float16"),
    ],
)
def test_bad_model_configs(kwargs, words):
    base = {"vocab_size": 64, "num_layers": 1, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8}
    with pytest.raises(ValueError, match=words):
        ModelConfig(**(base | kwargs))


def test_init_params_is_seeded():
    a, b, c = init_params(CONFIG, 3), init_params(CONFIG, 3), init_params(CONFIG, 4)
    assert np.array_equal(a["embed"], b["embed"]) and not np.array_equal(a["embed"], c["embed"])
