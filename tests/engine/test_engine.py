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
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import minilib
from minilib.engine import (
    Engine,
    EngineError,
    ModelConfig,
    SamplingParams,
    dense_generate,
    init_params,
)
from minilib.engine.model import dense_forward, dense_generate_with_margins
from minilib.engine.prefix_cache import BlockPool, find_longest_cache_hit, hash_request_tokens
from minilib.engine.scheduler import can_admit
from minilib.errors import KVCacheError
from minilib.kv_cache import pages_needed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32)
PARAMS = init_params(CONFIG, seed=0)
# Prompt lengths from 1 to 30: several are longer than the budget of 16 tokens (chunked).
PROMPTS = [np.random.default_rng(1).integers(0, 64, n).tolist() for n in (3, 17, 9, 30, 1, 12)]
MAX_NEW = 8
BF16_MARGIN = 0.25  # logits; bf16 rounding moves them by a few hundredths here

IMPLEMENTATIONS = {
    "jnp": minilib.ragged_paged_attention_jnp,
    "blockwise": minilib.ragged_paged_attention_blockwise,
}


@pytest.fixture(scope="module")
def dense_tokens():
    return [dense_generate(PARAMS, CONFIG, p, MAX_NEW) for p in PROMPTS]


def engine(attention=minilib.ragged_paged_attention_jnp, params=PARAMS, config=CONFIG, **kw):
    sizes = {"num_pages": 32, "page_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    return Engine(params, config, attention=attention, **(sizes | kw))


def assert_all_pages_free(eng: Engine):
    allocator = eng.scheduler.allocator
    assert allocator.num_free == eng.num_pages and allocator.num_used == 0
    assert not eng.has_unfinished


def checked_step(eng: Engine):
    """One step, then the pool's books: every count, the free queue, the cached pages."""
    stats = eng.step()
    problems = eng.scheduler.accounting_problems()
    assert not problems, f"after step {stats.step}: {problems}"
    return stats


def run_checked(eng: Engine, aborts=None):
    """Step to the end, checking the books after every step; `aborts` maps a step to the
    request ids aborted right after it (checked too)."""
    while eng.has_unfinished:
        stats = checked_step(eng)
        for request_id in (aborts or {}).get(stats.step, ()):
            eng.abort_request(request_id)
            assert not eng.scheduler.accounting_problems(), f"abort of {request_id}"


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
    # The default attention; it compiles per (q_len, kv_len), so three short requests.
    eng = Engine(PARAMS, CONFIG, num_pages=6, page_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    assert eng.attention is minilib.ref_ragged_paged_attention
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


# --- prefix caching --------------------------------------------------------------------------

PAGE = 4
SYSTEM = np.random.default_rng(5).integers(0, 64, 10).tolist()  # 2 full pages and 2 tokens


def shared_prefix_prompts():
    rng = np.random.default_rng(6)
    a = SYSTEM + rng.integers(0, 64, 3).tolist()  # 13 tokens: 3 full pages
    b = SYSTEM + rng.integers(0, 64, 5).tolist()  # shares pages 0 and 1 with a
    c = list(a)  # wholly cached but for its last token: 12 of 13 hit
    d = SYSTEM[:8]  # 8 tokens, both pages cached: the last page is computed anew
    e = rng.integers(0, 64, 6).tolist()  # nothing in common
    f = rng.integers(0, 64, 4).tolist() + SYSTEM[4:8]  # a's page 1, after another page 0
    return [a, b, c, d, e, f], [0, 8, 12, 4, 0, 0]


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_prefix_caching_computes_only_what_is_not_cached(enable_prefix_caching):
    prompts, want_cached = shared_prefix_prompts()
    eng = engine(page_size=PAGE, enable_prefix_caching=enable_prefix_caching)
    first = eng.add_request(prompts[0], 5)
    checked_step(eng)  # a's whole prompt in one step: its full pages are cached now
    ids = [first] + [eng.add_request(p, 5) for p in prompts[1:]]
    run_checked(eng)
    outputs = [eng.request_output(i) for i in ids]
    assert [list(o.token_ids) for o in outputs] == [
        dense_generate(PARAMS, CONFIG, p, 5) for p in prompts
    ]
    cached = [o.num_cached_tokens for o in outputs]
    assert cached == (want_cached if enable_prefix_caching else [0] * len(prompts))
    # Only the uncached prompt tokens ran as prefill (no preemption in this run) ...
    assert sum(s.num_preempted for s in eng.stats) == 0
    prefill = sum(s.num_prefill_tokens for s in eng.stats)
    assert prefill == sum(len(p) for p in prompts) - sum(cached)
    # ... and a prompt that is cached but for its last token computes just that one, or the
    # whole page that holds it when the hit would end on a page boundary.
    first_chunks = {i: n for s in eng.stats for i, kind, n in s.batch[::-1] if kind == "prefill"}
    if enable_prefix_caching:
        assert (first_chunks[ids[2]], first_chunks[ids[3]]) == (1, PAGE)
        assert any(s.shared_pages for s in eng.stats), "no page was ever shared"
        shared = next(s for s in eng.stats if s.shared_pages)
        page = shared.shared_pages[0]  # two page tables point at one page
        holders = [i for i, pages in shared.page_tables if page in pages]
        assert len(holders) >= 2 and list(shared.page_owners[page]) == sorted(holders)
        assert eng.scheduler.allocator.cached_pages, "finished requests' pages stay cached"
    assert_all_pages_free(eng)


def test_sharing_a_prefix_uses_fewer_pages():
    prompts, _ = shared_prefix_prompts()
    peaks = {}
    for caching in (False, True):
        eng = engine(page_size=PAGE, max_num_seqs=6, enable_prefix_caching=caching)
        eng.add_request(prompts[0], 5)
        checked_step(eng)
        for p in prompts[1:4]:
            eng.add_request(p, 5)
        run_checked(eng)
        peaks[caching] = max(s.num_pages_used for s in eng.stats)
    assert peaks[True] < peaks[False], peaks


def test_prefix_caching_under_preemption_and_abort():
    rng = np.random.default_rng(7)
    prompts = [SYSTEM + rng.integers(0, 64, n).tolist() for n in (5, 2, 7, 1, 3)]
    sampling = [SamplingParams(max_tokens=8, temperature=0.8, seed=20 + i) for i in range(5)]
    eng = engine(page_size=PAGE, num_pages=9, max_num_batched_tokens=8, max_num_seqs=4,
                 enable_prefix_caching=True)  # fmt: skip
    ids = [eng.add_request(p, sampling_params=sp) for p, sp in zip(prompts, sampling, strict=True)]
    run_checked(eng, aborts={2: [ids[4]], 6: [ids[0]]})  # a waiting one, then a running one
    outputs = [eng.request_output(i) for i in ids]
    dense = [
        dense_generate(PARAMS, CONFIG, p, sampling_params=sp)
        for p, sp in zip(prompts, sampling, strict=True)
    ]
    for out, want in zip(outputs, dense, strict=True):
        if out.finish_reason == "abort":
            assert list(out.token_ids) == want[: len(out.token_ids)] != want
        else:
            assert (list(out.token_ids), out.finish_reason) == (want, "length")
    assert [o.finish_reason for o in outputs].count("abort") == 2
    assert sum(s.num_preempted for s in eng.stats) > 0, "no preemption: make the pool smaller"
    assert any(s.shared_pages for s in eng.stats)
    readmitted_hits = sum(s.num_cached_tokens for s in eng.stats) - sum(
        o.num_cached_tokens for o in outputs
    )
    assert readmitted_hits > 0, "a preempted request should find its own pages again"
    assert_all_pages_free(eng)


def test_block_pool_evicts_least_recently_used_and_counts_references():
    pool = BlockPool(4)
    prompt = list(range(12))
    hashes = hash_request_tokens(prompt, PAGE)
    pages = pool.allocate(3)
    for page, h in zip(pages, hashes, strict=True):
        pool.cache_page(page, h)
    assert find_longest_cache_hit(hashes, pool, max_cache_hit_length=12, page_size=PAGE) == pages
    pool.touch(pages[:2])  # a second request shares the first two pages
    pool.free(pages)  # the first one finishes: page 2 is free, pages 0 and 1 still in use
    assert [pool.ref_cnt(p) for p in range(4)] == [1, 1, 0, 0]
    assert pool.free_pages == (3, 2)  # uncached page 3 first; cached page 2 kept longest
    pool.free(pages[:2])  # the second finishes: the prefix's start is evicted last
    assert pool.free_pages == (3, 2, 1, 0) and pool.cached_pages == (0, 1, 2)
    assert pool.allocate(2) == [3, 2]  # page 2 is evicted: its hash is forgotten
    assert pool.cached_pages == (0, 1)
    assert find_longest_cache_hit(hashes, pool, max_cache_hit_length=12, page_size=PAGE) == [0, 1]
    pool.touch([0])  # a hit on a free cached page takes it out of the free queue
    assert pool.free_pages == (1,) and pool.ref_cnt(0) == 1
    # Chained hashes: the same four tokens after another first page are not a hit.
    other = hash_request_tokens([63] * 4 + prompt[4:8], PAGE)
    assert find_longest_cache_hit(other, pool, max_cache_hit_length=8, page_size=PAGE) == []
    assert hash_request_tokens(prompt[:7], PAGE) == hashes[:1], "a partial page has no hash"


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda pool: pool.free([2]), "not in use"),
        (lambda pool: pool.free([0, 0]), "twice"),
        (lambda pool: pool.touch([1]), "not cached"),
        (lambda pool: pool.touch([9]), "page=9"),
        (lambda pool: pool.allocate(5), "Out of pages"),
        (lambda pool: pool.free(0), "list of page numbers"),
        (lambda pool: pool.cache_page(3, b"x"), "free"),
    ],
)
def test_block_pool_refuses_bad_calls_and_changes_nothing(call, words):
    pool = BlockPool(4)
    pages = pool.allocate(2)
    pool.cache_page(pages[0], b"h")
    before = (pool.free_pages, pool.cached_pages, [pool.ref_cnt(p) for p in range(4)])
    with pytest.raises(KVCacheError, match=words):
        call(pool)
    assert before == (pool.free_pages, pool.cached_pages, [pool.ref_cnt(p) for p in range(4)])


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


