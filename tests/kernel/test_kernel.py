"""The Pallas TPU kernel, run on CPU, against JAX's reference.

Every batch comes from `make_batch`, so unused page slots, unused pages and padding q rows are
NaN and padding sequence slots hold garbage: a kernel that reads them fails here.
The fast suite runs a dozen small cases and four random batches (`test_random_batches`);
`pytest -m slow` runs a random sweep.

Which path of the kernel each test covers:
- TPU interpret mode (`pltpu.InterpretParams`: HBM, VMEM, DMAs and semaphores simulated) runs
  the kernel with K and V read by plain ref indexing (it cannot view a ref as another shape
  or dtype). The parity tests run it twice: with DMAs done when waited for (the default) and
  with DMAs done as soon as started (`dma_execution_mode="eager"`), where a copy into a slot
  still being read changes the answer. The race tests add the race detector.
- The compiled path reads each KV head with one strided load through a flat 32-bit view of
  the slot (`strided.read_kv_head`). Plain `interpret=True` can run that (it can view refs, but
  does not simulate DMA timing): `test_strided_kv_loads_match_jax_reference`, and with TPU7x's
  padded slot, `test_padded_slot_matches_jax_reference` (the decode kernel's on every chip:
  `test_the_decode_kernel_pads_its_slot_on_every_chip`); at head_dim 64, in rows of 64 lanes,
  `test_narrow_rows_match_jax_reference`.
- `ragged_paged_attention` runs two kernels: the decode kernel on the one-token sequences, the
  mixed kernel on the others. Every parity test above runs both; the decode tests below also
  give the decode kernel several grid steps and watch every copy (`watch_kernel`).
- Mosaic's own compiler passes need libtpu: see the TPU compile tests.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    BLOCK_SIZES,
    INTERPRET,
    ONE_OF_EACH,
    TOLERANCE,
    assert_matches_jax,
    assert_output_matches_jax,
    jax_reference_jitted,
    one_case_per_path,
    one_of_each_batch,
    property_test,
    random_batches,
)
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.batch import make_batch
from minilib.errors import RPAInputError
from minilib.kernel import (
    KVBlockCopier,
    Levers,
    choose_points,
    decode_batch,
    kernel_config,
    ragged_paged_attention,
    reciprocal,
    resolve_interpret,
    rpa_jit,
    rpa_pallas_call,
    split_configs,
    strided_fold,
)
from minilib.kernel.lane_blocks import WholeRows
from minilib.kernel.levers import DecodeOpenBlocksWalker
from minilib.ladder.interpret import detecting_races, strict_interpret_params
from minilib.ladder.watch import watch_kernel

# A DMA runs when it is started: reading a slot that a copy is still filling gets new data.
EAGER = pltpu.InterpretParams(uninitialized_memory="nan", dma_execution_mode="eager")
DMA_MODES = {"DMAs on wait": INTERPRET, "DMAs eager": EAGER}


def run_kernel(interpret=INTERPRET):
    """The kernel with this interpret mode, called as the other implementations are."""
    return functools.partial(ragged_paged_attention, interpret=interpret)


# ---------------------------------------------------------------------------------------------
# Parity: the fast suite.
# ---------------------------------------------------------------------------------------------

# The kernel's own cases, with their make_batch options (conftest.CASES are every
# implementation's).
KERNEL_CASES = {
    # name: (seq_lens, make_batch options, kernel options)
    "decode": (
        [(1, 20), (1, 5), (1, 33), (1, 1)],
        dict(page_size=8, max_num_batched_tokens=8, max_num_seqs=6),
        dict(num_kv_pages_per_block=2, num_queries_per_block=8),
    ),
    "prefill, blocks not dividing pages_per_seq": (
        [(17, 17), (9, 9)],
        dict(page_size=8, pages_per_seq=4),
        dict(num_kv_pages_per_block=3, num_queries_per_block=8),
    ),
    "MQA, default block sizes": (ONE_OF_EACH, dict(num_q_heads=4, num_kv_heads=1, page_size=8), {}),
    "MHA, one page per block": (
        ONE_OF_EACH,
        dict(num_q_heads=2, num_kv_heads=2, page_size=16),
        dict(num_kv_pages_per_block=1, num_queries_per_block=4),
    ),
    "two heads blocks (16 q heads, 8 KV heads)": (
        [(6, 6), (1, 12), (3, 19)],
        dict(num_q_heads=16, num_kv_heads=8, head_dim=32, page_size=8),
        dict(num_kv_pages_per_block=2, num_queries_per_block=8),
    ),
    "sliding window and soft cap": (
        ONE_OF_EACH,
        dict(page_size=8),
        dict(sliding_window=6, soft_cap=20.0, num_kv_pages_per_block=1, num_queries_per_block=8),
    ),
    "bfloat16": (
        ONE_OF_EACH,
        dict(page_size=16, dtype=jnp.bfloat16),
        dict(num_kv_pages_per_block=2, num_queries_per_block=16),
    ),
    "head_dim 256 (two lane blocks per slot)": (
        ONE_OF_EACH,
        dict(num_q_heads=4, num_kv_heads=2, head_dim=256, page_size=8),
        dict(num_kv_pages_per_block=2, num_queries_per_block=8),
    ),
    # `open_blocks`: q blocks of one sequence see the KV blocks before their first row in a
    # loop with no mask; the q block rows of two sequences (10..15, 16..) see none there.
    "prefill chunks with open KV blocks": (
        [(10, 34), (22, 40), (1, 9)],
        dict(page_size=8, pages_per_seq=6),
        dict(num_kv_pages_per_block=1, num_queries_per_block=8),
    ),
    "open KV blocks, small mask value and soft cap": (
        [(10, 34), (22, 40), (1, 9)],
        dict(page_size=8, pages_per_seq=6),
        dict(mask_value=-3.0, soft_cap=10.0, num_kv_pages_per_block=1, num_queries_per_block=8),
    ),
    "fp8 KV with scales": (
        ONE_OF_EACH,
        dict(page_size=16, kv_dtype=jnp.float8_e4m3fn),
        dict(k_scale=0.5, v_scale=0.25, num_kv_pages_per_block=2, num_queries_per_block=16),
    ),
    "fp8 e5m2 KV with scales": (
        ONE_OF_EACH,
        dict(page_size=16, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e5m2),
        dict(k_scale=0.3, v_scale=0.7, num_kv_pages_per_block=2, num_queries_per_block=16),
    ),
}


# Every stack: the decode kernel, the mixed kernel at its default block sizes (eager DMAs),
# two lane blocks of head_dim, and an fp8 cache; the rest of the matrix once, in .venv.
PARITY_CASES = one_case_per_path(
    [
        pytest.param(name, dma_mode, id=f"{name}-{dma_mode}")
        for dma_mode in DMA_MODES
        for name in KERNEL_CASES
    ],
    "decode-DMAs on wait",
    "MQA, default block sizes-DMAs eager",
    "head_dim 256 (two lane blocks per slot)-DMAs on wait",
    "fp8 KV with scales-DMAs on wait",
)


@pytest.mark.parametrize("name, dma_mode", PARITY_CASES)
def test_matches_jax_reference(name, dma_mode):
    seq_lens, batch_options, options = KERNEL_CASES[name]
    batch = make_batch(seq_lens, **batch_options)
    assert_matches_jax(run_kernel(DMA_MODES[dma_mode]), batch, sm_scale=0.125, **options)


STRIDED_CASES = {
    # name: (make_batch options, kernel options); 2 * KV heads fill whole (8 * packing) tiles
    "bfloat16, 8 KV heads": (dict(num_kv_heads=8, dtype=jnp.bfloat16), {}),
    "float32, 4 KV heads, sliding window and soft cap": (
        dict(num_kv_heads=4, dtype=jnp.float32),
        dict(sliding_window=9, soft_cap=20.0),
    ),
    "bfloat16, two heads blocks": (dict(num_kv_heads=16, dtype=jnp.bfloat16), {}),
    "bfloat16, head_dim 256 (a strided load per lane block)": (
        dict(num_kv_heads=8, dtype=jnp.bfloat16, head_dim=256),
        {},
    ),
    # head_dim 64: rows of 64 lanes (`kernel.narrow_rows`), a padded slot by default there
    "bfloat16, head_dim 64 (rows of 64 lanes)": (
        dict(num_kv_heads=8, dtype=jnp.bfloat16, head_dim=64),
        {},
    ),
    "float32, 4 KV heads, head_dim 64, sliding window": (
        dict(num_kv_heads=4, dtype=jnp.float32, head_dim=64),
        dict(sliding_window=9),
    ),
    "fp8 e4m3fn KV with scales, 8 KV heads, head_dim 64": (
        dict(num_kv_heads=8, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, head_dim=64),
        dict(k_scale=0.25, v_scale=0.5),
    ),
    # fp8: four values to a word, two KV heads each (`kernel.fp8`). The kernel applies the
    # scales to the scores and the output, the reference to K and V, rounded to bf16: exact
    # for powers of two (e4m3fn here), not for e5m2's. (A v_scale below 1 keeps the outputs
    # under 4, where one bf16 rounding step is within the tolerance.)
    "fp8 e4m3fn KV with scales, 8 KV heads": (
        dict(num_kv_heads=8, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn),
        dict(k_scale=0.25, v_scale=0.5),
    ),
    "fp8 e5m2 KV with scales, 2 KV heads, head_dim 256": (
        dict(num_kv_heads=2, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e5m2, head_dim=256),
        dict(k_scale=0.3, v_scale=0.7),
    ),
}


def strided_case(name: str, levers: Levers | None = None):
    """One of STRIDED_CASES: its batch (head_dim 128 unless it says), options and config, with
    `levers` asked for (None: the chosen ones), decided for plain `interpret=True`, which runs
    the strided loads."""
    batch_options, options = STRIDED_CASES[name]
    batch_options = {"head_dim": 128, **batch_options}
    num_kv_heads = batch_options["num_kv_heads"]
    batch = make_batch(ONE_OF_EACH, num_q_heads=2 * num_kv_heads, page_size=8, **batch_options)
    options = dict(sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=8, **options)
    config = kernel_config(
        batch.q, batch.kv_pages, batch.page_indices, levers=levers, interpret=True, **options
    )
    return batch, options, config


def kernels(config):
    """The configs of the kernels `config` runs: the mixed one, and the decode one if any."""
    return [kernel for kernel in split_configs(config) if kernel is not None]


@pytest.mark.parametrize(
    "name",
    one_case_per_path(
        STRIDED_CASES,
        "bfloat16, 8 KV heads",
        "bfloat16, head_dim 256 (a strided load per lane block)",
        "fp8 e4m3fn KV with scales, 8 KV heads",
    ),
)
def test_strided_kv_loads_match_jax_reference(name):
    """The compiled path's strided K/V loads, in both kernels, run by plain `interpret=True`."""
    batch, options, config = strided_case(name)
    assert all(kernel.levers.strided_kv_loads for kernel in kernels(config))
    out, _ = rpa_jit(*batch.args(), config=config, interpret=True, trace_capacity=0)
    assert_output_matches_jax(out, batch, **options)


