"""Shared test helpers: the case lists, one tolerance per dtype, and the comparison of any
attention function with JAX's own reference."""

from __future__ import annotations

import gc
import hashlib
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    ref_ragged_paged_attention as jax_reference,
)

from minilib import (
    ragged_paged_attention,
    ragged_paged_attention_blockwise,
    ragged_paged_attention_jnp,
    ragged_paged_attention_pallas_basic,
    ref_ragged_paged_attention,
)
from minilib.batch import RaggedBatch, make_batch
from minilib.ladder.deadlock import fail_fast_on_deadlock
from minilib.parity import parity_tolerance
from minilib.tpu.numerics import one_bf16_pass

# Time limits on every test (tests/time_limit.py); what runs only under `slow` (tests/markers.py).
pytest_plugins = ["time_limit", "markers"]

os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_collection_modifyitems(items):
    """The notebooks first. Each test file runs whole on one worker (`--dist loadfile`, in the
    order collected), and tests/test_notebooks.py is the longest (about four minutes): started
    last, as its name sorts, it kept one worker busy while the other had nothing left to do."""
    items.sort(key=lambda item: item.path.name != "test_notebooks.py")  # a stable sort


# XLA:CPU maps the code of each program it compiles into the process (about three memory maps
# a program), and JAX keeps every program it compiled. A pytest worker that compiles for half an
# hour passes Linux's limit on a process's maps (vm.max_map_count, 65,530; tests/kernel/
# test_kernel.py adds about 3,600 a minute), and XLA's JIT then dies of a segfault loading the
# next program (two whole runs lost a worker so, in `backend_compile_and_load` and in
# `deserialize_executable`). Past half the limit, JAX's caches are emptied after a test file:
# the programs are unmapped, and later files compile what they need again.
MAX_MAPS_PATH, MAPS_PATH = "/proc/sys/vm/max_map_count", "/proc/self/maps"


def memory_maps() -> int | None:
    """This process's memory maps (None where /proc does not say)."""
    try:
        with open(MAPS_PATH) as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def release_compiled_programs(limit: int | None = None) -> bool:
    """Empty JAX's caches when this process holds over half of `limit` memory maps (by default
    the system's limit); whether it did."""
    if limit is None:
        try:
            limit = int(Path(MAX_MAPS_PATH).read_text())
        except (OSError, ValueError):
            return False
    maps = memory_maps()
    if maps is None or maps <= limit // 2:
        return False
    jax.clear_caches()
    gc.collect()
    return True


@pytest.fixture(autouse=True, scope="module")
def _programs_released_past_half_the_map_limit():
    yield
    release_compiled_programs()


# The folders whose tests run the course's own kernels. The checkers' tests (exercises/,
# ladder/) are left as a learner meets them: the checkers watch their kernels themselves.
KERNEL_FOLDERS = ("core", "engine", "kernel", "perf")


@pytest.fixture(autouse=True)
def _deadlocks_fail_fast(request):
    """A kernel's wait that nothing will end raises within seconds, naming its semaphore
    (`minilib.ladder.deadlock`), instead of hanging to the ten-minute watchdog: a copy that
    moves fewer bytes than its wait takes back fails its test, not the run's deadline."""
    if request.node.path.parent.name not in KERNEL_FOLDERS:
        yield
        return
    with fail_fast_on_deadlock():
        yield


def pytest_terminal_summary(terminalreporter):
    """The notebooks' times (tests/test_notebooks.py), each with its cost (what its budget
    counts) and its slowest cells, and their sum."""
    times = sorted(
        value
        for report in terminalreporter.stats.get("passed", [])
        for name, value in getattr(report, "user_properties", [])
        if name == "notebook_time"
    )
    if times:
        total = sum(seconds for _, seconds, _, _ in times)
        terminalreporter.write_sep("-", f"notebooks: {total:.0f} s in all")
        for notebook, seconds, cost, slowest in times:
            line = f"{notebook}: {seconds} s, cost {cost} s (slowest: {slowest})"
            terminalreporter.write_line(line)


# The five attention functions, in course order; all take JAX's arguments.
IMPLEMENTATIONS = {
    "reference": ref_ragged_paged_attention,
    "jnp": ragged_paged_attention_jnp,
    "blockwise": ragged_paged_attention_blockwise,
    "pallas_basic": ragged_paged_attention_pallas_basic,
    "kernel": ragged_paged_attention,
}

