"""Tests of the paged KV cache: the page allocator, the cache, its batch metadata, attention
over it, and a hypothesis state machine of random add/append/free operations."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    ref_ragged_paged_attention as jax_ref_ragged_paged_attention,
)
from kv_cache_checks import assert_same_state, make_cache, raises, snapshot, tokens

from minilib.errors import HintedError, RPAInputError
from minilib.kv_cache import PageAllocator, bucket_size, pages_needed, write_tokens
from minilib.reference import ref_ragged_paged_attention
from minilib.vectorized import ragged_paged_attention_jnp

# --- PageAllocator ----------------------------------------------------------------------------


def test_allocator_hands_out_pages_and_counts():
    alloc = PageAllocator(5)
    assert alloc.allocate(2, owner="a") == [0, 1]
    assert alloc.allocate(0, owner="b") == []
    assert alloc.allocate(1, owner="b") == [2]
    assert (alloc.num_free, alloc.num_used) == (2, 3)
    assert alloc.owners == ("a", "a", "b", None, None)
    assert alloc.owner(2) == "b"


def test_allocator_reuses_freed_pages_last():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    alloc.free([1, 0])
    assert alloc.free_pages == (3, 1, 0)  # first in, first out
    assert alloc.allocate(2) == [3, 1]


def test_allocator_out_of_pages_is_all_or_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    with raises("allocate(n=2) needs 2 free pages, but only num_free=1") as err:
        alloc.allocate(2)
    assert "total_num_pages=4" in str(err.value)
    # The allocator's own fixes: its free(pages), or a bigger allocator (no PagedKVCache).
    assert "free(pages)" in err.value.hint and "PageAllocator(total_num_pages=5)" in err.value.hint
    assert "PagedKVCache" not in err.value.hint
    assert (alloc.num_free, alloc.num_used, alloc.free_pages) == (1, 3, (3,))


@pytest.mark.parametrize("n", [-1, 1.5, "2"])
def test_allocator_rejects_bad_n(n):
    alloc = PageAllocator(4)
    with raises(f"allocate(n={n!r})"):
        alloc.allocate(n)
    assert alloc.num_free == 4


def test_allocator_double_free():
    alloc = PageAllocator(4)
    alloc.allocate(2)
    alloc.free([1])
    with raises("page 1 is not allocated") as err:
        alloc.free([0, 1])
    assert "double free" in str(err.value)
    assert (alloc.num_used, alloc.free_pages) == (1, (2, 3, 1))  # page 0 still allocated


def test_allocator_free_never_allocated_page():
    alloc = PageAllocator(4)
    with raises("page 3 is not allocated"):
        alloc.free([3])
    assert alloc.num_free == 4


def test_allocator_free_same_page_twice_in_one_call():
    alloc = PageAllocator(4)
    alloc.allocate(2)
    with raises("lists page 0 twice"):
        alloc.free([0, 0])
    assert alloc.num_used == 2


@pytest.mark.parametrize("page", [-1, 4])
def test_allocator_free_out_of_range_page(page):
    alloc = PageAllocator(4)
    alloc.allocate(4)
    with raises(f"page={page} is not a page number in [0, 4)"):
        alloc.free([0, page])
    assert alloc.num_used == 4


@pytest.mark.parametrize("total", [0, -3, 2.0])
def test_allocator_rejects_bad_size(total):
    with raises(f"total_num_pages={total!r} must be a positive int"):
        PageAllocator(total)


def test_errors_are_value_errors_with_hints_not_attention_input_errors():
    with pytest.raises(ValueError) as err:
        PageAllocator(1).allocate(2)
    assert isinstance(err.value, HintedError) and err.value.message and err.value.hint
    # A misuse of the cache is not a bad input to an attention call.
    assert not isinstance(err.value, RPAInputError)


# --- PagedKVCache: growing, freeing, reading back ---------------------------------------------


def test_pages_needed_and_bucket_size():
    assert [pages_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert [bucket_size(n) for n in (0, 1, 2, 3, 4, 5, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 32]


def test_append_allocates_pages_as_the_sequence_grows():
    cache = make_cache()
    cache.add_sequence("a")
    assert (cache.seq_len("a"), cache.pages("a")) == (0, ())
    for n_new, want_len, want_pages in [(3, 3, 1), (1, 4, 1), (1, 5, 2), (0, 5, 2), (7, 12, 3)]:
        cache.append("a", *tokens(cache, n_new))
        assert cache.seq_len("a") == want_len
        assert len(cache.pages("a")) == want_pages
        assert cache.allocator.num_used == want_pages
    assert all(cache.allocator.owner(p) == "a" for p in cache.pages("a"))


def test_append_writes_interleaved_kv_that_reads_back():
    cache = make_cache()
    cache.add_sequence("a")
    cache.add_sequence("b")
    k1, v1 = tokens(cache, 3)
    kb, vb = tokens(cache, 6, start=1000)
    k2, v2 = tokens(cache, 4, start=500)
    cache.append("a", k1, v1)
    cache.append("b", kb, vb)  # b's pages sit between a's
    cache.append("a", k2, v2)
    k, v = cache.gather_kv("a")
    np.testing.assert_array_equal(k, np.concatenate([k1, k2]))
    np.testing.assert_array_equal(v, np.concatenate([v1, v2]))
    # The layout itself: token 5 of "a" is in its page 1, slot 1; K of head h in slot 2h.
    page = cache.pages("a")[1]
    np.testing.assert_array_equal(cache.kv_pages[page, 1, 0::2], k2[2])
    np.testing.assert_array_equal(cache.kv_pages[page, 1, 1::2], v2[2])


def test_append_casts_to_the_cache_dtype():
    cache = make_cache(dtype=jnp.bfloat16)
    cache.add_sequence(0)
    cache.append(0, *tokens(cache, 2))
    assert cache.kv_pages.dtype == jnp.bfloat16
    np.testing.assert_array_equal(cache.gather_kv(0)[0].astype(np.float32), tokens(cache, 2)[0])


def test_free_returns_pages_and_they_are_reused():
    cache = make_cache(total_num_pages=4)
    cache.add_sequence("a")
    cache.append("a", *tokens(cache, 8))
    a_pages = cache.pages("a")
    cache.free("a")
    assert cache.seq_ids == () and cache.allocator.num_free == 4
    cache.add_sequence("a")  # a freed id may be added anew
    cache.append("a", *tokens(cache, 12))
    assert a_pages == (0, 1) and cache.pages("a") == (2, 3, 0)  # never-used pages first


def test_second_append_of_the_same_size_does_not_retrace():
    cache = make_cache(head_dim=5)
    cache.add_sequence("a")
    cache.append("a", *tokens(cache, 3))
    compiled = write_tokens._cache_size()  # private, but in every jax version we support
    cache.append("a", *tokens(cache, 3))
    cache.append("a", *tokens(cache, 4))  # same bucket as 3: padded to 4
    assert write_tokens._cache_size() == compiled


# --- PagedKVCache: errors leave the state unchanged ------------------------------------------


def test_add_existing_sequence():
    cache = make_cache()
    cache.add_sequence("a")
    before = snapshot(cache)
    with raises("seq_id='a' is already in the cache"):
        cache.add_sequence("a")
    assert_same_state(before, snapshot(cache))


def test_add_more_than_max_num_seqs():
    cache = make_cache(max_num_seqs=2)
    cache.add_sequence(0)
    cache.add_sequence(1)
    before = snapshot(cache)
    with raises("Cannot add seq_id=2: all max_num_seqs=2 sequence slots are live"):
        cache.add_sequence(2)
    assert_same_state(before, snapshot(cache))


@pytest.mark.parametrize("method", ["append", "free", "seq_len", "pages", "gather_kv"])
def test_unknown_sequence(method):
    cache = make_cache()
    cache.add_sequence("a")
    before = snapshot(cache)
    args = tokens(cache, 1) if method == "append" else ()
    with raises("Unknown seq_id='b'; live sequences: ['a']"):
        getattr(cache, method)("b", *args)
    assert_same_state(before, snapshot(cache))


def test_double_free_of_a_sequence():
    cache = make_cache()
    cache.add_sequence("a")
    cache.append("a", *tokens(cache, 5))
    cache.free("a")
    before = snapshot(cache)
    with raises("Unknown seq_id='a'"):
        cache.free("a")
    assert_same_state(before, snapshot(cache))


def test_append_past_pages_per_seq():
    cache = make_cache(pages_per_seq=2)  # at most 8 tokens
    cache.add_sequence("a")
    cache.append("a", *tokens(cache, 6))
    before = snapshot(cache)
    with raises("needs 3 pages, more than pages_per_seq=2 (at most 8 tokens"):
        cache.append("a", *tokens(cache, 3))
    assert_same_state(before, snapshot(cache))


def test_append_out_of_pages_allocates_nothing():
    cache = make_cache(total_num_pages=4)
    cache.add_sequence("a")
    cache.add_sequence("b")
    cache.append("a", *tokens(cache, 8))
    cache.append("b", *tokens(cache, 1))
    before = snapshot(cache)
    # b needs 2 more pages (4 -> 12 tokens would be 3 pages); only 1 is free.
    with raises("needs 2 new pages, but only num_free=1 of total_num_pages=4"):
        cache.append("b", *tokens(cache, 8))
    assert_same_state(before, snapshot(cache))


@pytest.mark.parametrize(
    "k_shape, v_shape, message",
    [
        ((2, 3, 3), (2, 3, 3), "k.shape=(2, 3, 3) must be [n_new, num_kv_heads=2, head_dim=3]"),
        ((2, 2, 3), (2, 2, 4), "v.shape=(2, 2, 4) must be [n_new, num_kv_heads=2, head_dim=3]"),
        ((2, 3), (2, 3), "k.shape=(2, 3) must be"),
        ((2, 2, 3), (3, 2, 3), "k.shape=(2, 2, 3) and v.shape=(3, 2, 3) must be equal"),
    ],
)
def test_append_bad_shapes(k_shape, v_shape, message):
    cache = make_cache()
    cache.add_sequence("a")
    before = snapshot(cache)
    with raises(message):
        cache.append("a", np.zeros(k_shape), np.zeros(v_shape))
    assert_same_state(before, snapshot(cache))


def test_bad_cache_size():
    with raises("page_size=0 must be a positive int"):
        make_cache(page_size=0)


# --- batch_metadata -------------------------------------------------------------------------


def test_batch_metadata_values_and_padding():
    cache = make_cache(max_num_seqs=4, pages_per_seq=3)
    for seq_id, n in [("a", 6), ("b", 1), ("c", 9)]:
        cache.add_sequence(seq_id)
        cache.append(seq_id, *tokens(cache, n))
    kv_lens, page_indices, cu_q_lens, num_seqs = cache.batch_metadata([("c", 4), ("a", 1)])
    assert all(a.dtype == jnp.int32 for a in (kv_lens, page_indices, cu_q_lens, num_seqs))
    assert kv_lens.tolist() == [9, 6, 0, 0]
    c, a = cache.pages("c"), cache.pages("a")
    assert page_indices.tolist() == [list(c), [*a, 0], [0, 0, 0], [0, 0, 0]]
    assert cu_q_lens.tolist() == [0, 4, 5, 0, 0]
    assert num_seqs.tolist() == [1 + 1]


def test_batch_metadata_empty_step():
    kv_lens, page_indices, cu_q_lens, num_seqs = make_cache().batch_metadata([])
    assert num_seqs.tolist() == [0] and not cu_q_lens.any() and not page_indices.any()


@pytest.mark.parametrize(
    "steps, message",
    [
        ([("a", 1), ("zz", 1)], "Unknown seq_id='zz'"),
        ([("a", 4)], "q_len=4 for seq_id='a' must be in [0, seq_len=3]"),
        ([("a", -1)], "q_len=-1 for seq_id='a' must be in [0, seq_len=3]"),
        ([("a", 1), ("a", 1)], "seq_id='a' appears twice"),
        ([("a", 1), ("b", 1), ("a", 0)], "len(steps)=3 sequences in one step, more than"),
    ],
)
def test_batch_metadata_errors(steps, message):
    cache = make_cache(max_num_seqs=2)
    for seq_id in "ab":
        cache.add_sequence(seq_id)
        cache.append(seq_id, *tokens(cache, 3))
    before = snapshot(cache)
    with raises(message):
        cache.batch_metadata(steps)
    assert_same_state(before, snapshot(cache))


# --- attention over the cache equals attention over the dense K/V ----------------------------


def dense_attention(q, k, v, sm_scale):
    """Causal softmax attention in NumPy (float64) of one sequence's last q_len tokens.
    q: [q_len, num_q_heads, head_dim]; k, v: [kv_len, num_kv_heads, head_dim]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * sm_scale
    future = np.arange(kv_len)[None, :] > (kv_len - q_len + np.arange(q_len))[:, None]
    scores = np.where(future, -np.inf, scores)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def test_attention_over_the_cache_matches_dense_attention():
    rng = np.random.default_rng(0)
    num_q_heads, num_kv_heads, head_dim, sm_scale = 4, 2, 8, 8**-0.5
    cache = make_cache(
        total_num_pages=16, page_size=4, num_kv_heads=num_kv_heads, head_dim=head_dim,
        max_num_seqs=5, pages_per_seq=4,
    )  # fmt: skip
    dense = {}  # seq_id -> (k, v) as appended

    def append(seq_id, n):
        k, v = rng.standard_normal((2, n, num_kv_heads, head_dim)).astype(np.float32)
        cache.append(seq_id, k, v)
        old_k, old_v = dense.get(seq_id, (k[:0], v[:0]))
        dense[seq_id] = (np.concatenate([old_k, k]), np.concatenate([old_v, v]))

    # Earlier steps: "x" comes and goes, so the pages of "a" and "b" are not contiguous.
    for seq_id, n in [("x", 5), ("a", 6), ("d", 2), ("b", 9)]:
        cache.add_sequence(seq_id)
        append(seq_id, n)
    cache.free("x")
    # This step: a chunk of "b", a decode of "a", "d" idle, a prefill of the new "c"; one
    # sequence slot of max_num_seqs=5 is padding.
    cache.add_sequence("c")
    steps = [("b", 3), ("a", 1), ("d", 0), ("c", 5)]
    for seq_id, q_len in steps:
        append(seq_id, q_len)
    metadata = cache.batch_metadata(steps)
    cu_q_lens = np.asarray(metadata[2])
    num_tokens = int(cu_q_lens[len(steps)])
    q = rng.standard_normal((num_tokens + 3, num_q_heads, head_dim)).astype(np.float32)

    want = np.concatenate(
        [
            dense_attention(q[cu_q_lens[i] : cu_q_lens[i + 1]], *dense[seq_id], sm_scale)
            for i, (seq_id, _) in enumerate(steps)
        ]
    )
    args = (jnp.asarray(q), cache.kv_pages, *metadata)
    ours = ref_ragged_paged_attention(*args, sm_scale=sm_scale)
    jaxs = jax_ref_ragged_paged_attention(*args, sm_scale=sm_scale)
    vectorized = ragged_paged_attention_jnp(*args, sm_scale=sm_scale)
    assert_close(ours[:num_tokens], want, q.dtype)
    assert_close(jaxs[:num_tokens], want, q.dtype)
    assert_close(vectorized[:num_tokens], want, q.dtype)