@pytest.mark.parametrize(
    "name",
    one_case_per_path(
        [
            "bfloat16, 8 KV heads",
            "bfloat16, two heads blocks",
            "bfloat16, head_dim 256 (a strided load per lane block)",
        ],
        "bfloat16, 8 KV heads",
    ),
)
def test_padded_slot_matches_jax_reference(name):
    """The padded slot of v6e and TPU7x (`padded_slot`: a bf16 slot as words, a spare row per
    token), forced here (a CPU is neither), in both kernels, run by plain `interpret=True`."""
    padded = dataclasses.replace(Levers.every(), whole_rows=False)  # head_dim 256 by lane block
    batch, options, config = strided_case(name, padded)
    assert all(kernel.levers.padded_slot for kernel in kernels(config))
    out, _ = rpa_jit(*batch.args(), config=config, interpret=True, trace_capacity=0)
    assert_output_matches_jax(out, batch, **options)


@pytest.mark.parametrize(
    "batch_options, options",
    [
        pytest.param(dict(num_q_heads=16, num_kv_heads=8), {}, id="bf16, a group of 2: a word"),
        pytest.param(dict(num_q_heads=32, num_kv_heads=8), {}, id="bf16, a group of 4: 2 words"),
        pytest.param(
            dict(num_q_heads=16, num_kv_heads=8, head_dim=256), {}, id="bf16, head_dim 256: indexed"
        ),
        pytest.param(
            dict(num_q_heads=16, num_kv_heads=4, dtype=jnp.float32),
            dict(sliding_window=9, soft_cap=20.0),
            id="f32, a group of 4: a head a word, sliding window, soft cap",
        ),
    ],
)
def test_strided_fold_matches_jax_reference(batch_options, options):
    """q folded by strided loads of words (`strided_fold`), in the mixed kernel, run by plain
    `interpret=True` (where refs can be viewed, as on the chip), on a batch with a prefill, a
    decode, an idle sequence and a chunk, NaN in its unused slots and pages."""
    batch_options = {"head_dim": 128, "dtype": jnp.bfloat16, **batch_options}
    batch = make_batch(ONE_OF_EACH, page_size=8, **batch_options)
    options = dict(sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=8, **options)
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, interpret=True, **options)
    mixed, _ = split_configs(config)
    if not mixed.levers.strided_fold:  # jax 0.7.2: not in plain interpret mode
        assert not strided_fold.interpret_stores_through_views()
        pytest.skip("this jax's interpret mode stores through no view of a ref")
    assert choose_points(mixed).fold_q is strided_fold.fold_q_heads
    out, _ = rpa_jit(*batch.args(), config=config, interpret=True, trace_capacity=0)
    assert_output_matches_jax(out, batch, **options)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_newton_reciprocal_matches_jax_reference(dtype):
    """The output divided by the refined reciprocal of v5e (`reciprocal`), forced here, in both
    kernels, in TPU interpret mode; with float32 outputs too, where the division shows most."""
    batch = make_batch(ONE_OF_EACH, page_size=8, max_num_seqs=6, dtype=dtype)
    options = dict(sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=8)
    config = kernel_config(
        batch.q, batch.kv_pages, batch.page_indices, levers=Levers.every(), **options
    )
    for kernel in kernels(config):
        assert choose_points(kernel).divide is reciprocal.divide, kernel
    out, _ = rpa_jit(*batch.args(), config=config, interpret=INTERPRET, trace_capacity=0)
    assert_output_matches_jax(out, batch, **options)