# --- abort, request ids and outputs ----------------------------------------------------------


def test_abort_frees_pages_at_once_and_the_others_carry_on(dense_tokens):
    eng = engine(max_num_seqs=2)
    ids = [eng.add_request(p, MAX_NEW) for p in PROMPTS[:3]]
    checked_step(eng)
    checked_step(eng)
    running, waiting = eng.requests[ids[1]], eng.requests[ids[2]]
    assert running in eng.scheduler.running and waiting in eng.scheduler.waiting
    free_before, held = eng.scheduler.allocator.num_free, len(running.pages)
    eng.abort_request(ids[1])
    assert eng.scheduler.allocator.num_free == free_before + held > free_before
    eng.abort_request(ids[2])
    assert not eng.scheduler.accounting_problems()
    for i in ids[1:]:
        out = eng.request_output(i)
        assert out.finish_reason == "abort" and out.metrics.finished_step == 2
        assert list(out.token_ids) == dense_tokens[ids.index(i)][: len(out.token_ids)]
    eng.abort_request(ids[1])  # already finished: nothing changes
    assert eng.request_output(ids[1]).finish_reason == "abort"
    run_checked(eng)
    assert eng.output(ids[0]) == dense_tokens[0]
    assert eng.request_output(ids[0]).finish_reason == "length"
    assert_all_pages_free(eng)


