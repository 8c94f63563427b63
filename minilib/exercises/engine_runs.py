"""The engine runs behind notebook 10's checkers: a small `Engine` with a learner's hook in
its scheduler, run to the end, and what it did. `minilib.exercises.ex10_engine` compares a
learner's run with the run of minilib's own function.

`run_engine` plugs in an admission rule and a preemption step (exercises 10.1, 10.2);
`run_caching_engine` the step that names full pages for the prefix cache (10.3), on one of
the `caching_scenario`s, and checks every request's tokens against `dense_generate` (the
model run on its prompt alone).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from minilib.engine.scheduler import cache_full_pages, can_admit, preempt
from minilib.errors import EngineError

__all__ = ["caching_scenario", "run_caching_engine", "run_engine"]


@functools.cache
def _tiny_model(num_layers: int = 1):
    from minilib.engine import TINY_CONFIG, init_params

    config = dataclasses.replace(  # narrower still
        TINY_CONFIG, embed_dim=16, mlp_dim=32, num_layers=num_layers
    )
    return config, init_params(config, seed=7)


@functools.cache
def _dense_tokens(prompt: tuple[int, ...], max_new_tokens: int, num_layers: int) -> list[int]:
    """What the model generates for `prompt` alone, without the engine (`dense_generate`)."""
    from minilib.engine import dense_generate

    config, params = _tiny_model(num_layers)
    return dense_generate(params, config, list(prompt), max_new_tokens)


def run_engine(rule=can_admit, preempt_fn=preempt, *, seed: int = 0) -> dict:
    """Run a small engine with `rule` and `preempt_fn` in its scheduler; return its outputs,
    the admissions and preemptions of every step, and the pages left in use.

    >>> result = run_engine()
    >>> result["pages still in use at the end"]
    0
    >>> len(result["outputs"]), [len(tokens) for tokens in result["outputs"]]
    (5, [5, 5, 5, 5, 5])
    >>> any(result["preempted per step"])  # 7 pages are too few for all five at once
    True
    >>> result["each request's num_preemptions"]  # one of them twice
    [0, 0, 2, 0, 1]
    """
    from minilib.engine import Engine
    from minilib.vectorized import ragged_paged_attention_jnp

    config, params = _tiny_model()
    engine = Engine(
        params,
        config,
        num_pages=7,
        page_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=3,
        attention=ragged_paged_attention_jnp,
    )
    engine.scheduler.admission_rule = rule
    engine.scheduler.preempt_request = preempt_fn
    rng = np.random.default_rng(1000 + seed)
    # With 7 pages, request 2 (13 tokens) is preempted twice and request 4 once: a function
    # that works the first time only (that forgets what an earlier preemption left) shows.
    prompts = [rng.integers(0, 32, n).tolist() for n in (3, 9, 13, 5, 2)]
    ids = [engine.add_request(p, 5) for p in prompts]
    for _ in range(200):  # a rule that admits nobody would loop forever
        if not engine.has_unfinished:
            break
        engine.step()
    return {
        "outputs": [engine.output(i) for i in ids],
        "admitted per step": [list(s.admitted) for s in engine.stats],
        "preempted per step": [list(s.preempted) for s in engine.stats],
        "each request's num_preemptions": [engine.requests[i].num_preemptions for i in ids],
        "pages still in use at the end": engine.scheduler.allocator.num_used,
    }


SYSTEM_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # shared by most requests of the engine run
CACHING_MODEL_LAYERS = 2  # with two layers, a token's K/V depends on the tokens before it


def caching_scenario(name: str, seed: int = 0) -> tuple[list[tuple[int, list[int]]], int]:
    """The requests of a prefix-caching engine run, as (step it arrives at, prompt), and the
    pool's size in pages. Two scenarios:

    "shared system prompt": one request, then five more after its first step, four of them
      sharing its 10-token system prompt; 10 pages, too few for all (preemption: request 3
      twice, finding the system prompt's page in the cache each time it comes back).
    "same prefix in one step": two requests whose first page is the same 4 tokens, both
      computing it in step 0; after step 1, two requests whose prompts begin with the
      second one's *next* 4 tokens, at position 0. 16 pages, enough for all.

    >>> arrivals, num_pages = caching_scenario("same prefix in one step")
    >>> [step for step, _ in arrivals], num_pages
    ([0, 0, 2, 2], 16)
    >>> (_, a), (_, b), (_, c), _ = arrivals
    >>> a == b[:4], c[:4] == b[4:8]
    (True, True)
    """
    if name == "shared system prompt":
        rng = np.random.default_rng(2000 + seed)
        # request 3 (17 tokens) is preempted twice: it comes back to the cache each time
        prompts = [SYSTEM_PROMPT + rng.integers(0, 32, n).tolist() for n in (5, 7, 1, 7, 2)]
        prompts.append(rng.integers(0, 32, 5).tolist())
        return [(0, prompts[0])] + [(1, p) for p in prompts[1:]], 10
    if name == "same prefix in one step":
        rng = np.random.default_rng(2100 + seed)
        first_page = rng.integers(0, 32, 4).tolist()
        a = first_page  # 4 tokens, and the budget of 8 leaves 4 for b: page 0 of both
        b = first_page + rng.integers(0, 32, 5).tolist()  # its page 1 is full after step 1
        later = [b[4:8] + rng.integers(0, 32, n).tolist() for n in (2, 3)]
        return [(0, a), (0, b), (2, later[0]), (2, later[1])], 16
    raise ValueError(f"caching_scenario: no scenario {name!r}")


def run_caching_engine(
    cache_fn=cache_full_pages, *, seed: int = 0, scenario: str = "shared system prompt"
) -> dict:
    """Run a small prefix-caching engine with `cache_fn` as its scheduler's `cache_pages` on
    `caching_scenario(scenario, seed)`, chunked prefill of 8 tokens a step. Returns which
    requests' tokens differ from `dense_generate` (the model run on each prompt alone), the
    outputs, the prompt tokens each found in the cache, and what was wrong with the pool's
    books after each step (`accounting_problems`), if anything.

    >>> result = run_caching_engine()
    >>> result["requests whose tokens differ from dense_generate's"]
    []
    >>> result["pool's books after each step"], result["pages still in use at the end"]
    ('right after every step', 0)
    >>> result["prompt tokens found in the prefix cache"]
    [0, 8, 8, 8, 8, 0]
    >>> any(result["preempted per step"])
    True
    >>> twins = run_caching_engine(scenario="same prefix in one step")
    >>> twins["requests whose tokens differ from dense_generate's"]
    []
    >>> twins["prompt tokens found in the prefix cache"]  # the last waits a step: a hit
    [0, 0, 0, 4]
    """
    from minilib.engine import Engine
    from minilib.vectorized import ragged_paged_attention_jnp

    arrivals, num_pages = caching_scenario(scenario, seed)
    config, params = _tiny_model(CACHING_MODEL_LAYERS)
    engine = Engine(
        params,
        config,
        num_pages=num_pages,
        page_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        attention=ragged_paged_attention_jnp,
        enable_prefix_caching=True,
    )
    engine.scheduler.cache_pages = cache_fn
    ids = []
    books = "right after every step"
    for step in range(200):  # a pool whose pages never come back would loop forever
        ids += [engine.add_request(p, 5) for arrives, p in arrivals if arrives == step]
        if not engine.has_unfinished and len(ids) == len(arrivals):
            break
        try:
            stats = engine.step()
        except EngineError as err:  # out of pages for good
            books = f"the engine stopped at step {step}: {err}"
            break
        problems = engine.scheduler.accounting_problems()
        if problems and books == "right after every step":
            books = f"after step {stats.step}: {problems[0]}"
    outputs = [engine.output(i) for i in ids]
    return {
        "requests whose tokens differ from dense_generate's": [
            i
            for i, ((_, prompt), tokens) in enumerate(zip(arrivals, outputs, strict=False))
            if tokens != _dense_tokens(tuple(prompt), 5, CACHING_MODEL_LAYERS)
        ],
        "outputs": outputs,
        "prompt tokens found in the prefix cache": [
            engine.request_output(i).num_cached_tokens for i in ids
        ],
        "preempted per step": [list(s.preempted) for s in engine.stats],
        "pool's books after each step": books,
        "pages still in use at the end": engine.scheduler.allocator.num_used,
    }