def test_whole_rows_match_jax_reference():
    """The padded slot of v6e and TPU7x with head_dim 256 whole in each token's rows
    (`lane_blocks.WholeRows`: one copy per page, read per 128-lane block), forced here (a CPU
    is neither), in both kernels, run by plain `interpret=True`."""
    name = "bfloat16, head_dim 256 (a strided load per lane block)"
    batch, options, config = strided_case(name, Levers.every())
    for kernel in kernels(config):
        assert isinstance(choose_points(kernel).slot, WholeRows), kernel
    out, _ = rpa_jit(*batch.args(), config=config, interpret=True, trace_capacity=0)
    assert_output_matches_jax(out, batch, **options)


@pytest.mark.parametrize(
    "name, padded",
    one_case_per_path(
        [
            pytest.param(name, padded, id=f"{name}-{'padded' if padded else 'plain'} slot")
            for name in (
                "bfloat16, head_dim 64 (rows of 64 lanes)",
                "float32, 4 KV heads, head_dim 64, sliding window",
                "fp8 e4m3fn KV with scales, 8 KV heads, head_dim 64",
            )
            for padded in (False, True)
        ],
        "bfloat16, head_dim 64 (rows of 64 lanes)-plain slot",
        "bfloat16, head_dim 64 (rows of 64 lanes)-padded slot",
    ),
)
def test_narrow_rows_match_jax_reference(name, padded):
    """head_dim 64 on the strided load, in rows of 64 lanes (`narrow_rows`), from a plain slot
    and from a padded one (bf16 only: an f32 or fp8 slot is never padded), in both kernels, run
    by plain `interpret=True`."""
    # fp8_as_stored: an fp8 cache reaches the strided load as words (no effect on the others)
    asked = Levers.only(
        "strided_kv_loads", "narrow_rows", "fp8_as_stored", *(["padded_slot"] if padded else [])
    )
    batch, options, config = strided_case(name, asked)
    for kernel in kernels(config):
        assert kernel.levers.narrow_rows and kernel.levers.strided_kv_loads, kernel
        assert kernel.levers.padded_slot == (padded and config.kv_itemsize == 2), kernel
    out, _ = rpa_jit(*batch.args(), config=config, interpret=True, trace_capacity=0)
    assert_output_matches_jax(out, batch, **options)


