"""`python -m minilib bench --tpu`: our kernel, JAX's and vLLM's RPA v3 timed on the workload
suite, on the TPU this runs on, in a markdown table to paste into an issue.

    python -m minilib bench --tpu                          # on a TPU: every workload
    python -m minilib bench --tpu --reps 20 --suite-workloads decode,mixed
    python -m minilib bench --tpu --interpret              # off a TPU: the harness, on a CPU

The workloads are `minilib.tpu.suite.SUITE`'s, the ones `python -m minilib compile --workloads`
compiles, with the same shapes (`Workload.specs`) and tables (`Workload.tables`), and each
kernel is called as that command compiles it (`minilib.tpu.at_defaults`), at its own block sizes:

  ours        `at_defaults.ours_whole_call`: attention alone, like JAX's kernel (ours/JAX)
  ours fused  `at_defaults.ours_fused_call`: also writing the new tokens' K/V into the cache,
              donated, as v3 does: ours/v3 is ours fused over v3
  JAX         JAX's `ragged_paged_attention` without block sizes: it picks its own tuned ones
  v3          `at_defaults.v3_whole_call`: vLLM's RPA v3 at its own block sizes, where its
              wheel is fetched (`minilib.tpu.v3`); the cache in its layout, donated

Each kernel gets its own arrays (random, seed 0: the time depends on shapes, not values),
runs `WARMUP_CALLS` untimed calls (the first compiles), then `reps` timed calls, each run to
completion; the table gives the median of the timed calls (`time_repeats`). A donated cache is
replaced, after each call, by the one the call returned. Nothing is compared here: parity on
the chip is `python -m minilib doctor --tpu`'s.

Off a TPU, `--interpret` runs the same harness in TPU interpret mode on a CPU, on small
versions of the workloads (`small_workload`): ours and ours fused run; JAX's kernel and v3
take no interpret flag and are compiled for a TPU only, so their cells say so. Those times
are a CPU simulating a TPU and mean nothing for a TPU.

What was tested on a CPU (tests/perf/test_tpu_bench.py): the whole harness in interpret mode
on tiny workloads (every kernel that can run there ran, the table's shape), the median and
the warm-up with a fake clock, the message without a TPU; and, where libtpu is installed,
that the bench's calls of a full-size workload compile for a compile-only v5e. Not tested on a
CPU: a run on a TPU, JAX's kernel or v3 running, any time measured.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from minilib.doctor import package_version
from minilib.tpu import at_defaults
from minilib.tpu.kernel_costs import rpa_function
from minilib.tpu.suite import SUITE, Workload

__all__ = [
    "Cell",
    "KernelCall",
    "Samples",
    "format_report",
    "kernel_calls",
    "run_suite_bench",
    "small_workload",
    "time_repeats",
    "workload_arrays",
]

COMMAND = "python -m minilib bench --tpu"
WARMUP_CALLS = 3
KERNELS = ("ours", "ours fused", "JAX", "v3")
SMALL_SCALE = 32  # interpret mode: every length over 32 (rounded up)
SMALL_SEQS_PER_KIND = 2  # interpret mode: at most two decode sequences and two others
TPU_ONLY = "compiled for a TPU only (it takes no interpret flag): not run in interpret mode"


# Timing: warm-up calls, then the median of timed ones. ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Samples:
    """The seconds of each timed call of a kernel, after `warmup` untimed calls.

    >>> Samples(warmup=3, seconds=(0.5, 0.1, 0.2)).median_s
    0.2
    """

    warmup: int
    seconds: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def time_repeats(call_once, *, warmup: int, reps: int, clock=time.perf_counter) -> Samples:
    """Call `call_once()` `warmup` times untimed, then `reps` times, each timed by `clock`
    (`call_once` must wait for its result: `jax.block_until_ready`).

    A fake clock shows what is measured: each timed call is two readings, none in warm-up.

    >>> readings = iter([10.0, 10.5, 20.0, 20.1, 30.0, 30.2])
    >>> samples = time_repeats(lambda: None, warmup=2, reps=3, clock=lambda: next(readings))
    >>> [round(s, 3) for s in samples.seconds], round(samples.median_s, 3)
    ([0.5, 0.1, 0.2], 0.2)
    """
    for _ in range(warmup):
        call_once()
    seconds = []
    for _ in range(reps):
        start = clock()
        call_once()
        seconds.append(clock() - start)
    return Samples(warmup, tuple(seconds))


# The workloads' arrays, and each kernel's call. -------------------------------------------------


def small_workload(workload: Workload) -> Workload:
    """A small version of `workload` for interpret mode on a CPU: one KV head (and its group of
    q heads), at most `SMALL_SEQS_PER_KIND` decode sequences and as many others, every length
    (and the sliding window) over `SMALL_SCALE`, rounded up. Same head_dim, dtypes and options.

    >>> w = small_workload(SUITE["gpt-oss"])
    >>> w.seqs, w.model.num_q_heads, w.model.num_kv_heads, w.model.sliding_window
    (((1, 64), (1, 64), (8, 32), (8, 32)), 8, 1, 4)
    """
    m = workload.model
    window = None if m.sliding_window is None else -(-m.sliding_window // SMALL_SCALE)
    group = m.num_q_heads // m.num_kv_heads
    model = dataclasses.replace(m, num_q_heads=group, num_kv_heads=1, sliding_window=window)
    decodes = [seq for seq in workload.seqs if seq[0] == 1][:SMALL_SEQS_PER_KIND]
    others = [seq for seq in workload.seqs if seq[0] > 1][:SMALL_SEQS_PER_KIND]
    seqs = tuple((-(-q // SMALL_SCALE), -(-kv // SMALL_SCALE)) for q, kv in decodes + others)
    return Workload(f"{workload.name}, small", seqs, model)


def workload_arrays(workload: Workload, *, whole_cache: bool = True, seed: int = 0) -> dict:
    """The arrays of one call on `workload`, by name: q, kv_pages, the tables, the new tokens'
    K and V (in q's dtype, as the model makes them), the attention sinks (zeros) and v3's
    distribution. The cache has `Workload.specs`' pages (at least 8192, so that it stays in
    HBM), or with `whole_cache=False` only the pages the batch uses.

    >>> a = workload_arrays(small_workload(SUITE["mixed"]), whole_cache=False)
    >>> a["q"].shape, a["kv_pages"].shape, a["new_keys"].shape, a["cu_q_lens"].tolist()
    ((18, 4, 128), (16, 16, 2, 128), (18, 1, 128), [0, 1, 2, 10, 18])
    """
    q_spec, kv_spec = workload.specs()[:2]
    num_pages = kv_spec.shape[0] if whole_cache else len(workload.seqs) * workload.pages_per_seq
    kv_lens, page_indices, cu_q_lens, num_seqs = workload.tables()
    new_kv_shape = (q_spec.shape[0], kv_spec.shape[2] // 2, q_spec.shape[2])
    keys = jax.random.split(jax.random.key(seed), 4)
    return {
        "q": random_array(keys[0], q_spec.shape, q_spec.dtype),
        "kv_pages": random_array(keys[1], (num_pages, *kv_spec.shape[1:]), kv_spec.dtype),
        "kv_lens": jnp.asarray(kv_lens),
        "page_indices": jnp.asarray(page_indices),
        "cu_q_lens": jnp.asarray(cu_q_lens),
        "num_seqs": jnp.asarray(num_seqs),
        "new_keys": random_array(keys[2], new_kv_shape, q_spec.dtype),
        "new_values": random_array(keys[3], new_kv_shape, q_spec.dtype),
        "sinks": jnp.zeros((q_spec.shape[1],), jnp.float32),
        "distribution": jnp.asarray(workload.distribution(), jnp.int32),
    }


def random_array(key, shape, dtype) -> jax.Array:
    """Standard normal values in `dtype` (drawn in float32: fp8 has no sampler of its own)."""
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


TABLES = ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")


def sink_argument(a: dict, sinks: bool) -> tuple:
    """(the sinks,) for a layer with attention sinks, else ()."""
    if sinks:
        return (a["sinks"],)
    return ()


def ours_arguments(a: dict, *, sinks: bool) -> tuple:
    """`at_defaults.ours_whole_call`'s: JAX's six arguments, then the sinks if any."""
    return (a["q"], a["kv_pages"], *(a[name] for name in TABLES), *sink_argument(a, sinks))


def fused_arguments(a: dict, *, sinks: bool) -> tuple:
    """`at_defaults.ours_fused_call`'s: JAX's six, the new K and V, then the sinks if any."""
    six = (a["q"], a["kv_pages"], *(a[name] for name in TABLES))
    return (*six, a["new_keys"], a["new_values"], *sink_argument(a, sinks))


def jax_arguments(a: dict) -> tuple:
    """JAX's kernel's six arguments."""
    return (a["q"], a["kv_pages"], *(a[name] for name in TABLES))


def v3_arguments(a: dict) -> tuple:
    """`at_defaults.v3_whole_call`'s: q, the new K and V, the cache in v3's layout (our pages
    reshaped: the same bytes), the tables (the page table flat) and the distribution."""
    from minilib.tpu.v3 import load_v3

    num_pages, page_size, combined_heads, head_dim = a["kv_pages"].shape
    dtype = a["kv_pages"].dtype
    kv_heads = combined_heads // 2
    shape = load_v3().get_kv_cache_shape(num_pages, page_size, kv_heads, head_dim, dtype)
    cache = a["kv_pages"].reshape(shape)
    page_indices = a["page_indices"].reshape(-1)
    new = (a["new_keys"], a["new_values"])
    return (a["q"], *new, cache, a["kv_lens"], page_indices, a["cu_q_lens"], a["distribution"])


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One kernel's call on a workload: `fn(*arguments(workload_arrays(...)))`, or, where it
    cannot run here, no `fn` and the reason in `note`. `donate`: the position of the cache
    when the call writes it (donated, and returned second).

    >>> calls = kernel_calls(SUITE["gpt-oss"])
    >>> [(c.kernel, c.fn is not None) for c in calls]
    [('ours', True), ('ours fused', True), ('JAX', False), ('v3', False)]
    >>> calls[2].note
    "JAX's kernel takes no attention sinks"
    """

    kernel: str
    fn: Callable | None
    arguments: Callable[[dict], tuple] | None
    donate: int | None = None
    note: str = ""


