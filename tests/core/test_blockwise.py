"""The blockwise (flash) version: parity with JAX's reference with block sizes of every kind,
and working memory that follows the block sizes, not the cache (one compile per shape, bf16
and fp8: tests/core/test_implementations.py).

Every batch comes from `make_batch`, so unused page slots, unused pages and q padding rows
hold NaN, and padding sequence slots hold garbage: any leak shows up as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    DTYPES,
    HEAD_CONFIGS,
    MIXED,
    assert_close,
    assert_matches_jax,
    case_batch,
    one_case_per_path,
    padded_batch,
    property_tests,
    random_batches,
)

from minilib.blockwise import (
    fold_heads_into_rows,
    q_block_window,
    ragged_paged_attention_blockwise,
    unfold_rows_into_heads,
)
from minilib.masking import kv_blocks_to_visit
from minilib.vectorized import ragged_paged_attention_jnp

# Each case costs a compile of JAX's reference and of ours, so the fast cases share one batch
# shape (MIXED, GQA 4, head_dim 64) where they can and vary the options; the slow suite adds
# more head configs and the rest of a sweep.
# (id, case name in conftest.CASES, block sizes, marks). Block sizes that do not divide
# pages_per_seq (8 here), and small q blocks.
BLOCKED_CASES = [
    ("gqa4", "gqa4", {}, ()),
    ("gqa4-blocks", "gqa4", {"num_kv_pages_per_block": 3, "num_queries_per_block": 5}, ()),
    ("sliding", "sliding-page8", {"num_kv_pages_per_block": 1}, ()),
    ("softcap", "softcap", {"num_queries_per_block": 2}, ()),
    ("mqa-decode-hd128", "mqa-sliding-softcap", {}, ()),
    ("mha-prefill", "mha-prefill", {"num_kv_pages_per_block": 1}, ()),
    ("gqa2", "gqa2", {"num_kv_pages_per_block": 3}, ()),
    ("gqa8-hd128", "gqa8-hd128", {"num_queries_per_block": 4}, ()),
    ("gqa8-16", "gqa8-16", {"num_kv_pages_per_block": 5}, pytest.mark.slow),
    ("all", "all", {}, pytest.mark.slow),
]


@pytest.mark.parametrize(
    "name, blocks",
    one_case_per_path(  # on every stack: a prefill and a decode
        [pytest.param(*c[1:3], id=c[0], marks=c[3]) for c in BLOCKED_CASES],
        "gqa4-blocks",
        "mqa-decode-hd128",
    ),
)
def test_matches_jax_reference(name, blocks):
    batch, options = case_batch(name)
    assert_matches_jax(ragged_paged_attention_blockwise, batch, **options, **blocks)


def test_q_block_window_stays_inside_q():
    # A block that would run past the end of q is shifted back; the rows it shifts over are
    # read but not live.
    rows, live = q_block_window(jnp.int32(10), jnp.int32(12), 4, 12)
    assert rows.tolist() == [8, 9, 10, 11]
    assert live.tolist() == [False, False, True, True]
    rows, live = q_block_window(jnp.int32(2), jnp.int32(5), 4, 12)
    assert rows.tolist() == [2, 3, 4, 5]
    assert live.tolist() == [True, True, True, False]  # row 5 is the next sequence's


def test_fold_heads_into_rows_groups_q_heads_by_kv_head():
    q_block = jnp.arange(3 * 8 * 2).reshape(3, 8, 2)  # 3 rows, 8 q heads, head_dim 2
    folded = fold_heads_into_rows(q_block, 2)  # 2 KV heads, 4 q heads each
    assert folded.shape == (2, 3 * 4, 2)
    # KV head 1, folded row 2 * 4 + 3: q row 2, q head 1 * 4 + 3.
    np.testing.assert_array_equal(folded[1, 2 * 4 + 3], q_block[2, 7])
    np.testing.assert_array_equal(unfold_rows_into_heads(folded, 3), q_block)


@pytest.mark.parametrize(
    "first_q_pos, last_q_pos, sliding_window, expected",
    [
        (99, 99, None, (0, 7)),  # a decode (kv_len 100) sees every key: blocks 0..6 of 16
        (0, 15, None, (0, 1)),  # the start of a prefill: only block 0
        (16, 16, None, (0, 2)),  # position 16 is the first key of block 1
        (99, 99, 8, (5, 7)),  # the window starts at key 92, in block 5
        (40, 47, 40, (0, 3)),  # keys 1..47
        (0, 0, None, (0, 1)),
    ],
)
def test_kv_blocks_to_visit_skips_blocks_nobody_sees(
    first_q_pos, last_q_pos, sliding_window, expected
):
    got = kv_blocks_to_visit(jnp.int32(first_q_pos), jnp.int32(last_q_pos), 16, sliding_window)
    assert tuple(int(b) for b in got) == expected


def compiled_temp_bytes(fn, pages_per_seq: int) -> int:
    """XLA's scratch memory for `fn` compiled (not run) on shapes with this pages_per_seq."""
    max_num_seqs, page_size = 8, 16
    shapes = (
        jax.ShapeDtypeStruct((32, 4, 64), jnp.float32),  # q
        jax.ShapeDtypeStruct((max_num_seqs * pages_per_seq, page_size, 4, 64), jnp.float32),
        jax.ShapeDtypeStruct((max_num_seqs,), jnp.int32),  # kv_lens
        jax.ShapeDtypeStruct((max_num_seqs, pages_per_seq), jnp.int32),  # page_indices
        jax.ShapeDtypeStruct((max_num_seqs + 1,), jnp.int32),  # cu_q_lens
        jax.ShapeDtypeStruct((1,), jnp.int32),  # num_seqs
    )
    analysis = jax.jit(fn).lower(*shapes).compile().memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    return analysis.temp_size_in_bytes