@pytest.mark.parametrize(
    "heads_in_flight, reload_v, path",
    # every stack: some heads in flight, V reloaded, in TPU interpret mode; on the strided
    # loads that case is test_attention_sink.py's representative (this batch, with sinks)
    one_case_per_path(
        [
            pytest.param(heads, reload_v, path, id=f"{path}-{heads}-{reload_v}")
            for path in ("strided loads", "TPU interpret")
            for heads, reload_v in [(1, False), (3, True), (8, False)]
        ],
        "TPU interpret-3-True",
    ),
)
def test_every_head_pipeline_matches_jax_reference(heads_in_flight, reload_v, path):
    """The software pipeline over KV heads (`attend_kv_heads`) in the mixed kernel, however
    many heads are in flight (one, some, all 8) and wherever V comes from: the defaults pick
    one per chip, so each is forced here. (The decode kernel takes its own default, all heads,
    V kept on this batch's strided layout; the other cases reload it.)"""
    batch = make_batch(
        ONE_OF_EACH, num_q_heads=16, num_kv_heads=8, head_dim=128, page_size=8, dtype=jnp.bfloat16
    )
    options = dict(sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=8)
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, **options)
    config = dataclasses.replace(config, heads_in_flight=heads_in_flight, reload_v=reload_v)
    interpret = True if path == "strided loads" else INTERPRET
    out, _ = rpa_jit(*batch.args(), config=config, interpret=interpret, trace_capacity=0)
    assert_output_matches_jax(out, batch, **options)