# TPU interpret mode with fresh VMEM and SMEM scratch NaN, so a kernel that reads memory it
# never wrote fails. One object, so that every call hits the same compile.
INTERPRET = pltpu.InterpretParams(uninitialized_memory="nan")

# The sequences of the parity tests, as (q_len, kv_len) pairs.
DECODE = [(1, 17), (1, 5), (1, 40), (1, 1)]
PREFILL = [(9, 9), (23, 23), (1, 1)]
MIXED = [(1, 30), (12, 12), (0, 7), (5, 33), (1, 64)]
ONE_OF_EACH = [(5, 5), (1, 20), (0, 7), (12, 40)]  # prefill, decode, idle, chunk

# (num_q_heads, num_kv_heads): MHA, GQA groups of 2, 4 and 8 (one KV head: MQA), 16 q heads.
HEAD_CONFIGS = [(4, 4), (8, 4), (8, 2), (8, 1), (16, 2)]
DTYPES = [jnp.float32, jnp.bfloat16]

# The parity cases of every implementation; each test file picks its cases (a compile of JAX's
# reference each) and adds its own block sizes.
# name: (seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, options)
CASES = {
    "mha": (MIXED, 4, 4, 64, 16, {}),
    "gqa2": (MIXED, 8, 4, 64, 8, {}),
    "gqa4": (MIXED, 8, 2, 64, 8, {}),
    "gqa4-hd128": (MIXED, 8, 2, 128, 4, {}),
    "gqa8": (MIXED, 8, 1, 64, 16, {}),  # 8 q heads on 1 kv head is also MQA
    "gqa8-hd128": (MIXED, 8, 1, 128, 4, {}),
    "mqa": (DECODE, 4, 1, 128, 32, {}),
    "mqa-sliding-softcap": (DECODE, 4, 1, 128, 32, {"sliding_window": 9, "soft_cap": 5.0}),
    "gqa8-16": (PREFILL, 16, 2, 64, 2, {}),
    "mha-prefill": (PREFILL, 4, 4, 64, 16, {}),
    "page1": (MIXED, 4, 2, 64, 1, {}),
    "decode": (DECODE, 8, 2, 128, 16, {}),
    "prefill": (PREFILL, 8, 2, 64, 8, {}),
    "sliding": (MIXED, 8, 2, 64, 4, {"sliding_window": 6}),
    "sliding-page8": (MIXED, 8, 2, 64, 8, {"sliding_window": 6}),
    "softcap": (MIXED, 8, 2, 64, 8, {"soft_cap": 2.0, "sm_scale": 0.5}),
    "mask": (MIXED, 4, 2, 64, 8, {"mask_value": -1e4}),
    "all": (MIXED, 8, 4, 128, 16, {"sliding_window": 9, "soft_cap": 5.0, "sm_scale": 0.1}),
}

# The largest absolute error allowed against JAX's reference, by the dtype of q (the compute
# dtype): one value per dtype for every implementation and every comparison.
# - float32: the implementations add the same terms in another order (blocks, an online
#   softmax), so they round differently, by float32's relative step 1.2e-7 at a time over up
#   to 64 keys; 1e-5 is above that rounding and far below the ~0.1 that a wrong or missing
#   key costs.
# - bfloat16 keeps 8 significant bits: between 2 and 4 its step is 2**-6 = 0.0156, so an output
#   there that rounds the other way than JAX's reference is off by 0.0156 (implementations
#   round scores and probabilities at different steps). 2e-2 allows one step for outputs
#   below 4, where standard-normal values lie; an output at or above 4 (a rare value of V that
#   one key's weight carries whole, as in a window of 2) is allowed one step at its own
#   magnitude (`bf16_step`: 0.03125 between 4 and 8), and no more.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}

# Options of the blocked implementations that JAX's reference does not take.
BLOCK_SIZES = ("num_kv_pages_per_block", "num_queries_per_block")


def padded_batch(seq_lens, **options) -> RaggedBatch:
    """`make_batch` with 5 padding q rows and 2 padding sequence slots, so that any read of the
    padding shows (make_batch fills it with NaN and garbage)."""
    return make_batch(
        seq_lens,
        max_num_batched_tokens=sum(q for q, _ in seq_lens) + 5,
        max_num_seqs=len(seq_lens) + 2,
        **options,
    )