def test_tpot_of_an_aborted_request_runs_from_its_first_token_to_its_last():
    """As vLLM: TPOT is measured between token timestamps, so the wait after the last token
    until the abort (and the step that did not run for it) does not count."""
    eng = engine()
    request_id = eng.add_request(PROMPTS[0], MAX_NEW)  # alone: a token every step
    for _ in range(3):
        checked_step(eng)
    time.sleep(0.2)
    eng.abort_request(request_id)
    out = eng.request_output(request_id)
    m, n = out.metrics, len(out.token_ids)
    assert (n, m.first_token_step, m.last_token_step, m.finished_step) == (3, 0, 2, 3)
    assert m.steps_per_output_token(n) == 1.0
    assert m.finished_time - m.last_token_time >= 0.2
    assert 0 < m.time_per_output_token(n) <= (m.finished_time - m.first_token_time - 0.2) / 2


def test_a_step_that_can_schedule_nothing_raises_engine_error_and_changes_nothing(dense_tokens):
    """A request waits, nothing runs, and the admission rule (a hook the exercises replace)
    refuses it: the engine's own EngineError, a ValueError with a hint, and no step taken."""
    eng = engine()
    request_id = eng.add_request(PROMPTS[0], MAX_NEW)
    eng.scheduler.admission_rule = lambda *args, **kwargs: False
    with pytest.raises(EngineError, match="No request could be scheduled: 1 waiting") as err:
        eng.step()
    assert isinstance(err.value, ValueError) and "admission_rule" in err.value.hint
    assert (eng.num_steps, eng.stats, eng.scheduler.allocator.num_free) == (0, [], eng.num_pages)
    assert list(eng.scheduler.waiting) == [eng.requests[request_id]]
    eng.scheduler.admission_rule = can_admit
    run_checked(eng)
    assert eng.output(request_id) == dense_tokens[0]