def run_pallas_call(batch, config, *, interpret, copier_class=KVBlockCopier):
    """The kernel's pallas_call itself, with any `interpret` value (the public function turns
    `True` into TPU interpret mode) and, for the mutation tests, another copier class."""
    points = dataclasses.replace(choose_points(config), copier=copier_class)
    call = rpa_pallas_call(
        batch.q, batch.kv_pages, config=config, interpret=interpret, points=points
    )
    return jax.jit(call)(*batch.args()[2:], batch.q, batch.kv_pages)[0]


def races_found() -> bool:
    """The race detector's verdict; its module moved between JAX versions."""
    for name in (
        "jax._src.pallas.mosaic.interpret.interpret_pallas_call",  # jax 0.8 and later
        "jax._src.pallas.mosaic.interpret",  # jax 0.7
    ):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "races"):
            assert module.races is not None, "the race detector did not run"
            return module.races.races_found
    raise AssertionError("cannot find the Pallas interpret race detector in this JAX")


RACE_TEST_OPTIONS = dict(sm_scale=0.125, num_kv_pages_per_block=3, num_queries_per_block=8)


@pytest.mark.parametrize("dma_mode", list(DMA_MODES))
def test_mixed_batch_without_races(dma_mode):
    """With the race detector on: a copy into one slot must never touch the slot in use."""
    params = detecting_races(DMA_MODES[dma_mode])
    assert_matches_jax(run_kernel(params), one_of_each_batch(), **RACE_TEST_OPTIONS)
    assert not races_found()


