"""Every bad input raises RPAInputError with JAX's text (where JAX checks it) and a hint;
valid edge cases pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_kernel

from minilib import (
    RPAInputError,
    dynamic_validate_inputs,
    make_batch,
    ragged_paged_attention_jnp,
    ref_ragged_paged_attention,
    static_validate_inputs,
)


def good_batch(**kw):
    kw.setdefault("num_q_heads", 8)
    kw.setdefault("num_kv_heads", 2)
    return make_batch([(3, 10), (1, 20), (4, 4)], page_size=4, max_num_seqs=5, **kw)


def args_with(batch, **replace):
    names = ["q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"]
    return [replace.get(name, getattr(batch, name)) for name in names]


def jax_message(validator, args, **options) -> str:
    """The message JAX's own validator gives for these inputs (computed, not copied)."""
    with pytest.raises(ValueError) as info:
        validator(*args, **options)
    return str(info.value)


def raises_ours(validator, args, **options) -> RPAInputError:
    with pytest.raises(RPAInputError) as info:
        validator(*args, **options)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.hint and f"Hint: {err.hint}" in str(err)
    return err


# Static checks that JAX makes itself: our message must contain JAX's text word for word.
STATIC_JAX_CASES = {
    "heads 12/8": lambda b: (
        args_with(b, q=jnp.zeros((8, 12, 64)), kv_pages=jnp.zeros((40, 4, 16, 64))),
        {},
    ),
    "num_seqs shape": lambda b: (args_with(b, num_seqs=jnp.array([1, 2], jnp.int32)), {}),
    "head_dim": lambda b: (args_with(b, q=jnp.zeros((8, 8, 32))), {}),
    "kv_lens shape": lambda b: (args_with(b, kv_lens=jnp.zeros(4, jnp.int32)), {}),
    "cu_q_lens shape": lambda b: (args_with(b, cu_q_lens=jnp.zeros(9, jnp.int32)), {}),
    "float kv_lens": lambda b: (args_with(b, kv_lens=b.kv_lens.astype(jnp.float32)), {}),
    "int64 page_indices": lambda b: (
        args_with(b, page_indices=np.asarray(b.page_indices, np.int64)),
        {},
    ),  # noqa: E501
    "sliding_window=0": lambda b: (args_with(b), {"sliding_window": 0}),
    "soft_cap=0": lambda b: (args_with(b), {"soft_cap": 0.0}),
    "kv pages per block 0": lambda b: (args_with(b), {"num_kv_pages_per_block": 0}),
    "kv pages per block too big": lambda b: (args_with(b), {"num_kv_pages_per_block": 99}),
    "queries per block": lambda b: (args_with(b), {"num_queries_per_block": -1}),
    "vmem": lambda b: (args_with(b), {"vmem_limit_bytes": 0}),
}


@pytest.mark.parametrize("case", STATIC_JAX_CASES)
@pytest.mark.parametrize("validator", ["static", "dynamic"])
def test_static_checks_carry_jax_text(case, validator):
    args, options = STATIC_JAX_CASES[case](good_batch())
    expected = jax_message(jax_kernel.static_validate_inputs, args, **options)
    ours = {"static": static_validate_inputs, "dynamic": dynamic_validate_inputs}[validator]
    err = raises_ours(ours, args, **options)
    assert err.message == expected
    assert str(err).startswith(expected + "\nHint: ")


def test_heads_message_and_hint():
    b = good_batch()
    args = args_with(b, q=jnp.zeros((8, 12, 64)), kv_pages=jnp.zeros((40, 4, 16, 64)))
    err = raises_ours(static_validate_inputs, args)
    assert "num_q_heads=12 must be divisible by num_kv_heads=8" in str(err)
    assert "[1, 2, 3, 4, 6, 12]" in err.hint  # the valid num_kv_heads
    assert "nearest to 8: 6)" in err.hint
    assert "jnp.repeat" in err.hint
    assert "transposed" in err.hint