@pytest.mark.parametrize("caching", [False, True], ids=["plain pool", "prefix caching"])
def test_a_step_whose_model_raises_counts_for_nothing_and_the_next_step_runs_it(
    dense_tokens, caching
):
    """Every step's first try fails in the last layer's attention (after the first layer has
    written its K/V): the error reaches the caller, the cache, the step count, the stats and
    the metrics stay as they were, and the books hold. The next step runs the plan that
    failed: the steps, preemptions among them, are those of a run that never failed, and end
    with the dense model's tokens."""
    failing = {"try": True, "calls": 0}

    def attention_that_fails_once_a_step(*args, **kwargs):
        failing["calls"] += 1
        if failing["try"] and failing["calls"] == CONFIG.num_layers:
            raise RuntimeError("the attention failed")
        return minilib.ragged_paged_attention_jnp(*args, **kwargs)

    eng = engine(attention_that_fails_once_a_step, num_pages=10, enable_prefix_caching=caching)
    ids = [eng.add_request(p, MAX_NEW) for p in PROMPTS]
    preempted = 0
    while eng.has_unfinished:
        cache, kept = eng.kv_pages, (eng.num_steps, len(eng.stats))
        metrics = [dataclasses.asdict(r.metrics) for r in eng.requests.values()]
        outputs = [list(r.output) for r in eng.requests.values()]
        failing.update({"try": True, "calls": 0})
        with pytest.raises(RuntimeError, match="the attention failed"):
            eng.step()
        assert eng.kv_pages is cache and (eng.num_steps, len(eng.stats)) == kept
        assert [dataclasses.asdict(r.metrics) for r in eng.requests.values()] == metrics
        assert [list(r.output) for r in eng.requests.values()] == outputs
        assert not eng.scheduler.accounting_problems()
        failing.update({"try": False, "calls": 0})
        preempted += len(checked_step(eng).preempted)
    assert preempted > 0, "10 pages are meant to force preemption"
    assert [eng.output(i) for i in ids] == dense_tokens
    clean = engine(num_pages=10, enable_prefix_caching=caching)
    for p in PROMPTS:
        clean.add_request(p, MAX_NEW)
    run_checked(clean)
    steps = [(s.admitted, s.preempted, s.batch, s.num_cached_tokens) for s in eng.stats]
    assert steps == [(s.admitted, s.preempted, s.batch, s.num_cached_tokens) for s in clean.stats]


def test_aborting_a_request_of_a_failed_step_makes_the_next_step_plan_afresh(dense_tokens):
    def failing(*args, **kwargs):
        raise RuntimeError("the attention failed")

    eng = engine(num_pages=10)
    ids = [eng.add_request(p, MAX_NEW) for p in PROMPTS]
    checked_step(eng)
    eng.attention = failing
    with pytest.raises(RuntimeError, match="the attention failed"):
        eng.step()
    eng.abort_request(ids[1])  # it ran in the failed step
    assert not eng.scheduler.accounting_problems()
    eng.attention = minilib.ragged_paged_attention_jnp
    stats = checked_step(eng)
    assert ids[1] not in [request_id for request_id, _, _ in stats.batch]
    run_checked(eng)
    assert eng.request_output(ids[1]).finish_reason == "abort"
    assert [eng.output(i) for i in ids if i != ids[1]] == dense_tokens[:1] + dense_tokens[2:]