class SingleBufferCopier(KVBlockCopier):
    """A deliberately broken kernel: one KV buffer for both slots (each slot keeps its own
    semaphore), so the next KV block is prefetched into the buffer being read."""

    def buffer(self, slot):
        return self.kv_bufs.at[0]


def run_single_buffered(interpret):
    batch = one_of_each_batch()
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, **RACE_TEST_OPTIONS)
    out = run_pallas_call(batch, config, interpret=interpret, copier_class=SingleBufferCopier)
    return batch, np.asarray(out, np.float32)


@pytest.mark.parametrize("dma_mode", list(DMA_MODES))
def test_the_race_detector_catches_a_single_buffered_kernel(dma_mode):
    """The race check above can fail on the kernel itself, whichever way DMAs are simulated."""
    params = detecting_races(DMA_MODES[dma_mode])
    run_single_buffered(params)
    assert races_found()


def test_eager_dmas_show_a_single_buffered_kernel_in_the_answer():
    """With eager DMAs, the prefetch overwrites the block being read: parity fails."""
    batch, out = run_single_buffered(EAGER)
    n = batch.num_tokens
    sm_scale = RACE_TEST_OPTIONS["sm_scale"]
    expected = np.asarray(jax_reference_jitted(batch, sm_scale=sm_scale), np.float32)
    error = np.abs(out[:n] - expected)
    assert not (error <= TOLERANCE[jnp.dtype(jnp.float32)]).all(), "the broken kernel still matches"


def test_the_race_detector_catches_a_deliberate_race():
    """The check above can fail: reading a buffer while a DMA still writes it is a race."""

    def racy_kernel(x_hbm_ref, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm_ref, buf, sem)
        copy.start()
        o_ref[...] = buf[...]  # too early: the copy has not been waited for
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    pl.pallas_call(
        racy_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
        interpret=detecting_races(),
    )(x).block_until_ready()
    assert races_found()


# ---------------------------------------------------------------------------------------------
# The decode kernel: the one-token sequences, apart.
# ---------------------------------------------------------------------------------------------

# Decode sequences among idle ones, a chunk and a prefill, with padding rows and slots; the
# decode kernel takes 2 sequences per grid step, so its walk crosses grid steps too.
DECODE_SEQS = [(1, 20), (0, 7), (1, 5), (9, 40), (1, 33), (5, 5), (1, 1), (1, 17)]
DECODE_CASES = {
    "decodes in four decode blocks": {},
    "sliding window and soft cap": dict(sliding_window=6, soft_cap=20.0),
    "a mask value that leaves masked keys a weight": dict(mask_value=-5.0, sliding_window=6),
}


@pytest.mark.parametrize("name", one_case_per_path(DECODE_CASES, "decodes in four decode blocks"))
def test_decode_kernel_in_several_grid_steps(name):
    """Both kernels, the decode kernel with 2 sequences per grid step, in TPU interpret mode
    with eager DMAs and the race detector on: parity with JAX's reference, no race, every
    copy waited for, and no semaphore left with a count at kernel exit."""
    batch = make_batch(DECODE_SEQS, page_size=8, max_num_batched_tokens=24, max_num_seqs=10)
    options = dict(
        sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=8, **DECODE_CASES[name]
    )
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, **options)
    config = dataclasses.replace(config, decode_seqs_per_block=2)
    with watch_kernel() as watch:
        out, _ = rpa_jit(
            *batch.args(), config=config, interpret=strict_interpret_params(), trace_capacity=0
        )
        out = jax.block_until_ready(out)
    assert not watch.raced and watch.never_waited() == [] and watch.deadlock is None
    assert "emaphore" not in watch.output, watch.output
    assert_output_matches_jax(out, batch, **options)