def test_attention_functions_validate_too():
    b = good_batch()
    args = args_with(b, q=jnp.zeros((8, 12, 64)), kv_pages=jnp.zeros((40, 4, 16, 64)))
    for fn in (ref_ragged_paged_attention, ragged_paged_attention_jnp):
        with pytest.raises(RPAInputError, match="num_q_heads=12 must be divisible"):
            fn(*args)


# Checks JAX makes at run time. JAX formats values with repr (np.int32(5), Array(...)), so
# the expected text here is written out, with plain integers.
def test_num_seqs_too_big():
    b = good_batch()
    err = raises_ours(dynamic_validate_inputs, args_with(b, num_seqs=jnp.array([6], jnp.int32)))
    assert err.message == "num_seqs[0]=6 must be less or equal to max_num_seqs=5"


def test_pages_per_seq_too_small():
    b = make_batch([(1, 20)], page_size=4)  # needs 5 pages
    args = args_with(b, page_indices=b.page_indices[:, :3])
    err = raises_ours(dynamic_validate_inputs, args)
    assert err.message == (
        "pages_per_seq=3 must be greater or equal to min_pages_per_seq=5 given "
        "max_kv_len=20 and page_size=4."
    )


def test_too_many_q_tokens():
    b = good_batch()
    cu = np.asarray(b.cu_q_lens).copy()
    cu[3] = 50  # q has 8 rows
    err = raises_ours(dynamic_validate_inputs, args_with(b, cu_q_lens=jnp.asarray(cu)))
    assert err.message == "Total q tokens 50 must be less or equal to max_num_batched_tokens=8."


def test_q_len_above_kv_len():
    b = good_batch()
    kv = np.asarray(b.kv_lens).copy()
    kv[0] = 2  # sequence 0 has 3 new tokens
    err = raises_ours(dynamic_validate_inputs, args_with(b, kv_lens=jnp.asarray(kv)))
    assert err.message == "q_len=3 must be less or equal to kv_len=2 at sequence 0."


# Mistakes JAX lets through or meets with a bare assert.
def test_page_index_out_of_range():
    b = good_batch()
    table = np.asarray(b.page_indices).copy()
    table[1, 2] = b.kv_pages.shape[0]  # one past the last page
    err = raises_ours(dynamic_validate_inputs, args_with(b, page_indices=jnp.asarray(table)))
    total = b.kv_pages.shape[0]
    assert err.message.startswith(f"page_indices[1, 2]={total} is outside [0, {total})")


def test_negative_page_index():
    b = good_batch()
    table = np.asarray(b.page_indices).copy()
    table[0, 0] = -1
    err = raises_ours(dynamic_validate_inputs, args_with(b, page_indices=jnp.asarray(table)))
    assert "page_indices[0, 0]=-1 is outside" in err.message


def test_cu_q_lens_must_start_at_zero():
    b = good_batch()
    cu = np.asarray(b.cu_q_lens).copy()
    cu[0] = 1
    err = raises_ours(dynamic_validate_inputs, args_with(b, cu_q_lens=jnp.asarray(cu)))
    assert err.message == "cu_q_lens[0]=1 must be 0."


def test_cu_q_lens_must_not_decrease():
    b = good_batch()
    cu = np.asarray(b.cu_q_lens).copy()  # [0, 3, 4, 8, ...]
    cu[2] = 2
    err = raises_ours(dynamic_validate_inputs, args_with(b, cu_q_lens=jnp.asarray(cu)))
    assert err.message == "cu_q_lens must not decrease: cu_q_lens[2]=2 < cu_q_lens[1]=3."


def test_negative_kv_len():
    b = good_batch()
    kv = np.asarray(b.kv_lens).copy()
    kv[1] = -4
    err = raises_ours(dynamic_validate_inputs, args_with(b, kv_lens=jnp.asarray(kv)))
    assert err.message == "kv_lens[1]=-4 must be non-negative."


def test_negative_num_seqs():
    b = good_batch()
    err = raises_ours(dynamic_validate_inputs, args_with(b, num_seqs=jnp.array([-1], jnp.int32)))
    assert err.message == "num_seqs[0]=-1 must be non-negative."


