"""Every attention function checks the values of concrete inputs before it runs, and under jit,
where values cannot be checked, no garbage length can hang a loop or give NaN.

The loop tests run in a subprocess with a time limit, so that a hang fails the test instead of
stopping the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import IMPLEMENTATIONS

from minilib import RPAInputError, make_batch, ragged_paged_attention_jnp

ROOT = Path(__file__).resolve().parents[2]

NAMES = ["q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"]


def batch():
    # 3 live sequences in 4 slots, pages of 4 tokens, 3 page columns.
    return make_batch([(3, 10), (1, 9), (2, 2)], page_size=4, max_num_seqs=4, pages_per_seq=3)


def broken(b, name, index, value):
    args = dict(zip(NAMES, b.args(), strict=True))
    array = np.asarray(args[name]).copy()
    array[index] = value
    args[name] = jnp.asarray(array)
    return list(args.values())


# Bad values that only dynamic_validate_inputs can see: (array, index, value, message part).
BAD_VALUES = {
    "q_len > kv_len": ("kv_lens", 0, 2, "q_len=3 must be less or equal to kv_len=2"),
    "kv_len past its pages": ("kv_lens", 1, 13, "pages_per_seq=3 must be greater or equal"),
    "page index 999": ("page_indices", (0, 1), 999, "page_indices[0, 1]=999 is outside"),
    "page index -1": ("page_indices", (1, 0), -1, "page_indices[1, 0]=-1 is outside"),
    "num_seqs > max_num_seqs": ("num_seqs", 0, 5, "must be less or equal to max_num_seqs=4"),
    "cu_q_lens decreasing": ("cu_q_lens", 2, 1, "cu_q_lens must not decrease"),
    "negative kv_len": ("kv_lens", 2, -1, "kv_lens[2]=-1 must be non-negative"),
    "negative num_seqs": ("num_seqs", 0, -1, "num_seqs[0]=-1 must be non-negative"),
    "cu_q_lens not from 0": ("cu_q_lens", 0, 1, "cu_q_lens[0]=1 must be 0"),
    "too many q tokens": ("cu_q_lens", 3, 99, "must be less or equal to max_num_batched_tokens"),
    "int32 wrap-around": ("cu_q_lens", 1, 2**31 - 1, "cu_q_lens must not decrease"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
@pytest.mark.parametrize("fn_name", IMPLEMENTATIONS)
def test_eager_call_checks_values(fn_name, case):
    name, index, value, message = BAD_VALUES[case]
    with pytest.raises(RPAInputError) as info:
        IMPLEMENTATIONS[fn_name](*broken(batch(), name, index, value))
    assert message in info.value.message
    assert info.value.hint


@pytest.mark.parametrize("fn_name", ["jnp", "blockwise"])
def test_validate_false_skips_the_value_checks(fn_name):
    args = broken(batch(), "page_indices", (0, 1), 999)
    out = IMPLEMENTATIONS[fn_name](*args, validate=False)
    assert out.shape == batch().q.shape


def test_under_jit_only_static_checks_run():
    args = broken(batch(), "kv_lens", 0, 2)  # q_len > kv_len: a value, invisible to jit
    out = jax.jit(ragged_paged_attention_jnp)(*args)
    assert out.shape == batch().q.shape
    bad_shape = [jnp.zeros((8, 3, 64)), *args[1:]]  # 3 q heads, 2 KV heads: a shape
    with pytest.raises(RPAInputError, match="num_q_heads=3 must be divisible"):
        jax.jit(ragged_paged_attention_jnp)(*bad_shape)


GARBAGE_UNDER_JIT = textwrap.dedent(
    """
    import time, jax, jax.numpy as jnp, numpy as np
    from minilib import (make_batch, ragged_paged_attention_blockwise,
                         ragged_paged_attention_pallas_basic)
    b = make_batch([(3, 10), (1, 9)], page_size=4, max_num_seqs=3, pages_per_seq=3)
    # A garbage kv_len makes a sequence read its unused slots: here they hold zeros, not
    # make_batch's NaN, so that any NaN in the output comes from the loops themselves.
    kv_pages = jnp.nan_to_num(b.kv_pages)
    big = 2**31 - 1
    garbage = {
        "num_seqs": {5: [big]},
        "kv_lens": {2: [big, -7, big]},
        "negative kv_lens": {2: [-big, -1, 5]},
        "cu_q_lens": {4: [0, big, -big, 3]},
        "everything": {2: [big] * 3, 4: [0, big, 1, big], 5: [big]},
    }
    for fn in (ragged_paged_attention_blockwise, ragged_paged_attention_pallas_basic):
        f = jax.jit(fn)
        for name, changes in garbage.items():
            args = [b.q, kv_pages, *b.args()[2:]]
            for i, value in changes.items():
                args[i] = jnp.asarray(value, jnp.int32)
            start = time.perf_counter()
            out = np.asarray(f(*args))
            assert np.isfinite(out[:4]).all(), (fn.__name__, name)
            print(fn.__name__, name, f"{time.perf_counter() - start:.2f} s")
    print("done")
    """
)


def test_garbage_lengths_under_jit_return_quickly_and_finite():
    # Compiles two functions (a few seconds each); a loop bounded by a garbage num_seqs or
    # q_len would run 2**31 times and never finish.
    result = subprocess.run(
        [sys.executable, "-c", GARBAGE_UNDER_JIT],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("done"), result.stdout
