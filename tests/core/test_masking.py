"""The mask rule, written once in minilib.masking: per key, as an array, and per KV block."""

from __future__ import annotations

import numpy as np
from conftest import property_test
from hypothesis import strategies as st

from minilib.masking import causal_mask, is_masked, kv_blocks_to_visit, q_position

WINDOWS = st.none() | st.integers(1, 40)


def _sees(q_pos: int, k_pos: int, sliding_window: int | None) -> bool:
    """The rule in words: a query sees itself and the keys before it, and with a window w only
    the last w of them."""
    oldest = 0 if sliding_window is None else q_pos - sliding_window + 1
    return oldest <= k_pos <= q_pos


def _causal_mask_hides_exactly_what_a_row_cannot_see(case):
    kv_len, q_len, window = case
    mask = np.asarray(causal_mask(q_len, kv_len, window))
    assert mask.shape == (q_len, kv_len)
    for i in range(q_len):
        q_pos = kv_len - q_len + i  # the q rows are the sequence's last q_len tokens
        for k_pos in range(kv_len):
            assert bool(mask[i, k_pos]) == (not _sees(q_pos, k_pos, window)), (i, k_pos)


test_causal_mask_hides_exactly_what_a_row_cannot_see = property_test(
    _causal_mask_hides_exactly_what_a_row_cannot_see,
    st.integers(1, 30).flatmap(lambda kv: st.tuples(st.just(kv), st.integers(1, kv), WINDOWS)),
    max_examples=40,
)


def test_the_rule_is_the_same_on_ints_numpy_and_jnp():
    q_pos, k_pos = np.arange(6)[:, None], np.arange(6)[None, :]
    as_numpy = is_masked(q_pos, k_pos, 3)
    assert isinstance(as_numpy, np.ndarray)
    np.testing.assert_array_equal(as_numpy, np.asarray(causal_mask(6, 6, 3)))
    assert [is_masked(4, k, 3) for k in range(6)] == [True, True, False, False, False, True]
    assert q_position(np.arange(3), 3, 10).tolist() == [7, 8, 9]


def _kv_blocks_to_visit_are_the_blocks_with_a_visible_key(case):
    first_q_pos, num_rows, kv_tokens_per_block, window = case
    last_q_pos = first_q_pos + num_rows - 1
    seen_blocks = {
        k_pos // kv_tokens_per_block
        for q_pos in range(first_q_pos, last_q_pos + 1)
        for k_pos in range(last_q_pos + 1)
        if _sees(q_pos, k_pos, window)
    }
    first, end = kv_blocks_to_visit(first_q_pos, last_q_pos, kv_tokens_per_block, window)
    assert (int(first), int(end)) == (min(seen_blocks), max(seen_blocks) + 1)
    assert seen_blocks == set(range(int(first), int(end)))  # no block in between is skipped


test_kv_blocks_to_visit_are_the_blocks_with_a_visible_key = property_test(
    _kv_blocks_to_visit_are_the_blocks_with_a_visible_key,
    st.tuples(st.integers(0, 100), st.integers(1, 20), st.sampled_from([1, 4, 16]), WINDOWS),
    max_examples=100,
)
