"""The kernel writing the new tokens' K/V into the cache (`new_keys`, `new_values`; the module
`minilib.kernel.kv_write`), exact against the separate scatter, `write_tokens`, then attention.

Every batch comes from `make_batch`: unused page slots, unused pages and padding q rows are
NaN, sequence slots past num_seqs hold garbage. The new K/V rows past the live tokens are NaN
too, so a write of a padding row shows. Bit-identical means NaN where NaN was.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BLOCK_SIZES, INTERPRET, jax_reference_jitted, one_case_per_path
from jax.experimental.pallas import tpu as pltpu

from minilib.batch import RaggedBatch, make_batch
from minilib.errors import RPAInputError
from minilib.kernel import kernel_config, kv_write, ragged_paged_attention, rpa_jit, rpa_write_jit
from minilib.kv_cache import write_tokens
from minilib.ladder.interpret import races_found, strict_interpret_params
from minilib.parity import parity_error, parity_tolerance

# Decodes (one at a page's first slot), a chunk and a prefill across page boundaries, an idle
# sequence, a one-token prefill; padding rows and sequence slots past num_seqs.
SEQ_LENS = [(1, 9), (5, 20), (0, 4), (1, 17), (12, 40), (3, 3), (1, 1)]
BATCH_OPTIONS = dict(page_size=8, max_num_seqs=9, max_num_batched_tokens=32, pages_per_seq=6)
BLOCKS = dict(num_kv_pages_per_block=2, num_queries_per_block=8)
# One decode sequence among a chunk, a prefill and an idle one.
LONE_DECODE = [(5, 20), (0, 4), (1, 9), (12, 40)]

CASES = {
    # name: (make_batch options, kernel options)
    "float32": (dict(), BLOCKS),
    "bfloat16": (dict(dtype=jnp.bfloat16), BLOCKS),
    "fp8 cache": (dict(kv_dtype=jnp.float8_e4m3fn), dict(k_scale=0.5, v_scale=0.25, **BLOCKS)),
    "two heads blocks, default block sizes": (
        dict(num_q_heads=16, num_kv_heads=8, head_dim=32),
        {},
    ),
    # The decode kernel writes one row in all: its wait is for that row alone. And the
    # attention options away from their neutral values (sm_scale 1, no window, no soft cap).
    "a lone decode sequence": (
        dict(seq_lens=LONE_DECODE),
        dict(sm_scale=0.125, sliding_window=12, soft_cap=20.0, **BLOCKS),
    ),
}


def new_kv(batch: RaggedBatch, seed: int = 1):
    """Random new K and V, one row per q row; the rows past the live tokens NaN."""
    rows, _, head_dim = batch.q.shape
    shape = (rows, batch.kv_pages.shape[2] // 2, head_dim)
    k, v = jax.random.normal(jax.random.PRNGKey(seed), (2, *shape), jnp.float32)
    live = (jnp.arange(rows) < batch.num_tokens)[:, None, None]
    k, v = (jnp.where(live, x, jnp.nan).astype(batch.q.dtype) for x in (k, v))
    return k, v


def scatter_targets(batch: RaggedBatch):
    """Each q row's page and slot, as the engine packs them for `write_tokens`: the q_len new
    tokens of a sequence end at position kv_len - 1. Padding rows get an out-of-range page
    (dropped by the scatter)."""
    total_pages, page_size = batch.kv_pages.shape[:2]
    pages = np.full(batch.q.shape[0], total_pages, np.int32)
    slots = np.zeros(batch.q.shape[0], np.int32)
    cu, table = np.asarray(batch.cu_q_lens), np.asarray(batch.page_indices)
    for s, (q_len, kv_len) in enumerate(batch.seq_lens):
        positions = np.arange(kv_len - q_len, kv_len)
        rows = slice(cu[s], cu[s] + q_len)
        pages[rows], slots[rows] = table[s, positions // page_size], positions % page_size
    return jnp.asarray(pages), jnp.asarray(slots)


def scattered(batch: RaggedBatch, k, v) -> RaggedBatch:
    """`batch` with the new tokens written by the separate scatter."""
    kv_pages = write_tokens(batch.kv_pages, *scatter_targets(batch), k, v)
    return dataclasses.replace(batch, kv_pages=kv_pages)


def fused(batch: RaggedBatch, k, v, **options):
    """(out, kv_pages) of the kernel writing the tokens; the batch's cache is copied first,
    as the call donates it."""
    args = list(batch.args())
    args[1] = jnp.array(batch.kv_pages, copy=True)
    return ragged_paged_attention(*args, new_keys=k, new_values=v, **options)


def assert_bit_identical(actual, expected, what: str):
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, what
    # Compare the bytes: NaN where NaN was, -0.0 apart from 0.0, fp8 exactly.
    np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8), err_msg=what)


@functools.cache
def case(name: str):
    batch_options, kernel_options = CASES[name]
    batch_options = dict(batch_options)
    seq_lens = batch_options.pop("seq_lens", SEQ_LENS)
    batch = make_batch(seq_lens, **BATCH_OPTIONS, **batch_options)
    return batch, new_kv(batch), kernel_options


@pytest.mark.parametrize(
    "name",
    # float32: where numerics differ; a lone decode: the wait for a single row
    one_case_per_path(CASES, "float32", "fp8 cache", "a lone decode sequence"),
)
def test_the_fused_write_is_the_separate_scatter_then_attention(name):
    batch, (k, v), options = case(name)
    after = scattered(batch, k, v)
    out, kv_pages = fused(batch, k, v, interpret=INTERPRET, **options)
    assert_bit_identical(kv_pages, after.kv_pages, "the cache written in the kernel")
    expected = ragged_paged_attention(*after.args(), interpret=INTERPRET, **options)
    assert_bit_identical(out, expected, "attention after the write")
    assert_matches_reference(out, after, **options)


def assert_matches_reference(out, batch: RaggedBatch, **options):
    """The live rows within a right answer's rounding of JAX's reference, here (under
    `MINILIB_TPU_NUMERICS=1` too: `parity_tolerance`); the padding rows zero."""
    n = batch.num_tokens
    reference_options = {k: v for k, v in options.items() if k not in BLOCK_SIZES}
    expected = jax_reference_jitted(batch, **reference_options)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[n:], 0.0)
    parity_error(np.asarray(out, np.float32)[:n], np.asarray(expected, np.float32),
                 tolerance=parity_tolerance(batch.q.dtype))  # fmt: skip


def test_only_the_new_tokens_slots_change():
    """Every other slot, of the sequences' pages and of the unused ones, keeps its bytes (NaN
    included), and every new token's slot holds its K and V."""
    batch, (k, v), options = case("float32")
    _, kv_pages = fused(batch, k, v, interpret=INTERPRET, **options)
    pages, slots = scatter_targets(batch)
    live = np.asarray(pages) < batch.kv_pages.shape[0]
    written = np.zeros(batch.kv_pages.shape[:2], bool)
    written[np.asarray(pages)[live], np.asarray(slots)[live]] = True
    assert written.sum() == batch.num_tokens
    assert_bit_identical(np.asarray(kv_pages)[~written], np.asarray(batch.kv_pages)[~written],
                         "slots no new token goes to")  # fmt: skip
    new = np.asarray(kv_pages)[np.asarray(pages)[live], np.asarray(slots)[live]]
    np.testing.assert_array_equal(new[:, 0::2], np.asarray(k)[live])
    np.testing.assert_array_equal(new[:, 1::2], np.asarray(v)[live])