def test_request_ids_are_never_reused_and_finished_requests_can_be_forgotten(dense_tokens):
    eng = engine()
    a = eng.add_request(PROMPTS[0], MAX_NEW)
    b = eng.add_request(PROMPTS[1], MAX_NEW)
    checked_step(eng)
    assert eng.pop_finished_outputs() == []
    run_checked(eng)
    c = eng.add_request(PROMPTS[2], MAX_NEW)
    popped = eng.pop_finished_outputs()
    assert [(o.request_id, list(o.token_ids)) for o in popped] == [
        (a, dense_tokens[0]),
        (b, dense_tokens[1]),
    ]
    assert set(eng.requests) == {c}
    d = eng.add_request(PROMPTS[3], MAX_NEW)
    assert (a, b, c, d) == (0, 1, 2, 3)
    with pytest.raises(EngineError, match="forgotten") as err:
        eng.request_output(a)
    assert "Hint:" in str(err.value)
    for bad, words in ((7, "ids 0 .. 3 only"), ("0", "ints"), (True, "ints"), (1.0, "ints")):
        with pytest.raises(EngineError, match=words):
            eng.abort_request(bad)
    run_checked(eng)
    assert [eng.output(c), eng.output(d)] == dense_tokens[2:4]


def test_request_metrics_in_seconds_and_steps():
    eng = engine(max_num_seqs=1)  # one at a time: the second waits for the first
    early = time.perf_counter() - 0.5
    ids = [eng.add_request(PROMPTS[0], 4, arrival_time=early), eng.add_request(PROMPTS[2], 4)]
    checked_step(eng)
    running = eng.request_output(ids[0])
    assert running.finish_reason is None and running.metrics.finished_time is None
    run_checked(eng)
    assert running.metrics.finished_time is None, "an output is a snapshot"
    m0, m1 = (eng.request_output(i).metrics for i in ids)
    for m in (m0, m1):
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.steps_per_output_token(4) == 1.0  # alone in the batch: a token every step
        assert m.time_per_output_token(4) > 0
    assert m0.arrival_time == early and m0.time_to_first_token >= 0.5
    assert (m0.arrival_step, m0.first_scheduled_step, m0.first_token_step) == (0, 0, 0)
    assert m0.finished_step == 3 and m1.first_scheduled_step == 4 and m1.time_in_queue > 0
    assert m1.steps_to_first_token == 5


BAD_ADDS = {
    "both max_new_tokens and sampling_params": (
        {"max_new_tokens": 4, "sampling_params": SamplingParams()},
        "Both",
    ),
    "neither": ({}, "Neither"),
    "sampling_params of another type": ({"sampling_params": {"temperature": 0.5}}, "not a"),
    "stop token outside the vocabulary": (
        {"sampling_params": SamplingParams(stop_token_ids=[64])},
        "outside the vocabulary",
    ),
    "more logprobs than the vocabulary": (
        {"sampling_params": SamplingParams(max_tokens=4, logprobs=65)},
        "logprobs=65",
    ),
    "too many tokens for the pool": (
        {"sampling_params": SamplingParams(max_tokens=40)},
        "whole pool",
    ),
    "arrival_time in the future": (
        {"max_new_tokens": 4, "arrival_time": time.perf_counter() + 1e6},
        "arrival_time",
    ),
    "arrival_time not a number": ({"max_new_tokens": 4, "arrival_time": "now"}, "arrival_time"),
}


@pytest.mark.parametrize("case", list(BAD_ADDS))
def test_bad_sampling_request_is_refused_and_changes_nothing(case):
    kwargs, words = BAD_ADDS[case]
    seedless = SamplingParams(max_tokens=4)
    reference = engine(num_pages=10)
    reference.add_request(PROMPTS[1], sampling_params=seedless)
    want = reference.generate([PROMPTS[0]], sampling_params=seedless)
    eng = engine(num_pages=10)
    first = eng.add_request(PROMPTS[1], sampling_params=seedless)
    checked_step(eng)
    with pytest.raises(EngineError, match=words) as err:
        eng.add_request(PROMPTS[0], **kwargs)
    assert "Hint:" in str(err.value)
    # Nothing changed: the next id is the next one, and the engine's generator was not
    # advanced (a seedless request gets the seed it would have got).
    second = eng.add_request(PROMPTS[0], sampling_params=seedless)
    assert second == first + 1
    run_checked(eng)
    assert eng.output(second) == want[0]
    assert eng.output(first) == reference.output(0)


def test_dense_generate_refuses_bad_sampling_requests():
    for kwargs, words in list(BAD_ADDS.values())[:4]:
        with pytest.raises(EngineError, match=words):
            dense_generate(PARAMS, CONFIG, PROMPTS[0], **kwargs)


