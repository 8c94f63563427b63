"""`python -m minilib bench`: time every ragged paged attention implementation on the same batches.

    python -m minilib bench --quick                       # one small case, about a minute on CPU
    python -m minilib bench --workload mixed --num-seqs 32
    python -m minilib bench --targets                     # the course's speed targets, PASS/FAIL
    python -m minilib bench --engine                      # serving engine vs dense, tokens/s
    python -m minilib bench --help

For each implementation and each case (workload x number of sequences x head config):

  first    the first call, compile included. `jax.clear_caches()` runs before it, so nothing
           compiled for an earlier row is reused. `xla_s` is the part spent in XLA's backend
           compiler, as JAX's own monitoring events report it.
  warm     the median of warm calls on the same batch: the steady-state time.
  new      the first call on a NEW mix of lengths with the same array shapes, and `new/warm`,
           its ratio to the next (warm) call on those lengths. An implementation compiled once
           per shape has a ratio near 1; one that retraces per mix of lengths (both references
           loop over sequences in Python) compiles again. `comp` counts XLA compilations during
           the first and the new call: the direct evidence of retracing.
  roofline `minilib.roofline`'s lower bound for the batch on this device (on a TPU, the chip's
           figures; on a CPU, its matmul FLOP/s and read bandwidth, measured in the same run),
           and the achieved bandwidth: the bytes the batch cannot avoid, over the warm time.

On a CPU, minilib's Pallas kernel runs in TPU interpret mode: right answers, not TPU speed, so
it is not a speed target and is not timed beside compiled code (`--interpret` times it in a
separate, labelled table). JAX's own kernel only runs on a TPU. On a TPU both kernels run on
the same batches in the same run.

The memory sweep compiles (without running) the gather-all jnp version and the blockwise one
for growing max_kv_len and reads XLA's `memory_analysis().temp_size_in_bytes`: the gather-all
version's working memory grows with the whole cache, the blockwise one's with its block sizes.

Results: a table on stdout, and plots in `--out-dir` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from minilib.batch import RaggedBatch, make_batch, random_seq_lens
from minilib.roofline import Chip, RPACost, batch_cost, detect_chip, roofline

# ---------------------------------------------------------------------------------------------
# What to run: data only.

# Workload name -> the fraction of its sequences that decode (q_len 1); the rest are prefills
# or prefill chunks, shrunk to fit the step's token budget (max_num_batched_tokens).
WORKLOADS: dict[str, float] = {"decode-heavy": 0.9, "mixed": 0.5, "prefill-heavy": 0.1}

# Head config name -> (num_q_heads, num_kv_heads, head_dim). `--heads 4/2/64` gives any other.
HEAD_CONFIGS: dict[str, tuple[int, int, int]] = {"gqa": (32, 8, 128), "mqa": (32, 1, 128)}

DEFAULT_NUM_SEQS = (8, 32, 128)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One ragged paged attention implementation, imported only when it is run."""

    name: str  # the name on the command line and in the table
    module: str
    attr: str
    mode: str  # "eager": Python loop over sequences; "jit": compiled once per shape; "pallas"
    needs_tpu: bool = False
    default: bool = True  # run unless --impls names it


IMPLEMENTATIONS: tuple[Implementation, ...] = (
    Implementation(
        "jax-ref",
        "jax.experimental.pallas.ops.tpu.ragged_paged_attention",
        "ref_ragged_paged_attention",
        "eager",
    ),
    # Same algorithm and cost as JAX's reference: left out by default to save minutes.
    Implementation(
        "minilib-ref", "minilib.reference", "ref_ragged_paged_attention", "eager", default=False
    ),
    Implementation("jnp", "minilib.vectorized", "ragged_paged_attention_jnp", "jit"),
    Implementation("blockwise", "minilib.blockwise", "ragged_paged_attention_blockwise", "jit"),
    Implementation("kernel", "minilib.kernel", "ragged_paged_attention", "pallas"),
    Implementation(
        "jax-kernel",
        "jax.experimental.pallas.ops.tpu.ragged_paged_attention",
        "ragged_paged_attention",
        "pallas",
        needs_tpu=True,
    ),
)

