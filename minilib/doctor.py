"""`python -m minilib doctor`: where am I running, and does attention give the right answer?

`python -m minilib doctor --tpu` (`tpu_self_check`, at the end of this module) is the longer
self-check for a real TPU: every implementation and ladder solution run on the chip, parity at
its precision, and our kernel timed beside JAX's and vLLM's v3, in a report to paste into an
issue. Off a TPU, `--tpu --interpret` runs the same checks in TPU interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from minilib.batch import RaggedBatch, make_batch, random_seq_lens
from minilib.parity import parity_tolerance
from minilib.perf.workloads import TARGET_CASE, BenchCase, case_batch, fit_token_budget
from minilib.tpu.numerics import one_bf16_pass

__all__ = [
    "batch_label",
    "doctor",
    "engine_check",
    "expected_output",
    "kernel_mode",
    "ladder_checks",
    "ladder_rungs",
    "max_abs_error",
    "max_error",
    "package_version",
    "parity_passes",
    "parity_smoke_check",
    "precision_line",
    "self_check_batches",
    "tpu_compile_check",
    "tpu_self_check",
    "v3_run",
    "warm_ms",
]


def package_version(name: str) -> str:
    """The installed version of a distribution, or 'not installed'.

    >>> package_version("jax") == jax.__version__, package_version("no-such-package")
    (True, 'not installed')
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def kernel_mode(backend: str | None = None) -> str:
    """How minilib's Pallas kernel runs here: compiled on a TPU, TPU interpret mode elsewhere.

    >>> kernel_mode("tpu")
    'compiled (Mosaic, on the TPU)'
    >>> kernel_mode("cpu")
    'interpreted (TPU interpret mode on cpu: right answers, not TPU speed)'
    """
    backend = jax.default_backend() if backend is None else backend
    if backend == "tpu":
        return "compiled (Mosaic, on the TPU)"
    return f"interpreted (TPU interpret mode on {backend}: right answers, not TPU speed)"


def precision_line() -> str:
    """What a float32 matmul at JAX's default precision is here, and so the parity tolerance:
    float32 on a CPU; one bfloat16 pass on a TPU, or under this course's emulation of one
    (`minilib.tpu.numerics`, which the course's test run switches on for Colab's stack).

    >>> print(precision_line())  # doctest: +SKIP
    float32 matmuls run in float32 here (cpu): parity tolerance 1e-04
    """
    if jax.default_backend() == "tpu":
        where = "as one bfloat16 pass here (a TPU)"
    elif one_bf16_pass():
        where = "as one bfloat16 pass here (minilib.tpu.numerics emulates a TPU's on the CPU)"
    else:
        where = f"in float32 here ({jax.default_backend()})"
    return f"float32 matmuls run {where}: parity tolerance {parity_tolerance():.0e}"


def expected_output(batch: RaggedBatch, sm_scale: float) -> np.ndarray:
    """JAX's own reference on `batch`, its live rows, with float32-accurate matmuls.

    >>> batch = make_batch([(2, 2), (1, 5)], max_num_batched_tokens=8)
    >>> expected_output(batch, sm_scale=0.125).shape   # 3 live rows of [8, 4, 64]
    (3, 4, 64)
    """
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention as jax_reference,
    )

    # JAX's reference loops over sequences in Python; jit with the lengths as constants
    # compiles that loop once instead of op by op.
    lengths = [np.asarray(a) for a in batch.args()[2:]]
    reference = jax.jit(lambda q, kv: jax_reference(q, kv, *lengths, sm_scale=sm_scale))
    # The reference's matmuls float32-accurate (HIGHEST), even where a float32 matmul at the default
    # precision is one bfloat16 pass (a TPU; minilib.tpu.numerics): the float32 answer.
    with jax.default_matmul_precision("highest"):
        return np.asarray(reference(batch.q, batch.kv_pages))[: batch.num_tokens]


