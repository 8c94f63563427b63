from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from minilib import (
    RPAInputError,
    attention_kind,
    combined_head_slots,
    head_groups,
    kv_head_for_q_head,
    merge_kv_pages,
    nearest_valid_num_kv_heads,
    repeat_kv,
    split_kv_pages,
    valid_num_kv_heads,
)


def test_valid_num_kv_heads_are_the_divisors():
    for num_q_heads in range(1, 40):
        valid = valid_num_kv_heads(num_q_heads)
        assert valid == [d for d in range(1, num_q_heads + 1) if num_q_heads % d == 0]


def test_nearest_valid():
    assert nearest_valid_num_kv_heads(12, 8) == [6]
    assert nearest_valid_num_kv_heads(12, 9) == [6, 12]
    assert nearest_valid_num_kv_heads(32, 7) == [8]
    assert nearest_valid_num_kv_heads(32, 8) == [8]


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, kind", [(8, 8, "MHA"), (8, 2, "GQA"), (8, 1, "MQA")]
)
def test_kind(num_q_heads, num_kv_heads, kind):
    assert attention_kind(num_q_heads, num_kv_heads) == kind


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(8, 8), (8, 2), (8, 1), (32, 8), (6, 3)])
def test_groups_partition_the_q_heads(num_q_heads, num_kv_heads):
    groups = head_groups(num_q_heads, num_kv_heads)
    assert len(groups) == num_kv_heads
    assert sorted(h for g in groups for h in g) == list(range(num_q_heads))
    for kv_head, group in enumerate(groups):
        assert all(kv_head_for_q_head(h, num_q_heads, num_kv_heads) == kv_head for h in group)


def test_bad_head_counts_raise_the_validators_error():
    with pytest.raises(RPAInputError, match="num_q_heads=12 must be divisible by num_kv_heads=8"):
        head_groups(12, 8)
    with pytest.raises(RPAInputError, match="num_kv_heads=0 must be positive"):
        kv_head_for_q_head(0, 4, 0)
    with pytest.raises(ValueError, match="q_head=9 must be in"):
        kv_head_for_q_head(9, 8, 2)


def test_repeat_kv_gives_each_q_head_its_group_head():
    k = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4)  # [tokens, kv_heads, dim]
    repeated = repeat_kv(k, num_q_heads=6, axis=1)
    assert repeated.shape == (2, 6, 4)
    for q_head in range(6):
        kv = kv_head_for_q_head(q_head, 6, 3)
        np.testing.assert_array_equal(repeated[:, q_head], k[:, kv])


def test_split_and_merge_are_inverse():
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((3, 4, 6, 8)))
    k, v = split_kv_pages(kv)
    np.testing.assert_array_equal(k[:, :, 1], kv[:, :, 2])  # K of kv head 1 in slot 2
    np.testing.assert_array_equal(v[:, :, 1], kv[:, :, 3])  # V of kv head 1 in slot 3
    np.testing.assert_array_equal(merge_kv_pages(k, v), kv)


def test_slots_match_split():
    assert combined_head_slots(3) == [("K", 0), ("V", 0), ("K", 1), ("V", 1), ("K", 2), ("V", 2)]


def test_split_rejects_odd_axis():
    with pytest.raises(ValueError, match="even combined head axis"):
        split_kv_pages(jnp.zeros((2, 4, 3, 8)))
