"""The kernel ladder (minilib.ladder): every rung against plain jnp on NaN-padded inputs, in the
strictest TPU interpret mode, with no race and every copy waited for; the Python next_work
against the full kernel's plan; and, where libtpu is installed (marker `tpu_compile`), every
rung compiled for v5e by Mosaic. The checkers' own tests are in test_ladder_checkers.py.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib import make_batch
from minilib.ladder import (
    aligned_blocks,
    async_copy,
    double_buffer,
    flash,
    prefetch,
    prefill_chunk,
    ragged,
    scalar_prefetch,
)
from minilib.ladder.interpret import races_found, strict_interpret_params
from minilib.ladder.watch import watch_kernel
from minilib.tpu.compile import compile_for_tpu, tpu_compile_available

ROOT = Path(__file__).resolve().parents[2]

DECODE_KERNELS = {
    "scalar_prefetch": scalar_prefetch.paged_decode_attention,
    "async_copy": async_copy.paged_decode_attention_async_copy,
    "double_buffer": double_buffer.paged_decode_attention_double_buffered,
    "prefetch": prefetch.paged_decode_attention_prefetch,
}


def solutions(module: str):
    spec = importlib.util.spec_from_file_location(module, ROOT / "solutions" / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def decode_args(kv_lens, *, dtype=jnp.float32, **shape):
    """A decode batch: one q row per sequence slot, kv_len 0 for an empty slot."""
    batch = make_batch([(1, n) if n else (0, 0) for n in kv_lens], dtype=dtype, **shape)
    rows = iter(range(batch.q.shape[0]))
    q = jnp.stack([batch.q[next(rows)] if n else jnp.ones_like(batch.q[0]) for n in kv_lens])
    return q, batch.kv_pages, batch.kv_lens, batch.page_indices


def assert_finite_and_close(out, expected, dtype):
    assert np.isfinite(np.asarray(out, np.float32)).all(), "NaN or inf in the kernel's output"
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("name", DECODE_KERNELS)
@pytest.mark.parametrize(
    "kv_lens, dtype, shape",
    [
        # a one-token sequence, a full last page, unused page slots (NaN pages behind them),
        # empty slots (kv_len 0) first and in the middle
        ([0, 5, 20, 0, 1, 16], jnp.float32, dict(page_size=8, pages_per_seq=4)),
        ([33, 2], jnp.bfloat16, dict(page_size=16, num_q_heads=8, num_kv_heads=2)),
    ],
    ids=["f32-gqa", "bf16"],
)
def test_decode_rungs_match_the_reference_and_leave_no_copy_behind(name, kv_lens, dtype, shape):
    args = decode_args(kv_lens, dtype=dtype, head_dim=128, **shape)
    with watch_kernel() as watch:
        out = DECODE_KERNELS[name](*args, sm_scale=0.1, interpret=strict_interpret_params())
        jax.block_until_ready(out)
    assert not watch.raced and watch.never_waited() == [] and watch.deadlock is None
    assert watch.overwrite is None and watch.shared is None
    expected = scalar_prefetch.paged_decode_reference(*args, sm_scale=0.1)
    assert_finite_and_close(out, expected, dtype)
    empty = [s for s, n in enumerate(kv_lens) if n == 0]
    assert (np.asarray(out, np.float32)[empty] == 0).all(), "an empty slot's output is 0"


def test_rung_7_matches_jax_reference_leaving_no_copy_behind():
    """A ragged batch: q_len 0 with keys, a decode, chunks over q blocks, kv_lens of whole
    pages, NaN in unused pages and q padding; q blocks of 8 rows, KV blocks of 16 tokens."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention,
    )

    seqs = [(5, 13), (0, 9), (1, 16), (10, 24), (3, 40)]
    b = make_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=128, page_size=8,
                   max_num_batched_tokens=24, max_num_seqs=6)  # fmt: skip
    with watch_kernel() as watch:
        out = ragged.ragged_paged_attention_ladder(
            *b.args(), sm_scale=0.1, num_queries_per_block=8, num_kv_pages_per_block=2,
            interpret=strict_interpret_params(),
        )  # fmt: skip
        jax.block_until_ready(out)
    assert not watch.raced and watch.never_waited() == [] and watch.deadlock is None
    assert watch.overwrite is None and watch.shared is None
    blocks = dict(block_q=8, num_q_blocks=3, num_kv_pages_per_block=2, page_size=8)
    plan = ragged.ragged_copy_plan(b.kv_lens, b.page_indices, b.cu_q_lens, 5, **blocks)
    assert [c.page for c in watch.copies] == [p for *_, pages in plan for p in pages]
    expected = ref_ragged_paged_attention(*b.args(), sm_scale=0.1)
    assert_finite_and_close(out[:19], expected, jnp.float32)