EAGER = pltpu.InterpretParams(uninitialized_memory="nan", dma_execution_mode="eager")


def test_eager_dmas_and_the_race_detector_find_no_read_before_the_write():
    """DMAs done as soon as started, and the strict interpreter's race detector: a read of
    the cache before the write's wait would see the old slots, or race."""
    batch, (k, v), options = case("float32")
    after = scattered(batch, k, v)
    expected = ragged_paged_attention(*after.args(), interpret=INTERPRET, **options)
    for params in (EAGER, strict_interpret_params()):
        out, kv_pages = fused(batch, k, v, interpret=params, **options)
        assert_bit_identical(kv_pages, after.kv_pages, f"the cache, {params}")
        assert_bit_identical(out, expected, f"the output, {params}")
    assert not races_found()  # the strict run's verdict


def test_a_kernel_that_does_not_wait_for_its_writes_is_caught(monkeypatch):
    """The checks above can fail: without the wait (DMAs done on wait), the KV blocks are
    read without the new tokens. (Block sizes of its own: a new trace of the jitted call.)"""
    monkeypatch.setattr(kv_write, "wait_for_the_writes", lambda *args: None)
    batch, (k, v), _ = case("float32")
    options = dict(num_kv_pages_per_block=1, num_queries_per_block=16)
    after = scattered(batch, k, v)
    expected = ragged_paged_attention(*after.args(), interpret=INTERPRET, **options)
    try:
        out, _ = fused(batch, k, v, interpret=INTERPRET, **options)
    finally:
        rpa_write_jit.clear_cache()  # no later call may reuse the kernel without the wait
    assert not np.array_equal(np.asarray(out), np.asarray(expected), equal_nan=True)


def test_a_write_whose_wait_wants_a_row_more_fails_in_seconds(monkeypatch):
    """A copy/wait byte mismatch (a write of `kv_len // page_size` pages leaves its wait
    short the same way) fails in seconds, naming the write's wait, under the guard of every
    kernel test (tests/conftest.py), instead of hanging to the ten-minute watchdog."""
    wait = kv_write.wait_for_the_writes
    monkeypatch.setattr(
        kv_write, "wait_for_the_writes", lambda ref, rows, sem: wait(ref, rows + 1, sem)
    )
    batch, (k, v), _ = case("float32")
    options = dict(num_kv_pages_per_block=1, num_queries_per_block=16)
    start = time.monotonic()
    try:
        with pytest.raises(Exception, match="deadlock: a wait on DMA semaphore") as raised:
            fused(batch, k, v, interpret=INTERPRET, **options)
    finally:
        rpa_write_jit.clear_cache()  # no later call may reuse the kernel with the longer wait
    assert time.monotonic() - start < 120  # its compile included: the watchdog is 600 s
    if jax.__version_info__ >= (0, 8):  # JAX gives the wait's line from 0.8 on
        assert "wait_for_the_writes" in str(raised.value)


