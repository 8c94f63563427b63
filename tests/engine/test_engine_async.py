"""minilib.engine.async_scheduling: `Engine(async_scheduling=True)` plans step n + 1 while
step n runs, and gives the tokens of synchronous scheduling, token for token: greedy and
sampled, through chunked prefill, preemption, prefix caching, aborts (of a request whose
token is in flight too), stop tokens and speculative decoding. The pool's books are checked
after every step, and no caller ever sees a placeholder.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import test_engine_spec_decode as spec_runs
from engine_runs import MAX_NEW, PROMPTS, assert_all_pages_free, engine

from minilib.engine import EngineError, SamplingParams
from minilib.engine.scheduler import PLACEHOLDER

SAMPLED = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_k=20, top_p=0.9)


def run(eng, prompts, params, abort_after=None) -> tuple[list, list]:
    """Serve `prompts` (one SamplingParams each) to the end, checking after every step the
    books, and that no output shows a placeholder (nor holds one, once ended);
    `abort_after` {request index: n} aborts that request once it has n tokens. Returns
    (tokens, finish reasons)."""
    ids = [eng.add_request(p, sampling_params=s) for p, s in zip(prompts, params, strict=True)]
    while eng.has_unfinished:
        eng.step()
        assert not eng.scheduler.accounting_problems()
        for i, n in (abort_after or {}).items():
            if len(eng.output(ids[i])) == n and not eng.requests[ids[i]].finished:
                eng.abort_request(ids[i])
                assert not eng.scheduler.accounting_problems()
        assert all(PLACEHOLDER not in eng.output(i) for i in ids)
        ended = [r.output for r in eng.requests.values() if r.finished]
        assert all(PLACEHOLDER not in output for output in ended), "a placeholder kept"
    outputs = [eng.request_output(i) for i in ids]
    return [list(o.token_ids) for o in outputs], [o.finish_reason for o in outputs]


def both(prompts, params, abort_after=None, **kw) -> tuple:
    """The same requests on a synchronous and an async engine: (sync's, async's, async
    engine)."""
    sync = run(engine(**kw), prompts, params, abort_after)
    eng = engine(async_scheduling=True, **kw)
    return sync, run(eng, prompts, params, abort_after), eng


@pytest.mark.parametrize("caching", [False, True])
def test_same_tokens_as_sync_through_preemption_and_sampling(caching):
    params = [dataclasses.replace(SAMPLED, seed=i) for i in range(len(PROMPTS))]
    params[0] = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)  # and one greedy
    sync, async_, eng = both(PROMPTS, params, num_pages=10, enable_prefix_caching=caching)
    assert async_ == sync
    assert sum(s.num_preempted for s in eng.stats) > 0, "no preemption"
    assert eng.async_loop.in_flight is None or not eng.async_loop.in_flight.plan.seqs
    assert_all_pages_free(eng)


def test_stop_tokens_end_a_request_whose_next_token_is_in_flight():
    greedy = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0)] * len(PROMPTS)
    (want, _), _, _ = both(PROMPTS, greedy)
    stops = [
        dataclasses.replace(p, stop_token_ids=(w[3],)) for p, w in zip(greedy, want, strict=True)
    ]
    stops[1] = dataclasses.replace(SAMPLED, seed=1, stop_token_ids=(5, 9, 17))
    sync, async_, eng = both(PROMPTS, stops)
    assert async_ == sync
    assert sync[1].count("stop") >= len(PROMPTS) - 1, sync[1]
    wasted = [s for s in eng.stats if any(i not in eng.scheduler.running for i, *_ in s.batch)]
    assert wasted, "no step ran a request that had stopped"
    assert_all_pages_free(eng)


def test_aborts_while_running_and_while_waiting_keep_the_same_tokens():
    params = [dataclasses.replace(SAMPLED, seed=i) for i in range(len(PROMPTS))]
    abort_after = {0: 2, 2: 5, 5: 0}  # request 5 is aborted before its first token
    sync, async_, eng = both(PROMPTS, params, abort_after, num_pages=10)
    assert async_ == sync
    assert [sync[1][i] for i in abort_after] == ["abort"] * 3
    assert [len(sync[0][i]) for i in abort_after] == list(abort_after.values())
    assert_all_pages_free(eng)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_decoding_gives_the_same_tokens(temperature):
    shared = spec_runs.PROMPTS[4] + [11, 12]
    prompts = [*spec_runs.PROMPTS, shared]
    params = [
        SamplingParams(max_tokens=spec_runs.MAX_NEW, temperature=temperature, seed=i)
        for i in range(len(prompts))
    ]
    kw = dict(num_speculative_tokens=4, num_pages=12, enable_prefix_caching=True)
    sync, async_, eng = both(prompts, params, **kw)
    assert async_ == sync
    assert sum(s.num_preempted for s in eng.stats) > 0, "no preemption"
    assert sum(s.num_accepted_tokens for s in eng.stats) > 0, "no draft kept"
    assert_all_pages_free(eng)


def test_logprobs_and_min_tokens_match_sync():
    params = [
        dataclasses.replace(SAMPLED, seed=i, logprobs=2, min_tokens=3, stop_token_ids=(i,))
        for i in range(len(PROMPTS))
    ]
    sync_engine, async_engine = engine(), engine(async_scheduling=True)
    assert run(async_engine, PROMPTS, params) == run(sync_engine, PROMPTS, params)
    for i in range(len(PROMPTS)):
        want = sync_engine.request_output(i).logprobs
        got = async_engine.request_output(i).logprobs
        assert [sorted(d) for d in got] == [sorted(d) for d in want]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose([g[t] for t in w], list(w.values()), atol=1e-5)


def test_the_next_step_is_launched_before_this_one_is_read():
    eng = engine(async_scheduling=True)
    ids = [eng.add_request(p, MAX_NEW) for p in PROMPTS[:2]]
    while not eng.requests[ids[0]].output:
        eng.step()
    in_flight = eng.async_loop.in_flight
    assert in_flight is not None and in_flight.plan.seqs
    assert eng.requests[ids[0]].output[-1] == PLACEHOLDER  # its token is on the device
    assert PLACEHOLDER in eng.last_batch.tokens.tolist()  # the model read it from there
    assert PLACEHOLDER not in eng.output(ids[0])
    assert PLACEHOLDER not in eng.request_output(ids[0]).token_ids


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_async_scheduling_must_be_a_bool(value):
    with pytest.raises(EngineError, match=f"async_scheduling={value!r} must be True or False"):
        engine(async_scheduling=value)
    assert issubclass(EngineError, ValueError)