@pytest.mark.parametrize(
    "seed", [0, 1] + [pytest.param(seed, marks=pytest.mark.slow) for seed in range(2, 12)]
)
def test_random_serving_runs_match_dense_and_keep_the_books(seed):
    """A sweep: shared prefixes, sampled and greedy requests, small pools (preemption),
    aborts at random steps; books after every step, tokens against the dense model."""
    rng = np.random.default_rng(100 + seed)
    prefix = rng.integers(0, 64, int(rng.integers(4, 14))).tolist()
    prompts = [
        (prefix if rng.random() < 0.7 else [])
        + rng.integers(0, 64, int(rng.integers(1, 9))).tolist()
        for _ in range(6)
    ]
    sampling = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 9)),
            temperature=float(rng.choice([0.0, 0.7, 1.0])),
            top_k=int(rng.choice([0, 5])),
            top_p=float(rng.choice([1.0, 0.8])),
            seed=int(rng.integers(1000)),
        )
        for _ in prompts
    ]
    page_size = int(rng.choice([2, 4]))
    largest = max(
        pages_needed(len(p) + sp.max_tokens - 1, page_size)
        for p, sp in zip(prompts, sampling, strict=True)
    )
    eng = engine(
        page_size=page_size,
        num_pages=largest + int(rng.integers(0, 8)),  # the largest request fits, maybe no more
        max_num_batched_tokens=int(rng.choice([6, 16])),
        max_num_seqs=int(rng.integers(2, 5)),
        enable_prefix_caching=bool(rng.random() < 0.8),
    )
    ids = [eng.add_request(p, sampling_params=sp) for p, sp in zip(prompts, sampling, strict=True)]
    aborts = {int(rng.integers(0, 8)): [int(rng.choice(ids))]}
    run_checked(eng, aborts=aborts)
    for i, p, sp in zip(ids, prompts, sampling, strict=True):
        out, want = eng.request_output(i), dense_generate(PARAMS, CONFIG, p, sampling_params=sp)
        if out.finish_reason == "abort":
            assert list(out.token_ids) == want[: len(out.token_ids)]
        else:
            assert list(out.token_ids) == want, (seed, i)
    assert_all_pages_free(eng)


# --- sharded over 1, 2 and 4 simulated devices -----------------------------------------------


def run_sharded_check(num_devices: int = 4) -> dict:
    """tests/engine/engine_sharded_check.py in a fresh process with `num_devices` CPU devices."""
    env = dict(os.environ)
    # The device count, after any flags of the test run's own (tasks.py's unoptimised compiles).
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_devices}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = ROOT / "tests" / "engine" / "engine_sharded_check.py"
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded():
    return run_sharded_check(4)


def test_sharded_runs_equal_the_unsharded_run_and_the_dense_model(sharded):
    assert sharded["num_devices"] == 4
    for run in sharded["runs"]:
        assert run["tokens"] == run["unsharded"] == run["dense"], run
        assert run["pages_free"], run
    seen = {(run["attention"], run["mesh_size"]) for run in sharded["runs"]}
    want = {("jnp", 1), ("jnp", 2), ("jnp", 4), ("blockwise", 2), ("blockwise", 4)}
    assert want | {("kernel", 4), ("ref", 4)} <= seen, seen


def test_sharded_kv_pages_are_split_by_kv_head(sharded):
    # Each device holds 2*num_kv_heads/D of the combined head axis: its KV heads' K and V.
    assert sharded["shard_shapes"]["4"] == [[16, 4, 2, 32]] * 4


def test_sharded_projections_are_split_by_head(sharded):
    specs = sharded["weight_specs"]
    for name in ("wq", "wk", "wv", "wo"):
        assert "kv_heads" in specs[name], specs
    assert "kv_heads" not in specs["w_in"] + specs["w_out"], specs


def test_more_devices_than_kv_heads_replicate_them(sharded):
    run = sharded["replicated"]
    assert run["tokens"] == run["dense"] and run["pages_free"], run
    assert run["replicas"] == 2
    # each of the 4 devices holds K and V of one KV head: a copy of one of the 2
    assert run["shard_shapes"] == [[16, 4, 2, 32]] * 4


def test_sharded_attention_sinks_match_dense(sharded):
    run = sharded["sinks"]
    assert run["tokens"] == run["dense"] != run["dense_without_sinks"], run