def one_of_each_batch() -> RaggedBatch:
    """ONE_OF_EACH with padding rows and slots, and 7 page columns, which KV blocks of 2 or 3
    pages do not divide: the edges of a kernel's loops in one small batch."""
    return make_batch(
        ONE_OF_EACH, page_size=8, max_num_batched_tokens=24, max_num_seqs=6, pages_per_seq=7
    )


def schedule_batch() -> RaggedBatch:
    """The batch of the schedule figure and explorer tests: two heads blocks (16 q heads on 8
    KV heads), a prefill, two decodes and a chunk."""
    return make_batch(
        [(12, 12), (1, 40), (6, 30), (1, 9)],
        num_q_heads=16,
        num_kv_heads=8,
        head_dim=128,
        page_size=8,
    )


def case_batch(name: str) -> tuple[RaggedBatch, dict]:
    """The padded batch of CASES[name], and a copy of its attention options."""
    seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, options = CASES[name]
    batch = padded_batch(
        seq_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
    )
    return batch, dict(options)


# The options that random_batches draws.
# sm_scale stays below 1 (the default): a mix-up of sm_scale and soft_cap (the cap applied
# before the scale, or no scale at all) changes the answer only when sm_scale is not 1.
SM_SCALES = st.floats(0.05, 0.8)
SOFT_CAPS = st.floats(0.5, 30.0)
SLIDING_WINDOWS = st.integers(1, 12)  # 1: each row sees its own key only
# A mask value that leaves masked keys a weight (JAX adds it to their scores), or one so low
# that they weigh nothing (at or below masking.NEGLIGIBLE_MASK_VALUE, -1e30, the blocked
# versions skip KV blocks whose keys are all masked).
MASK_VALUES = st.one_of(st.floats(-20.0, -0.5), st.sampled_from([-1e4, -1e30]))
# The scales of an fp8 cache: powers of two, which the kernel applies to the scores and the
# output exactly as the references apply them to K and V (rounded to q's dtype); v_scale
# below 1 keeps bf16 outputs below 4, where one bf16 rounding step is within TOLERANCE.
K_SCALES = st.sampled_from([0.5, 0.25, 1.0, 2.0])
V_SCALES = st.sampled_from([0.5, 0.25])


