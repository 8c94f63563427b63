"""minilib.engine.spec_decode: speculative decoding with vLLM's n-gram proposer.

Greedy: the tokens with speculation are those without, token for token, through chunked
prefill, preemption and prefix caching, and those of the dense model. Sampled: the output
distribution is unchanged, by a chi-square test on a vocabulary of four tokens against the
exact distribution, computed from the dense model's logits; the same test fails a wrong
acceptance rule. The pool's books are checked after every step, and the pages of rejected
drafts go back to the pool.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import minilib.engine.engine as engine_module
from minilib.engine import Engine, EngineError, ModelConfig, SamplingParams, init_params
from minilib.engine.model import dense_forward, dense_generate
from minilib.engine.spec_decode import propose_ngram, rejection_sample
from minilib.kv_cache import pages_needed

CONFIG = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32)
PARAMS = init_params(CONFIG, seed=0)
RNG = np.random.default_rng(1)
# Random prompts, and prompts that repeat themselves (where n-grams find drafts).
PROMPTS = [RNG.integers(0, 64, n).tolist() for n in (3, 17, 9, 30)] + [
    [1, 2, 3, 4, 5] * 3,
    [7, 8, 9, 10, 7, 8, 9, 10, 7],
]
MAX_NEW = 12
SIZES = {"num_pages": 32, "page_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4}


def engine(**kw):
    return Engine(PARAMS, CONFIG, **(SIZES | kw))


def run_checked(eng: Engine):
    """Step to the end; after every step the pool's books, and no request holds a page
    past the ones its tokens need (rejected drafts' pages went back)."""
    while eng.has_unfinished:
        eng.step()
        assert not eng.scheduler.accounting_problems()
        for request in eng.scheduler.running:
            assert len(request.pages) <= pages_needed(len(request.tokens), eng.page_size)


@pytest.fixture(scope="module")
def greedy_tokens():
    return engine().generate(PROMPTS, MAX_NEW)


def test_ngram_proposer_is_vllms():
    """vLLM's docstring example, and its rules: the longest n-gram wins, its earliest
    occurrence, never the suffix itself, fewer than k tokens near the end."""
    kw = {"prompt_lookup_min": 2, "prompt_lookup_max": 3}
    assert propose_ngram([1, 2, 3, 4, 2, 3], num_speculative_tokens=4, **kw) == [4, 2, 3]
    longest = [9, 5, 6, 1, 8, 5, 6, 2, 9, 5, 6]  # [9, 5, 6] beats the later [5, 6]
    assert propose_ngram(longest, num_speculative_tokens=2, **kw) == [1, 8]
    earliest = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose_ngram(earliest, num_speculative_tokens=1, **kw) == [1]
    assert propose_ngram([3, 3], num_speculative_tokens=3, **kw) == []  # n >= 2: too short
    assert propose_ngram([3, 3], num_speculative_tokens=3, prompt_lookup_min=1,
                         prompt_lookup_max=1) == [3]  # fmt: skip
    assert propose_ngram([1, 2, 3], num_speculative_tokens=3, **kw) == []


def test_greedy_speculation_gives_the_same_tokens_and_saves_steps(greedy_tokens):
    assert greedy_tokens == [dense_generate(PARAMS, CONFIG, p, MAX_NEW) for p in PROMPTS]
    plain = engine()
    plain.generate(PROMPTS, MAX_NEW)
    spec = engine(num_speculative_tokens=3)
    ids = [spec.add_request(p, MAX_NEW) for p in PROMPTS]
    run_checked(spec)
    assert [spec.output(i) for i in ids] == greedy_tokens
    proposed = sum(s.num_draft_tokens for s in spec.stats)
    accepted = sum(s.num_accepted_tokens for s in spec.stats)
    assert 0 < accepted < proposed, (accepted, proposed)  # kept and rejected drafts both
    assert spec.num_steps < plain.num_steps
    verified = [n for s in spec.stats for _, kind, n in s.batch if kind == "decode" and n > 1]
    assert verified and max(verified) == 4, "a decode of k + 1 = 4 rows"
    assert spec.scheduler.allocator.num_free == spec.num_pages


@pytest.mark.parametrize("caching", [False, True])
def test_greedy_speculation_through_preemption_and_prefix_caching(greedy_tokens, caching):
    shared = PROMPTS[4] + [11, 12]  # shares 3 full pages with PROMPTS[4]
    prompts = [*PROMPTS, shared]
    want = [*greedy_tokens, dense_generate(PARAMS, CONFIG, shared, MAX_NEW)]
    spec = engine(num_speculative_tokens=4, num_pages=12, enable_prefix_caching=caching)
    ids = [spec.add_request(p, MAX_NEW) for p in prompts]
    run_checked(spec)
    assert [spec.output(i) for i in ids] == want
    assert sum(s.num_preempted for s in spec.stats) > 0, "no preemption"
    assert sum(s.num_accepted_tokens for s in spec.stats) > 0
    if caching:
        assert sum(s.num_cached_tokens for s in spec.stats) > 0, "no prefix cache hit"
    assert spec.scheduler.allocator.num_free == spec.num_pages


def test_stop_tokens_and_max_tokens_end_a_speculative_request_where_they_would():
    prompt = PROMPTS[4]
    want = engine().generate([prompt], MAX_NEW)[0]
    stop = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[want[5]], seed=0)
    spec = engine(num_speculative_tokens=5)
    i = spec.add_request(prompt, sampling_params=stop)
    run_checked(spec)
    out = spec.request_output(i)
    assert list(out.token_ids) == want[: want.index(want[5]) + 1]
    assert out.finish_reason == "stop"
    assert spec.scheduler.allocator.num_free == spec.num_pages