def test_under_jit_the_cache_comes_back_updated():
    batch, (k, v), options = case("float32")
    call = jax.jit(functools.partial(ragged_paged_attention, interpret=INTERPRET, **options))
    args = list(batch.args())
    args[1] = jnp.array(batch.kv_pages, copy=True)
    out, kv_pages = call(*args, new_keys=k, new_values=v)
    assert_bit_identical(kv_pages, scattered(batch, k, v).kv_pages, "the cache under jit")


def test_the_writing_kernels_walk_and_copy_as_the_others_do():
    """With the write, each kernel's trace (every KV block's copy start, wait and compute) is
    the trace without it, on the cache the write left: the write adds no step to the walk."""
    batch, (k, v), options = case("float32")
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, **options)
    args = [batch.q, jnp.array(batch.kv_pages, copy=True), *batch.args()[2:]]
    run = dict(config=config, interpret=INTERPRET, trace_capacity=256)
    out, kv_pages, traces = rpa_write_jit(*args, k, v, **run)
    plain_out, plain_traces = rpa_jit(batch.q, kv_pages, *batch.args()[2:], **run)
    assert_bit_identical(out, plain_out, "the output")
    for written, plain in zip(traces, plain_traces, strict=True):
        assert int(plain[0, 0]) > 0
        np.testing.assert_array_equal(np.asarray(written), np.asarray(plain))


def test_an_empty_batch_writes_nothing():
    batch = make_batch([], **BATCH_OPTIONS)
    k, v = new_kv(batch)
    out, kv_pages = fused(batch, k, v, interpret=INTERPRET, **BLOCKS)
    assert_bit_identical(kv_pages, batch.kv_pages, "the cache of an empty batch")
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_a_garbage_batch_under_jit_writes_only_inside_its_sequences_pages():
    """Under jit nothing validates the batch; the tables are clamped. A sequence whose kv_len
    (3) is below its q_len (5) gets its last 3 rows at positions 0..2, and nothing else
    changes; the slots past num_seqs (huge kv_lens, pages out of range) write nothing."""
    batch = make_batch([(5, 20), (1, 9)], **BATCH_OPTIONS)
    k, v = new_kv(batch)
    args = list(batch.args())
    args[1], args[2] = jnp.array(batch.kv_pages, copy=True), batch.kv_lens.at[0].set(3)
    call = jax.jit(functools.partial(ragged_paged_attention, interpret=INTERPRET, **BLOCKS))
    _, kv_pages = call(*args, new_keys=k, new_values=v)
    table = np.asarray(batch.page_indices)  # page_size 8: the decode's position 8 is page 1
    pages = jnp.array([table[0, 0]] * 3 + [table[1, 1]])
    rows = jnp.array([2, 3, 4, 5])  # sequence 0's last three rows, and the decode's
    expected = write_tokens(batch.kv_pages, pages, jnp.array([0, 1, 2, 0]), k[rows], v[rows])
    assert_bit_identical(kv_pages, expected, "the cache of a garbage batch")


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the value and the fix.
# ---------------------------------------------------------------------------------------------


def bad_calls(k, v):
    kvh = k.shape[1]
    return {
        "only new_keys": (dict(new_keys=k), "new_keys was given without new_values"),
        "only new_values": (dict(new_values=v), "new_values was given without new_keys"),
        "one row short": (dict(new_keys=k[:-1], new_values=v), "new_keys.shape="),
        "q's heads, not the KV heads": (
            dict(new_keys=k, new_values=jnp.repeat(v, 2, axis=1)),
            f"new_values.shape=({k.shape[0]}, {2 * kvh}, {k.shape[2]}) must be",
        ),
        "integer values": (dict(new_keys=k, new_values=v.astype(jnp.int32)), "a float dtype"),
        "two dtypes": (
            dict(new_keys=k, new_values=v.astype(jnp.bfloat16)),
            "new_keys.dtype=float32 and new_values.dtype=bfloat16 must be the same",
        ),
        "not an array": (dict(new_keys=k, new_values=[1.0]), "new_values must be an array"),
    }


BAD_CALLS = ("only new_keys", "only new_values", "one row short", "q's heads, not the KV heads",
             "integer values", "two dtypes", "not an array")  # fmt: skip


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_new_kv_is_a_value_error_naming_it(name):
    batch, (k, v), _ = case("float32")
    keywords, message = bad_calls(k, v)[name]
    with pytest.raises(RPAInputError, match="Hint: ") as error:
        ragged_paged_attention(*batch.args(), interpret=INTERPRET, **keywords)
    assert message in str(error.value)
    assert isinstance(error.value, ValueError)