def max_abs_error(out, expected: np.ndarray) -> float:
    """max |out - expected| over the live rows (`expected` holds only those); NaN if any
    output is NaN, so that `parity_passes` fails it.

    >>> max_abs_error(np.array([1.0, 2.0, 7.0]), np.array([1.0, 2.5]))
    0.5
    >>> max_abs_error(np.array([np.nan, 2.0]), np.array([1.0, 2.0]))
    nan
    """
    live = np.asarray(out, np.float32)[: len(expected)]
    return float(np.max(np.abs(live - expected)))


def max_error(fn, expected: list[tuple[RaggedBatch, np.ndarray]], sm_scale: float) -> float:
    """The largest `max_abs_error` of `fn` (JAX's signature) over the batches of `expected`,
    each with its `expected_output`.

    >>> from minilib.vectorized import ragged_paged_attention_jnp
    >>> batch = make_batch([(2, 2), (1, 5)], max_num_batched_tokens=8)
    >>> expected = [(batch, expected_output(batch, sm_scale=0.125))]
    >>> error = max_error(ragged_paged_attention_jnp, expected, sm_scale=0.125)
    >>> parity_passes({"jnp": error})
    True
    """
    errors = [max_abs_error(fn(*b.args(), sm_scale=sm_scale), out) for b, out in expected]
    return float(np.max(errors))  # NaN if any is NaN


def parity_smoke_check() -> tuple[dict[str, float], float]:
    """Run minilib's vectorized attention and its Pallas kernel (compiled on a TPU,
    interpreted elsewhere) against JAX's own reference on one small NaN-padded batch.
    Returns ({name: max abs error}, seconds).

    It compiles and runs both implementations (`doctor` prints how long that took), so the
    example is not run:

    >>> errors, seconds = parity_smoke_check()  # doctest: +SKIP
    >>> errors  # doctest: +SKIP
    {'jnp': 1.1920928955078125e-06, 'kernel': 4.76837158203125e-07}
    """
    from minilib.kernel import ragged_paged_attention
    from minilib.vectorized import ragged_paged_attention_jnp

    start = time.perf_counter()
    batch = make_batch(
        [(6, 6), (1, 20), (3, 11)], num_q_heads=4, num_kv_heads=2, head_dim=128, page_size=8
    )
    expected = [(batch, expected_output(batch, sm_scale=0.125))]
    functions = {"jnp": ragged_paged_attention_jnp, "kernel": ragged_paged_attention}
    errors = {name: max_error(fn, expected, sm_scale=0.125) for name, fn in functions.items()}
    return errors, time.perf_counter() - start


def parity_passes(errors: dict[str, float]) -> bool:
    """Are `parity_smoke_check`'s errors small enough? Float32 rounding (1e-4) where float32
    matmuls run in float32 (a CPU); where they are one bfloat16 pass (a TPU, or its emulation
    on the CPU), what that pass costs (`minilib.tpu.numerics.BF16_PASS_TOLERANCE`; the kernel
    measured 0.0064 under the emulation).

    >>> parity_passes({"jnp": 1e-6, "kernel": float("nan")})
    False
    """
    tolerance = parity_tolerance()
    return all(np.isfinite(err) and err < tolerance for err in errors.values())


def doctor() -> bool:
    """Print the environment report. Returns True when the parity check passes.

    It runs `parity_smoke_check`, and compiles the kernel for v5e where libtpu is installed,
    so the example is not run; on a CPU without libtpu it printed:

    >>> doctor()  # doctest: +SKIP
    backend:      cpu (cpu)
    jax:          0.12.0.1
    jaxlib:       0.12.0.1
    libtpu:       not installed
    Pallas kernel: interpreted (TPU interpret mode on cpu: right answers, not TPU speed)
    precision:    float32 matmuls run in float32 here (cpu): parity tolerance 1e-04
    parity check: PASS: max |minilib - jax reference|: jnp 8.3e-07, kernel 1.3e-06 (6.2 s)
    TPU compile:  not available: libtpu is not installed (jax 0.12.0.1). Install it with: ...
    True
    """
    backend = jax.default_backend()
    print(f"backend:      {backend} ({jax.devices()[0].device_kind})")
    print(f"jax:          {jax.__version__}")
    print(f"jaxlib:       {package_version('jaxlib')}")
    print(f"libtpu:       {package_version('libtpu')}")
    print(f"Pallas kernel: {kernel_mode(backend)}")
    print(f"precision:    {precision_line()}")
    errors, seconds = parity_smoke_check()
    ok = parity_passes(errors)
    details = ", ".join(f"{name} {err:.1e}" for name, err in errors.items())
    verdict = "PASS" if ok else "FAIL"
    print(f"parity check: {verdict}: max |minilib - jax reference|: {details} ({seconds:.1f} s)")
    return tpu_compile_check() and ok