def kernel_calls(workload: Workload, *, interpret: bool = False) -> list[KernelCall]:
    """The calls of `KERNELS` on `workload`, each at its own block sizes, as `python -m minilib
    compile --workloads` compiles them; with `interpret`, ours in TPU interpret mode and
    JAX's kernel and v3 not run (`TPU_ONLY`).

    >>> [(c.kernel, c.note[:24]) for c in kernel_calls(SUITE["decode"], interpret=True)][2:]
    [('JAX', "JAX's kernel is compiled"), ('v3', 'v3 is compiled for a TPU')]
    """
    model = workload.model
    sm_scale = model.head_dim**-0.5
    ours_options = dict(sm_scale=sm_scale, **model.options())
    if interpret:
        ours_options["interpret"] = True  # passed on to our kernel, in place of False
    ours = functools.partial(at_defaults.ours_whole_call, **ours_options)
    fused = functools.partial(at_defaults.ours_fused_call, **ours_options)
    sinks = model.sinks
    return [
        KernelCall("ours", ours, functools.partial(ours_arguments, sinks=sinks)),
        KernelCall("ours fused", fused, functools.partial(fused_arguments, sinks=sinks), 1),
        jax_kernel_call(workload, interpret),
        v3_kernel_call(workload, interpret),
    ]