def test_logprobs_come_one_per_token_with_speculation():
    asked = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, seed=0, logprobs=2)
    plain, spec = engine(), engine(num_speculative_tokens=3)
    outputs = []
    for eng in (plain, spec):
        i = eng.add_request(PROMPTS[4], sampling_params=asked)
        run_checked(eng)
        outputs.append(eng.request_output(i))
    assert outputs[0].token_ids == outputs[1].token_ids
    for want, got in zip(outputs[0].logprobs, outputs[1].logprobs, strict=True):
        assert want.keys() == got.keys()
        assert np.allclose(list(want.values()), list(got.values()), atol=1e-4)


# --- bad settings and bad drafts -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_speculative_tokens": -1}, r"num_speculative_tokens=-1 must be an int >= 0"),
        ({"num_speculative_tokens": 2.0}, r"num_speculative_tokens=2.0 must be an int"),
        ({"num_speculative_tokens": 16}, r"num_speculative_tokens=16 needs 17 q rows .* "
         r"max_num_batched_tokens=16"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, r"prompt_lookup_min=0"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
         r"prompt_lookup_min=4 > prompt_lookup_max=3"),
    ],
)  # fmt: skip
def test_speculative_settings_that_cannot_work_are_refused(kwargs, words):
    with pytest.raises(EngineError, match=words) as err:
        engine(**kwargs)
    assert err.value.hint


def scheduler_state(eng: Engine):
    s = eng.scheduler
    return (
        [(r.request_id, list(r.pages), r.num_computed, list(r.output)) for r in s.running],
        [r.request_id for r in s.waiting],
        s.allocator.num_free,
        eng.num_steps,
    )


@pytest.mark.parametrize(
    "drafts, words",
    [([1, 2, 3, 4], r"\[1, 2, 3, 4\], must be at most 3 token ids"),
     ([1, 64], r"\[1, 64\], must be at most 3 token ids in \[0, vocab_size=64\)"),
     (["a"], r"\['a'\]"), (None, "None")],
)  # fmt: skip
def test_a_proposers_bad_drafts_are_refused_and_change_nothing(drafts, words):
    eng = engine(num_speculative_tokens=3)
    for p in PROMPTS[:3]:
        eng.add_request(p, MAX_NEW)
    for _ in range(4):
        eng.step()
    before = scheduler_state(eng)
    good = eng.scheduler.propose_drafts
    eng.scheduler.propose_drafts = lambda token_ids: drafts
    with pytest.raises(EngineError, match=words):
        eng.step()
    assert scheduler_state(eng) == before
    assert not eng.scheduler.accounting_problems()
    eng.scheduler.propose_drafts = good
    run_checked(eng)  # and it carries on
    assert eng.scheduler.allocator.num_free == eng.num_pages