def tpu_compile_check() -> bool:
    """Report whether a TPU compile is available here (libtpu, no TPU needed); when it is,
    compile the kernel for v5e and print what the compiler made of it. Returns False only
    when libtpu is there and the kernel does not compile.

    With libtpu it compiles the kernel for v5e, so the example is not run; with libtpu
    0.0.42.1 it printed:

    >>> tpu_compile_check()  # doctest: +SKIP
    TPU compile:  PASS: libtpu 0.0.42.1 with jax 0.10.2; the kernel compiles for v5e: 4,560
    bundles per KV block, VMEM 9,172 KiB (static estimates, not timings; ...)
    True
    """
    from minilib.tpu.compile import tpu_compile_available

    ok, reason = tpu_compile_available()
    if not ok:  # the reason ends with how to install libtpu, for this jax
        print(f"TPU compile:  not available: {reason}")
        return True
    from minilib.tpu.kernel_costs import compile_rpa, rpa_specs

    report = compile_rpa("ours", rpa_specs(), chip="v5e")
    if not report.compiled:
        print(f"TPU compile:  FAIL: {reason}; the kernel did not compile for v5e:")
        print(report.error)
        return False
    print(
        f"TPU compile:  PASS: {reason}; the kernel compiles for v5e: "
        f"{report.bundles_per_kv_block:,} bundles per KV block, VMEM {report.vmem_bytes // 1024:,} "
        f"KiB (static estimates, not timings; python -m minilib compile compares with JAX's)"
    )
    return True


# ---------------------------------------------------------------------------------------------
# `python -m minilib doctor --tpu`: the self-check to run once on a real TPU, and paste.

# The self-check's batches: a decode, a mixed and a prefill step, each with a decode fraction
# (as `minilib.perf.workloads` draws them), all of the SAME array shapes, so that each
# implementation compiles once for all three. The parity batches are small: the reference loops
# over sequences in Python, and pallas_basics runs interpreted even on a TPU. On a TPU the
# timing batches are the course's speed-target shapes in bfloat16, the dtype a server uses; in
# interpret mode the timings only show that the timing runs, on the parity batches.
SELF_CHECK_STEPS = {"decode": 1.0, "mixed": 0.5, "prefill": 0.0}
PARITY_CASE = BenchCase("mixed", 4, (4, 2, 128), page_size=16, pages_per_seq=4,
                        max_num_batched_tokens=64)  # fmt: skip
TIMING_CASE = dataclasses.replace(TARGET_CASE, dtype="bfloat16")
TPU_TIMING_REPS = 20  # in interpret mode, 1
BENCH_TPU_COMMAND = "python -m minilib bench --tpu"  # minilib.perf.tpu_bench
V3_QUERIES_PER_BLOCK = 32  # v3's mixed kernel: q blocks of 32 tokens, KV blocks as compared


def self_check_batches(case: BenchCase) -> dict[str, RaggedBatch]:
    """{step: batch} for each step of `SELF_CHECK_STEPS`, all of `case`'s array shapes.

    >>> batches = self_check_batches(PARITY_CASE)
    >>> [(step, b.q.shape) for step, b in batches.items()]
    [('decode', (64, 4, 128)), ('mixed', (64, 4, 128)), ('prefill', (64, 4, 128))]
    >>> batch_label(batches["decode"]), batch_label(batches["mixed"])
    ('4 decode + 0 prefill', '3 decode + 1 prefill')
    """
    batches = {}
    for step, decode_fraction in SELF_CHECK_STEPS.items():
        pairs = random_seq_lens(case.num_seqs, max_kv_len=case.max_kv_len,
                                decode_fraction=decode_fraction)  # fmt: skip
        batches[step] = case_batch(case, fit_token_budget(pairs, case.max_num_batched_tokens))
    return batches


