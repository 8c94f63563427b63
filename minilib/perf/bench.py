"""`python -m minilib bench`: time every ragged paged attention implementation on the same batches.

    python -m minilib bench --quick                       # one small case
    python -m minilib bench --workload mixed --num-seqs 32
    python -m minilib bench --engine                      # continuous vs static batching
    python -m minilib bench --tpu                         # on a TPU: ours, JAX's, v3 on the
                                                          # workload suite (minilib.perf.tpu_bench)
    python -m minilib bench --help

For each implementation and each case (workload x number of sequences x head config; the
batches come from `minilib.perf.workloads`, the timing from `minilib.perf.timing`):

  first    the first call, compile included. `jax.clear_caches()` runs before it, so nothing
           compiled for an earlier row is reused. `xla_s` is the part spent in XLA's backend
           compiler, as JAX's own monitoring events report it.
  warm     the median of warm calls on the same batch: the steady-state time.
  new      the first call on a NEW mix of lengths with the same array shapes, and `new/warm`,
           its ratio to the next (warm) call on those lengths. An implementation compiled once
           per shape has a ratio near 1; one that retraces per mix of lengths (both references
           loop over sequences in Python) compiles again. `comp` counts XLA compilations during
           the first and the new call: the direct evidence of retracing.
  roofline `minilib.perf.roofline`'s lower bound for the batch on this device (on a TPU, the chip's
           figures; on a CPU, its matmul FLOP/s and read bandwidth, measured in the same run),
           and the achieved bandwidth: the bytes the batch cannot avoid, over the warm time.

On a CPU, minilib's Pallas kernel runs in TPU interpret mode: right answers, not TPU speed, so
it is not a speed target and is not timed beside compiled code (`--interpret` times it in a
separate, labelled table). JAX's own kernel only runs on a TPU. On a TPU both kernels run on
the same batches in the same run.

The memory sweep compiles (without running) the gather-all jnp version and the blockwise one
(and the kernels, on a TPU) for growing max_kv_len and reads XLA's
`memory_analysis().temp_size_in_bytes`.

Results: a table on stdout, and plots in `--out-dir` (default benchmarks/results/). The speed
targets, judged PASS/FAIL from these rows, are `benchmarks/check_targets.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from minilib.perf import tpu_bench
from minilib.perf.implementations import IMPLEMENTATIONS, prepare_implementation
from minilib.perf.memory_sweep import format_memory_table, memory_sweep, save_memory_plot
from minilib.perf.roofline import Chip, RPACost, batch_cost, roofline
from minilib.perf.timing import (
    Timing,
    describe_chip,
    device_chip,
    time_implementation,
)
from minilib.perf.tpu_bench import SUITE
from minilib.perf.workloads import HEAD_CONFIGS, WORKLOADS, BenchCase, case_batches

__all__ = ["BenchRow", "format_table", "run_bench"]

DEFAULT_NUM_SEQS = (8, 32, 128)
# The largest KV cache a run may build: bigger sizes are a typo.
MAX_KV_CACHE_BYTES = 16 * 2**30


# ---------------------------------------------------------------------------------------------
# The run.


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One implementation on one case: its timing, its error and its place on the roofline.

    >>> from minilib.perf.roofline import Chip
    >>> tiny = BenchCase("mixed", 2, (4, 2, 64), page_size=8, pages_per_seq=2,
    ...                  max_num_batched_tokens=8)
    >>> toy = Chip("toy", hbm_bytes_per_s=1e10, peak_flops_per_s=1e11)
    >>> row = run_bench([tiny], ["jnp"], reps=1, chip=toy, log=lambda *a, **k: 0)[0]
    >>> row.impl, row.ok, row.interpreted, row.tokens_per_s > 0
    ('jnp', True, False, True)
    """

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
    def interpreted(self) -> bool:
        return self.ok and "interpret mode" in self.note

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
    get a row with the reason in `note` and no timing.

    >>> from minilib.perf.roofline import Chip
    >>> tiny = BenchCase("mixed", 2, (4, 2, 64), page_size=8, pages_per_seq=2,
    ...                  max_num_batched_tokens=8)
    >>> toy = Chip("toy", hbm_bytes_per_s=1e10, peak_flops_per_s=1e11)
    >>> rows = run_bench([tiny], ["jnp", "jax-kernel"], reps=1, chip=toy, log=lambda *a, **k: 0)
    >>> [(r.impl, r.ok) for r in rows]
    [('jnp', True), ('jax-kernel', False)]
    """
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
            fn, note = prepare_implementation(impl, backend)
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


# ---------------------------------------------------------------------------------------------
# The table.

# (header, alignment and width, the cell of a timed row). A row that did not run shows its
# case, its implementation and then its note.
COLUMNS = (
    ("case", "<32", lambda r: r.case.label()),
    ("impl", "<12", lambda r: r.impl),
    ("first_s", ">8", lambda r: f"{r.timing.first_s:.2f}"),
    ("xla_s", ">6", lambda r: f"{r.timing.first_xla_s:.2f}"),
    ("comp", ">5", lambda r: f"{r.timing.first_compiles}"),
    ("warm_ms", ">9", lambda r: f"{r.timing.warm_s * 1e3:.1f}"),
    ("new_ms", ">9", lambda r: f"{r.timing.new_s * 1e3:.1f}"),
    ("new/warm", ">8", lambda r: f"{r.timing.new_over_warm:.1f}"),
    ("comp", ">5", lambda r: f"{r.timing.new_compiles}"),
    ("tok/s", ">9", lambda r: f"{r.tokens_per_s:.0f}"),
    ("GB/s", ">7", lambda r: f"{r.achieved_bytes_per_s / 1e9:.1f}"),
    ("%BW", ">6", lambda r: f"{100 * r.achieved_bytes_per_s / r.chip.hbm_bytes_per_s:.2f}"),
    ("%roof", ">6", lambda r: f"{100 * r.roofline_fraction:.2f}"),
    ("max_err", ">8", lambda r: "-" if math.isnan(r.max_err) else f"{r.max_err:.1e}"),
)
NAME_COLUMNS = 2  # case and impl: what a row that did not run still shows

TABLE_KEY = """\
columns: first_s = first call incl. compile (after jax.clear_caches()); xla_s = of which XLA
compiling; comp = XLA compilations (first call, then new-lengths call); warm_ms = median warm
call; new_ms = first call on a new mix of lengths, same shapes; new/warm = that over the next
(warm) call on the same new lengths: about 1 if compiled once per shape, >> 1 if retracing;
tok/s = live q rows / warm time; GB/s = unavoidable bytes (q, whole KV pages, out) / warm time;
%BW = that over the device's bandwidth; %roof = roofline lower bound / warm time;
max_err = max |out - first timed impl's out| on the live rows."""