# Okabe-Ito: distinguishable with every common form of colour blindness.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442")


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One batch shape to time: a workload, a number of sequences, a head config."""

    workload: str
    num_seqs: int
    heads: tuple[int, int, int]  # num_q_heads, num_kv_heads, head_dim
    page_size: int = 16
    pages_per_seq: int = 64  # max kv_len = pages_per_seq * page_size
    max_num_batched_tokens: int = 1024
    dtype: str = "float32"

    @property
    def max_kv_len(self) -> int:
        return self.pages_per_seq * self.page_size

    @property
    def heads_label(self) -> str:
        return "/".join(str(h) for h in self.heads)

    def label(self) -> str:
        return f"{self.workload} {self.num_seqs} seqs {self.heads_label}"


# The course's speed-target case: a 32-sequence mixed step of a GQA model, kv lengths drawn
# uniformly from 1 to 1024 (pages_per_seq 64 of 16 tokens), at most 1024 q rows.
TARGET_CASE = BenchCase("mixed", 32, HEAD_CONFIGS["gqa"], 16, 64, 1024)


# ---------------------------------------------------------------------------------------------
# Batches.


def workload_seq_lens(
    workload: str, num_seqs: int, *, max_kv_len: int, max_num_batched_tokens: int, seed: int = 0
) -> list[tuple[int, int]]:
    """Random (q_len, kv_len) pairs for one step of a workload, within the token budget.

    >>> pairs = workload_seq_lens("decode-heavy", 8, max_kv_len=64, max_num_batched_tokens=32)
    >>> len(pairs), sum(q for q, _ in pairs) <= 32
    (8, True)
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown {workload=}: choose one of {sorted(WORKLOADS)}.")
    pairs = random_seq_lens(
        num_seqs, max_kv_len=max_kv_len, decode_fraction=WORKLOADS[workload], seed=seed
    )
    return fit_token_budget(pairs, max_num_batched_tokens)