def test_the_decode_kernel_pads_its_slot_on_every_chip():
    """The decode kernel holds a bf16 slot padded (`padded_slot`) wherever K and V come from
    the strided load, also where the mixed kernel's slot is plain (`split_configs`: its loop
    is mostly loads), and matches JAX's reference so: both kernels on DECODE_SEQS, the decode
    kernel in several grid steps, run by plain `interpret=True` (which runs the strided load)."""
    batch = make_batch(
        DECODE_SEQS,
        num_q_heads=16,
        num_kv_heads=8,
        head_dim=128,
        dtype=jnp.bfloat16,
        page_size=8,
        max_num_batched_tokens=24,
        max_num_seqs=10,
    )
    options = dict(sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=8)
    # On a CPU, as on a chip whose mixed kernel keeps the plain slot (v4, v5p).
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, interpret=True, **options)
    config = dataclasses.replace(config, decode_seqs_per_block=2)
    mixed, decode = split_configs(config)
    assert mixed.levers.strided_kv_loads and decode.levers.strided_kv_loads
    assert not mixed.levers.padded_slot and decode.levers.padded_slot
    out, _ = rpa_jit(*batch.args(), config=config, interpret=True, trace_capacity=0)
    assert_output_matches_jax(out, batch, **options)


@pytest.mark.parametrize("name", ["bfloat16, 8 KV heads", "fp8 e4m3fn KV with scales, 8 KV heads"])
def test_the_decode_kernel_walks_its_open_blocks_first(name):
    """A decode row sits at kv_len - 1, so every KV block that ends by kv_len is open: no mask,
    no V zeroed (`open_blocks`, `levers.DecodeOpenBlocksWalker`). kv_len a whole number of
    blocks (every block open), one token more (one masked block after them), shorter than a
    block (none open): both kernels, the strided loads run by plain `interpret=True`, NaN in
    the unused slots and pages."""
    batch_options, options = STRIDED_CASES[name]
    batch = make_batch(
        [(1, 32), (1, 33), (4, 20), (1, 7), (1, 16)], num_q_heads=16, page_size=8, **batch_options
    )
    options = dict(sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=8, **options)
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, interpret=True, **options)
    _, decode = split_configs(config)
    assert choose_points(decode).walker is DecodeOpenBlocksWalker
    assert decode.kv_tokens_per_block == 16
    out, _ = rpa_jit(*batch.args(), config=config, interpret=True, trace_capacity=0)
    assert_output_matches_jax(out, batch, **options)


class SkipsFirstWaitsCopier(KVBlockCopier):
    """A deliberately broken kernel: it never waits for the copies of a sequence's first KV
    block (computing with the slot while they may still run)."""

    def wait(self, work, slot):
        pl.when(work.kv_blk > 0)(lambda: super(SkipsFirstWaitsCopier, self).wait(work, slot))


def test_the_decode_checks_catch_a_copy_never_waited_for():
    """The checks above can fail: the decode kernel alone, with copies it never waits for."""
    batch = make_batch(DECODE_SEQS, page_size=8, max_num_batched_tokens=24, max_num_seqs=10)
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, num_kv_pages_per_block=2)
    _, decode = split_configs(dataclasses.replace(config, decode_seqs_per_block=2))
    tables = decode_batch(*batch.args()[2:], config)
    q = jnp.take(batch.q, tables.rows, axis=0, mode="clip")
    points = dataclasses.replace(choose_points(decode), copier=SkipsFirstWaitsCopier)
    call = rpa_pallas_call(
        q, batch.kv_pages, config=decode, interpret=strict_interpret_params(), points=points
    )
    with watch_kernel() as watch:
        jax.block_until_ready(call(*tables.tables(), q, batch.kv_pages))
    assert watch.raced and watch.never_waited()
    assert "emaphore" in watch.output