def format_row(r: BenchRow) -> str:
    """One line of the table: every column of a timed row, or the note of one that did not run.

    >>> tiny = BenchCase("mixed", 2, (4, 2, 64), page_size=8, pages_per_seq=2,
    ...                  max_num_batched_tokens=8)
    >>> cost = batch_cost(case_batches(tiny)[0])
    >>> toy = Chip("toy", hbm_bytes_per_s=1e10, peak_flops_per_s=1e11)
    >>> print(format_row(BenchRow(tiny, "jax-kernel", "needs a TPU", None, cost, toy, math.nan)))
    mixed 2 seqs 4/2/64              jax-kernel    needs a TPU
    """
    columns = COLUMNS if r.ok else COLUMNS[:NAME_COLUMNS]
    return (" ".join(f"{cell(r):{spec}}" for _, spec, cell in columns) + f"  {r.note}").rstrip()


def format_table(rows: list[BenchRow]) -> str:
    """The rows as a text table: compiled/eager rows first, interpret-mode rows apart.

    >>> tiny = BenchCase("mixed", 2, (4, 2, 64), page_size=8, pages_per_seq=2,
    ...                  max_num_batched_tokens=8)
    >>> cost = batch_cost(case_batches(tiny)[0])
    >>> toy = Chip("toy", hbm_bytes_per_s=1e10, peak_flops_per_s=1e11)
    >>> row = BenchRow(tiny, "jax-kernel", "needs a TPU", None, cost, toy, math.nan)
    >>> print(format_table([row]))  # doctest: +ELLIPSIS
    case                             impl          first_s  xla_s  comp ... max_err  note
    ------...
    mixed 2 seqs 4/2/64              jax-kernel    needs a TPU
    """
    header = " ".join(f"{name:{spec}}" for name, spec, _ in COLUMNS) + "  note"
    sections = [
        ("", [r for r in rows if not r.interpreted]),
        (
            "TPU INTERPRET MODE (Pallas kernel simulated on CPU): correctness only, NOT a "
            "speed target; do not compare these times with the rows above",
            [r for r in rows if r.interpreted],
        ),
    ]
    lines = []
    for title, section in sections:
        if not section:
            continue
        if title:
            lines += ["", title]
        lines += [header, "-" * len(header), *map(format_row, section)]
    return "\n".join(lines)


