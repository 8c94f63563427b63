"""minilib.engine's prefix caching: only what is not cached is computed, and the block pool
keeps its books."""

from __future__ import annotations

import numpy as np
import pytest
from engine_runs import (
    CONFIG,
    PAGE,
    PARAMS,
    SYSTEM,
    assert_all_pages_free,
    checked_step,
    engine,
    run_checked,
    shared_prefix_prompts,
)

from minilib.engine import SamplingParams, dense_generate
from minilib.engine.prefix_cache import BlockPool, find_longest_cache_hit, hash_request_tokens
from minilib.errors import KVCacheError


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