@st.composite
def random_batches(
    draw,
    *,
    fixed_shapes: bool = False,
    dtypes=((jnp.float32, None),),
    one_of_everything: bool = False,
    block_sizes=(),
):
    """(batch, options): a random ragged batch (random lengths, idle sequences included, NaN
    padding) and random attention options (sm_scale; maybe a sliding window, a soft cap, a
    mask value; the scales of an fp8 cache), the one random-batch builder of the tests.

    dtypes: the (q dtype, KV dtype) pairs to draw from (KV dtype None: q's).

    block_sizes: the names of BLOCK_SIZES to draw too, for the blocked implementations: KV
    blocks of 1 to pages_per_seq pages, q blocks of 1, 3, 8 or 16 rows.

    fixed_shapes: the same array shapes every time (5 sequence slots of 6 pages of 4 tokens,
    40 q rows, 4 q heads on 2 KV heads) and two option sets (no sm_scale: the caller's), so
    that a jitted implementation compiles twice in all; else head counts, page size and
    padding vary too.

    one_of_everything: every example holds a prefill, a decode, a chunk and an idle sequence
    (random lengths, random order), padding rows and a padding slot, and sets every option.
    For the fast suite's few examples: hypothesis' first example is its simplest (each draw
    at its lower bound), which otherwise is an empty batch with no options.
    """
    if fixed_shapes:
        num_kv_heads, group, page_size, pages_per_seq = 2, 2, 4, 6
        max_seqs, max_kv_len, max_q_len = 5, pages_per_seq * page_size, 8
    else:
        num_kv_heads = draw(st.sampled_from([1, 2]))
        group = draw(st.sampled_from([1, 2, 4]))
        page_size = draw(st.sampled_from([1, 3, 8, 16]))
        max_seqs, max_kv_len, max_q_len = 5, 40, 40
    if one_of_everything:
        seq_lens = draw(one_of_each_kind(max_kv_len))
    else:
        seq_lens = []
        for _ in range(draw(st.integers(0, max_seqs))):
            kv_len = draw(st.integers(0, max_kv_len))
            seq_lens.append((draw(st.integers(0, min(kv_len, max_q_len))), kv_len))
    if fixed_shapes:
        shapes = dict(max_num_batched_tokens=40, max_num_seqs=max_seqs, pages_per_seq=pages_per_seq,
                      total_num_pages=max_seqs * pages_per_seq + 3)  # fmt: skip
    else:
        padding_rows = draw(st.integers(1, 8))
        padding_slots = draw(st.integers(1 if one_of_everything else 0, 2))
        shapes = dict(max_num_batched_tokens=padding_rows + sum(q for q, _ in seq_lens),
                      max_num_seqs=max(len(seq_lens) + padding_slots, 1))  # fmt: skip
    dtype, kv_dtype = draw(st.sampled_from(dtypes))
    batch = make_batch(
        seq_lens,
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        page_size=page_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        seed=draw(st.integers(0, 2**16)),
        **shapes,
    )
    if fixed_shapes:
        options = {} if kv_dtype is None else {"k_scale": 0.5, "v_scale": 2.0}
        return batch, {**options, "sliding_window": draw(st.sampled_from([None, 5]))}
    sizes = {
        "num_kv_pages_per_block": st.integers(1, batch.page_indices.shape[1]),
        "num_queries_per_block": st.sampled_from([1, 3, 8, 16]),
    }
    options = {name: draw(sizes[name]) for name in block_sizes}
    options["sm_scale"] = draw(SM_SCALES)
    if kv_dtype is not None:
        options.update(k_scale=draw(K_SCALES), v_scale=draw(V_SCALES))
    if one_of_everything:
        # A window of at least 2 keys: a window of 1 leaves each row its own key only, and
        # no score would matter in the simplest example.
        options.update(sliding_window=draw(st.integers(2, 12)), soft_cap=draw(SOFT_CAPS),
                       mask_value=draw(MASK_VALUES))  # fmt: skip
        return batch, options
    for name, values in [("sliding_window", SLIDING_WINDOWS), ("soft_cap", SOFT_CAPS),
                         ("mask_value", MASK_VALUES)]:  # fmt: skip
        if draw(st.booleans()):
            options[name] = draw(values)
    return batch, options


@st.composite
def one_of_each_kind(draw, max_kv_len: int) -> list[tuple[int, int]]:
    """(q_len, kv_len) of a prefill, a decode, a chunk (some tokens cached, several new) and an
    idle sequence, with random lengths, in a random order; at their simplest, the shortest
    lengths that still make each kind."""
    prefill = draw(st.integers(2, max_kv_len))
    decode = draw(st.integers(2, max_kv_len))
    chunk = draw(st.integers(3, max_kv_len))
    kinds = [(prefill, prefill), (1, decode), (draw(st.integers(2, chunk - 1)), chunk),
             (0, draw(st.integers(0, max_kv_len)))]  # fmt: skip
    return draw(st.permutations(kinds))