def save_times_plot(rows: list[BenchRow], path: Path) -> Path:
    """`minilib.perf.plots.bench_times_figure` of the timed rows (interpreted ones left out), saved.

    >>> import tempfile
    >>> tiny = BenchCase("mixed", 2, (4, 2, 64), page_size=8, pages_per_seq=2,
    ...                  max_num_batched_tokens=8)
    >>> toy = Chip("toy", hbm_bytes_per_s=1e10, peak_flops_per_s=1e11)
    >>> rows = run_bench([tiny], ["jnp"], reps=1, chip=toy, log=lambda *a, **k: 0)
    >>> save_times_plot(rows, Path(tempfile.mkdtemp()) / "bench.png").exists()
    True
    """
    from minilib.perf.plots import bench_times_figure, save_figure  # matplotlib: not on a TPU VM

    timings: dict[str, dict[str, Timing]] = {}
    for r in rows:
        if r.ok and not r.interpreted:
            timings.setdefault(r.case.label(), {})[r.impl] = r.timing
    device = jax.devices()[0]
    title = f"Ragged paged attention on {device.device_kind} ({device.platform})"
    return save_figure(bench_times_figure(timings, title), path)


# ---------------------------------------------------------------------------------------------
# Command line: `python -m minilib bench` (its parser is made in minilib/__main__.py).


def parse_heads(text: str) -> tuple[int, int, int]:
    """An argparse type: 'gqa', 'mqa', or 'num_q_heads/num_kv_heads/head_dim' such as '4/2/64'.

    >>> parse_heads("gqa"), parse_heads("4/2/64")
    ((32, 8, 128), (4, 2, 64))
    """
    if text in HEAD_CONFIGS:
        return HEAD_CONFIGS[text]
    try:
        num_q_heads, num_kv_heads, head_dim = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give one of {sorted(HEAD_CONFIGS)} or Q/KV/DIM such as 32/8/128"
        ) from None
    if min(num_q_heads, num_kv_heads, head_dim) < 1 or num_q_heads % num_kv_heads:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the three numbers must be positive, and {num_kv_heads=} "
            f"must divide {num_q_heads=}"
        )
    return num_q_heads, num_kv_heads, head_dim


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1.

    >>> positive_int("3")
    3
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def float_dtype(text: str) -> str:
    """An argparse type: the name of a float dtype for q and the KV cache.

    >>> float_dtype("bfloat16")
    'bfloat16'
    """
    try:
        ok = jnp.issubdtype(jnp.dtype(text), jnp.floating) and jnp.dtype(text).itemsize >= 2
    except TypeError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r}: choose float32, bfloat16 or float16")
    return str(jnp.dtype(text))


def choice_of(names):
    """An argparse type: one of `names`.

    >>> choice_of(["jnp", "blockwise"])("jnp")
    'jnp'
    """

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(names)}")
        return text

    return parse


