"""minilib.engine's requests: abort, failed steps, request ids, metrics, bad sampling requests,
and random serving runs against the dense model."""

from __future__ import annotations

import dataclasses
import time

import engine_runs
import numpy as np
import pytest
from engine_runs import (
    CONFIG,
    MAX_NEW,
    PARAMS,
    PROMPTS,
    assert_all_pages_free,
    checked_step,
    engine,
    run_checked,
)

import minilib
from minilib.engine import EngineError, SamplingParams, dense_generate
from minilib.engine.scheduler import can_admit
from minilib.kv_cache import pages_needed

dense_tokens = engine_runs.dense_tokens  # the fixture


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