# ---------------------------------------------------------------------------------------------
# Options, block sizes and errors (no kernel run).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_kv_pages_per_block=0), "num_kv_pages_per_block=0 must be in range (0, 3]"),
        (dict(num_kv_pages_per_block=4), "num_kv_pages_per_block=4 must be in range (0, 3]"),
        (dict(num_queries_per_block=0), "num_queries_per_block=0 must be positive"),
        (dict(vmem_limit_bytes=-1), "vmem_limit_bytes=-1 must be positive"),
    ],
)
def test_bad_block_arguments_raise(options, message):
    batch = make_batch([(5, 5), (1, 20)], page_size=8)
    with pytest.raises(RPAInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ragged_paged_attention(*batch.args(), interpret=INTERPRET, **options)


def test_bad_head_counts_raise():
    batch = make_batch([(3, 3)], num_q_heads=6, num_kv_heads=3)
    q = jnp.zeros((3, 6, 64))
    kv_pages = jnp.zeros(batch.kv_pages.shape[:2] + (8, 64))  # 4 KV heads for 6 q heads
    with pytest.raises(RPAInputError, match="num_q_heads=6 must be divisible by num_kv_heads=4"):
        ragged_paged_attention(q, kv_pages, *batch.args()[2:], interpret=INTERPRET)


ON_TPU = jax.default_backend() == "tpu"


@pytest.mark.skipif(ON_TPU, reason="a TPU host compiles: see the next test")
def test_interpret_default_is_tpu_interpret_mode_without_a_tpu():
    assert isinstance(resolve_interpret(None), pltpu.InterpretParams)


@pytest.mark.skipif(not ON_TPU, reason="needs a TPU host")
def test_interpret_default_compiles_on_a_tpu_host():
    assert resolve_interpret(None) is False


def test_explicit_interpret_values_are_kept():
    assert isinstance(resolve_interpret(True), pltpu.InterpretParams)
    assert resolve_interpret(False) is False
    params = pltpu.InterpretParams(detect_races=True)
    assert resolve_interpret(params) is params


@pytest.mark.parametrize("interpret", ["yes", 2.5, 1, 0, "False"], ids=repr)
def test_other_interpret_values_are_a_clear_error(interpret):
    batch = make_batch([(1, 5)], page_size=8)
    with pytest.raises(ValueError, match=rf"interpret={interpret!r} is not an interpret mode"):
        ragged_paged_attention(*batch.args(), interpret=interpret)


# ---------------------------------------------------------------------------------------------
# Random batches, random options, random block sizes: a few in the fast suite, a sweep in the
# slow one.
# ---------------------------------------------------------------------------------------------


KERNEL_DTYPES = ((jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, jnp.float8_e4m3fn))


def check_random_batch(batch_and_options):
    """The kernel in TPU interpret mode on a random batch, with random options (a random
    sm_scale always) and random block sizes: q blocks of 1 or 3 rows too, and pages of 1 or 3
    tokens, so that a KV block spans many pages and q blocks cut sequences anywhere."""
    batch, options = batch_and_options
    assert_matches_jax(run_kernel(), batch, **options)


# Fast: hypothesis' simplest example (a prefill, a decode, a chunk and an idle sequence, each
# as short as it can be, pages of 1 token, blocks of 1) and three random ones, every option set.
test_random_batches = property_test(
    check_random_batch,
    random_batches(dtypes=KERNEL_DTYPES, block_sizes=BLOCK_SIZES, one_of_everything=True),
    max_examples=4,
)
test_random_batches_sweep = pytest.mark.slow(
    property_test(
        check_random_batch,
        random_batches(dtypes=KERNEL_DTYPES, block_sizes=BLOCK_SIZES),
        max_examples=12,
    )
)