def comma_list(kind):
    """An argparse type: a comma-separated, non-empty list of `kind`.

    >>> comma_list(positive_int)("8, 32,128")
    [8, 32, 128]
    """

    def parse(text: str) -> list:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one value")
        return items

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `python -m minilib bench`.

    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> parser.parse_args(["--num-seqs", "8,32"]).num_seqs
    [8, 32]
    """
    p.add_argument("--quick", action="store_true", help="one small mixed case, 8 sequences")
    p.add_argument(
        "--workload", type=comma_list(choice_of(list(WORKLOADS))), default=list(WORKLOADS),
        help="comma list",
    )  # fmt: skip
    p.add_argument("--num-seqs", type=comma_list(positive_int), default=list(DEFAULT_NUM_SEQS))
    p.add_argument(
        "--heads", type=comma_list(parse_heads), default=["gqa", "mqa"],
        help="comma list of gqa (32/8/128), mqa (32/1/128) or Q/KV/DIM",
    )  # fmt: skip
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--pages-per-seq", type=positive_int, default=64, help="max kv_len / page_size")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=1024)
    p.add_argument(
        "--dtype", type=float_dtype, default=None,
        help="q and KV dtype (default: bfloat16 on TPU, else float32)",
    )  # fmt: skip
    p.add_argument(
        "--impls", type=comma_list(choice_of([i.name for i in IMPLEMENTATIONS])), default=None,
        help="comma list of " + ",".join(i.name for i in IMPLEMENTATIONS)
        + " (default: all but minilib-ref)",
    )  # fmt: skip
    p.add_argument("--reps", type=positive_int, default=5, help="warm calls per implementation")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="off TPU, also time the interpreted kernel; with --tpu, run its harness here in "
        "TPU interpret mode on small workloads (times that mean nothing for a TPU)",
    )
    p.add_argument(
        "--tpu",
        action="store_true",
        help="on a TPU: time ours, JAX's kernel and vLLM's v3 on the workload suite "
        "(minilib.tpu.suite), a markdown table to paste into an issue; uses --reps",
    )
    p.add_argument(
        "--suite-workloads",
        type=comma_list(choice_of(list(SUITE))),
        default=list(SUITE),
        help="with --tpu: comma list of the suite's workloads",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory sweep")
    p.add_argument(
        "--max-kv-lens", type=comma_list(positive_int), default=[256, 1024, 4096, 16384],
        help="the memory sweep's max_kv_len values",
    )  # fmt: skip
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--engine", action="store_true",
        help="serving workload: minilib.engine with continuous against static batching",
    )  # fmt: skip
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))


def default_dtype() -> str:
    """The dtype served on this backend: bfloat16 on a TPU, float32 elsewhere.

    >>> default_dtype() == ("bfloat16" if jax.default_backend() == "tpu" else "float32")
    True
    """
    return "bfloat16" if jax.default_backend() == "tpu" else "float32"


def cases_from_args(args) -> list[BenchCase]:
    """Every case the flags name: head configs x workloads x numbers of sequences.

    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> args = parser.parse_args(["--workload", "mixed", "--num-seqs", "8,32", "--heads", "mqa"])
    >>> [case.label() for case in cases_from_args(args)]
    ['mixed 8 seqs 32/1/128', 'mixed 32 seqs 32/1/128']
    """
    dtype = args.dtype or default_dtype()
    heads = [HEAD_CONFIGS[h] if isinstance(h, str) else h for h in args.heads]
    return [
        BenchCase(w, n, h, args.page_size, args.pages_per_seq, args.max_num_batched_tokens, dtype)
        for h in heads
        for w in args.workload
        for n in args.num_seqs
    ]


def apply_quick(args) -> None:
    """--quick: one small case (mixed, 8 sequences, GQA, max kv_len 256), short sweep.

    >>> args = argparse.Namespace()
    >>> apply_quick(args)
    >>> args.num_seqs, args.pages_per_seq * 16, args.max_kv_lens
    ([8], 256, [256, 1024, 4096])
    """
    args.workload, args.num_seqs, args.heads = ["mixed"], [8], ["gqa"]
    args.pages_per_seq, args.max_num_batched_tokens, args.reps = 16, 256, 3
    args.max_kv_lens = [256, 1024, 4096]


def run(args) -> int:
    """Run `python -m minilib bench` with parsed flags. Returns the exit code: 0; 1 when any
    row failed to run; 2 (through `args.parser.error`) for flags that do not fit together.
    With --tpu, `minilib.perf.tpu_bench.run`."""
    if args.tpu:
        return tpu_bench.run(args)
    if args.quick:
        apply_quick(args)
    cases = cases_from_args(args)
    if max(args.num_seqs) > args.max_num_batched_tokens:
        args.parser.error(
            f"--num-seqs {max(args.num_seqs)} is more than --max-num-batched-tokens "
            f"{args.max_num_batched_tokens}: every sequence needs at least one q row"
        )
    biggest = max(cases, key=BenchCase.kv_cache_bytes)
    if biggest.kv_cache_bytes() > MAX_KV_CACHE_BYTES:
        args.parser.error(
            f"--num-seqs {biggest.num_seqs} x --pages-per-seq {args.pages_per_seq} x "
            f"--page-size {args.page_size} makes a KV cache of "
            f"{biggest.kv_cache_bytes() / 2**30:.1f} GiB, more than this harness allows "
            f"({MAX_KV_CACHE_BYTES / 2**30:.0f} GiB)"
        )
    if args.engine:  # the serving engine's throughput (minilib/engine/throughput.py)
        from minilib.engine.throughput import engine_bench

        print(engine_bench(reps=args.reps).describe())
        return 0
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
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
    failed = [f"{r.case.label()}: {r.impl}" for r in rows if r.note.startswith("failed")]
    if not args.no_plot:
        path = save_times_plot(rows, args.out_dir / f"bench_{device.platform}.png")
        print(f"plot: {path.resolve()}")
    if not args.no_memory:
        base = dataclasses.replace(cases[0], workload="mixed")
        points, notes = memory_sweep(args.max_kv_lens, base=base)
        print(f"\nworking memory of one compiled call, {base.num_seqs} sequences, heads "
              f"{base.heads_label}, {base.dtype}:")  # fmt: skip
        print(format_memory_table(points, notes))
        if points and not args.no_plot:
            path = save_memory_plot(points, args.out_dir / f"memory_{device.platform}.png")
            print(f"plot: {path.resolve()}")
    if failed:
        print(f"{len(failed)} row(s) failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0