def jax_kernel_call(workload: Workload, interpret: bool) -> KernelCall:
    """JAX's kernel without block sizes (it picks its own), or why it does not run here."""
    model = workload.model
    if interpret:
        return KernelCall("JAX", None, None, note=f"JAX's kernel is {TPU_ONLY}")
    if model.sinks:
        return KernelCall("JAX", None, None, note="JAX's kernel takes no attention sinks")
    fn = functools.partial(rpa_function("jax"), sm_scale=model.head_dim**-0.5, **model.options())
    return KernelCall("JAX", fn, jax_arguments)


def v3_kernel_call(workload: Workload, interpret: bool) -> KernelCall:
    """v3 at its own block sizes (`at_defaults.v3_whole_call`), or why it does not run here."""
    from minilib.tpu.v3 import v3_available

    model = workload.model
    if interpret:
        return KernelCall("v3", None, None, note=f"v3 is {TPU_ONLY}")
    unsupported = model.v3_unsupported()
    if unsupported is not None:
        return KernelCall("v3", None, None, note=unsupported)
    available, reason = v3_available()
    if not available:
        return KernelCall("v3", None, None, note=reason)
    options = dict(sm_scale=model.head_dim**-0.5, **model.options())
    fn = functools.partial(at_defaults.v3_whole_call, **options)
    return KernelCall("v3", fn, v3_arguments, donate=3)