# --- the sampled distribution ----------------------------------------------------------------

TINY = ModelConfig(vocab_size=4, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
TINY_PARAMS = jax.tree.map(lambda w: w / 4, init_params(TINY, seed=3))  # logits of spread ~1
TINY_PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
# (temperature, top_k, top_p): plain sampling, where the processed logits are the raw ones,
# and every setting away from its neutral value, where a draft's probability taken from the
# raw logits (not the processed ones) keeps drafts at the wrong rate.
SETTINGS = {"plain": (1.0, 0, 1.0), "temperature 0.7, top_k 3, top_p 0.9": (0.7, 3, 0.9)}
COUNTED = 3  # the first three tokens: 64 outcomes
NUM_REQUESTS = 1500
SIGNIFICANCE = 1e-4  # the correct sampler's fixed-seed p-value must be above it


def processed_probs(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution a draw comes from, by the rule `SamplingParams` states, in float64:
    logits / temperature; the top_k most likely (0: all); of those, the fewest most likely
    whose probability reaches top_p."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    kept = np.zeros(len(scaled), bool)
    kept[order[: top_k or len(scaled)]] = True
    probs = np.where(kept, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    reached = np.cumsum(probs[order]) >= top_p
    fewest = int(np.argmax(reached)) + 1 if reached.any() else len(scaled)
    kept[:] = False
    kept[order[:fewest]] = True
    probs = np.where(kept, probs, 0.0)
    return probs / probs.sum()


def exact_distribution(temperature, top_k, top_p) -> dict[tuple[int, ...], float]:
    """P(first COUNTED tokens) from the dense model's logits, path by path."""
    cache = jnp.zeros((TINY.num_layers, 64, TINY.num_kv_heads, TINY.head_dim))
    probs = {}
    for path in itertools.chain.from_iterable(
        itertools.product(range(4), repeat=n) for n in range(COUNTED)
    ):
        tokens = np.zeros(64, np.int32)
        tokens[: len(TINY_PROMPT) + len(path)] = TINY_PROMPT + list(path)
        logits, _, _ = dense_forward(TINY_PARAMS, TINY, tokens, 0, cache, cache)
        last = logits[len(TINY_PROMPT) + len(path) - 1]
        probs[path] = processed_probs(last, temperature, top_k, top_p)
    return {
        path: float(np.prod([probs[path[:i]][t] for i, t in enumerate(path)]))
        for path in itertools.product(range(4), repeat=COUNTED)
    }


def sampled_counts(num_speculative_tokens: int, settings) -> tuple[dict, Engine]:
    temperature, top_k, top_p = settings
    eng = Engine(TINY_PARAMS, TINY, num_pages=512, page_size=4, max_num_batched_tokens=256,
                 max_num_seqs=64, num_speculative_tokens=num_speculative_tokens)  # fmt: skip
    ids = [
        eng.add_request(TINY_PROMPT, sampling_params=SamplingParams(
            max_tokens=COUNTED + 1, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed))
        for seed in range(NUM_REQUESTS)
    ]  # fmt: skip
    while eng.has_unfinished:
        eng.step()
    counts = {}
    for i in ids:
        path = tuple(eng.output(i)[:COUNTED])
        counts[path] = counts.get(path, 0) + 1
    return counts, eng


def chi_square_p_value(counts: dict, exact: dict) -> float:
    """Pearson's test, outcomes with an expected count below 5 pooled into one."""
    observed, expected, pooled = [], [], [0.0, 0.0]
    for path, p in exact.items():
        if p * NUM_REQUESTS < 5:
            pooled[0] += counts.get(path, 0)
            pooled[1] += p * NUM_REQUESTS
        else:
            observed.append(counts.get(path, 0))
            expected.append(p * NUM_REQUESTS)
    if pooled[1]:
        observed.append(pooled[0])
        expected.append(pooled[1])
    assert sum(observed) == NUM_REQUESTS and len(observed) >= 10
    return float(
        scipy_stats.chisquare(observed, np.array(expected) * NUM_REQUESTS / sum(expected)).pvalue
    )


@functools.cache
def exact(name: str) -> dict[tuple[int, ...], float]:
    distribution = exact_distribution(*SETTINGS[name])
    assert abs(sum(distribution.values()) - 1) < 1e-5
    assert max(distribution.values()) < 0.2, "too peaked to test the sampler"
    return distribution


@pytest.mark.parametrize("name", SETTINGS)
def test_sampled_speculation_keeps_the_output_distribution(name):
    counts, eng = sampled_counts(num_speculative_tokens=2, settings=SETTINGS[name])
    proposed = sum(s.num_draft_tokens for s in eng.stats)
    accepted = sum(s.num_accepted_tokens for s in eng.stats)
    assert proposed >= NUM_REQUESTS and 0.1 * proposed < accepted < 0.9 * proposed
    assert chi_square_p_value(counts, exact(name)) > SIGNIFICANCE


def too_willing(uniform, p_draft):
    """A wrong acceptance rule: keep a draft with probability sqrt(p(x)), not p(x)."""
    return uniform < jnp.sqrt(p_draft)


def test_the_distribution_test_fails_a_wrong_acceptance_rule(monkeypatch):
    wrong = functools.partial(rejection_sample, keep=too_willing)
    monkeypatch.setattr(engine_module, "rejection_sample", wrong)
    counts, _ = sampled_counts(num_speculative_tokens=2, settings=SETTINGS["plain"])
    assert chi_square_p_value(counts, exact("plain")) < SIGNIFICANCE


def test_rejection_sample_draws_the_first_token_from_p_whatever_the_draft():
    """The sampler alone, many seeds at once: the first token's frequencies are p's, for a
    likely draft and an unlikely one."""
    n = 20000
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, 2, 4))
    keys = jnp.stack([jnp.zeros(n, jnp.uint32), jnp.arange(n, dtype=jnp.uint32)], axis=1)
    for draft in (0, 3):
        tokens, accepted = rejection_sample(
            logits, jnp.full((n, 1), draft), jnp.ones(n, jnp.int32), keys,
            jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.ones(n),
        )  # fmt: skip
        first = np.bincount(np.asarray(tokens[:, 0]), minlength=4)
        assert scipy_stats.chisquare(first, p * n).pvalue > SIGNIFICANCE
        kept = np.asarray(accepted) == 1
        assert abs(kept.mean() - p[draft]) < 4 * np.sqrt(p[draft] / n)  # kept w.p. p(draft)


@pytest.mark.parametrize(
    "settings",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 3, 1.0), (0.7, 3, 0.8), (1.5, 0, 0.6)],
    ids=["plain", "temperature", "top_k", "top_k and top_p", "top_p"],
)
def test_a_draft_is_kept_with_its_probability_after_temperature_top_k_and_top_p(settings):
    """The sampler alone, many seeds at once: a draft is kept with its probability under the
    request's temperature, top_k and top_p (computed here by the stated rule), and the first
    token's frequencies are that distribution's, zero where top-k or top-p drop a token."""
    temperature, top_k, top_p = settings
    n = 20000
    raw = np.log([0.4, 0.3, 0.2, 0.1])
    p = processed_probs(raw, temperature, top_k, top_p)
    logits = jnp.broadcast_to(jnp.asarray(raw, jnp.float32), (n, 2, 4))
    keys = jnp.stack([jnp.zeros(n, jnp.uint32), jnp.arange(n, dtype=jnp.uint32)], axis=1)
    for draft in (0, 1):
        tokens, accepted = rejection_sample(
            logits,
            jnp.full((n, 1), draft),
            jnp.ones(n, jnp.int32),
            keys,
            jnp.zeros(n, jnp.int32),
            jnp.full(n, temperature, jnp.float32),
            jnp.full(n, top_k, jnp.int32),
            jnp.full(n, top_p, jnp.float32),
        )
        kept = np.asarray(accepted) == 1
        assert abs(kept.mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n) + 1e-9
        first = np.bincount(np.asarray(tokens[:, 0]), minlength=4)
        assert np.all(first[p == 0] == 0)
        assert scipy_stats.chisquare(first[p > 0], p[p > 0] * n).pvalue > SIGNIFICANCE
