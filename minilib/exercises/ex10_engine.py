"""Notebook 10's exercises: the scheduler's admission rule, preemption's page-freeing step,
and the step of prefix caching that names full pages.

Each checker first compares your function with minilib's on many small situations, then
plugs it into a real `Engine` (its scheduler's hooks `admission_rule`, `preempt_request` and
`cache_pages`) on a pool small enough to make requests wait and be preempted, and checks that
the engine still gives every request the same tokens and leaves every page free; with
prefix caching, it also checks the pool's books after every step, and that every request's
tokens are `dense_generate`'s (the model run on its prompt alone), also when two requests
compute the same prefix in the same step.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import numpy as np

from minilib.engine.prefix_cache import BlockPool, hash_block_tokens, hash_request_tokens
from minilib.engine.scheduler import Request, cache_full_pages, can_admit, preempt
from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, compare_values
from minilib.exercises.engine_runs import run_caching_engine, run_engine
from minilib.kv_cache import PageAllocator, pages_needed

__all__ = [
    "check_cache_full_pages",
    "check_can_admit",
    "check_preempt",
    "run_caching_engine",
    "run_engine",
]


def _compare_state_or_run(want: dict, got: dict, case: Case) -> None:
    """A case is a state after the function (each field compared) or an engine run."""
    if case.args[0] == "engine":
        _compare_runs(want, got)
        return
    for key in want:
        compare_values(want[key], got[key], key)


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
    Passed: can_admit matches the reference on all 121 cases.
    CheckResult('can_admit', status='passed')
    """
    cases = []
    # Prompts of 4 and 8 tokens fill whole pages, and 4 fits in a budget of 8 with room to
    # spare (a rule that gives the token sampled after the prompt a page too asks for one
    # more); most free pages come first, so that a rule asking for too much fails first where
    # the pages would have been enough for the whole prompt.
    situations = itertools.product((1, 4, 7, 8, 20), (0, 3, 8), (5, 2, 1, 0), (2, 3))
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
    cases.append(
        Case(
            "a small engine serving 5 requests with your rule (one is preempted twice)",
            ("engine", seed),
        )
    )

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
        "a prompt longer than the token budget left is admitted too (chunked prefill): this "
        "step computes its first token_budget_left tokens, later steps the rest. Admit when the "
        "first chunk's pages are free; the whole prompt need not fit in this step.": call(
            lambda n, **k: n <= k["token_budget_left"] and can_admit(n, **k)
        ),
        "no page is needed yet for the token sampled at the end of the prompt: it goes into "
        "the cache in the next step, as a decode, and the scheduler gives it a page then. The "
        "first chunk needs pages_needed(min(num_prompt_tokens, token_budget_left), page_size) "
        "pages, not one token more.": call(
            lambda n, **k: (
                can_admit(n, **k)
                and (
                    n > k["token_budget_left"]
                    or pages_needed(n + 1, k["page_size"]) <= k["num_free_pages"]
                )
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
    request.num_preemptions = int(rng.integers(0, 3))  # preempted before, maybe
    request.num_computed = len(prompt) + len(output) - 1 if output else len(prompt)
    request.pages = allocator.allocate(pages_needed(request.num_computed, 4), owner=3)
    allocator.allocate(int(rng.integers(0, 2)), owner="other")
    return request, allocator


def _after(fn, request, allocator):
    """State of a copy of (request, allocator) after fn(request, allocator). The free pages
    are compared in page order: the order they are freed in is the function's choice."""
    request, allocator = copy.deepcopy((request, allocator))
    fn(request, allocator)
    return {
        "request.pages": list(request.pages),
        "request.num_computed": request.num_computed,
        "request.output": list(request.output),
        "request.num_preemptions": request.num_preemptions,
        "allocator.free_pages, in page order": sorted(allocator.free_pages),
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
                f"{len(request.output)} tokens generated, num_preemptions="
                f"{request.num_preemptions}; free pages {list(allocator.free_pages)}",
                ("state", (request, allocator)),
            )
        )
    cases.append(
        Case(
            "a small engine whose pool is too small for all 5 requests (one is preempted twice)",
            ("engine", seed),
        )
    )

    def call(f):
        def run(kind, value):
            if kind == "engine":
                return run_engine(preempt_fn=f, seed=value)
            return _after(f, *value)

        return run

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

    def counts_the_preemption(request, allocator):
        preempt(request, allocator)
        request.num_preemptions += 1

    def resets_the_count(request, allocator):
        preempt(request, allocator)
        request.num_preemptions = 0

    mistakes = {
        "num_computed must go back to 0: the K/V of those tokens is gone with the pages, so "
        "the request must recompute them all.": call(keeps_num_computed),
        "keep request.output: the tokens generated so far are recomputed together with the "
        "prompt (as prefill, in chunks), not generated again one by one.": call(forgets_output),
        "the pages never went back to the pool: allocator.free(request.pages).": call(leaks_pages),
        "after freeing, clear request.pages: the request no longer owns those pages (another "
        "request may get them next).": call(keeps_page_list),
        "leave request.num_preemptions alone: the scheduler counts each preemption itself, "
        "after calling your function, so counting it here counts it twice.": (
            call(counts_the_preemption)
        ),
        "leave request.num_preemptions alone: it counts every preemption of the request, the "
        "earlier ones too (the scheduler adds this one after your function); setting it to 0 "
        "forgets them, which shows once a request is preempted a second time.": (
            call(resets_the_count)
        ),
    }
    return run_check(
        "preempt",
        call(fn),
        call(preempt),
        cases,
        diagnose(_compare_state_or_run, mistakes),
        verbose=verbose,
    )


# --- Exercise 10.3: naming full pages for the prefix cache ----------------------------------


def _caching_situation(
    rng, *, num_computed: int, num_generated: int, hit_pages: int, twin_pages: int = 0
):
    """A request part way through its tokens, holding its pages in a BlockPool; its first
    `hit_pages` pages came from the cache (their hashes are in request.cached_hashes). One
    page of someone else is cached too. With `twin_pages`, the request's next pages are cached
    already, as another request's pages: that request computed the same prefix in the same
    step, and was named first."""
    pool = BlockPool(12)
    other = pool.allocate(1)
    pool.cache_page(other[0], hash_block_tokens(None, [31, 31, 31, 31]))
    prompt = rng.integers(0, 32, int(rng.integers(9, 15))).tolist()
    output = rng.integers(0, 32, num_generated).tolist()
    request = Request(3, prompt, max_new_tokens=8, output=output)
    request.num_computed = min(num_computed, len(prompt) + len(output))
    hashes = hash_request_tokens(request.tokens, 4)[: hit_pages + twin_pages]
    pages = pool.allocate(hit_pages)
    for page, block_hash in zip(pages, hashes[:hit_pages], strict=True):
        pool.cache_page(page, block_hash)
    twins = pool.allocate(twin_pages)  # the other request's copies of the same pages
    for page, block_hash in zip(twins, hashes[hit_pages:], strict=True):
        pool.cache_page(page, block_hash)
    request.pages = pages + pool.allocate(-(-request.num_computed // 4) - hit_pages)
    request.cached_hashes = list(hashes[:hit_pages])
    return request, pool


def _after_caching(fn, request, pool):
    """State of a copy of (request, pool) after fn(request, pool, 4)."""
    request, pool = copy.deepcopy((request, pool))
    fn(request, pool, 4)
    return {
        "the pool's cached pages": list(pool.cached_pages),
        "each of the request's pages: cached under the hash of which tokens": [
            _hash_name(pool.block_hash(page), request) for page in request.pages
        ],
        "reference counts of the request's pages": [pool.ref_cnt(p) for p in request.pages],
        "request.cached_hashes, named by tokens": [
            _hash_name(h, request) for h in request.cached_hashes
        ],
    }


def _hash_name(block_hash, request) -> str:
    """A hash, told as the tokens it names: 'tokens 0..7' (a chained hash covers every token
    from 0), 'tokens 4..7 alone' (not chained), or 'none'."""
    if block_hash is None:
        return "none"
    tokens = request.tokens
    chained = hash_request_tokens(tokens, 4)
    if block_hash in chained:
        return f"tokens 0..{4 * chained.index(block_hash) + 3}"
    for start in range(0, len(tokens), 4):
        if block_hash == hash_block_tokens(None, tokens[start : start + 4]):
            return f"tokens {start}..{start + 3} alone, not chained"
        for end in range(start + 1, min(start + 4, len(tokens))):
            parent = chained[start // 4 - 1] if start else None
            if block_hash == hash_block_tokens(parent, tokens[start:end]):
                return f"tokens 0..{end - 1}: a page with {end - start} of 4 tokens"
    return "some other hash"


def check_cache_full_pages(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(request, pool, page_size) -> None`, which puts every page of `request` that
    is now full of computed K/V into the prefix cache (`pool.cache_page(page, block_hash)`,
    the hash chained from the page before) and appends its hash to `request.cached_hashes`;
    then run two prefix-caching engines with it, one that preempts and one where two requests
    compute the same prefix in the same step: every request must get `dense_generate`'s tokens.

    >>> check_cache_full_pages(cache_full_pages)
    Passed: cache_full_pages matches the reference on all 9 cases.
    CheckResult('cache_full_pages', status='passed')
    """
    rng = np.random.default_rng(1030 + seed)
    situations = [  # (num_computed, num_generated, hit_pages, twin_pages)
        (6, 0, 0, 0),  # a prompt chunk that ends inside page 1
        (8, 0, 0, 0),  # ... that ends on a page boundary
        (13, 2, 2, 0),  # started from 2 cached pages; a generated token completes page 2
        (9, 0, 1, 0),  # one cached page, one more full now, a chunk part way into the third
        (3, 0, 0, 0),  # not one full page yet
        (12, 3, 0, 0),  # after a preemption: prompt and generated tokens recomputed together
        (9, 0, 0, 1),  # page 0 computed by another request too, in the same step
    ]
    cases = []
    for num_computed, num_generated, hit_pages, twin_pages in situations:
        request, pool = _caching_situation(
            rng,
            num_computed=num_computed,
            num_generated=num_generated,
            hit_pages=hit_pages,
            twin_pages=twin_pages,
        )
        twins = (
            f"; another request computed the same first {twin_pages} page(s) in the same step, "
            "and its copy is cached already"
            if twin_pages
            else ""
        )
        cases.append(
            Case(
                f"{len(request.tokens)} tokens ({len(request.output)} generated), "
                f"num_computed={request.num_computed}, pages={request.pages}, "
                f"{len(request.cached_hashes)} of them cached already{twins}, page_size=4",
                ("state", (request, pool)),
            )
        )
    cases.append(
        Case(
            "a prefix-caching engine: 5 requests sharing a 10-token system prompt, a pool "
            "too small for all (preemption), prefill chunks of 8 tokens",
            ("engine", (seed, "shared system prompt")),
        )
    )
    cases.append(
        Case(
            "a prefix-caching engine: two requests compute the same first page in the same "
            "step; two later ones begin with the second one's next page (at position 0)",
            ("engine", (seed, "same prefix in one step")),
        )
    )

    def call(f):
        def run(kind, value):
            if kind == "engine":
                seed, scenario = value
                return run_caching_engine(f, seed=seed, scenario=scenario)
            return _after_caching(f, *value)

        return run

    def page_holds_tokens(request, pool, page_size):  # full of tokens, not of computed K/V
        for i in range(len(request.cached_hashes), len(request.tokens) // page_size):
            parent = request.cached_hashes[-1] if request.cached_hashes else None
            block_hash = hash_block_tokens(
                parent, request.tokens[i * page_size : (i + 1) * page_size]
            )
            if i < len(request.pages):
                pool.cache_page(request.pages[i], block_hash)
            request.cached_hashes.append(block_hash)

    def partial_page_too(request, pool, page_size):  # the page being written, too
        for i in range(len(request.cached_hashes), -(-request.num_computed // page_size)):
            parent = request.cached_hashes[-1] if request.cached_hashes else None
            tokens = request.tokens[i * page_size : min((i + 1) * page_size, request.num_computed)]
            pool.cache_page(request.pages[i], hash_block_tokens(parent, tokens))
            request.cached_hashes.append(hash_block_tokens(parent, tokens))

    def not_chained(request, pool, page_size):
        for i in range(len(request.cached_hashes), request.num_computed // page_size):
            block_hash = hash_block_tokens(
                None, request.tokens[i * page_size : (i + 1) * page_size]
            )
            pool.cache_page(request.pages[i], block_hash)
            request.cached_hashes.append(block_hash)

    def takes_a_reference(request, pool, page_size):
        for i in range(len(request.cached_hashes), request.num_computed // page_size):
            _cache_page(request, pool, page_size, i)
            pool.touch([request.pages[i]])

    def skips_pages_cached_already(request, pool, page_size):
        for i in range(len(request.cached_hashes), request.num_computed // page_size):
            parent = request.cached_hashes[-1] if request.cached_hashes else None
            block_hash = hash_block_tokens(
                parent, request.tokens[i * page_size : (i + 1) * page_size]
            )
            if pool.get_cached_page(block_hash) is not None:
                continue  # without recording its hash
            pool.cache_page(request.pages[i], block_hash)
            request.cached_hashes.append(block_hash)

    def forgets_cached_hashes(request, pool, page_size):
        hashes = list(request.cached_hashes)
        for i in range(len(hashes), request.num_computed // page_size):
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
            )
            pool.cache_page(request.pages[i], hashes[-1])

    mistakes = {
        "a page is full when its K/V is computed (i <  request.num_computed // page_size), not "
        "when the request merely has its tokens: a prompt chunk or the token just sampled may "
        "not be in the page yet, and a request that hit it would share a partly written page.": (
            call(page_holds_tokens)
        ),
        "only full pages are cached: the page that is still being written belongs to this "
        "request alone, and a request that hit it would write its own tokens into a shared "
        "page.": call(partial_page_too),
        "chain each hash to the page before (hash_block_tokens(request.cached_hashes[-1], "
        "tokens)): K/V depends on every earlier token, so the same four tokens after another "
        "prefix hold other K/V.": call(not_chained),
        "the cache takes no reference of its own (no pool.touch): the page is counted once, "
        "for the request holding it, so that the count drops to 0 when the request is "
        "preempted or finishes and the page can be freed or evicted. Here a count was never "
        "dropped, and the page never came back.": call(takes_a_reference),
        "append each new hash to request.cached_hashes: the next page's hash chains from it, "
        "and the next call starts after the pages already named.": call(forgets_cached_hashes),
        "a page whose hash is in the cache already (another request computed the same prefix, "
        "in the same step) still gets its hash appended to request.cached_hashes; "
        "pool.cache_page simply keeps the first copy. Skipped, the next page's hash restarts "
        "the chain, as if the page began the sequence: a later request that begins with those "
        "tokens finds K/V computed after another prefix.": call(skips_pages_cached_already),
    }
    return run_check(
        "cache_full_pages",
        call(fn),
        call(cache_full_pages),
        cases,
        diagnose(_compare_state_or_run, mistakes),
        verbose=verbose,
    )


def _cache_page(request, pool, page_size: int, i: int) -> None:
    """The reference's step for page `i` alone (for the mistakes above)."""
    parent = request.cached_hashes[-1] if request.cached_hashes else None
    block_hash = hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
    pool.cache_page(request.pages[i], block_hash)
    request.cached_hashes.append(block_hash)