# The run. ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cell:
    """One kernel on one workload: its samples, or why there are none.

    >>> Cell("decode", "v3", None, "not fetched").ran
    False
    """

    workload: str
    kernel: str
    samples: Samples | None
    note: str = ""

    @property
    def ran(self) -> bool:
        return self.samples is not None


def time_kernel(call: KernelCall, arguments: tuple, *, warmup: int, reps: int, clock) -> Samples:
    """`time_repeats` of `call` on `arguments`; a donated cache is replaced after each call by
    the one the call returned (its old buffer is gone)."""
    donated = () if call.donate is None else (call.donate,)
    fn = jax.jit(call.fn, donate_argnums=donated)
    arguments = list(arguments)

    def call_once():
        out = jax.block_until_ready(fn(*arguments))
        if call.donate is not None:
            arguments[call.donate] = out[1]

    return time_repeats(call_once, warmup=warmup, reps=reps, clock=clock)


def run_suite_bench(
    workloads: dict[str, Workload],
    *,
    interpret: bool = False,
    reps: int = 5,
    warmup: int = WARMUP_CALLS,
    clock=time.perf_counter,
    log=print,
) -> list[Cell]:
    """Time every kernel of `kernel_calls` on every workload: a `Cell` each, in order. A kernel
    that fails is a cell with the error's first line.

    >>> tiny = Workload("tiny", ((1, 20), (4, 20)), SUITE["decode"].model)
    >>> tiny = small_workload(tiny)  # one KV head
    >>> cells = run_suite_bench({"tiny": tiny}, interpret=True, reps=1, warmup=0,
    ...                         log=lambda *a, **k: None)
    >>> [(c.kernel, c.ran) for c in cells]
    [('ours', True), ('ours fused', True), ('JAX', False), ('v3', False)]
    """
    cells = []
    for name, workload in workloads.items():
        for call in kernel_calls(workload, interpret=interpret):
            timing = dict(warmup=warmup, reps=reps, clock=clock)
            cells.append(bench_cell(name, workload, call, interpret, timing, log))
    return cells


def bench_cell(
    name: str, workload: Workload, call: KernelCall, interpret: bool, timing: dict, log
) -> Cell:
    """One `Cell`: `call` timed on fresh arrays of `workload` (`timing`: `time_kernel`'s
    keywords), or its note when it does not run here, or its error's first line."""
    if call.fn is None:
        return Cell(name, call.kernel, None, call.note)
    log(f"  {name}: {call.kernel} ...", file=sys.stderr, flush=True)
    arrays = workload_arrays(workload, whole_cache=not interpret)
    try:
        samples = time_kernel(call, call.arguments(arrays), **timing)
    except Exception as err:  # noqa: BLE001  (a failing kernel is a cell)
        first_line = (str(err).splitlines() or [""])[0]
        return Cell(name, call.kernel, None, f"failed: {type(err).__name__}: {first_line}")
    return Cell(name, call.kernel, samples)


# The report: a markdown table to paste into an issue. -------------------------------------------


def milliseconds(cell: Cell | None) -> str:
    """A cell's median in ms, or "-" when it did not run."""
    if cell is None or not cell.ran:
        return "-"
    return f"{cell.samples.median_s * 1e3:.3f}"


def ratio(numerator: Cell | None, denominator: Cell | None) -> str:
    """The ratio of two cells' medians, or "-" unless both ran.

    >>> fast, slow = (Cell("w", k, Samples(1, (s,))) for k, s in (("a", 0.8), ("b", 1.0)))
    >>> ratio(fast, slow), ratio(fast, Cell("w", "v3", None, "not fetched"))
    ('0.80', '-')
    """
    if numerator is None or denominator is None or not (numerator.ran and denominator.ran):
        return "-"
    return f"{numerator.samples.median_s / denominator.samples.median_s:.2f}"


def environment_lines(interpret: bool) -> list[str]:
    """The chip and the versions, as list items of the report."""
    from minilib.tpu.v3 import v3_available

    device = jax.devices()[0]
    versions = ", ".join(f"{name} {package_version(name)}" for name in ("jax", "jaxlib", "libtpu"))
    chip = f"{device.device_kind} ({device.platform}), {jax.device_count()} device(s)"
    if interpret:
        chip += ": INTERPRET MODE on a CPU, small workloads"
    return [f"- chip: {chip}", f"- versions: {versions}", f"- v3: {v3_available()[1]}"]