def tpu_self_check(interpret: bool = False, ladder: bool = True) -> bool:
    """`python -m minilib doctor --tpu`: on a TPU, compile and run every implementation and
    every ladder solution, check parity at the chip's precision, time ours, JAX's kernel and
    vLLM's v3, and print a report to paste into an issue. Returns True when every check passed.

    Off a TPU it says so and returns False, unless `interpret`: then it runs the same checks
    with the kernels in TPU interpret mode (right answers, not TPU speed), on small batches.
    `ladder=False` leaves out the ladder's checkers (about a minute in interpret mode).

    >>> tpu_self_check()  # on a CPU
    No TPU found: JAX's backend here is cpu (cpu). ... python -m minilib doctor --tpu --interpret
    False
    """
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not interpret:
        print(
            f"No TPU found: JAX's backend here is {jax.default_backend()} "
            f"({jax.devices()[0].device_kind}). The self-check is meant for a real TPU. To run "
            "the same checks here, with the kernels in TPU interpret mode (right answers, not "
            "TPU speed): python -m minilib doctor --tpu --interpret"
        )
        return False
    print("minilib TPU self-check (python -m minilib doctor --tpu)")
    print_versions()
    results = implementation_checks()
    results.append(engine_check())
    if ladder:
        results += ladder_checks()
    else:
        print("\nladder solutions: not checked (--no-ladder)")
    results.append(timing_check(on_tpu))
    failed = [name for name, ok in results if not ok]
    verdict = f"FAIL: {', '.join(failed)}" if failed else "PASS"
    print(f"\nresult: {verdict} ({len(results) - len(failed)} of {len(results)} checks passed)")
    return not failed


def print_versions() -> None:
    """The first lines of the self-check: versions, chip, how the kernels run, precision."""
    from minilib.tpu.v3 import v3_available

    device = jax.devices()[0]
    versions = ", ".join(
        f"{name} {package_version(name)}" for name in ("jax", "jaxlib", "libtpu", "numpy")
    )
    print(f"versions:  python {platform.python_version()}, {versions}")
    print(f"v3:        {v3_available()[1]}")
    print(f"chip:      {device.device_kind} ({device.platform}), {jax.device_count()} device(s)")
    print(f"kernels:   {kernel_mode(device.platform)}")
    print(f"precision: {precision_line()}")


def implementation_checks() -> list[tuple[str, bool]]:
    """Every implementation of the course against JAX's reference on the three parity batches
    (`PARITY_CASE`), and notebook 07's first kernel, `add_vectors`. [(check, passed)]."""
    from minilib import (
        add_vectors,
        ragged_paged_attention,
        ragged_paged_attention_blockwise,
        ragged_paged_attention_jnp,
        ragged_paged_attention_pallas_basic,
        ref_ragged_paged_attention,
    )

    functions = {
        "reference": ref_ragged_paged_attention,
        "jnp": ragged_paged_attention_jnp,
        "blockwise": ragged_paged_attention_blockwise,
        "pallas_basics": ragged_paged_attention_pallas_basic,  # interpret mode only, by design
        "kernel": ragged_paged_attention,  # compiled on a TPU, interpreted elsewhere
    }
    sm_scale = PARITY_CASE.heads[2] ** -0.5
    batches = self_check_batches(PARITY_CASE).values()
    expected = [(batch, expected_output(batch, sm_scale)) for batch in batches]
    print(
        f"\nimplementations: max |out - JAX's reference (float32)| over a decode, a mixed and a "
        f"prefill batch ({PARITY_CASE.num_seqs} seqs, heads {PARITY_CASE.heads_label}):"
    )
    results = []
    for name, fn in functions.items():
        try:
            error = max_error(fn, expected, sm_scale)
            ok, shown = parity_passes({name: error}), f"{error:.1e}"
        except Exception as err:  # noqa: BLE001  (a failing implementation is a failed check)
            ok, shown = False, f"failed: {type(err).__name__}: {str(err).splitlines()[0]}"
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<14} {shown}")
        results.append((name, ok))
    x, y = jnp.arange(1024.0), jnp.ones(1024)
    ok = bool(jnp.array_equal(add_vectors(x, y, interpret=jax.default_backend() != "tpu"), x + y))
    print(f"  {'PASS' if ok else 'FAIL'}  add_vectors    notebook 07's first kernel: exact")
    return [*results, ("add_vectors", ok)]