def test_sharded_serving_with_prefix_caching_sampling_and_abort(sharded):
    run = sharded["serving"]
    assert run["problems"] == [], run["problems"]
    assert run["tokens"] == run["dense"], run
    assert run["aborted_states"] == ["waiting", "running"]
    for reason, tokens, dense in run["aborted"]:
        assert reason == "abort" and tokens == dense[: len(tokens)] and len(tokens) < len(dense)
    assert any(tokens for _, tokens, _ in run["aborted"]), "the running one had tokens"
    assert run["num_cached_tokens"][1:4] == [8, 8, 8], run["num_cached_tokens"]
    assert run["preempted"] > 0 and run["shared_pages_seen"] and run["pages_free"], run


def test_bad_meshes_get_clear_errors(sharded):
    assert "num_kv_heads=4 is not divisible" in sharded["errors"]["kv heads not divisible"]
    assert "num_q_heads=6 is not divisible" in sharded["errors"]["q heads not divisible"]
    assert "'model'" in sharded["errors"]["unknown axis"]
    assert "Hint:" in sharded["errors"]["unknown axis"]
    assert "not a jax.sharding.Mesh" in sharded["errors"]["not a mesh"]


# --- the live view ---------------------------------------------------------------------------


def test_live_view_is_real_widgets_and_replays_every_step():
    import ipywidgets as widgets

    from minilib.engine.view import EngineView

    eng = engine(num_pages=10)
    view = EngineView(eng, "test")
    assert isinstance(view, widgets.VBox)
    assert all(isinstance(c, widgets.HTML | widgets.IntSlider) for c in view.children)
    for prompt in PROMPTS:
        eng.add_request(prompt, MAX_NEW)
    view.run(max_steps=1)
    assert len(eng.stats) == 1 and "step 0 of 1" in view.text
    view.run()
    n = len(eng.stats)
    assert not eng.has_unfinished
    assert (view.slider.max, view.slider.value) == (n - 1, n - 1)
    assert (
        f"step {n - 1} of {n}" in view.text and f"pages in use: 0 of {eng.num_pages}" in view.text
    )
    first = next(s for s in eng.stats if s.preempted)
    view.slider.value = first.step  # replay: the panels show that step again
    assert f"step {first.step} of {n}" in view.text
    assert f"preempted: r{first.preempted[0]}" in view.text
    assert view.pages.value.count("title='page ") == eng.num_pages
    for owner in {o for owners in first.page_owners for o in owners}:
        assert f">r{owner}</div>" in view.pages.value
    for request_id, kind, num_tokens in first.batch:
        assert f"r{request_id} {kind[0]}{num_tokens}" in view.text


def test_live_view_replays_the_steps_the_engine_kept():
    from minilib.engine.view import EngineView

    eng = engine(max_stats=4)
    view = EngineView(eng, "the last 4 steps")
    eng.add_request(PROMPTS[1], MAX_NEW)
    view.run()
    n = eng.num_steps
    assert n > 4 and (view.slider.min, view.slider.max, view.slider.value) == (n - 4, n - 1, n - 1)
    view.slider.value = n - 4  # the oldest step kept
    assert f"step {n - 4} of {n}" in view.text


def test_live_view_shows_shared_pages_and_page_tables():
    from minilib.engine.view import EngineView

    prompts, _ = shared_prefix_prompts()
    eng = engine(page_size=PAGE, enable_prefix_caching=True)
    view = EngineView(eng, "prefix caching")
    eng.add_request(prompts[0], 3)
    view.show(checked_step(eng))
    for p in prompts[1:4]:
        eng.add_request(p, 3)
    view.run()
    shared = next(s for s in eng.stats if s.shared_pages)
    view.slider.value = shared.step
    page = shared.shared_pages[0]
    holders = "+".join(f"r{o}" for o in shared.page_owners[page])
    assert f"title='page {page}: shared by " in view.pages.value
    assert f">{holders}</div>" in view.pages.value
    for request_id, pages in shared.page_tables:  # every request's row of page_indices
        assert f"r{request_id}: " in view.text
        assert all(f"title='page {p}:" in view.tables.value for p in pages)
    assert f"prompt tokens from the prefix cache: {shared.num_cached_tokens}" in view.text
    view.slider.value = len(eng.stats) - 1  # at the end: every page free, the full ones cached
    assert view.pages.value.count(">c</div>") == len(eng.stats[-1].cached_pages) > 0
