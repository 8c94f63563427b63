"""What the paged KV cache's test modules share: a small cache, tokens to append, and its state
before and after a call that must change nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest

from minilib.errors import KVCacheError
from minilib.kv_cache import PagedKVCache


def make_cache(**sizes) -> PagedKVCache:
    config = dict(
        total_num_pages=8, page_size=4, num_kv_heads=2, head_dim=3, max_num_seqs=3,
        pages_per_seq=3,
    )  # fmt: skip
    config.update(sizes)
    return PagedKVCache(**config)


def tokens(cache: PagedKVCache, n: int, start: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """n tokens of K and V with distinct, exactly representable values (V = -K)."""
    shape = (n, cache.num_kv_heads, cache.head_dim)
    k = start + np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    return k, -k - 0.5


def snapshot(cache: PagedKVCache) -> dict:
    """Everything a failed call must leave unchanged."""
    return {
        "seqs": {s: (cache.seq_len(s), cache.pages(s)) for s in cache.seq_ids},
        "free_pages": cache.allocator.free_pages,
        "owners": cache.allocator.owners,
        "kv_pages": np.asarray(cache.kv_pages).copy(),
    }


def assert_same_state(before: dict, after: dict) -> None:
    np.testing.assert_array_equal(before.pop("kv_pages"), after.pop("kv_pages"))
    assert before == after


def raises(match: str):
    """pytest.raises for a KVCacheError whose message contains `match` literally."""
    return pytest.raises(KVCacheError, match=re.escape(match))
