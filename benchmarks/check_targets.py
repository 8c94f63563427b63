"""The course's speed targets, PASS/FAIL, all ratios measured in this one run.

    JAX_PLATFORMS=cpu python benchmarks/check_targets.py            # on a CPU
    python benchmarks/check_targets.py                              # on a TPU runtime
    python benchmarks/check_targets.py --reps 3 --dtype float32

The timed targets run `minilib.perf.bench.run_bench` on one case,
`minilib.perf.workloads.TARGET_CASE`: a
32-sequence mixed step (about half decodes) of a GQA model, 32 q heads, 8 KV heads, head_dim
128, page_size 16, pages_per_seq 64 (kv lengths 1 to 1024), max_num_batched_tokens 1024,
float32 on a CPU (bfloat16 on a TPU). See `check_targets` and `check_tpu_targets` below. The
static targets compile our kernel, JAX's and vLLM's RPA v3 for v5e, v6e and TPU7x (needs
libtpu, not a TPU, and v3's wheel: `python -m minilib.tpu.v3 fetch`), judge the claims of
`minilib.tpu.comparison.CLAIMS` (PASS/FAIL) and report every other comparison (INFO): see
`minilib.tpu.comparison.static_targets`. They are static estimates, not timings.

Exit code 0 when no target fails, 1 otherwise, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax

from minilib.perf.bench import (
    BenchRow,
    default_dtype,
    float_dtype,
    format_table,
    positive_int,
    run_bench,
)
from minilib.perf.timing import describe_chip, device_chip
from minilib.perf.workloads import TARGET_CASE, BenchCase
from minilib.tpu.comparison import static_targets


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
    (useful FLOPs / a big matmul's FLOP/s, measured in the same run). Then the TPU targets and
    the static targets.
    """
    chip = device_chip(case.dtype)
    log(describe_chip(chip))
    rows = run_bench([case], ["jax-ref", "jnp", "blockwise"], reps=reps, chip=chip, log=log)
    log(format_table(rows))
    ref, jnp_row, blockwise = rows
    return [
        speedup(
            "jnp first call >= 5x faster than JAX's reference (compile included)",
            ref,
            jnp_row,
            "first_s",
            at_least=5,
        ),  # fmt: skip
        no_retrace(jnp_row),
        no_retrace(blockwise),
        speedup(
            "jnp warm no slower than JAX's reference warm", ref, jnp_row, "warm_s", at_least=1
        ),  # fmt: skip
        speedup(
            "blockwise warm >= 3x faster than JAX's reference warm",
            ref,
            blockwise,
            "warm_s",
            at_least=3,
        ),  # fmt: skip
        *flop_bound(blockwise),
        *check_tpu_targets(case, reps=reps, log=log),
        *check_static_targets(),
    ]


def not_measured(name: str, *rows: BenchRow) -> TargetResult | None:
    """A FAIL naming the rows that did not run, or None when all of them ran."""
    missing = [f"{r.impl}: {r.note}" for r in rows if not r.ok]
    return (
        TargetResult(name, False, f"could not measure ({'; '.join(missing)})") if missing else None
    )


def speedup(name: str, slow: BenchRow, fast: BenchRow, field: str, *, at_least: float):
    """`fast` at least `at_least` times faster than `slow` in `field` (first_s or warm_s)."""
    if failed := not_measured(name, slow, fast):
        return failed
    slow_s, fast_s = getattr(slow.timing, field), getattr(fast.timing, field)
    scale, unit = (1, "s") if field == "first_s" else (1e3, "ms")
    return TargetResult(
        name,
        slow_s / fast_s >= at_least,
        f"{slow_s / fast_s:.2f}x ({slow.impl} {slow_s * scale:.2f} {unit}, "
        f"{fast.impl} {fast_s * scale:.2f} {unit})",
    )


def no_retrace(row: BenchRow) -> TargetResult:
    """The first call on new lengths (same shapes) costs at most 3x a warm call on them."""
    name = f"{row.impl}: no retrace on new lengths (new-lengths call <= 3x warm call)"
    if failed := not_measured(name, row):
        return failed
    t = row.timing
    return TargetResult(
        name,
        t.new_over_warm <= 3,
        f"{t.new_over_warm:.2f}x (first call on new lengths {t.new_s * 1e3:.1f} ms, warm call "
        f"on them {t.new_warm_s * 1e3:.1f} ms, {t.new_compiles} XLA compiles on new lengths)",
    )


def flop_bound(row: BenchRow) -> list[TargetResult]:
    """Reported, not judged: the warm time over the useful-FLOP bound of this device."""
    if not row.ok:
        return []
    bound_s = row.cost.flops / row.chip.peak_flops_per_s
    return [
        TargetResult(
            f"{row.impl} against the useful-FLOP bound of this device",
            None,
            f"{row.flop_bound_multiple:.1f}x the bound (warm {row.timing.warm_s * 1e3:.1f} "
            f"ms; bound {bound_s * 1e3:.1f} ms = {row.cost.flops / 1e9:.2f} useful GFLOP / "
            f"{row.chip.peak_flops_per_s / 1e9:.1f} GFLOP/s measured matmul)",
        )
    ]


def check_static_targets() -> list[TargetResult]:
    """The kernel's static TPU targets (compiled bundles per KV block and spills against JAX's
    kernel and vLLM's RPA v3, on any host with libtpu): judged where `CLAIMS` claims a cell,
    reported elsewhere. See `minilib.tpu.comparison.static_targets`."""
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
    return [throughput_against(names[0], ours, theirs), share_of_roofline(names[1], decode)]


def throughput_against(name: str, ours: BenchRow, theirs: BenchRow) -> TargetResult:
    """Our kernel's tokens per second at least 90% of JAX's kernel's, on the same batches."""
    if failed := not_measured(name, ours, theirs):
        return failed
    ratio = ours.tokens_per_s / theirs.tokens_per_s
    detail = f"{ratio:.1%} ({ours.tokens_per_s:,.0f} against {theirs.tokens_per_s:,.0f} tok/s)"
    return TargetResult(name, ratio >= 0.9, detail)


def share_of_roofline(name: str, row: BenchRow) -> TargetResult:
    """At least 70% of the chip's HBM roofline."""
    if failed := not_measured(name, row):
        return failed
    chip = row.chip
    detail = (
        f"{row.roofline_fraction:.1%} of the roofline ({row.achieved_bytes_per_s / 1e9:.0f} "
        f"GB/s of {chip.hbm_bytes_per_s / 1e9:.0f} GB/s on {chip.name})"
    )
    return TargetResult(name, row.roofline_fraction >= 0.7, detail)


def main(argv: list[str] | None = None) -> int:
    """The command line. Returns the exit code: 0, 1 when a target fails, 2 for a bad flag."""
    parser = argparse.ArgumentParser(description="The course's speed targets, PASS/FAIL.")
    parser.add_argument("--reps", type=positive_int, default=5, help="warm calls per row")
    parser.add_argument(
        "--dtype", type=float_dtype, default=None,
        help="q and KV dtype (default: bfloat16 on TPU, else float32)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    case = dataclasses.replace(TARGET_CASE, dtype=args.dtype or default_dtype())
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
    print(f"speed targets on: {case}  (timings are noisy on a shared machine)")
    results = check_targets(case, reps=args.reps)
    print("\n".join(r.line() for r in results))
    return 0 if all(r.passed is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
