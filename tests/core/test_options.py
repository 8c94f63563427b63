"""minilib.options: AttentionOptions checks every option once, and keeps plain Python numbers.

The messages of the options every validator sees are checked, mistake by mistake, in
tests/core/test_validation.py (through minilib.explore.mistakes); these check the object itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minilib.errors import RPAInputError
from minilib.options import DEFAULT_MASK_VALUE, AttentionOptions, attention_options

INT_OPTIONS = ("sliding_window", "num_kv_pages_per_block", "num_queries_per_block",
               "vmem_limit_bytes")  # fmt: skip
FLOAT_OPTIONS = ("sm_scale", "soft_cap", "mask_value")


def test_values_become_plain_python_numbers():
    options = AttentionOptions(
        sm_scale=jnp.float32(0.5),
        soft_cap=np.float64(30.0),
        mask_value=np.float32(-1e4),
        sliding_window=np.int32(8),
        num_kv_pages_per_block=jnp.int32(4),
        num_queries_per_block=np.int64(16),
        vmem_limit_bytes=2**25,
    )
    for name in FLOAT_OPTIONS:
        assert type(getattr(options, name)) is float, name
    for name in INT_OPTIONS:
        assert type(getattr(options, name)) is int, name
    assert options == AttentionOptions(
        sm_scale=0.5, soft_cap=30.0, mask_value=-1e4, sliding_window=8,
        num_kv_pages_per_block=4, num_queries_per_block=16, vmem_limit_bytes=2**25,
    )  # fmt: skip
    assert hash(options) == hash(AttentionOptions(**vars(options)))


def test_none_means_the_default_mask_value():
    assert AttentionOptions(mask_value=None).mask_value == DEFAULT_MASK_VALUE
    assert AttentionOptions().mask_value == DEFAULT_MASK_VALUE


@pytest.mark.parametrize("name", INT_OPTIONS + FLOAT_OPTIONS)
def test_a_traced_value_is_named_as_traced(name):
    """Under jit an option is a tracer: say so, whatever kind of number the option is."""

    @jax.jit
    def build(x):
        AttentionOptions(**{name: x})

    kind = jnp.int32 if name in INT_OPTIONS else jnp.float32
    with pytest.raises(RPAInputError, match=f"{name} is a traced value") as info:
        build(jnp.asarray(-3 if name == "mask_value" else 3, kind))
    assert "must be a whole number" not in str(info.value)
    assert "static_argnames" in info.value.hint


@pytest.mark.parametrize(
    "name, hint_word",
    [("sliding_window", "window"), ("num_queries_per_block", "q rows"),
     ("vmem_limit_bytes", "byte count")],
)  # fmt: skip
@pytest.mark.parametrize("value", [0, -2])
def test_counts_must_be_positive(name, hint_word, value):
    with pytest.raises(RPAInputError) as info:
        AttentionOptions(**{name: value})
    assert info.value.message == f"{name}={value} must be positive."
    assert hint_word in info.value.hint


@pytest.mark.parametrize("name", ["sliding_window", "num_queries_per_block", "vmem_limit_bytes"])
def test_counts_must_fit_in_int32(name):
    """The kernels compute with them in int32: 2**31 - 1 is taken, 2**31 and a huge typed
    number are refused by name (an explorer's field once gave an OverflowError)."""
    assert getattr(AttentionOptions(**{name: 2**31 - 1}), name) == 2**31 - 1
    for value in (2**31, 10**20):
        with pytest.raises(RPAInputError) as info:
            AttentionOptions(**{name: value})
        assert info.value.message.startswith(f"{name}={value} is too large")
        assert "int32" in info.value.message


def test_num_kv_pages_per_block_range_is_left_to_the_shape_check():
    """1..pages_per_seq needs the arrays: static_validate_inputs says it, with both values."""
    assert AttentionOptions(num_kv_pages_per_block=0).num_kv_pages_per_block == 0
    with pytest.raises(RPAInputError, match="must be a whole number"):
        AttentionOptions(num_kv_pages_per_block=2.0)


@pytest.mark.parametrize("name", INT_OPTIONS)
@pytest.mark.parametrize("value", [2.5, True, "4", np.bool_(True)])
def test_counts_must_be_whole_numbers(name, value):
    with pytest.raises(RPAInputError, match=rf"^{name}=.* must be a whole number \(an int\)\."):
        AttentionOptions(**{name: value})


def test_an_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="sliding_windw"):
        AttentionOptions(sliding_windw=4)


def test_options_or_keywords_not_both():
    options = AttentionOptions(sliding_window=4)
    assert attention_options(options) is options
    assert attention_options(sliding_window=4) == options
    with pytest.raises(TypeError, match="not both"):
        attention_options(options, sliding_window=4)