# The engine check's model and stream: head_dim 128 and pages of 16 tokens, as the kernel runs
# on a TPU; a prompt longer than the step's budget (chunked), a short one and a one-token one.
ENGINE_CHECK = {"vocab_size": 128, "num_layers": 1, "num_q_heads": 4, "num_kv_heads": 2,
                "head_dim": 128}  # fmt: skip
ENGINE_CHECK_PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [2, 7], [1])
ENGINE_CHECK_TOKENS = 4


def engine_check() -> tuple[str, bool]:
    """A short stream through the serving engine with minilib's kernel as its attention
    (compiled on a TPU, where it is the engine's default; TPU interpret mode elsewhere), its
    tokens against `dense_generate`'s on the same platform: equal, token for token.
    ("engine", passed).

    >>> engine_check()  # doctest: +SKIP
    <BLANKLINE>
    engine: 3 requests through minilib's kernel (compiled (Mosaic, on the TPU)) ...
      PASS  engine == dense, token for token (12 tokens)
    ('engine', True)
    """
    from minilib.engine import Engine, ModelConfig, dense_generate, init_params
    from minilib.kernel import ragged_paged_attention

    config = ModelConfig(**ENGINE_CHECK)
    params = init_params(config, seed=0)
    print(
        f"\nengine: {len(ENGINE_CHECK_PROMPTS)} requests through minilib's kernel "
        f"({kernel_mode()}), {ENGINE_CHECK_TOKENS} greedy tokens each, against the dense model:"
    )
    try:
        engine = Engine(params, config, num_pages=8, page_size=16, max_num_batched_tokens=16,
                        max_num_seqs=4, attention=ragged_paged_attention)  # fmt: skip
        got = engine.generate(list(ENGINE_CHECK_PROMPTS), ENGINE_CHECK_TOKENS)
    except Exception as err:  # noqa: BLE001  (a failing engine is a failed check)
        print(f"  FAIL  failed: {type(err).__name__}: {str(err).splitlines()[0]}")
        return "engine", False
    want = [dense_generate(params, config, p, ENGINE_CHECK_TOKENS) for p in ENGINE_CHECK_PROMPTS]
    ok = got == want
    shown = f"{sum(map(len, got))} tokens" if ok else f"engine {got}, dense {want}"
    print(f"  {'PASS' if ok else 'FAIL'}  engine == dense, token for token ({shown})")
    return "engine", ok


def ladder_rungs() -> list[tuple[str, object, object]]:
    """[(rung, its checker, its solution)] for every rung of the ladder (`minilib.ladder`).

    >>> [(rung, solution.__module__) for rung, _, solution in ladder_rungs()][:2]
    [('rung 1', 'minilib.ladder.flash'), ('rung 2', 'minilib.ladder.scalar_prefetch')]
    """
    from minilib.exercises.ex07_flash import check_flash_attention
    from minilib.exercises.ex08_ladder import (
        check_double_buffered_decode,
        check_paged_decode_async_copy,
        check_paged_decode_attention,
        check_prefetching_decode,
    )
    from minilib.exercises.ex08_ragged import check_prefill_chunk, check_ragged_paged_attention
    from minilib.ladder.async_copy import paged_decode_attention_async_copy
    from minilib.ladder.double_buffer import paged_decode_attention_double_buffered
    from minilib.ladder.flash import flash_attention
    from minilib.ladder.prefetch import paged_decode_attention_prefetch
    from minilib.ladder.prefill_chunk import prefill_chunk_attention
    from minilib.ladder.ragged import ragged_paged_attention_ladder
    from minilib.ladder.scalar_prefetch import paged_decode_attention

    return [
        ("rung 1", check_flash_attention, flash_attention),
        ("rung 2", check_paged_decode_attention, paged_decode_attention),
        ("rung 3", check_paged_decode_async_copy, paged_decode_attention_async_copy),
        ("rung 4", check_double_buffered_decode, paged_decode_attention_double_buffered),
        ("rung 5", check_prefetching_decode, paged_decode_attention_prefetch),
        ("rung 6", check_prefill_chunk, prefill_chunk_attention),
        ("rung 7", check_ragged_paged_attention, ragged_paged_attention_ladder),
    ]


