"""Every bad input raises RPAInputError with JAX's text (where JAX checks it) and a hint;
valid edge cases pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import IMPLEMENTATIONS
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_kernel

from minilib import (
    RPAInputError,
    dynamic_validate_inputs,
    make_batch,
    ragged_paged_attention_jnp,
    ref_ragged_paged_attention,
    static_validate_inputs,
)
from minilib.explore.mistakes import MISTAKES, base_batch, run_mistake


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


# The one catalogue of mistakes (minilib.explore.mistakes), each with what the validators must say.
# Static mistakes (shapes, dtypes, options): static_validate_inputs raises, and
# dynamic_validate_inputs, which runs the static checks first, raises the same error.
# Where JAX's own validator checks the same thing, our message is JAX's, word for word:
JAX_CHECKS = [
    "12 q heads with 8 KV heads",
    "q transposed to [num_q_heads, tokens, head_dim]",
    "q's head_dim differs from kv_pages'",
    "kv_lens longer than page_indices",
    "cu_q_lens one entry short",
    "num_seqs with two entries",
    "kv_lens as int64 (NumPy's default)",
    "page_indices as int64 (NumPy's default)",
    "kv_lens as floats",
    "soft_cap=0.0 to turn it off",
    "sliding_window=0 to turn it off",
    "num_kv_pages_per_block > pages_per_seq",
    "num_kv_pages_per_block=0",
    "num_queries_per_block=-1",
    "vmem_limit_bytes=0",
]
# The checks JAX does not make (or makes with a bare assert or an unpacking error): our
# message, word for word.
STATIC = {
    "q without its head axis": "q.shape=(9, 32) must have 3 dimensions.",
    "K pages only, not kv_pages": "num_combined_kv_heads=1 (kv_pages.shape[2]) must be even.",
    "K and V stacked on an axis of their own": (
        "kv_pages.shape=(9, 8, 2, 2, 8) must have 4 dimensions."
    ),
    "kv_lens as a column": "kv_lens.shape=(3, 1) must have 1 dimensions.",
    "page_indices flattened": "page_indices.shape=(9,) must have 2 dimensions.",
    "cu_q_lens as a column": "cu_q_lens.shape=(4, 1) must have 1 dimensions.",
    "num_seqs as a scalar": "num_seqs.shape=() must have 1 dimensions.",
    "k_scale as an array": "k_scale=Array(0.5, dtype=float32) must be a Python float or None.",
    "k_scale as an int": "k_scale=2 must be a Python float or None.",
}
# Bad options and dtypes: the validators and every attention function reject them.
OPTIONS = {
    "q as integers": (
        "q.dtype=dtype('int32') must be a float dtype of 16 bits or more "
        "(float32, bfloat16, float16)."
    ),
    "q in fp8": (
        "q.dtype=dtype(float8_e4m3fn) must be a float dtype of 16 bits or more "
        "(float32, bfloat16, float16)."
    ),
    "kv_pages as int8": (
        "kv_pages.dtype=dtype('int8') must be a float dtype (float32, bfloat16, or an fp8 "
        "type such as float8_e4m3fn with k_scale and v_scale)."
    ),
    "kv_pages as bool": (
        "kv_pages.dtype=dtype('bool') must be a float dtype (float32, bfloat16, or an fp8 "
        "type such as float8_e4m3fn with k_scale and v_scale)."
    ),
    "soft_cap=inf to turn it off": "soft_cap=inf must be finite.",
    "sliding_window negative": "sliding_window=-3 must be positive.",
    "sliding_window as a float": "sliding_window=2.5 must be a whole number (an int).",
    "sliding_window=True": "sliding_window=True must be a whole number (an int).",
    "mask_value=-inf": "mask_value=-inf must be a finite negative number.",
    "mask_value=nan": "mask_value=nan must be a finite negative number.",
    "mask_value=0.0": "mask_value=0.0 must be a finite negative number.",
    "mask_value positive": "mask_value=1e+30 must be a finite negative number.",
    "mask_value as a string": "mask_value='-1e9' must be a real number.",
    "sm_scale=nan": "sm_scale=nan must be finite.",
    "sm_scale as an array": "sm_scale=Array([1., 1.], dtype=float32) must be a real number.",
    "sm_scale as a string": "sm_scale='0.125' must be a real number.",
    "k_scale=0.0": "k_scale=0.0 must be positive and finite.",
    "v_scale negative": "v_scale=-0.5 must be positive and finite.",
    "v_scale=inf": "v_scale=inf must be positive and finite.",
}
# Dynamic mistakes: shapes, dtypes and options are fine, only the values are wrong. The
# static validator lets them through; the dynamic one says:
DYNAMIC = {
    "pages_per_seq too small": (
        "pages_per_seq=1 must be greater or equal to min_pages_per_seq=3 given max_kv_len=20 "
        "and page_size=8."
    ),
    "q_len > kv_len": "q_len=5 must be less or equal to kv_len=0 at sequence 0.",
    "a negative kv_len": "kv_lens[1]=-1 must be non-negative.",
    "a page index out of range": (
        "page_indices[1, 0]=9 is outside [0, 9), the pages of kv_pages, for sequence 1 with "
        "kv_len=20."
    ),
    "a negative page index": (
        "page_indices[0, 0]=-1 is outside [0, 9), the pages of kv_pages, for sequence 0 with "
        "kv_len=5."
    ),
    "cu_q_lens decreasing": "cu_q_lens must not decrease: cu_q_lens[2]=4 < cu_q_lens[1]=5.",
    "cu_q_lens without its leading 0": "cu_q_lens[0]=5 must be 0.",
    "q shorter than the packed tokens": (
        "Total q tokens 9 must be less or equal to max_num_batched_tokens=8."
    ),
    "num_seqs > max_num_seqs": "num_seqs[0]=4 must be less or equal to max_num_seqs=3",
    "num_seqs negative": "num_seqs[0]=-1 must be non-negative.",
}
VALID = ["correct: a valid mixed batch"]
# Wrong values that every check lets through: only the answer shows them.
SILENT = ["a stale kv_len, which no check can catch"]


def test_every_mistake_has_its_expected_message():
    named = [*VALID, *SILENT, *JAX_CHECKS, *STATIC, *OPTIONS, *DYNAMIC]
    assert len(named) == len(set(named)), "each mistake in one group"
    assert set(named) == set(MISTAKES)


@pytest.mark.parametrize("name", JAX_CHECKS)
@pytest.mark.parametrize("validator", ["static", "dynamic"])
def test_static_checks_carry_jax_text(name, validator):
    args, options = MISTAKES[name](base_batch())
    expected = jax_message(jax_kernel.static_validate_inputs, args, **options)
    ours = {"static": static_validate_inputs, "dynamic": dynamic_validate_inputs}[validator]
    err = raises_ours(ours, args, **options)
    assert err.message == expected
    assert str(err).startswith(expected + "\nHint: ")


@pytest.mark.parametrize("name", [*STATIC, *OPTIONS])
@pytest.mark.parametrize("validator", ["static", "dynamic"])
def test_static_mistakes_raise_our_message(name, validator):
    args, options = MISTAKES[name](base_batch())
    ours = {"static": static_validate_inputs, "dynamic": dynamic_validate_inputs}[validator]
    err = raises_ours(ours, args, **options)
    assert err.message == {**STATIC, **OPTIONS}[name]


@pytest.mark.parametrize("name", DYNAMIC)
def test_dynamic_mistakes_raise_only_in_the_dynamic_check(name):
    args, options = MISTAKES[name](base_batch())
    static_validate_inputs(*args, **options)  # shapes, dtypes and options are fine
    err = raises_ours(dynamic_validate_inputs, args, **options)
    assert err.message == DYNAMIC[name]


@pytest.mark.parametrize("name", VALID)
def test_valid_entries_pass_both_validators(name):
    assert run_mistake(name, static_validate_inputs) is None
    assert run_mistake(name) is None


@pytest.mark.parametrize("name", SILENT)
def test_silent_mistakes_pass_both_validators_and_change_the_answer(name):
    # Notebook 05 tells this story: the validators cannot catch it, the answer is wrong.
    assert run_mistake(name, static_validate_inputs) is None
    assert run_mistake(name) is None
    base = base_batch()
    args, options = MISTAKES[name](base)
    n = base.num_tokens
    right = ref_ragged_paged_attention(*base.args())[:n]
    wrong = ref_ragged_paged_attention(*args, **options)[:n]
    assert bool(jnp.isfinite(wrong).all())
    assert float(jnp.abs(wrong - right).max()) > 0.1  # a wrong answer, not rounding


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


def test_jax_only_asserts_odd_combined_heads():
    args, options = MISTAKES["K pages only, not kv_pages"](base_batch())
    with pytest.raises(AssertionError):
        jax_kernel.static_validate_inputs(*args, **options)


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


@pytest.mark.parametrize("name", OPTIONS)
def test_every_attention_function_rejects_bad_options(name):
    from minilib import (
        ragged_paged_attention,
        ragged_paged_attention_blockwise,
        ragged_paged_attention_pallas_basic,
    )

    args, options = MISTAKES[name](base_batch())
    for fn in (
        ref_ragged_paged_attention,
        ragged_paged_attention_jnp,
        ragged_paged_attention_blockwise,
        ragged_paged_attention_pallas_basic,
        ragged_paged_attention,
    ):
        with pytest.raises(RPAInputError) as info:
            fn(*args, **options)
        assert info.value.message == OPTIONS[name], fn.__name__


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


def zero_size(axis: str) -> list:
    """An empty step (num_seqs=[0], which the value checks accept) with one axis of size 0.
    Each used to pass validation and then crash in its own way in each implementation
    (ZeroDivisionError, IndexError, TypeError, or none at all)."""
    b = make_batch([], max_num_seqs=3, max_num_batched_tokens=8, pages_per_seq=2, page_size=4)
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = b.args()
    return {
        "no q rows": [q[:0], kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs],
        "no q heads": [q[:, :0], kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs],
        "head_dim 0": [q[..., :0], kv_pages[..., :0], kv_lens, page_indices, cu_q_lens, num_seqs],
        "no pages": [q, kv_pages[:0], kv_lens, page_indices, cu_q_lens, num_seqs],
        "page_size 0": [q, kv_pages[:, :0], kv_lens, page_indices, cu_q_lens, num_seqs],
        "no sequence slots": [q, kv_pages, kv_lens[:0], page_indices[:0], cu_q_lens[:1], num_seqs],
        "no page-table columns": [q, kv_pages, kv_lens, page_indices[:, :0], cu_q_lens, num_seqs],
    }[axis]


ZERO_SIZES = {
    "no q rows": "max_num_batched_tokens=0 (q.shape[0]) must be positive.",
    "no q heads": "num_q_heads=0 (q.shape[1]) must be positive.",
    "head_dim 0": "head_dim=0 (q.shape[2]) must be positive.",
    "no pages": "total_num_pages=0 (kv_pages.shape[0]) must be positive.",
    "page_size 0": "page_size=0 (kv_pages.shape[1]) must be positive.",
    "no sequence slots": "max_num_seqs=0 (page_indices.shape[0]) must be positive.",
    "no page-table columns": "pages_per_seq=0 (page_indices.shape[1]) must be positive.",
}


@pytest.mark.parametrize("axis", ZERO_SIZES)
@pytest.mark.parametrize("validator", [static_validate_inputs, dynamic_validate_inputs])
def test_zero_size_axes_are_rejected(axis, validator):
    err = raises_ours(validator, zero_size(axis))
    assert err.message == ZERO_SIZES[axis]


@pytest.mark.parametrize("axis", ZERO_SIZES)
@pytest.mark.parametrize("fn_name", IMPLEMENTATIONS)
def test_every_attention_function_rejects_zero_size_axes(fn_name, axis):
    """Eagerly, and under jit, where only the static checks run: the same clear error from
    every implementation, before any of them divides by the size."""
    fn = IMPLEMENTATIONS[fn_name]
    calls = {"eager": fn} if fn_name == "reference" else {"eager": fn, "jit": jax.jit(fn)}
    for how, call in calls.items():  # our reference reads the lengths: it cannot run under jit
        with pytest.raises(RPAInputError) as info:
            call(*zero_size(axis))
        assert info.value.message == ZERO_SIZES[axis], how
        assert info.value.hint
