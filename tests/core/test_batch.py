from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from minilib import RPAInputError, dynamic_validate_inputs, make_batch, random_seq_lens, seq_kind
from minilib.heads import split_kv_pages


def test_shapes_and_padding():
    b = make_batch(
        [(3, 10), (1, 20)],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        page_size=4,
        max_num_batched_tokens=9,
        max_num_seqs=4,
        pages_per_seq=6,
        total_num_pages=20,
    )
    assert b.q.shape == (9, 8, 32)
    assert b.kv_pages.shape == (20, 4, 4, 32)
    assert b.page_indices.shape == (4, 6)
    assert b.kv_lens.shape == (4,) and b.cu_q_lens.shape == (5,)
    np.testing.assert_array_equal(b.kv_lens[:2], [10, 20])
    np.testing.assert_array_equal(b.cu_q_lens[:3], [0, 3, 4])
    assert int(b.num_seqs[0]) == 2 and b.num_tokens == 4
    assert np.isnan(np.asarray(b.q[4:])).all() and np.isfinite(np.asarray(b.q[:4])).all()
    dynamic_validate_inputs(*b.args())


def test_only_used_slots_hold_numbers():
    b = make_batch([(2, 5), (1, 9)], page_size=4, total_num_pages=12, pages_per_seq=5)
    k_pages, _ = split_kv_pages(b.kv_pages)
    finite = np.isfinite(np.asarray(k_pages)).all(axis=(2, 3))  # [page, slot]
    expected = np.zeros_like(finite)
    for i, kv_len in enumerate([5, 9]):
        for t in range(kv_len):
            expected[int(b.page_indices[i, t // 4]), t % 4] = True
    np.testing.assert_array_equal(finite, expected)
    # The unused columns of a live sequence point at NaN-filled (unused) pages.
    unused = np.asarray(b.page_indices[0, 2:])
    assert not finite[unused].any()


def test_pages_are_not_shared():
    b = make_batch([(1, 33), (4, 40), (2, 2)], page_size=8)
    used = [p for i, n in enumerate([5, 5, 1]) for p in np.asarray(b.page_indices[i, :n])]
    assert len(used) == len(set(used))


def test_fp8_and_bf16():
    b = make_batch([(2, 4)], dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)
    assert b.q.dtype == jnp.bfloat16 and b.kv_pages.dtype == jnp.float8_e4m3fn


def test_errors():
    with pytest.raises(RPAInputError, match=r"\(q_len=5, kv_len=3\) needs 0 <= q_len <= kv_len"):
        make_batch([(5, 3)])
    with pytest.raises(RPAInputError, match="max_num_seqs=1 is too small .* need 2"):
        make_batch([(1, 1), (1, 1)], max_num_seqs=1)


def test_describe_lists_each_sequence():
    text = make_batch([(4, 4), (1, 30), (3, 10), (0, 2)], max_num_seqs=5).describe()
    assert "4 of 5 sequence slots live (1 prefill, 1 decode, 1 chunk, 1 idle)" in text
    assert "cu_q_lens    = [0, 4, 5, 8, 8," in text
    assert text.count("\n") >= 9


def test_kinds():
    assert [seq_kind(*p) for p in [(0, 3), (3, 3), (1, 9), (4, 9)]] == [
        "idle",
        "prefill",
        "decode",
        "chunk",
    ]


def test_random_seq_lens_are_valid():
    pairs = random_seq_lens(50, max_kv_len=100, max_q_len=16, seed=3)
    assert len(pairs) == 50
    assert all(1 <= q <= min(kv, 16) and kv <= 100 for q, kv in pairs)
    assert any(q == 1 for q, _ in pairs) and any(q > 1 for q, _ in pairs)


# --- bad arguments: every one raises RPAInputError with a hint -----------------------------------


@pytest.mark.parametrize(
    "seq_lens, message",
    [
        ([(2.7, 5.9)], "q_len=2.7 must be a whole number"),
        ([(2, 5.0)], "kv_len=5.0 must be a whole number"),
        ([(True, 5)], "q_len=True must be a whole number"),
        ([5], "seq_lens[0] = 5 must be a (q_len, kv_len) pair"),
        ([(1, 2, 3)], "must be a (q_len, kv_len) pair"),
        (["ab"], "must be a (q_len, kv_len) pair"),
        (5, "seq_lens=5 must be a list of pairs"),
        ([(3, 2)], "needs 0 <= q_len <= kv_len"),
        ([(-1, 2)], "needs 0 <= q_len <= kv_len"),
    ],
)
def test_bad_seq_lens(seq_lens, message):
    with pytest.raises(RPAInputError) as info:
        make_batch(seq_lens)
    assert message in info.value.message and info.value.hint


SIZES = [
    "num_q_heads",
    "num_kv_heads",
    "head_dim",
    "page_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "pages_per_seq",
    "total_num_pages",
]


@pytest.mark.parametrize("name", SIZES)
@pytest.mark.parametrize("value", [0, -3, 2.5, 4.0, True, "8"])
def test_sizes_must_be_positive_whole_numbers(name, value):
    with pytest.raises(RPAInputError) as info:
        make_batch([(1, 5)], **{name: value})
    assert f"{name}={value!r}" in info.value.message and info.value.hint


@pytest.mark.parametrize("name", ["dtype", "kv_dtype"])
@pytest.mark.parametrize("value", [jnp.int32, np.int8, "foo", jnp.bool_])
def test_dtypes_must_be_float(name, value):
    with pytest.raises(RPAInputError, match="must be a float dtype"):
        make_batch([(1, 5)], **{name: value})


def test_seed_must_be_a_non_negative_int():
    for seed in (-1, 1.5):
        with pytest.raises(RPAInputError, match="seed="):
            make_batch([(1, 5)], seed=seed)


def test_numpy_integer_lengths_and_sizes_are_fine():
    b = make_batch([(np.int64(2), np.int32(5))], page_size=np.int64(4), head_dim=np.int32(8))
    assert b.seq_lens == ((2, 5),) and b.kv_pages.shape[1] == 4
