"""The paged KV cache under a hypothesis state machine of random add/append/free operations,
and each bad argument of its small calls: a KVCacheError, and nothing changed."""

from __future__ import annotations

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kv_cache_checks import assert_same_state, make_cache, snapshot, tokens

from minilib.errors import KVCacheError
from minilib.kv_cache import FILL_ORDERS, PageAllocator, PagedKVCache, fill_cache, pages_needed

# --- a state machine of random operations -----------------------------------------------------


class PagedKVCacheMachine(RuleBasedStateMachine):
    """Random add_sequence / append / free / batch_metadata calls, legal or not, checked
    against a plain model: a dict of each live sequence's K and V."""

    PAGE_SIZE, PAGES_PER_SEQ, TOTAL, MAX_SEQS = 2, 3, 5, 3

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(
            total_num_pages=self.TOTAL, page_size=self.PAGE_SIZE, num_kv_heads=2, head_dim=2,
            max_num_seqs=self.MAX_SEQS, pages_per_seq=self.PAGES_PER_SEQ,
        )  # fmt: skip
        self.model: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.counter = 0.0  # so every appended value is new

    def expect_error(self, method, *args):
        before = snapshot(self.cache)
        with pytest.raises(KVCacheError):
            getattr(self.cache, method)(*args)
        assert_same_state(before, snapshot(self.cache))

    def pages_in_use(self) -> int:
        return sum(pages_needed(len(k), self.PAGE_SIZE) for k, _ in self.model.values())

    @rule(seq_id=st.integers(0, 4))
    def add_sequence(self, seq_id):
        if seq_id in self.model or len(self.model) == self.MAX_SEQS:
            self.expect_error("add_sequence", seq_id)
        else:
            self.cache.add_sequence(seq_id)
            self.model[seq_id] = tokens(self.cache, 0)

    @rule(seq_id=st.integers(0, 4), n_new=st.integers(0, 5))
    def append(self, seq_id, n_new):
        k, v = tokens(self.cache, n_new, start=self.counter)
        self.counter += k.size
        if seq_id not in self.model:
            self.expect_error("append", seq_id, k, v)
            return
        old_k, old_v = self.model[seq_id]
        need = pages_needed(len(old_k) + n_new, self.PAGE_SIZE)
        new_pages = need - pages_needed(len(old_k), self.PAGE_SIZE)
        if need > self.PAGES_PER_SEQ or new_pages > self.TOTAL - self.pages_in_use():
            self.expect_error("append", seq_id, k, v)
        else:
            self.cache.append(seq_id, k, v)
            self.model[seq_id] = (np.concatenate([old_k, k]), np.concatenate([old_v, v]))

    @rule(seq_id=st.integers(0, 4))
    def free(self, seq_id):
        if seq_id in self.model:
            self.cache.free(seq_id)
            del self.model[seq_id]
        else:
            self.expect_error("free", seq_id)

    @rule(data=st.data())
    def batch_metadata(self, data):
        seq_ids = data.draw(st.lists(st.integers(0, 4), max_size=4, unique=True))
        steps = [(s, data.draw(st.integers(0, 7))) for s in seq_ids]
        legal = all(s in self.model and q <= len(self.model[s][0]) for s, q in steps)
        if not legal or len(steps) > self.MAX_SEQS:
            self.expect_error("batch_metadata", steps)
            return
        kv_lens, page_indices, cu_q_lens, num_seqs = self.cache.batch_metadata(steps)
        assert num_seqs.tolist() == [len(steps)]
        assert kv_lens.tolist()[: len(steps)] == [len(self.model[s][0]) for s, _ in steps]
        want_cu_q_lens = np.cumsum([0] + [q for _, q in steps]).tolist()
        assert cu_q_lens.tolist()[: len(steps) + 1] == want_cu_q_lens
        for i, (s, _) in enumerate(steps):
            pages = self.cache.pages(s)
            assert page_indices[i].tolist() == [*pages] + [0] * (self.PAGES_PER_SEQ - len(pages))

    @invariant()
    def pages_add_up(self):
        alloc = self.cache.allocator
        assert alloc.num_free + alloc.num_used == self.TOTAL
        assert alloc.num_used == self.pages_in_use()

    @invariant()
    def no_page_owned_twice(self):
        owned = [p for s in self.cache.seq_ids for p in self.cache.pages(s)]
        assert len(owned) == len(set(owned))
        assert not set(owned) & set(self.cache.allocator.free_pages)
        for s in self.cache.seq_ids:
            assert all(self.cache.allocator.owner(p) == s for p in self.cache.pages(s))

    @invariant()
    def each_sequence_has_just_enough_pages(self):
        assert set(self.cache.seq_ids) == set(self.model)
        for s, (k, _) in self.model.items():
            assert self.cache.seq_len(s) == len(k)
            assert len(self.cache.pages(s)) == pages_needed(len(k), self.PAGE_SIZE)

    @invariant()
    def stored_kv_reads_back(self):
        kv_pages = np.asarray(self.cache.kv_pages)  # read in NumPy, not with the cache's code
        for s, (k, v) in self.model.items():
            # [seq_len, 2*num_kv_heads, head_dim], the tokens in order
            slots = kv_pages[list(self.cache.pages(s))].reshape(-1, 4, 2)[: len(k)]
            np.testing.assert_array_equal(slots[:, 0::2], k)
            np.testing.assert_array_equal(slots[:, 1::2], v)


PagedKVCacheMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=25, deadline=None
)
TestPagedKVCacheMachine = PagedKVCacheMachine.TestCase


# --- small cases: every bad argument raises KVCacheError, and nothing changes ------------------


def pool_state(alloc: PageAllocator):
    return alloc.free_pages, alloc.owners


@pytest.mark.parametrize(
    "pages, message",
    [
        (1, "free(pages=1): pages must be a list of page numbers."),
        (np.int64(1), "pages must be a list of page numbers"),
        ("01", "pages must be a list of page numbers"),
        ([True], "page=True is not a page number"),
        ([1.0], "page=1.0 is not a page number"),
    ],
)
def test_free_takes_a_list_of_page_numbers(pages, message):
    alloc = PageAllocator(4)
    alloc.allocate(3, owner="a")
    before = pool_state(alloc)
    with pytest.raises(KVCacheError) as info:
        alloc.free(pages)
    assert message in info.value.message and info.value.hint
    assert pool_state(alloc) == before


@pytest.mark.parametrize(
    "seq_len, page_size, message",
    [
        (5, 0, "page_size=0 must be a positive int."),
        (5, -4, "page_size=-4 must be a positive int."),
        (-5, 4, "seq_len=-5 must be an int >= 0."),
        (2.5, 4, "seq_len=2.5 must be an int >= 0."),
        (5, 2.0, "page_size=2.0 must be a positive int."),
        (True, 4, "seq_len=True must be an int >= 0."),
    ],
)
def test_pages_needed_rejects_bad_sizes(seq_len, page_size, message):
    with pytest.raises(KVCacheError) as info:
        pages_needed(seq_len, page_size)
    assert info.value.message == message


def test_pages_needed_of_nothing_is_zero():
    assert pages_needed(0, 4) == 0 and pages_needed(np.int32(9), np.int64(4)) == 3


@pytest.mark.parametrize(
    "dtype", [None, jnp.int32, np.int8, "foo", jnp.bool_, np.float64, jnp.complex64]
)
def test_cache_dtype_must_be_a_float_jax_can_hold(dtype):
    with pytest.raises(KVCacheError) as info:
        make_cache(dtype=dtype)
    assert "PagedKVCache(dtype=" in info.value.message and info.value.hint


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_cache_reports_the_dtype_of_its_pages(dtype):
    cache = make_cache(dtype=dtype)
    assert cache.dtype == cache.kv_pages.dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("size", [0, -1, True, 2.0, "3", None])
def test_cache_sizes_must_be_positive_ints(size):
    with pytest.raises(KVCacheError, match="must be a positive int"):
        make_cache(page_size=size)


def test_allocate_refuses_a_bool():
    alloc = PageAllocator(4)
    with pytest.raises(KVCacheError, match="non-negative int"):
        alloc.allocate(True)
    assert pool_state(alloc) == (tuple(range(4)), (None,) * 4)


def test_append_refuses_strings_and_complex_values():
    cache = make_cache()
    cache.add_sequence("a")
    before = np.asarray(cache.kv_pages).copy()
    for bad in (np.full((1, 2, 3), "x"), np.ones((1, 2, 3), np.complex64)):
        with pytest.raises(KVCacheError, match="must be numeric arrays"):
            cache.append("a", bad, np.ones((1, 2, 3)))
    assert cache.seq_len("a") == 0 and cache.allocator.num_used == 0
    np.testing.assert_array_equal(np.asarray(cache.kv_pages), before)


def test_fill_cache_orders_differ():
    lists = []
    for order in FILL_ORDERS:
        cache, ids = fill_cache([37, 5, 120], page_size=16, total_num_pages=24, order=order)
        lists.append([cache.pages(s) for s in ids])
    assert lists[0] == [(0, 1, 2), (3,), tuple(range(4, 12))]
    assert lists[1] != lists[0] and lists[2] != lists[0]
    assert all(p % 2 == 0 for seq in lists[2] for p in seq)  # the holes of the freed ones
