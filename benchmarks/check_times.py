"""How long a learner waits for each kernel checker of the ladder: the warm time per rung.

    JAX_PLATFORMS=cpu python benchmarks/check_times.py
    JAX_PLATFORMS=cpu python benchmarks/check_times.py --reps 3

Each checker runs once on the tested solution to warm up (JAX's first compiles of the
references, the TPU lowering), then `--reps` more times; the table gives the first call and the
fastest warm one, in seconds, against the course's aim of 5 s. A warm check still compiles the
learner's kernel: in interpret mode a compile takes seconds and a run a fraction of one, so
each checker runs its cases in one shape (one compile) where it can. Where libtpu is installed
the checkers also compile for a v5e with Mosaic, which adds that compile's time.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import minilib.exercises as ex

ROOT = Path(__file__).resolve().parents[1]
AIM_SECONDS = 5.0


def solutions(module: str):
    spec = importlib.util.spec_from_file_location(module, ROOT / "solutions" / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rungs():
    """(rung, checker, the solution it checks)."""
    sol7, sol8 = solutions("ex07_flash"), solutions("ex08_ladder")
    return [
        ("1a flash kernel body", ex.check_flash_attention, sol7.flash_attention),
        ("1b flash pallas_call", ex.check_flash_pallas_call, sol7.flash_attention_call),
        ("2 scalar prefetch", ex.check_paged_decode_attention, sol8.paged_decode_attention),
        ("3 async copy", ex.check_paged_decode_async_copy, sol8.paged_decode_async_copy),
        ("4 double buffer", ex.check_double_buffered_decode, sol8.double_buffered_decode),
        ("5a next_work", ex.check_next_work, sol8.next_work),
        ("5b prefetch", ex.check_prefetching_decode, sol8.prefetching_decode),
    ]


def timed(checker, fn) -> float:
    start = time.perf_counter()
    result = checker(fn, verbose=False)
    seconds = time.perf_counter() - start
    if not result.passed:
        raise SystemExit(f"{checker.__name__} fails its solution:\n{result.report}")
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="warm calls per checker (best kept)")
    args = parser.parse_args(argv)
    print(f"{'rung':24s} {'first_s':>8s} {'warm_s':>8s}  aim <= {AIM_SECONDS:.0f} s")
    worst = 0.0
    for name, checker, fn in rungs():
        first = timed(checker, fn)
        warm = min(timed(checker, fn) for _ in range(max(args.reps, 1)))
        worst = max(worst, warm)
        flag = "" if warm <= AIM_SECONDS else "  (over the aim)"
        print(f"{name:24s} {first:8.1f} {warm:8.1f}{flag}", flush=True)
    print(f"slowest warm check: {worst:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
