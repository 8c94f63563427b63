"""Every option of the signature at once, drawn at random, against JAX's reference: sm_scale,
sliding_window, soft_cap, mask_value, float32 and bfloat16, an fp8 cache with its k_scale and
v_scale, and the block sizes an implementation takes, on random NaN-padded batches.

The case files check each option on fixed batches (conftest.CASES), mostly one at a time, and
the other property tests draw a few options for one dtype. Here each implementation meets
each dtype pair with every option set (`random_batches(one_of_everything=True)`), so that a
mix-up between two options (the soft cap applied before sm_scale, say) shows. The kernel's
own random batches are in tests/kernel/test_kernel.py (`test_random_batches`).

Each example compiles JAX's reference and the implementation anew, so the fast suite takes
three examples per case: hypothesis' simplest one (every kind of sequence, each as short as
it can be) and two random ones. .venv-oldest runs one case per dtype pair, spread over the
implementations; `pytest -m slow` runs many examples of every case, where each option may
also be left at its default.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from conftest import (
    IMPLEMENTATIONS,
    assert_matches_jax,
    one_case_per_path,
    property_test,
    random_batches,
)
from hypothesis import strategies as st

# (q dtype, KV dtype), by name; KV dtype None: q's.
DTYPE_PAIRS = {
    "float32": (jnp.float32, None),
    "bfloat16": (jnp.bfloat16, None),
    "bfloat16 q, fp8 e4m3fn KV": (jnp.bfloat16, jnp.float8_e4m3fn),
    "float32 q, fp8 e5m2 KV": (jnp.float32, jnp.float8_e5m2),
}
# The block sizes each implementation takes (the kernel's: tests/kernel/test_kernel.py).
BLOCK_SIZES_TAKEN = {
    "reference": (),
    "jnp": (),
    "blockwise": ("num_kv_pages_per_block", "num_queries_per_block"),
    "pallas_basic": ("num_queries_per_block",),
}

CASES = [
    pytest.param(name, dtypes, id=f"{name}-{dtypes}")
    for name in BLOCK_SIZES_TAKEN
    for dtypes in DTYPE_PAIRS
]


def check_matches_jax_reference(name, dtypes, data, *, one_of_everything):
    """Implementation `name` on a random batch of these dtypes, with random options and block
    sizes, against JAX's reference."""
    strategy = random_batches(
        dtypes=[DTYPE_PAIRS[dtypes]],
        block_sizes=BLOCK_SIZES_TAKEN[name],
        one_of_everything=one_of_everything,
    )
    batch, options = data.draw(strategy, label="batch, options")
    assert_matches_jax(IMPLEMENTATIONS[name], batch, **options)


def check_every_option(name, dtypes, data):
    check_matches_jax_reference(name, dtypes, data, one_of_everything=True)


def check_random_options(name, dtypes, data):
    check_matches_jax_reference(name, dtypes, data, one_of_everything=False)


# Every stack: each dtype pair once, each with another implementation; the rest of the matrix
# once, in .venv.
test_every_option_matches_jax_reference = pytest.mark.parametrize(
    "name, dtypes",
    one_case_per_path(
        CASES,
        "reference-float32",
        "jnp-bfloat16",
        "blockwise-bfloat16 q, fp8 e4m3fn KV",
        "pallas_basic-float32 q, fp8 e5m2 KV",
    ),
)(property_test(check_every_option, st.data(), max_examples=3))
test_every_option_matches_jax_reference_sweep = pytest.mark.slow(
    pytest.mark.parametrize("name, dtypes", CASES)(
        property_test(check_random_options, st.data(), max_examples=25)
    )
)
