"""The course's speed targets, PASS/FAIL, all ratios measured in this one run.

    JAX_PLATFORMS=cpu python benchmarks/check_targets.py            # on a CPU
    python benchmarks/check_targets.py                              # on a TPU runtime
    python benchmarks/check_targets.py --reps 3 --dtype float32

The timed targets run `minilib.bench.run_bench` on one case, `minilib.bench.TARGET_CASE`: a
32-sequence mixed step (about half decodes) of a GQA model, 32 q heads, 8 KV heads, head_dim
128, page_size 16, pages_per_seq 64 (kv lengths 1 to 1024), max_num_batched_tokens 1024,
float32 on a CPU (bfloat16 on a TPU). See `check_targets` and `check_tpu_targets` below. The
static targets compile both kernels for v5e and v6e (needs libtpu, not a TPU): see
`minilib.kernel_costs.static_targets`.

Exit code 0 when no target fails, 1 otherwise, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax

from minilib.bench import (
    TARGET_CASE,
    default_dtype,
    float_dtype,
    format_table,
    positive_int,
    run_bench,
)
from minilib.kernel_costs import static_targets
from minilib.timing import describe_chip, device_chip
from minilib.workloads import BenchCase


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