def ladder_checks(rungs=None) -> list[tuple[str, bool]]:
    """Every ladder solution (or those of `rungs`, from `ladder_rungs`) through its own checker:
    strict TPU interpret mode, then Mosaic's compile where libtpu is installed, as on a TPU VM.
    [(check, passed)].

    It runs the checkers, about a minute in interpret mode, so the example is not run:

    >>> ladder_checks(ladder_rungs()[4:5])  # doctest: +SKIP
    <BLANKLINE>
    ladder solutions, each by its checker:
      PASS  rung 5 paged_decode_attention_prefetch: Passed: prefetching_decode matches ...
            It lowers for v5e (bf16, 8 sequences, ...)
    [('rung 5 (paged_decode_attention_prefetch)', True)]
    """
    print("\nladder solutions, each by its checker:")
    results = []
    for rung, check, solution in ladder_rungs() if rungs is None else rungs:
        result = check(solution, verbose=False)
        lines = result.report.splitlines()
        print(f"  {'PASS' if result.passed else 'FAIL'}  {rung} {solution.__name__}: {lines[0]}")
        # Passed: only how it compiled ("Mosaic compiles it for v5e (...)"), without the why.
        for line in lines[1:] if not result.passed else [lines[-1].split(";")[0]]:
            print(f"        {line}")
        results.append((f"{rung} ({solution.__name__})", result.passed))
    return results


def warm_ms(fn, *args, reps: int) -> float:
    """The median milliseconds of `reps` warm calls of `fn(*args)`, after one call to compile
    (`minilib.perf.timing.timed_call` each; `time_implementation` would also time a cold
    start, after clearing JAX's caches).

    >>> warm_ms(jax.jit(jnp.sin), jnp.ones(8), reps=2) > 0
    True
    """
    from minilib.perf.timing import timed_call

    timed_call(fn, *args)
    return 1e3 * statistics.median(timed_call(fn, *args)[1] for _ in range(reps))


def timing_check(on_tpu: bool) -> tuple[str, bool]:
    """Time ours, JAX's kernel and v3 (where each runs here) on a decode, a mixed and a prefill
    batch: warm ms, and each over ours. ("timings", True unless a kernel failed)."""
    from minilib.perf.implementations import IMPLEMENTATIONS, prepare_implementation
    from minilib.tpu.v3 import v3_available

    case, reps = (TIMING_CASE, TPU_TIMING_REPS) if on_tpu else (PARITY_CASE, 1)
    backend = jax.default_backend()
    kernels, notes = {}, {}
    for impl in IMPLEMENTATIONS:
        if impl.name in ("kernel", "jax-kernel"):
            kernels[impl.name], notes[impl.name] = prepare_implementation(impl, backend)
    v3_ok, v3_reason = v3_available()
    if not on_tpu:
        v3_ok, v3_reason = False, "not timed: it runs only on a TPU"
    notes["v3"] = "" if v3_ok else v3_reason
    print(
        f"\ntimings: median of {reps} warm calls, ms; (x ours) = its time over ours, above 1 "
        f"when ours is faster. {case.num_seqs} seqs, heads {case.heads_label}, {case.dtype}, "
        f"at most {case.max_num_batched_tokens} q rows:"
    )
    print(f"  {'step':<8} {'sequences':<20} {'ours':>9} {'jax-kernel':>18} {'v3':>18}")
    ok = True
    for step, batch in self_check_batches(case).items():
        runs = {name: (fn, batch.args()) for name, fn in kernels.items() if fn is not None}
        if v3_ok:
            runs["v3"] = v3_run(batch)
        times = {}
        for name, (fn, args) in runs.items():
            try:
                times[name] = warm_ms(functools.partial(fn, sm_scale=case.heads[2] ** -0.5),
                                      *args, reps=reps)  # fmt: skip
            except Exception as err:  # noqa: BLE001  (a failing kernel is a failed check)
                notes[name] = f"failed: {type(err).__name__}: {str(err).splitlines()[0]}"
                ok = False
        ours = times.get("kernel", math.nan)
        cells = [f"{ours:9.3f}"]
        for name in ("jax-kernel", "v3"):
            cells.append(f"{times[name]:9.3f} ({times[name] / ours:.2f}x)" if name in times
                         else f"{'-':>18}")  # fmt: skip
        print(f"  {step:<8} {batch_label(batch):<20} {' '.join(cells)}")
    for name, note in notes.items():
        if note:
            print(f"  {name}: {note}")
    print(f"  the whole workload suite, each kernel at its own block sizes: {BENCH_TPU_COMMAND}")
    return "timings", ok