def test_rung_6_matches_jax_reference():
    from minilib.exercises.ex08_ragged import _prefill_cases

    case = _prefill_cases(0)[1]  # NaN pages: a chunk of 16 over 5 pages, an idle slot
    q_lens = np.asarray(case.args[4])
    out = prefill_chunk.prefill_chunk_attention(
        *case.args, **case.kwargs, interpret=strict_interpret_params()
    )
    assert not races_found()
    expected = prefill_chunk.prefill_chunk_reference(*case.args, **case.kwargs)
    live = (np.arange(out.shape[1])[None, :] < q_lens[:, None])[:, :, None, None]
    assert_finite_and_close(np.where(live, out, 0), expected, jnp.float32)


@pytest.mark.parametrize("option", ["sliding_window", "soft_cap", "k_scale", "v_scale"])
def test_rung_7_refuses_what_it_does_not_have(option):
    b = make_batch([(3, 3)], head_dim=128, page_size=8)
    with pytest.raises(ValueError, match=f"{option}=.*rung 7 has no {option}"):
        ragged.ragged_paged_attention_ladder(*b.args(), **{option: 4.0}, interpret=True)
    with pytest.raises(ValueError, match="num_queries_per_block=5 must divide"):
        ragged.ragged_paged_attention_ladder(*b.args(), num_queries_per_block=5, interpret=True)


@pytest.mark.parametrize("kv_len, block_q, block_kv", [(21, 8, 8), (32, 16, 16), (17, 8, 16)])
def test_flash_attention_matches_the_reference(kv_len, block_q, block_kv):
    rng = np.random.default_rng(kv_len)
    q, k, v = (jnp.asarray(rng.standard_normal((2, n, 128)), jnp.float32) for n in (16, 32, 32))
    k, v = k.at[:, kv_len:].set(jnp.nan), v.at[:, kv_len:].set(jnp.nan)
    options = dict(kv_len=kv_len, sm_scale=0.1, block_q=block_q, block_kv=block_kv)
    out = flash.flash_attention(q, k, v, interpret=strict_interpret_params(), **options)
    assert not races_found()
    assert_finite_and_close(out, flash.flash_attention_reference(q, k, v, **options), q.dtype)


@pytest.mark.parametrize("seed", range(6))
def test_next_work_gives_the_full_kernels_plan(seed):
    rng = np.random.default_rng(seed)
    kv_lens = [int(n) for n in rng.integers(1, 40, size=int(rng.integers(1, 5)))]
    page_size = int(rng.choice([4, 8, 16]))
    planned = prefetch.planned_decode_schedule(kv_lens, page_size)
    assert prefetch.decode_schedule(prefetch.next_work, kv_lens, page_size) == planned
    assert prefetch.decode_schedule(solutions("ex08_ladder").next_work, kv_lens, page_size) == (
        planned
    )


def test_aligned_blocks_agree_with_the_first_kernel():
    from minilib import pallas_basics as pb
    from minilib.vectorized import gather_all_kv

    batch = make_batch([(6, 6), (1, 19), (3, 11)], num_q_heads=4, num_kv_heads=2, head_dim=32)
    q, kv_pages, kv_lens, page_indices, cu_q_lens, _ = batch.args()
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_seq = pb.q_by_sequence(q, cu_q_lens[:-1], q_lens, 16)
    k, v = gather_all_kv(kv_pages, page_indices, kv_lens)
    options = dict(sm_scale=0.2, num_queries_per_block=8, interpret=True)
    out = aligned_blocks.attention_pallas_call_aligned(q_seq, k, v, q_lens, kv_lens, **options)
    first = pb.attention_pallas_call(q_seq, k, v, q_lens, kv_lens, sliding_window=None,
                                     soft_cap=None, mask_value=-1e30, **options)  # fmt: skip
    rows = (jnp.arange(16)[None, :] < q_lens[:, None])[:, :, None, None]
    assert_finite_and_close(jnp.where(rows, out, 0), jnp.where(rows, first, 0), q.dtype)