def fit_token_budget(pairs, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """Shrink the q_lens longer than 1, in proportion, until all q rows fit the budget.

    A server's scheduler does the same: a prompt too long for this step is chunked.

    >>> fit_token_budget([(1, 9), (8, 8), (8, 16)], 9)
    [(1, 9), (4, 8), (4, 16)]
    """
    pairs = [(int(q), int(kv)) for q, kv in pairs]
    live = sum(1 for q, _ in pairs if q > 0)
    if live > max_num_batched_tokens:
        raise ValueError(
            f"{live} sequences with new tokens cannot fit {max_num_batched_tokens=}: "
            "raise max_num_batched_tokens or lower num_seqs."
        )
    total = sum(q for q, _ in pairs)
    if total <= max_num_batched_tokens:
        return pairs
    small = sum(q for q, _ in pairs if q <= 1)
    scale = (max_num_batched_tokens - small) / sum(q for q, _ in pairs if q > 1)
    pairs = [(max(1, int(q * scale)) if q > 1 else q, kv) for q, kv in pairs]
    while (excess := sum(q for q, _ in pairs) - max_num_batched_tokens) > 0:
        i = max(range(len(pairs)), key=lambda j: pairs[j][0])  # the longest q gives way
        q, kv = pairs[i]
        pairs[i] = (max(1, q - excess), kv)
    return pairs


def case_batches(case: BenchCase, seed: int = 0) -> tuple[RaggedBatch, RaggedBatch]:
    """Two batches of the case with the SAME array shapes and different lengths."""
    num_q_heads, num_kv_heads, head_dim = case.heads
    shapes = dict(
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=case.page_size,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_num_seqs=case.num_seqs,
        pages_per_seq=case.pages_per_seq,
        total_num_pages=case.num_seqs * case.pages_per_seq + 3,
        dtype=jnp.dtype(case.dtype),
    )
    batches = []
    for s in (seed, seed + 1):
        pairs = workload_seq_lens(
            case.workload,
            case.num_seqs,
            max_kv_len=case.max_kv_len,
            max_num_batched_tokens=case.max_num_batched_tokens,
            seed=s,
        )
        batches.append(make_batch(pairs, seed=s, **shapes))
    return batches[0], batches[1]


# ---------------------------------------------------------------------------------------------
# Implementations.


def load_implementation(impl: Implementation, backend: str):
    """(function, note). The function is None, and the note says why, when it cannot run here.

    On a CPU, a Pallas implementation is returned in TPU interpret mode, with a note saying so.
    """
    if impl.needs_tpu and backend != "tpu":
        return None, f"unavailable: needs a TPU (this is {backend})"
    try:
        fn = getattr(importlib.import_module(impl.module), impl.attr)
    except (ImportError, AttributeError) as err:
        return None, f"unavailable: {type(err).__name__}: {err}"
    if impl.mode == "pallas" and backend != "tpu":
        if "interpret" in inspect.signature(fn).parameters:
            fn = functools.partial(fn, interpret=True)
        return fn, f"TPU interpret mode on {backend}: correctness only, NOT a speed target"
    return fn, ""


# ---------------------------------------------------------------------------------------------
# Timing.

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compile_log = {"count": 0, "seconds": 0.0}


def _on_event_duration(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        _compile_log["count"] += 1
        _compile_log["seconds"] += duration


@functools.cache
def _listen_for_compiles() -> None:
    # Registered once per process (unregistering differs between JAX versions).
    jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


def timed_call(fn, *args, **kwargs):
    """(output, seconds, XLA compiles, XLA compile seconds) of one call, run to completion."""
    _listen_for_compiles()
    count, seconds = _compile_log["count"], _compile_log["seconds"]
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    elapsed = time.perf_counter() - start
    return out, elapsed, _compile_log["count"] - count, _compile_log["seconds"] - seconds


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one implementation on one case (see the module docstring)."""

    first_s: float  # first call, compile included
    first_compiles: int
    first_xla_s: float  # of first_s, the time in XLA's compiler
    warm_s: float  # median of warm calls
    warm_calls: int
    new_s: float  # one call on a new mix of lengths, same shapes (nan if not run)
    new_compiles: int
    new_warm_s: float  # the next call on those new lengths, now warm

    @property
    def new_over_warm(self) -> float:
        """The first call on new lengths over a warm call on the same lengths: about 1 when
        new lengths reuse the compile, far more when they retrace."""
        return self.new_s / self.new_warm_s


def time_implementation(
    fn, batch: RaggedBatch, new_batch: RaggedBatch | None, *, reps: int = 5,
    budget_s: float = 20.0, **kwargs
):  # fmt: skip
    """Time `fn` on `batch` cold, then warm, then twice on `new_batch` (first, then warm).
    Returns (Timing, the output on `batch`).

    Warm calls: `reps` of them, but no more than fit in `budget_s` once three are done.
    """
    jax.clear_caches()  # a cold start: nothing compiled by earlier rows is reused
    out, first_s, first_compiles, first_xla_s = timed_call(fn, *batch.args(), **kwargs)
    warm = []
    while len(warm) < reps and not (len(warm) >= 3 and sum(warm) > budget_s):
        warm.append(timed_call(fn, *batch.args(), **kwargs)[1])
    new_s, new_compiles, new_warm_s = math.nan, 0, math.nan
    if new_batch is not None:
        _, new_s, new_compiles, _ = timed_call(fn, *new_batch.args(), **kwargs)
        new_warm_s = timed_call(fn, *new_batch.args(), **kwargs)[1]
    timing = Timing(
        first_s=first_s,
        first_compiles=first_compiles,
        first_xla_s=first_xla_s,
        warm_s=statistics.median(warm),
        warm_calls=len(warm),
        new_s=new_s,
        new_compiles=new_compiles,
        new_warm_s=new_warm_s,
    )
    return timing, out


def measure_matmul_flops(n: int = 2048, dtype=jnp.float32, reps: int = 5) -> float:
    """This device's achievable matmul FLOP/s: the median of `reps` [n, n] @ [n, n] products."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, a))
    times = [timed_call(matmul, a, a)[1] for _ in range(reps)]
    return 2 * n**3 / statistics.median(times)


def measure_read_bandwidth(num_bytes: int = 256 * 2**20, reps: int = 5) -> float:
    """This device's achievable memory bandwidth, bytes/s: the sum of one big array.

    A read-only stream: writing a fresh output would time the allocator's page faults too.
    """
    x = jnp.ones(num_bytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    times = [timed_call(total, x)[1] for _ in range(reps)]
    return num_bytes / statistics.median(times)


def device_chip(dtype: str) -> Chip:
    """The roofline figures to compare against: the TPU's own, or this device, measured."""
    chip = detect_chip()
    if chip is not None:
        return chip
    device = jax.devices()[0]
    return Chip(
        f"{device.device_kind} ({device.platform}, measured: {dtype} matmul, array sum)",
        hbm_bytes_per_s=measure_read_bandwidth(),
        peak_flops_per_s=measure_matmul_flops(dtype=jnp.dtype(dtype)),
    )


# ---------------------------------------------------------------------------------------------
# The run.


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One implementation on one case: its timing, its error and its place on the roofline."""

    case: BenchCase
    impl: str
    note: str  # why it did not run, or how it ran (interpret mode)
    timing: Timing | None
    cost: RPACost
    chip: Chip
    max_err: float  # max |out - baseline| over the live rows; nan for the baseline itself

    @property
    def ok(self) -> bool:
        return self.timing is not None

    @property
    def tokens_per_s(self) -> float:
        return self.cost.num_tokens / self.timing.warm_s

    @property
    def achieved_bytes_per_s(self) -> float:
        """The bytes the batch cannot avoid, over the warm time."""
        return self.cost.bytes / self.timing.warm_s

    @property
    def roofline_fraction(self) -> float:
        """The roofline lower bound over the warm time: 1.0 would be perfect."""
        return roofline(self.cost, self.chip).time_s / self.timing.warm_s

    @property
    def flop_bound_multiple(self) -> float:
        """Warm time over the useful-FLOP bound (useful FLOPs / peak FLOP/s)."""
        return self.timing.warm_s / (self.cost.flops / self.chip.peak_flops_per_s)


def run_bench(
    cases, impl_names=None, *, reps: int = 5, interpret: bool = False, chip: Chip | None = None,
    log=print
) -> list[BenchRow]:  # fmt: skip
    """Time every implementation on every case. Implementations that cannot run here, or fail,
    get a row with the reason in `note` and no timing."""
    backend = jax.default_backend()
    chosen = [
        impl
        for impl in IMPLEMENTATIONS
        if (impl.default if impl_names is None else impl.name in impl_names)
    ]
    chip = chip or device_chip(cases[0].dtype)
    rows = []
    for case in cases:
        batch, new_batch = case_batches(case)
        sm_scale = case.heads[2] ** -0.5
        cost = batch_cost(batch)
        baseline = None
        for impl in chosen:
            fn, note = load_implementation(impl, backend)
            if fn is not None and impl.mode == "pallas" and backend != "tpu" and not interpret:
                fn, note = None, f"not timed: {note} (pass --interpret to time it apart)"
            timing, err = None, math.nan
            if fn is not None:
                log(f"  {case.label()}: {impl.name} ...", file=sys.stderr, flush=True)
                try:
                    timing, out = time_implementation(
                        fn, batch, new_batch, reps=reps, sm_scale=sm_scale
                    )
                    live = np.asarray(out[: batch.num_tokens], np.float32)
                    if baseline is None:
                        baseline = (impl.name, live)
                    else:
                        err = float(np.max(np.abs(live - baseline[1])))
                        note = note or f"err vs {baseline[0]}"
                except Exception as error:  # noqa: BLE001  (a failing implementation is a row)
                    note = f"failed: {type(error).__name__}: {str(error).splitlines()[0]}"
            rows.append(BenchRow(case, impl.name, note, timing, cost, chip, err))
    return rows


def is_interpreted(row: BenchRow) -> bool:
    return "interpret mode" in row.note and row.ok


def format_table(rows: list[BenchRow]) -> str:
    """The rows as a text table: compiled/eager rows first, interpret-mode rows apart."""
    header = (
        f"{'case':32s} {'impl':12s} {'first_s':>8s} {'xla_s':>6s} {'comp':>5s} "
        f"{'warm_ms':>9s} {'new_ms':>9s} {'new/warm':>8s} {'comp':>5s} {'tok/s':>9s} "
        f"{'GB/s':>7s} {'%BW':>6s} {'%roof':>6s} {'max_err':>8s}  note"
    )
    lines = []
    sections = [
        ("", [r for r in rows if not is_interpreted(r)]),
        (
            "TPU INTERPRET MODE (Pallas kernel simulated on CPU): correctness only, NOT a "
            "speed target; do not compare these times with the rows above",
            [r for r in rows if is_interpreted(r)],
        ),
    ]
    for title, section in sections:
        if not section:
            continue
        if title:
            lines += ["", title]
        lines += [header, "-" * len(header)]
        for r in section:
            lines.append(format_row(r))
    return "\n".join(lines)


def format_row(r: BenchRow) -> str:
    head = f"{r.case.label():32s} {r.impl:12s}"
    if not r.ok:
        return f"{head} {r.note}"
    t = r.timing
    err = "-" if math.isnan(r.max_err) else f"{r.max_err:.1e}"
    return (
        f"{head} {t.first_s:8.2f} {t.first_xla_s:6.2f} {t.first_compiles:5d} "
        f"{t.warm_s * 1e3:9.1f} {t.new_s * 1e3:9.1f} {t.new_over_warm:8.1f} {t.new_compiles:5d} "
        f"{r.tokens_per_s:9.0f} {r.achieved_bytes_per_s / 1e9:7.1f} "
        f"{100 * r.achieved_bytes_per_s / r.chip.hbm_bytes_per_s:6.2f} "
        f"{100 * r.roofline_fraction:6.2f} {err:>8s}  {r.note}"
    )


def describe_chip(chip: Chip) -> str:
    return (
        f"roofline device: {chip.name}: {chip.hbm_bytes_per_s / 1e9:.1f} GB/s, "
        f"{chip.peak_flops_per_s / 1e12:.3f} TFLOP/s, ridge {chip.ridge_point:.1f} FLOP/byte"
    )


TABLE_KEY = """\
columns: first_s = first call incl. compile (after jax.clear_caches()); xla_s = of which XLA
compiling; comp = XLA compilations (first call, then new-lengths call); warm_ms = median warm
call; new_ms = first call on a new mix of lengths, same shapes; new/warm = that over the next
(warm) call on the same new lengths: about 1 if compiled once per shape, >> 1 if retracing;
tok/s = live q rows / warm time; GB/s = unavoidable bytes (q, whole KV pages, out) / warm time;
%BW = that over the device's bandwidth; %roof = roofline lower bound / warm time;
max_err = max |out - first timed impl's out| on the live rows."""


# ---------------------------------------------------------------------------------------------
# Working memory as max_kv_len grows.


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    impl: str
    max_kv_len: int
    temp_bytes: float  # XLA's temp buffers of the compiled call; nan if not reported
    kv_cache_bytes: int  # the kv_pages argument, for scale


def compiled_temp_bytes(fn, case: BenchCase) -> float:
    """`temp_size_in_bytes` of `fn` compiled for the case's shapes (nothing is allocated)."""
    num_q_heads, num_kv_heads, head_dim = case.heads
    dtype = jnp.dtype(case.dtype)
    i32 = jnp.int32
    args = (
        jax.ShapeDtypeStruct((case.max_num_batched_tokens, num_q_heads, head_dim), dtype),
        jax.ShapeDtypeStruct(
            (case.num_seqs * case.pages_per_seq, case.page_size, 2 * num_kv_heads, head_dim),
            dtype,
        ),
        jax.ShapeDtypeStruct((case.num_seqs,), i32),
        jax.ShapeDtypeStruct((case.num_seqs, case.pages_per_seq), i32),
        jax.ShapeDtypeStruct((case.num_seqs + 1,), i32),
        jax.ShapeDtypeStruct((1,), i32),
    )
    compiled = jax.jit(functools.partial(fn, sm_scale=head_dim**-0.5)).lower(*args).compile()
    analysis = compiled.memory_analysis()
    return math.nan if analysis is None else float(analysis.temp_size_in_bytes)


def memory_sweep(
    max_kv_lens, impl_names=("jnp", "blockwise", "kernel", "jax-kernel"), *,
    base: BenchCase = TARGET_CASE, log=print
) -> tuple[list[MemoryPoint], list[str]]:  # fmt: skip
    """Compiled working memory of each implementation as max_kv_len grows. Returns the points
    and notes on the implementations left out (unavailable, or interpreted: an interpreter's
    buffers say nothing about the kernel's memory on a TPU)."""
    backend = jax.default_backend()
    points, notes = [], []
    for impl in IMPLEMENTATIONS:
        if impl.name not in impl_names:
            continue
        fn, note = load_implementation(impl, backend)
        if fn is None or (impl.mode == "pallas" and backend != "tpu"):
            notes.append(f"{impl.name}: {note or 'skipped'}")
            continue
        for max_kv_len in max_kv_lens:
            case = dataclasses.replace(base, pages_per_seq=max(1, max_kv_len // base.page_size))
            log(f"  memory: {impl.name} max_kv_len={max_kv_len} ...", file=sys.stderr, flush=True)
            try:
                temp = compiled_temp_bytes(fn, case)
            except Exception as error:  # noqa: BLE001
                notes.append(f"{impl.name} at max_kv_len={max_kv_len}: failed: {error}")
                continue
            num_q, num_kv, head_dim = case.heads
            cache = (
                case.num_seqs * case.pages_per_seq * case.page_size * 2 * num_kv * head_dim
            ) * jnp.dtype(case.dtype).itemsize
            points.append(MemoryPoint(impl.name, case.max_kv_len, temp, cache))
    return points, notes


def format_memory_table(points: list[MemoryPoint], notes: list[str]) -> str:
    lines = [f"{'impl':12s} {'max_kv_len':>10s} {'temp_MiB':>10s} {'kv_cache_MiB':>12s}"]
    for p in points:
        lines.append(
            f"{p.impl:12s} {p.max_kv_len:10d} {p.temp_bytes / 2**20:10.1f} "
            f"{p.kv_cache_bytes / 2**20:12.1f}"
        )
    return "\n".join(lines + [f"  ({note})" for note in notes])


# ---------------------------------------------------------------------------------------------
# Plots.


def plot_times(rows: list[BenchRow], path: Path) -> Path:
    """Three panels, first call / warm call / new-lengths call, log scale, one bar per impl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.ok and not is_interpreted(r)]
    cases = list(dict.fromkeys(r.case.label() for r in timed))
    impls = list(dict.fromkeys(r.impl for r in timed))
    panels = [
        ("first call, compile included", "seconds", lambda t: t.first_s),
        ("warm call (median)", "milliseconds", lambda t: t.warm_s * 1e3),
        ("new mix of lengths, same shapes", "milliseconds", lambda t: t.new_s * 1e3),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(6 + 1.6 * len(cases) * 3, 4.8), squeeze=False)
    width = 0.8 / max(len(impls), 1)
    for ax, (title, unit, value) in zip(axes[0], panels, strict=True):
        for k, impl in enumerate(impls):
            xs, ys = [], []
            for i, case in enumerate(cases):
                for r in timed:
                    if r.impl == impl and r.case.label() == case:
                        xs.append(i + (k - (len(impls) - 1) / 2) * width)
                        ys.append(value(r.timing))
            bars = ax.bar(xs, ys, width, label=impl, color=PALETTE[k % len(PALETTE)])
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([c.replace(" seqs ", " seqs\n") for c in cases], fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(unit + " (log scale)")
        ax.set_xlabel("workload, sequences, heads q/kv/dim")
    axes[0][0].legend(title="implementation")
    device = jax.devices()[0]
    fig.suptitle(f"Ragged paged attention on {device.device_kind} ({device.platform})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(points: list[MemoryPoint], path: Path) -> Path:
    """Working memory (XLA temp) against max_kv_len, with the KV cache's own size for scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    impls = list(dict.fromkeys(p.impl for p in points))
    for k, impl in enumerate(impls):
        mine = [p for p in points if p.impl == impl]
        ax.plot(
            [p.max_kv_len for p in mine],
            [p.temp_bytes / 2**20 for p in mine],
            marker="o",
            color=PALETTE[k % len(PALETTE)],
            label=f"{impl}: temp memory",
        )
    cache = {p.max_kv_len: p.kv_cache_bytes / 2**20 for p in points}
    ax.plot(list(cache), list(cache.values()), "k--", label="the KV cache itself (argument)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(cache), [str(n) for n in cache])
    ax.set_yscale("symlog", linthresh=1.0)  # linear below 1 MiB, so that 0 can be shown
    ax.set_ylim(bottom=0)
    ax.set_xlabel("max_kv_len = pages_per_seq * page_size (log scale)")
    ax.set_ylabel("MiB (log scale above 1)")
    ax.set_title("Working memory of one compiled call as max_kv_len grows")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# The course's speed targets.


@dataclasses.dataclass(frozen=True)
class TargetResult:
    name: str
    passed: bool | None  # None: reported, not judged
    detail: str

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "INFO"}[self.passed]
        return f"{verdict}  {self.name}: {self.detail}"


def check_targets(case: BenchCase = TARGET_CASE, *, reps: int = 5, log=print):
    """Run the speed targets on `case`, all ratios from this one run. Returns the results.

    1. jnp's first call (compile included) >= 5x faster than JAX's reference's first call;
    2. no retrace on new lengths: jnp's (and blockwise's) new-lengths call <= 3x its warm call;
    3. jnp warm no slower than JAX's reference warm;
    4. blockwise warm >= 3x faster than JAX's reference warm;
    and, reported: how far blockwise's warm time is above the useful-FLOP bound of this device
    (useful FLOPs / a big matmul's FLOP/s, measured in the same run).
    """
    chip = device_chip(case.dtype)
    log(describe_chip(chip))
    rows = run_bench([case], ["jax-ref", "jnp", "blockwise"], reps=reps, chip=chip, log=log)
    log(format_table(rows))
    by_name = {r.impl: r for r in rows}
    results = []

    def judge(name, needs, ok, detail):
        missing = [n for n in needs if not by_name[n].ok]
        if missing:
            notes = "; ".join(f"{n}: {by_name[n].note}" for n in missing)
            results.append(TargetResult(name, False, f"could not measure ({notes})"))
        else:
            results.append(TargetResult(name, ok(), detail()))

    t = {n: r.timing for n, r in by_name.items()}
    judge(
        "jnp first call >= 5x faster than JAX's reference (compile included)",
        ["jax-ref", "jnp"],
        lambda: t["jax-ref"].first_s / t["jnp"].first_s >= 5,
        lambda: (
            f"{t['jax-ref'].first_s / t['jnp'].first_s:.1f}x "
            f"(jax-ref {t['jax-ref'].first_s:.2f} s, jnp {t['jnp'].first_s:.2f} s)"
        ),
    )
    for name in ("jnp", "blockwise"):
        judge(
            f"{name}: no retrace on new lengths (new-lengths call <= 3x warm call)",
            [name],
            lambda n=name: t[n].new_over_warm <= 3,
            lambda n=name: (
                f"{t[n].new_over_warm:.2f}x (first call on new lengths "
                f"{t[n].new_s * 1e3:.1f} ms, warm call on them {t[n].new_warm_s * 1e3:.1f} ms, "
                f"{t[n].new_compiles} XLA compiles on new lengths)"
            ),
        )
    judge(
        "jnp warm no slower than JAX's reference warm",
        ["jax-ref", "jnp"],
        lambda: t["jax-ref"].warm_s / t["jnp"].warm_s >= 1,
        lambda: (
            f"{t['jax-ref'].warm_s / t['jnp'].warm_s:.2f}x "
            f"(jax-ref {t['jax-ref'].warm_s * 1e3:.1f} ms, jnp {t['jnp'].warm_s * 1e3:.1f} ms)"
        ),
    )
    judge(
        "blockwise warm >= 3x faster than JAX's reference warm",
        ["jax-ref", "blockwise"],
        lambda: t["jax-ref"].warm_s / t["blockwise"].warm_s >= 3,
        lambda: (
            f"{t['jax-ref'].warm_s / t['blockwise'].warm_s:.2f}x (jax-ref "
            f"{t['jax-ref'].warm_s * 1e3:.1f} ms, blockwise {t['blockwise'].warm_s * 1e3:.1f} ms)"
        ),
    )
    if by_name["blockwise"].ok:
        row = by_name["blockwise"]
        bound_s = row.cost.flops / chip.peak_flops_per_s
        results.append(
            TargetResult(
                "blockwise against the useful-FLOP bound of this device",
                None,
                f"{row.flop_bound_multiple:.1f}x the bound (warm {row.timing.warm_s * 1e3:.1f} "
                f"ms; bound {bound_s * 1e3:.1f} ms = {row.cost.flops / 1e9:.2f} useful GFLOP / "
                f"{chip.peak_flops_per_s / 1e9:.1f} GFLOP/s measured matmul)",
            )
        )
    return results + check_tpu_targets(case, reps=reps, log=log) + check_static_targets()


def check_static_targets() -> list[TargetResult]:
    """The kernel's static TPU targets (compiled bundles and spills against JAX's kernel, on
    any host with libtpu): see `minilib.kernel_costs.static_targets`."""
    from minilib.kernel_costs import static_targets

    return [TargetResult(name, passed, detail) for name, passed, detail in static_targets()]


# The TPU targets: the mixed case of the speed targets, and a decode-heavy step of the same
# shapes, in bfloat16 (the dtype served on TPUs).
TPU_MIXED_CASE = dataclasses.replace(TARGET_CASE, dtype="bfloat16")
TPU_DECODE_CASE = dataclasses.replace(TPU_MIXED_CASE, workload="decode-heavy")


def check_tpu_targets(case: BenchCase = TARGET_CASE, *, reps: int = 5, log=print, backend=None):
    """On a TPU: our kernel within 10% of JAX's kernel throughput on the mixed case, and at
    least 70% of the HBM roofline on the decode-heavy case, both from this run. Elsewhere the
    targets are listed as not measured (the kernel runs in interpret mode off a TPU)."""
    backend = jax.default_backend() if backend is None else backend
    names = (
        "kernel throughput >= 90% of JAX's kernel (mixed, bfloat16)",
        "kernel >= 70% of the HBM roofline (decode-heavy, bfloat16)",
    )
    if backend != "tpu":
        return [
            TargetResult(name, None, f"not measured: needs a TPU (backend here: {backend})")
            for name in names
        ]
    chip = device_chip("bfloat16")
    rows = run_bench([TPU_MIXED_CASE], ["kernel", "jax-kernel"], reps=reps, chip=chip, log=log)
    rows += run_bench([TPU_DECODE_CASE], ["kernel"], reps=reps, chip=chip, log=log)
    log(format_table(rows))
    ours, theirs, decode = rows
    results = []
    if ours.ok and theirs.ok:
        ratio = ours.tokens_per_s / theirs.tokens_per_s
        results.append(
            TargetResult(
                names[0],
                ratio >= 0.9,
                f"{ratio:.1%} ({ours.tokens_per_s:,.0f} against {theirs.tokens_per_s:,.0f} tok/s)",
            )
        )
    else:
        results.append(TargetResult(names[0], False, f"{ours.note or theirs.note}"))
    if decode.ok:
        fraction = decode.roofline_fraction
        results.append(
            TargetResult(
                names[1],
                fraction >= 0.7,
                f"{fraction:.1%} of the roofline ({decode.achieved_bytes_per_s / 1e9:.0f} GB/s "
                f"of {chip.hbm_bytes_per_s / 1e9:.0f} GB/s on {chip.name})",
            )
        )
    else:
        results.append(TargetResult(names[1], False, decode.note))
    return results


# ---------------------------------------------------------------------------------------------
# Command line.


def parse_heads(text: str) -> tuple[int, int, int]:
    """'gqa', 'mqa', or 'num_q_heads/num_kv_heads/head_dim' such as '4/2/64'."""
    if text in HEAD_CONFIGS:
        return HEAD_CONFIGS[text]
    try:
        num_q_heads, num_kv_heads, head_dim = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--heads {text!r}: give one of {sorted(HEAD_CONFIGS)} or Q/KV/DIM such as 32/8/128"
        ) from None
    return num_q_heads, num_kv_heads, head_dim


def comma_list(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minilib bench",
        description="Time the ragged paged attention implementations; see minilib/bench.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="one small mixed case, 8 sequences")
    p.add_argument("--targets", action="store_true", help="run the speed targets (PASS/FAIL)")
    p.add_argument("--workload", type=comma_list(str), default=list(WORKLOADS), help="comma list")
    p.add_argument("--num-seqs", type=comma_list(int), default=list(DEFAULT_NUM_SEQS))
    p.add_argument(
        "--heads", type=comma_list(parse_heads), default=["gqa", "mqa"],
        help="comma list of gqa (32/8/128), mqa (32/1/128) or Q/KV/DIM",
    )  # fmt: skip
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pages-per-seq", type=int, default=64, help="max kv_len / page_size")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument(
        "--dtype", default=None, help="q and KV dtype (default: bfloat16 on TPU, else float32)"
    )
    p.add_argument(
        "--impls", type=comma_list(str), default=None,
        help="comma list of " + ",".join(i.name for i in IMPLEMENTATIONS)
        + " (default: all but minilib-ref)",
    )  # fmt: skip
    p.add_argument("--reps", type=int, default=5, help="warm calls per implementation")
    p.add_argument(
        "--interpret", action="store_true", help="off TPU, also time the interpreted kernel"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory sweep")
    p.add_argument(
        "--max-kv-lens", type=comma_list(int), default=[256, 1024, 4096, 16384],
        help="the memory sweep's max_kv_len values",
    )  # fmt: skip
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--engine", action="store_true",
        help="engine workload: minilib.engine against dense_generate one request at a time",
    )  # fmt: skip
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    return p


def cases_from_args(args) -> list[BenchCase]:
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "tpu" else "float32")
    heads = [HEAD_CONFIGS[h] if isinstance(h, str) else h for h in args.heads]
    for w in args.workload:
        if w not in WORKLOADS:
            raise SystemExit(f"--workload {w!r}: choose from {', '.join(WORKLOADS)}")
    return [
        BenchCase(w, n, h, args.page_size, args.pages_per_seq, args.max_num_batched_tokens, dtype)
        for h in heads
        for w in args.workload
        for n in args.num_seqs
    ]


def apply_quick(args) -> None:
    """--quick: one small case (mixed, 8 sequences, GQA, max kv_len 256), short sweep."""
    args.workload, args.num_seqs, args.heads = ["mixed"], [8], ["gqa"]
    args.pages_per_seq, args.max_num_batched_tokens, args.reps = 16, 256, 3
    args.max_kv_lens = [256, 1024, 4096]


def main(argv: list[str] | None = None) -> int:
    """The command line. Returns the exit code: 0, or 1 when a speed target fails."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
    if args.impls is not None:
        unknown = set(args.impls) - {i.name for i in IMPLEMENTATIONS}
        if unknown:
            known = ", ".join(i.name for i in IMPLEMENTATIONS)
            print(f"unknown --impls {sorted(unknown)}: choose from {known}", file=sys.stderr)
            return 2
    if args.engine:  # the serving engine's throughput (minilib/engine/throughput.py)
        from minilib.engine.throughput import engine_bench

        print(engine_bench(reps=args.reps).describe())
        return 0
    if args.targets:
        case = dataclasses.replace(TARGET_CASE, dtype=cases_from_args(args)[0].dtype)
        print(f"speed targets on: {case}  (timings are noisy on a shared machine)")
        results = check_targets(case, reps=args.reps)
        print("\n".join(r.line() for r in results))
        return 0 if all(r.passed is not False for r in results) else 1
    if args.quick:
        apply_quick(args)
    cases = cases_from_args(args)
    chip = device_chip(cases[0].dtype)
    print(describe_chip(chip))
    if device.platform != "tpu":
        print(
            "note: on CPU, minilib's Pallas kernel runs in TPU interpret mode and is NOT a speed "
            "target; JAX's kernel needs a TPU."
        )
    rows = run_bench(cases, args.impls, reps=args.reps, interpret=args.interpret, chip=chip)
    print(format_table(rows))
    print(TABLE_KEY)
    if not args.no_plot:
        path = plot_times(rows, args.out_dir / f"bench_{device.platform}.png")
        print(f"plot: {path.resolve()}")
    if not args.no_memory:
        base = dataclasses.replace(cases[0], workload="mixed")
        points, notes = memory_sweep(args.max_kv_lens, base=base)
        print(f"\nworking memory of one compiled call, {base.num_seqs} sequences, heads "
              f"{base.heads_label}, {base.dtype}:")  # fmt: skip
        print(format_memory_table(points, notes))
        if points and not args.no_plot:
            path = plot_memory(points, args.out_dir / f"memory_{device.platform}.png")
            print(f"plot: {path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