def test_working_memory_does_not_grow_with_pages_per_seq():
    blockwise = lambda *args: ragged_paged_attention_blockwise(*args, num_kv_pages_per_block=4)
    small, large = 8, 64  # pages_per_seq: 8x more cache per sequence
    gather_all = [compiled_temp_bytes(ragged_paged_attention_jnp, p) for p in (small, large)]
    flash = [compiled_temp_bytes(blockwise, p) for p in (small, large)]
    # The gather-all version holds K and V of every page of every sequence slot ...
    assert gather_all[1] > 4 * gather_all[0]
    # ... the blockwise one a single KV block, whatever the cache size.
    assert flash[1] <= flash[0] * 1.1 + 4096
    assert flash[1] < gather_all[1] / 8


def check_blockwise_matches_jnp(batch_and_options):
    """The gather-all jnp version (itself checked against JAX's reference in
    test_attention.py) compiles once for all these shapes; JAX's reference, once per
    example."""
    batch, options = batch_and_options
    ours = ragged_paged_attention_blockwise(
        *batch.args(), sm_scale=0.3, num_kv_pages_per_block=4, num_queries_per_block=3, **options
    )
    expected = ragged_paged_attention_jnp(*batch.args(), sm_scale=0.3, **options)
    assert_close(ours, expected, batch.q.dtype)


def check_blockwise_matches_jax_reference(batch_and_options):
    batch, options = batch_and_options
    assert_matches_jax(
        ragged_paged_attention_blockwise,
        batch,
        sm_scale=0.3,
        num_kv_pages_per_block=4,
        num_queries_per_block=3,
        **options,
    )


# JAX's reference compiles once per example, the jnp version once for all: many examples
# against jnp, a few against JAX's reference; the slow suite runs many of both.
test_property_matches_jnp, test_property_matches_jnp_sweep = property_tests(
    check_blockwise_matches_jnp, random_batches(fixed_shapes=True), fast=15, slow=300
)
test_property_matches_jax_reference, test_property_matches_jax_reference_sweep = property_tests(
    check_blockwise_matches_jax_reference, random_batches(fixed_shapes=True), fast=4, slow=60
)


# The sweep: every GQA ratio and head_dim in both dtypes, with blocks of one page and one q row,
# uneven blocks (3 pages, 5 rows) and the default ones. Two cases run in the fast suite: GQA 4
# at head_dim 128 in bfloat16 with uneven blocks, and MQA at head_dim 64 in float32 with
# blocks of one; the rest are slow.
SWEEP_BLOCKS = {"blocks of 1": (1, 1), "uneven blocks": (3, 5), "default blocks": (None, None)}
FAST_SWEEP_CASES = {
    "bfloat16-uneven blocks-hd128-8q2kv",
    "float32-blocks of 1-hd64-8q1kv",
}


def sweep_case(dtype, blocks: str, head_dim: int, num_q_heads: int, num_kv_heads: int):
    """One case of the sweep as a pytest param, marked slow unless in FAST_SWEEP_CASES."""
    case_id = f"{jnp.dtype(dtype).name}-{blocks}-hd{head_dim}-{num_q_heads}q{num_kv_heads}kv"
    marks = () if case_id in FAST_SWEEP_CASES else pytest.mark.slow
    args = (num_q_heads, num_kv_heads, head_dim, SWEEP_BLOCKS[blocks], dtype)
    return pytest.param(*args, id=case_id, marks=marks)


SWEEP_CASES = [
    sweep_case(dtype, blocks, head_dim, num_q_heads, num_kv_heads)
    for dtype in DTYPES
    for blocks in SWEEP_BLOCKS
    for head_dim in (64, 128)
    for num_q_heads, num_kv_heads in HEAD_CONFIGS
]
assert FAST_SWEEP_CASES <= {case.id for case in SWEEP_CASES}


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, blocks, dtype", SWEEP_CASES)
def test_sweep_matches_jax_reference(num_q_heads, num_kv_heads, head_dim, blocks, dtype):
    batch = padded_batch(
        MIXED,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=8,
        dtype=dtype,
    )
    assert_matches_jax(
        ragged_paged_attention_blockwise,
        batch,
        sm_scale=head_dim**-0.5,
        sliding_window=20,
        num_kv_pages_per_block=blocks[0],
        num_queries_per_block=blocks[1],
    )