# --- Mosaic, where libtpu is installed -----------------------------------------------------

AVAILABLE, REASON = tpu_compile_available()


def decode_specs(dtype):
    s = jax.ShapeDtypeStruct
    return (s((8, 8, 128), dtype), s((64, 16, 4, 128), dtype), s((8,), jnp.int32),
            s((8, 4), jnp.int32))  # fmt: skip


def ladder_solutions():
    sol7, sol8 = solutions("ex07_flash"), solutions("ex08_ladder")
    return {
        "flash": sol7.flash_attention,
        "scalar_prefetch": sol8.paged_decode_attention,
        "async_copy": sol8.paged_decode_async_copy,
        "double_buffer": sol8.double_buffered_decode,
        "prefetch": sol8.prefetching_decode,
        "ragged": sol8.ragged_paged_attention,
    }


@pytest.mark.tpu_compile
@pytest.mark.parametrize("source", ["minilib", "solutions"])
@pytest.mark.parametrize("name", ["flash", *DECODE_KERNELS])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_every_rung_compiles_for_v5e(source, name, dtype):
    if not AVAILABLE:
        pytest.skip(f"no TPU compile here: {REASON}")
    fn = {"flash": flash.flash_attention, **DECODE_KERNELS}[name]
    if source == "solutions":
        fn = ladder_solutions()[name]
    if name == "flash":
        qkv = [jax.ShapeDtypeStruct((2, n, 128), dtype) for n in (128, 256, 256)]
        fn = functools.partial(fn, kv_len=200, sm_scale=0.1, block_q=32, block_kv=128)
        report = compile_for_tpu(fn, *qkv, chip="v5e")
    else:
        report = compile_for_tpu(functools.partial(fn, sm_scale=0.1), *decode_specs(dtype))
    assert report.compiled, report.error


@pytest.mark.tpu_compile
@pytest.mark.parametrize("source", ["minilib", "solutions"])
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_rung_7_compiles_for_v5e_and_v6e(source, chip):
    if not AVAILABLE:
        pytest.skip(f"no TPU compile here: {REASON}")
    fn = ragged.ragged_paged_attention_ladder
    if source == "solutions":
        fn = ladder_solutions()["ragged"]
    s = jax.ShapeDtypeStruct
    i32, bf16 = jnp.int32, jnp.bfloat16
    specs = (s((64, 8, 128), bf16), s((64, 16, 4, 128), bf16), s((8,), i32), s((8, 8), i32),
             s((9,), i32), s((1,), i32))  # fmt: skip
    options = dict(sm_scale=0.1, num_queries_per_block=16, num_kv_pages_per_block=2)
    report = compile_for_tpu(functools.partial(fn, **options), *specs, chip=chip)
    assert report.compiled, report.error


@pytest.mark.tpu_compile
def test_the_first_kernel_needs_aligned_blocks_and_then_compiles():
    if not AVAILABLE:
        pytest.skip(f"no TPU compile here: {REASON}")
    from minilib.pallas_basics import ragged_paged_attention_pallas_basic

    batch = make_batch([(6, 6), (1, 19), (3, 11)], num_q_heads=4, num_kv_heads=2, head_dim=32)
    first = functools.partial(ragged_paged_attention_pallas_basic, sm_scale=0.2, interpret=False)
    report = compile_for_tpu(first, *batch.args(), chip="v5e")
    assert not report.compiled and "divisible by 8 and 128" in report.error
    s = jax.ShapeDtypeStruct
    args = (s((3, 16, 4, 32), jnp.float32), s((3, 24, 2, 32), jnp.float32),
            s((3, 24, 2, 32), jnp.float32), s((3,), jnp.int32), s((3,), jnp.int32))  # fmt: skip
    aligned = functools.partial(
        aligned_blocks.attention_pallas_call_aligned, sm_scale=0.2, num_queries_per_block=8
    )
    report = compile_for_tpu(aligned, *args, chip="v5e")
    assert report.compiled, report.error


