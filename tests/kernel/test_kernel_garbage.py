"""The kernel under `jit` with a garbage batch description: no hang, no out-of-bounds copy.

Under `jit` the values of kv_lens, page_indices, cu_q_lens and num_seqs cannot be validated
(they are tracers), so the jitted wrapper clamps them once, before the kernels
(`minilib.kernel.call.clamp_tables`): every loop bound over sequences is clamped to
max_num_seqs, every one over pages or KV blocks to pages_per_seq, every page number to the pages
there are.
The answer for a garbage batch is garbage, but it must come back, and be finite.

Path covered: TPU interpret mode (`pltpu.InterpretParams`, DMAs and semaphores simulated, so
an out-of-range page or an unmatched DMA wait fails or hangs here as it would on the chip).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, one_of_each_batch

from minilib.kernel import ragged_paged_attention

# Generous: a healthy run takes a few seconds. The limit only turns a hang into a failure.
HANG_LIMIT_SECONDS = 120


def run_or_fail_after(seconds: float, fn):
    """fn() in a daemon thread; fail the test if it has not returned after `seconds`."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as error:  # reported below, in the test's thread
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"no answer within {seconds} s: the kernel hangs")
    if "error" in result:
        raise result["error"]
    return result["value"]


def garbage_batch(edit):
    """A valid mixed batch (prefill, decode, idle, chunk; padding slots), then `edit` applied
    to its NumPy copies of (kv_lens, page_indices, cu_q_lens, num_seqs).

    The garbage is in the tables only: q and the pages are finite here (make_batch's NaN
    padding is zeroed), since a table pointing at NaN data rightly gives NaN. Fresh scratch
    memory is NaN (`INTERPRET`), so reading memory the kernel never wrote still shows."""
    batch = one_of_each_batch()
    tables = [np.array(a) for a in batch.args()[2:]]
    edit(*tables)
    return jnp.nan_to_num(batch.q), jnp.nan_to_num(batch.kv_pages), *tables


def set_at(name, index, value):
    def edit(kv_lens, page_indices, cu_q_lens, num_seqs):
        tables = dict(
            kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs
        )
        tables[name][index] = value

    return edit


GARBAGE = {
    "num_seqs = 2**31 - 1": set_at("num_seqs", 0, 2**31 - 1),
    "num_seqs = -1": set_at("num_seqs", 0, -1),
    "negative kv_len": set_at("kv_lens", 1, -5),
    "kv_len past its pages": set_at("kv_lens", 3, 7 * 8 + 100),
    "q_len > kv_len": set_at("kv_lens", 0, 2),
    "page index past the pages": set_at("page_indices", (3, 2), 999),
    "page index -1": set_at("page_indices", (1, 0), -1),
    "decreasing cu_q_lens": set_at("cu_q_lens", 2, 1),
    "cu_q_lens past the q rows": set_at("cu_q_lens", 4, 10_000),
    "negative cu_q_lens": set_at("cu_q_lens", 1, -7),
}


# One jitted kernel for every case: the garbage is in the values, not the shapes, so all of
# them run one compiled program (a new `jax.jit` per test would compile it again each time).
KERNEL = jax.jit(
    functools.partial(
        ragged_paged_attention,
        sm_scale=0.125,
        num_kv_pages_per_block=3,
        num_queries_per_block=8,
        interpret=INTERPRET,
    )
)


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_tables_under_jit_return_finite_values(name):
    args = garbage_batch(GARBAGE[name])
    out = run_or_fail_after(HANG_LIMIT_SECONDS, lambda: np.asarray(KERNEL(*args), np.float32))
    assert out.shape == args[0].shape
    assert np.isfinite(out).all(), f"{name}: non-finite values in the output"