def format_report(
    cells: list[Cell],
    workloads: dict[str, Workload],
    *,
    interpret: bool,
    reps: int,
    warmup: int = WARMUP_CALLS,
) -> str:
    """The cells as markdown: the chip and versions, a row per workload (median ms of each
    kernel, ours/JAX, ours fused/v3), then why any cell is empty.

    >>> w = {"decode": SUITE["decode"]}
    >>> cells = [Cell("decode", "ours", Samples(3, (2e-3, 1e-3, 3e-3))),
    ...          Cell("decode", "JAX", Samples(3, (4e-3,)))]
    >>> print(format_report(cells, w, interpret=False, reps=3).splitlines()[-1])
    | decode | Llama-3-8B | 2.000 | - | 4.000 | - | 0.50 | - |
    """
    by_key = {(c.workload, c.kernel): c for c in cells}
    lines = [f"### `{COMMAND}`: ours, JAX's kernel and vLLM's RPA v3 on the workload suite", ""]
    lines += environment_lines(interpret)
    lines += [
        f"- median ms of {reps} timed calls per kernel, after {warmup} untimed calls (the "
        "first compiles); each kernel at its own block sizes",
        "- ours/JAX: ours over JAX's kernel (neither writes the cache); ours/v3: ours fused "
        "over v3 (both write the new tokens' K/V into the cache, donated)",
    ]
    if interpret:
        lines.append(
            "- **these are interpret-mode times on a CPU (a CPU simulating a TPU, on "
            "small workloads): they mean nothing for a TPU**"
        )
    lines += [
        "",
        "| workload | model | "
        + " | ".join(f"{k} ms" for k in KERNELS)
        + " | ours/JAX | ours/v3 |",
        "|---|---|" + "---:|" * (len(KERNELS) + 2),
    ]
    for name, workload in workloads.items():
        row = {kernel: by_key.get((name, kernel)) for kernel in KERNELS}
        times = " | ".join(milliseconds(row[kernel]) for kernel in KERNELS)
        ratios = f"{ratio(row['ours'], row['JAX'])} | {ratio(row['ours fused'], row['v3'])}"
        lines.append(f"| {name} | {workload.model.name} | {times} | {ratios} |")
    return "\n".join(lines + note_lines(cells))


def note_lines(cells: list[Cell]) -> list[str]:
    """Why cells are empty: one line per kernel and reason, with its workloads."""
    reasons: dict[tuple[str, str], list[str]] = {}
    for cell in cells:
        if not cell.ran:
            reasons.setdefault((cell.kernel, cell.note), []).append(cell.workload)
    lines = [
        f"- {kernel} ({', '.join(names)}): {note}" for (kernel, note), names in reasons.items()
    ]
    return ["", "Not timed:", *lines] if lines else []


# Command line: `python -m minilib bench --tpu` (its flags are bench's: minilib/perf/bench.py).


def no_tpu_message() -> str:
    """What `bench --tpu` says without a TPU (and without --interpret)."""
    device = jax.devices()[0]
    return (
        f"{COMMAND} needs a TPU: JAX's backend here is {jax.default_backend()} "
        f"({device.device_kind}). To test the same harness here, in TPU interpret mode on "
        f"small workloads (times that mean nothing for a TPU): {COMMAND} --interpret"
    )


def run(args) -> int:
    """`python -m minilib bench --tpu`: 0; 1 without a TPU (unless --interpret) or when a
    kernel failed; 2 (`args.parser.error`) for --interpret on a TPU."""
    on_tpu = jax.default_backend() == "tpu"
    if on_tpu and args.interpret:
        args.parser.error(
            "--tpu --interpret is for a machine without a TPU: on a TPU, drop --interpret"
        )
    if not on_tpu and not args.interpret:
        print(no_tpu_message(), file=sys.stderr)
        return 1
    workloads = {name: SUITE[name] for name in args.suite_workloads}
    if args.interpret:
        workloads = {name: small_workload(w) for name, w in workloads.items()}
    cells = run_suite_bench(workloads, interpret=args.interpret, reps=args.reps)
    print(format_report(cells, workloads, interpret=args.interpret, reps=args.reps))
    failed = [f"{c.workload}: {c.kernel}" for c in cells if c.note.startswith("failed")]
    if failed:
        print(f"{len(failed)} kernel(s) failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0