@pytest.mark.tpu_compile
def test_the_checkers_report_the_mosaic_compile():
    if not AVAILABLE:
        pytest.skip(f"no TPU compile here: {REASON}")
    import minilib.exercises as ex

    result = ex.check_prefetching_decode(ladder_solutions()["prefetch"], verbose=False)
    assert result.passed and "Mosaic compiles it for v5e" in result.report, result.report
    result = ex.check_flash_attention(flash_with_unaligned_q_block(), verbose=False)
    assert result.status == "failed" and "Mosaic" in result.report, result.report


def flash_with_unaligned_q_block():
    """Rung 1 with the head axis last-but-one in the q block: right in interpret mode, refused
    by Mosaic (a (1, head_dim) block of a [num_heads, head_dim] slab is not (8, 128)-aligned)."""

    def fn(q, k, v, *, kv_len, sm_scale, block_q, block_kv, interpret):
        q_t = jnp.swapaxes(q, 0, 1)  # [q_len, num_heads, head_dim]
        num_heads, q_len, head_dim = q.shape

        def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, **options):
            return flash.flash_kernel(q_ref.at[:, 0, :], k_ref, v_ref, o_ref, m_ref, l_ref,
                                      acc_ref, **options)  # fmt: skip

        spec_q = pl.BlockSpec((block_q, 1, head_dim), lambda h, i, j: (i, h, 0))
        spec_kv = pl.BlockSpec((None, block_kv, head_dim), lambda h, i, j: (h, j, 0))
        spec_o = pl.BlockSpec((None, block_q, head_dim), lambda h, i, j: (h, i, 0))
        return pl.pallas_call(
            functools.partial(kernel, kv_len=kv_len, q_len=q_len, sm_scale=sm_scale),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            grid=(num_heads, q_len // block_q, pl.cdiv(kv_len, block_kv)),
            in_specs=[spec_q, spec_kv, spec_kv],
            out_specs=spec_o,
            scratch_shapes=[
                pltpu.VMEM((block_q, 1), jnp.float32),
                pltpu.VMEM((block_q, 1), jnp.float32),
                pltpu.VMEM((block_q, head_dim), jnp.float32),
            ],  # fmt: skip
            interpret=interpret,
        )(q_t, k, v)

    return fn


@pytest.mark.tpu_compile
def test_a_kernel_compiles_in_this_process_too():
    """The checkers' path once libtpu has started without dump flags (a notebook)."""
    if not AVAILABLE:
        pytest.skip(f"no TPU compile here: {REASON}")
    from minilib.exercises.kernel_checking import compile_in_this_process

    fn = functools.partial(ladder_solutions()["prefetch"], sm_scale=0.1, interpret=False)
    assert compile_in_this_process(fn, decode_specs(jnp.bfloat16), "v5e") == (True, None)
    compiled, error = compile_in_this_process(
        functools.partial(
            flash_with_unaligned_q_block(),
            kv_len=200,
            sm_scale=0.1,
            block_q=32,
            block_kv=128,
            interpret=False,
        ),  # fmt: skip
        [jax.ShapeDtypeStruct((2, n, 128), jnp.float32) for n in (128, 256, 256)],
        "v5e",
    )
    assert not compiled and "divisible by 8 and 128" in error


def test_the_checker_refuses_blocks_a_tpu_cannot_tile():
    """Right in interpret mode, refused for a TPU: by JAX's TPU lowering everywhere, and by
    Mosaic too where libtpu is installed."""
    import minilib.exercises as ex

    result = ex.check_flash_attention(flash_with_unaligned_q_block(), verbose=False)
    assert result.status == "failed", result.report
    assert "right in interpret mode" in result.report
    assert "divisible by 8 and 128" in result.report, result.report
