"""Notebook 10's exercises: the scheduler's admission rule, and preemption's page-freeing step.

Each checker first compares your function with minilib's on many small situations, then
plugs it into a real `Engine` (its scheduler's hooks `admission_rule` and `preempt_request`)
on a pool small enough to make requests wait and be preempted, and checks that the engine
still gives every request the same tokens and leaves every page free.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable

import numpy as np

from minilib.engine.scheduler import Request, can_admit, preempt
from minilib.exercises.checking import (
    Case,
    CheckResult,
    Mismatch,
    compare_values,
    diagnose,
    run_check,
)
from minilib.kv_cache import PageAllocator, pages_needed

__all__ = ["check_can_admit", "check_preempt", "run_engine"]


@functools.cache
def _tiny_model():
    from minilib.engine import ModelConfig, init_params

    config = ModelConfig(
        vocab_size=32,
        num_layers=1,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=8,
        embed_dim=16,
        mlp_dim=32,
    )
    return config, init_params(config, seed=7)


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
    prompts = [rng.integers(0, 32, n).tolist() for n in (6, 13, 3, 9, 2)]
    ids = [engine.add_request(p, 5) for p in prompts]
    for _ in range(200):  # a rule that admits nobody would loop forever
        if not engine.has_unfinished:
            break
        engine.step()
    return {
        "outputs": [engine.output(i) for i in ids],
        "admitted per step": [list(s.admitted) for s in engine.stats],
        "preempted per step": [list(s.preempted) for s in engine.stats],
        "pages still in use at the end": engine.scheduler.allocator.num_used,
    }


def _compare_runs(want: dict, got: dict) -> None:
    for key in want:
        if want[key] != got[key]:
            raise Mismatch(
                f"with your function in the engine, {key}:\n  expected {want[key]}\n"
                f"  got      {got[key]}"
            )


# --- Exercise 10.1: the admission rule ------------------------------------------------------


def check_can_admit(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(num_prompt_tokens, *, token_budget_left, num_free_pages, page_size,
    num_running, max_num_seqs) -> bool`, the scheduler's admission rule, then run an engine
    with it.

    >>> check_can_admit(can_admit)
    Passed: can_admit matches the reference on all 73 cases.
    CheckResult('can_admit', status='passed')
    """
    cases = []
    situations = itertools.product((1, 7, 20), (0, 3, 8), (0, 1, 2, 5), (2, 3))
    for prompt, budget, free, running in situations:
        kwargs = dict(
            token_budget_left=budget,
            num_free_pages=free,
            page_size=4,
            num_running=running,
            max_num_seqs=3,
        )
        text = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        cases.append(Case(f"num_prompt_tokens={prompt}, {text}", ("rule", prompt), kwargs))
    cases.append(Case("a small engine serving 5 requests with your rule", ("engine", seed)))

    def call(rule):
        def run(kind, value, **kwargs):
            if kind == "engine":
                return run_engine(rule=rule, seed=value)
            return rule(value, **kwargs)

        return run

    def compare(want, got, case):
        if case.args[0] == "engine":
            _compare_runs(want, got)
        else:
            compare_values(want, got, "admit")

    mistakes = {
        "a sequence slot must be free: admit only while num_running < max_num_seqs.": (
            call(lambda n, **k: can_admit(n, **(k | {"max_num_seqs": 10**9})))
        ),
        "only the first chunk needs pages now: min(num_prompt_tokens, token_budget_left) "
        "tokens, not the whole prompt (later chunks get pages in later steps).": call(
            lambda n, **k: (
                can_admit(n, **k) and pages_needed(n, k["page_size"]) <= k["num_free_pages"]
            )
        ),
        "with no token budget left (token_budget_left == 0) nothing more fits in this step.": (
            call(
                lambda n, **k: (
                    k["num_running"] < k["max_num_seqs"]
                    and pages_needed(min(n, k["token_budget_left"]), k["page_size"])
                    <= k["num_free_pages"]
                )
            )
        ),
    }
    return run_check(
        "can_admit", call(fn), call(can_admit), cases, diagnose(compare, mistakes), verbose=verbose
    )


# --- Exercise 10.2: preemption --------------------------------------------------------------


def _situation(rng, num_pages: int):
    """A pool with some pages taken by other requests, and a request holding a few."""
    allocator = PageAllocator(num_pages)
    allocator.allocate(int(rng.integers(0, 3)), owner="other")
    prompt = rng.integers(0, 32, int(rng.integers(2, 12))).tolist()
    output = rng.integers(0, 32, int(rng.integers(0, 4))).tolist()
    request = Request(3, prompt, max_new_tokens=8, output=output)
    request.num_computed = len(prompt) + len(output) - 1 if output else len(prompt)
    request.pages = allocator.allocate(pages_needed(request.num_computed, 4), owner=3)
    allocator.allocate(int(rng.integers(0, 2)), owner="other")
    return request, allocator


def _after(fn, request, allocator):
    """State of a copy of (request, allocator) after fn(request, allocator)."""
    request, allocator = copy.deepcopy((request, allocator))
    fn(request, allocator)
    return {
        "request.pages": list(request.pages),
        "request.num_computed": request.num_computed,
        "request.output": list(request.output),
        "allocator.free_pages": list(allocator.free_pages),
    }


def check_preempt(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(request, allocator) -> None`, which evicts `request` from the cache so that
    it is recomputed later; then run an engine that preempts with it.

    >>> check_preempt(preempt)
    Passed: preempt matches the reference on all 7 cases.
    CheckResult('preempt', status='passed')
    """
    rng = np.random.default_rng(1020 + seed)
    cases = []
    for _ in range(6):
        request, allocator = _situation(rng, num_pages=int(rng.integers(6, 10)))
        cases.append(
            Case(
                f"request with pages={request.pages}, num_computed={request.num_computed}, "
                f"{len(request.output)} tokens generated; free pages {list(allocator.free_pages)}",
                ("state", (request, allocator)),
            )
        )
    cases.append(
        Case("a small engine whose pool is too small for all 5 requests", ("engine", seed))
    )

    def call(f):
        def run(kind, value):
            if kind == "engine":
                return run_engine(preempt_fn=f, seed=value)
            return _after(f, *value)

        return run

    def compare(want, got, case):
        if case.args[0] == "engine":
            _compare_runs(want, got)
            return
        for key in want:
            compare_values(want[key], got[key], key)

    def keeps_num_computed(request, allocator):
        allocator.free(request.pages)
        request.pages = []

    def forgets_output(request, allocator):
        preempt(request, allocator)
        request.output = []

    def leaks_pages(request, allocator):
        request.pages, request.num_computed = [], 0

    def keeps_page_list(request, allocator):
        allocator.free(request.pages)
        request.num_computed = 0

    mistakes = {
        "num_computed must go back to 0: the K/V of those tokens is gone with the pages, so "
        "the request must recompute them all.": call(keeps_num_computed),
        "keep request.output: the tokens generated so far are recomputed together with the "
        "prompt (one prefill), not generated again one by one.": call(forgets_output),
        "the pages never went back to the pool: allocator.free(request.pages).": call(leaks_pages),
        "after freeing, clear request.pages: the request no longer owns those pages (another "
        "request may get them next).": call(keeps_page_list),
    }
    return run_check(
        "preempt", call(fn), call(preempt), cases, diagnose(compare, mistakes), verbose=verbose
    )