def assert_close(got, want, dtype) -> float:
    """Check `got` is within TOLERANCE[dtype] of `want` everywhere, or, where float32 matmuls
    are one bfloat16 pass (`MINILIB_TPU_NUMERICS=1`, a TPU), within `parity_tolerance`; return
    the max abs error."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    error = float(np.max(np.abs(got - want))) if got.size else 0.0
    tolerance = TOLERANCE[jnp.dtype(dtype)]
    if one_bf16_pass():
        tolerance = max(tolerance, parity_tolerance(dtype))
    allowed = tolerance
    if jnp.dtype(dtype) == jnp.bfloat16:  # one rounding step at each output's own magnitude
        allowed = np.maximum(tolerance, bf16_step(want))
    over = np.abs(got - want) > allowed
    if over.any():
        worst = np.unravel_index(np.argmax(np.where(over, np.abs(got - want), -1)), got.shape)
        raise AssertionError(f"max abs error {error} > {tolerance}: got {got[worst]}, want "
                             f"{want[worst]} at {tuple(map(int, worst))}")  # fmt: skip
    return error


def bf16_step(values):
    """bfloat16's rounding step at each of `values`: 2**(e - 7) for |value| in [2**e, 2**(e+1))
    (tests/core/test_parity.py)."""
    magnitude = np.maximum(np.abs(values), np.finfo(np.float32).tiny)
    return np.exp2(np.floor(np.log2(magnitude)) - 7)


def assert_matches_jax(fn, batch: RaggedBatch, **options) -> float:
    """Run `fn` on `batch`; check it against JAX's reference (see `assert_output_matches_jax`).
    Block sizes in `options` go to `fn` only. Returns the max abs error."""
    out = fn(*batch.args(), **options)
    return assert_output_matches_jax(out, batch, **options)


def assert_output_matches_jax(out, batch: RaggedBatch, **options) -> float:
    """Check an attention output for `batch`: its shape and dtype are q's, it is finite, the
    live rows agree with JAX's reference and the padding rows are zero. Returns the max abs
    error."""
    n = batch.num_tokens
    assert out.shape == batch.q.shape
    assert out.dtype == batch.q.dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "NaN/inf leaked into the output"
    np.testing.assert_array_equal(out[n:], 0.0, err_msg="rows past cu_q_lens[num_seqs]")
    reference_options = {k: v for k, v in options.items() if k not in BLOCK_SIZES}
    if batch.seq_lens:
        expected = np.asarray(jax_reference_jitted(batch, **reference_options), np.float32)
    else:  # JAX's reference cannot concatenate zero sequences
        expected = np.zeros((0, *batch.q.shape[1:]), np.float32)
    assert np.isfinite(expected).all(), "the reference itself produced NaN: bad test batch"
    return assert_close(out[:n], expected, batch.q.dtype)


def jax_reference_jitted(batch: RaggedBatch, **options) -> np.ndarray:
    """JAX's reference output for `batch`, traced once as a whole under jit with the lengths
    as constants, and kept for the rest of the test process.

    JAX's reference loops over sequences in Python; called eagerly it compiles every op for
    every sequence shape (seconds per batch). Under jit the loop unrolls into one program,
    whose compile still takes seconds: many tests compare another implementation, block size
    or option with the same batch, so each batch's output is computed once, keyed by the
    batch's contents and the options (`_REFERENCE_OUTPUTS`).
    """
    key = (batch_fingerprint(batch), tuple(sorted(options.items())))
    if key not in _REFERENCE_OUTPUTS:
        lengths = [np.asarray(a) for a in batch.args()[2:]]
        fn = jax.jit(lambda q, kv_pages: jax_reference(q, kv_pages, *lengths, **options))
        _REFERENCE_OUTPUTS[key] = np.asarray(fn(batch.q, batch.kv_pages))
    return _REFERENCE_OUTPUTS[key]


_REFERENCE_OUTPUTS: dict = {}


def batch_fingerprint(batch: RaggedBatch) -> str:
    """A digest of every array of `batch` (dtype, shape and bytes): equal for equal batches."""
    digest = hashlib.sha256()
    for array in batch.args():
        array = np.asarray(array)
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).view(np.uint8).tobytes())
    return digest.hexdigest()


def one_case_per_path(params, *representatives):
    """The cases of an interpret-mode matrix as pytest params: those named in
    `representatives` (one per code path) run on every stack; the rest are marked `matrix`,
    and run once, in .venv (tasks.py: .venv-oldest deselects them).

    params: the cases' ids (strings), or pytest.param(...)s with ids.
    """
    cases = [p if hasattr(p, "values") else pytest.param(p, id=p) for p in params]
    ids = {case.id for case in cases}
    missing = [r for r in representatives if r not in ids]
    assert not missing, f"no such case: {missing}"
    return [
        case
        if case.id in representatives
        else pytest.param(*case.values, id=case.id, marks=[*case.marks, pytest.mark.matrix])
        for case in cases
    ]


def property_test(check, strategy, max_examples: int):
    """`check` as a hypothesis test over examples drawn from `strategy`, with this many
    examples and no deadline (each new shape compiles)."""
    relaxed = settings(
        max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    return relaxed(given(strategy)(check))


def property_tests(check, strategy, fast: int, slow: int):
    """`check` as two hypothesis tests: `fast` examples in the fast suite, and a sweep of
    `slow` examples marked slow (`pytest -m slow`)."""
    return (
        property_test(check, strategy, fast),
        pytest.mark.slow(property_test(check, strategy, slow)),
    )