def test_odd_combined_heads():
    b = good_batch()
    err = raises_ours(static_validate_inputs, args_with(b, kv_pages=jnp.zeros((40, 4, 3, 64))))
    assert err.message == "num_combined_kv_heads=3 (kv_pages.shape[2]) must be even."
    # JAX itself only asserts here.
    with pytest.raises(AssertionError):
        jax_kernel.static_validate_inputs(*args_with(b, kv_pages=jnp.zeros((40, 4, 3, 64))))


@pytest.mark.parametrize(
    "name, bad, rank",
    [
        ("q", jnp.zeros((8, 512)), 3),
        ("kv_pages", jnp.zeros((40, 4, 4, 16, 64)), 4),
        ("kv_lens", jnp.zeros((5, 1), jnp.int32), 1),
        ("page_indices", jnp.zeros(5, jnp.int32), 2),
        ("cu_q_lens", jnp.zeros((6, 1), jnp.int32), 1),
        ("num_seqs", jnp.array(3, jnp.int32), 1),
    ],
)
def test_wrong_rank(name, bad, rank):
    err = raises_ours(static_validate_inputs, args_with(good_batch(), **{name: bad}))
    assert err.message == f"{name}.shape={tuple(bad.shape)} must have {rank} dimensions."


def test_scale_must_be_float():
    err = raises_ours(static_validate_inputs, args_with(good_batch()), k_scale=2)
    assert err.message == "k_scale=2 must be a Python float or None."


def test_dynamic_refuses_traced_values_clearly():
    b = good_batch()
    with pytest.raises(RPAInputError, match="outside jax.jit"):
        jax.jit(lambda *a: dynamic_validate_inputs(*a))(*b.args())


# Valid edge cases do not raise.
def test_valid_batches_pass():
    dynamic_validate_inputs(*good_batch().args(), sliding_window=3, soft_cap=30.0, k_scale=0.5)


def test_sequence_with_no_new_tokens_is_valid():
    dynamic_validate_inputs(*make_batch([(0, 9), (2, 2)]).args())


def test_zero_sequences_is_valid():
    dynamic_validate_inputs(*make_batch([], max_num_seqs=3).args())


def test_garbage_in_padding_slots_is_valid():
    b = good_batch()  # 3 live sequences in 5 slots
    kv = np.asarray(b.kv_lens).copy()
    kv[3:] = [-7, 10**6]
    table = np.asarray(b.page_indices).copy()
    table[3:] = -99
    cu = np.asarray(b.cu_q_lens).copy()
    cu[4:] = [-1, 3]
    dynamic_validate_inputs(
        *args_with(
            b, kv_lens=jnp.asarray(kv), page_indices=jnp.asarray(table), cu_q_lens=jnp.asarray(cu)
        )
    )


def test_unused_page_table_columns_may_hold_garbage():
    b = make_batch([(1, 5)], page_size=4, pages_per_seq=6)  # uses 2 of 6 columns
    table = np.asarray(b.page_indices).copy()
    table[0, 2:] = 10**6
    dynamic_validate_inputs(*args_with(b, page_indices=jnp.asarray(table)))