def batch_label(batch: RaggedBatch) -> str:
    """How many sequences of `batch` decode (q_len 1), and how many prefill (a prompt or a
    chunk of one).

    >>> batch_label(make_batch([(1, 9), (4, 4), (1, 3)]))
    '2 decode + 1 prefill'
    """
    decodes = sum(q_len == 1 for q_len, _ in batch.seq_lens)
    return f"{decodes} decode + {len(batch.seq_lens) - decodes} prefill"


def v3_run(batch: RaggedBatch):
    """(function, arguments) that run vLLM's v3 (`minilib.tpu.v3.rpa_v3`) on `batch`'s
    sequences, or None when v3 is not installed. Timed only, not compared: v3 keeps the cache
    in its own layout, here our pages reshaped to its shape, and the new tokens' K and V
    (zeros) apart. A decode-only batch goes to v3's decode kernel, any other to its mixed one.

    Needs v3, which runs only on a TPU, so the example is not run:

    >>> fn, args = v3_run(make_batch([(1, 9), (1, 3)]))  # doctest: +SKIP
    >>> len(args)  # doctest: +SKIP
    8
    """
    from minilib.tpu.kernel_costs import COMPARISON_KV_PAGES_PER_BLOCK, V3_VMEM_LIMIT_BYTES
    from minilib.tpu.v3 import load_v3, rpa_v3, v3_available

    if not v3_available()[0]:
        return None
    q, kv_pages, kv_lens, page_indices, cu_q_lens, _ = batch.args()
    num_pages, page_size, num_combined_kv_heads, head_dim = kv_pages.shape
    num_kv_heads, dtype = num_combined_kv_heads // 2, kv_pages.dtype
    cache_shape = load_v3().get_kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim, dtype)
    new_kv = jnp.zeros((q.shape[0], num_kv_heads, head_dim), dtype)
    # v3's distribution: sequences [0, d) decode only, [d, p) prefill only, [p, m) mixed.
    live = len(batch.seq_lens)
    d = live if all(q_len == 1 for q_len, _ in batch.seq_lens) else 0
    distribution = jnp.array([d, d, live], jnp.int32)
    args = (q, new_kv, new_kv, kv_pages.reshape(cache_shape), kv_lens, page_indices.reshape(-1),
            cu_q_lens, distribution)  # fmt: skip
    fn = jax.jit(
        rpa_v3,
        static_argnames=("sm_scale", "num_queries_per_block", "kv_tokens_per_block",
                         "vmem_limit_bytes"),
    )  # fmt: skip
    run = functools.partial(
        fn,
        num_queries_per_block=V3_QUERIES_PER_BLOCK,
        kv_tokens_per_block=COMPARISON_KV_PAGES_PER_BLOCK * page_size,
        vmem_limit_bytes=V3_VMEM_LIMIT_BYTES,
    )
    return run, args