# Options: every bad one raises, from the validators and from every attention function.
BAD_OPTIONS = {
    "mask_value=nan": ({"mask_value": float("nan")}, "mask_value=nan must be a finite negative"),
    "mask_value=-inf": (
        {"mask_value": float("-inf")},
        "mask_value=-inf must be a finite negative",
    ),
    "mask_value=0": ({"mask_value": 0.0}, "mask_value=0.0 must be a finite negative"),
    "mask_value=1e30": ({"mask_value": 1e30}, "must be a finite negative"),
    "mask_value str": ({"mask_value": "-1e9"}, "mask_value='-1e9' must be a real number"),
    "sm_scale=nan": ({"sm_scale": float("nan")}, "sm_scale=nan must be finite"),
    "sm_scale array": ({"sm_scale": jnp.ones(2)}, "must be a real number"),
    "sm_scale str": ({"sm_scale": "0.125"}, "sm_scale='0.125' must be a real number"),
    "soft_cap=inf": ({"soft_cap": float("inf")}, "soft_cap=inf must be finite"),
    "sliding_window=2.5": ({"sliding_window": 2.5}, "sliding_window=2.5 must be a whole number"),
    "sliding_window=True": ({"sliding_window": True}, "must be a whole number"),
    "sliding_window=-3": ({"sliding_window": -3}, "sliding_window=-3 must be positive."),
    "k_scale=0": ({"k_scale": 0.0}, "k_scale=0.0 must be positive and finite"),
    "v_scale<0": ({"v_scale": -0.5}, "v_scale=-0.5 must be positive and finite"),
    "v_scale=inf": ({"v_scale": float("inf")}, "v_scale=inf must be positive and finite"),
    "q int32": ({"q": "int32"}, "q.dtype=dtype('int32') must be a float dtype"),
    "q fp8": ({"q": "float8_e4m3fn"}, "must be a float dtype of 16 bits or more"),
    "kv_pages int8": ({"kv_pages": "int8"}, "kv_pages.dtype=dtype('int8') must be a float"),
    "kv_pages bool": ({"kv_pages": "bool"}, "must be a float dtype"),
}


def split_case(batch, case):
    """(args, options) of a BAD_OPTIONS case: dtype entries recast an array."""
    changes, message = BAD_OPTIONS[case]
    arrays = {k: getattr(batch, k).astype(v) for k, v in changes.items() if k in ("q", "kv_pages")}
    options = {k: v for k, v in changes.items() if k not in ("q", "kv_pages")}
    return args_with(batch, **arrays), options, message


@pytest.mark.parametrize("case", BAD_OPTIONS)
@pytest.mark.parametrize("validator", ["static", "dynamic"])
def test_bad_options_raise(case, validator):
    args, options, message = split_case(good_batch(), case)
    ours = {"static": static_validate_inputs, "dynamic": dynamic_validate_inputs}[validator]
    err = raises_ours(ours, args, **options)
    assert message in err.message


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_every_attention_function_rejects_bad_options(case):
    from minilib import (
        ragged_paged_attention,
        ragged_paged_attention_blockwise,
        ragged_paged_attention_pallas_basic,
    )

    args, options, message = split_case(good_batch(), case)
    for fn in (
        ref_ragged_paged_attention,
        ragged_paged_attention_jnp,
        ragged_paged_attention_blockwise,
        ragged_paged_attention_pallas_basic,
        ragged_paged_attention,
    ):
        with pytest.raises(RPAInputError) as info:
            fn(*args, **options)
        assert message in info.value.message, fn.__name__


@pytest.mark.parametrize(
    "sm_scale", [1 / jnp.sqrt(8.0), np.float32(1 / np.sqrt(8.0)), 1 / np.sqrt(8.0)]
)
def test_sm_scale_may_be_a_jax_or_numpy_scalar(sm_scale):
    from minilib import ragged_paged_attention_blockwise

    b = good_batch()
    want = ragged_paged_attention_jnp(*b.args(), sm_scale=float(sm_scale))
    for fn in (ragged_paged_attention_jnp, ragged_paged_attention_blockwise):
        got = fn(
            *b.args(), sm_scale=sm_scale, soft_cap=np.float32(30.0), sliding_window=np.int64(5)
        )
        ref = fn(*b.args(), sm_scale=float(sm_scale), soft_cap=30.0, sliding_window=5)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert want.shape == b.q.shape


def test_fp8_kv_pages_and_default_mask_value_are_valid():
    b = good_batch(kv_dtype=jnp.float8_e4m3fn)
    dynamic_validate_inputs(*b.args(), k_scale=0.5, v_scale=2.0, mask_value=None)
    dynamic_validate_inputs(*good_batch(dtype=jnp.bfloat16).args(), mask_value=-1e9)
