"""What the eager value checks cost: minilib's attention functions with validate=True (the
default for an eager call) against validate=False, on the bench's mixed workload.

    JAX_PLATFORMS=cpu python benchmarks/validation_overhead.py [num_seqs ...]   # default 8 32 128

For each case: `dynamic_validate_inputs` alone, then each function both ways, interleaved call
by call so that both see the same machine load. Medians of `REPS` calls; the difference is
the overhead (within the noise when it is far smaller than the call).
"""

from __future__ import annotations

import statistics
import sys

from minilib import dynamic_validate_inputs
from minilib.blockwise import ragged_paged_attention_blockwise
from minilib.perf.timing import timed_call
from minilib.perf.workloads import HEAD_CONFIGS, BenchCase, case_batches
from minilib.vectorized import ragged_paged_attention_jnp

REPS = 5


def seconds(fn, *args, **kwargs) -> float:
    """The seconds of one call, run to completion."""
    return timed_call(fn, *args, **kwargs)[1]


def main(num_seqs=(8, 32, 128)) -> None:
    for n in num_seqs:
        case = BenchCase("mixed", n, HEAD_CONFIGS["gqa"])
        batch, _ = case_batches(case)
        args, sm_scale = batch.args(), case.heads[2] ** -0.5
        checks = statistics.median(
            seconds(dynamic_validate_inputs, *args, sm_scale=sm_scale) for _ in range(30)
        )
        print(f"{case.label()}: dynamic_validate_inputs alone {1e3 * checks:.3f} ms")
        for fn in (ragged_paged_attention_jnp, ragged_paged_attention_blockwise):
            on, off = [], []
            for validate in (True, False):  # compile first
                seconds(fn, *args, sm_scale=sm_scale, validate=validate)
            for _ in range(REPS):
                on.append(seconds(fn, *args, sm_scale=sm_scale))
                off.append(seconds(fn, *args, sm_scale=sm_scale, validate=False))
            on_ms, off_ms = 1e3 * statistics.median(on), 1e3 * statistics.median(off)
            print(
                f"  {fn.__name__:34s} validate=True {on_ms:9.2f} ms   validate=False "
                f"{off_ms:9.2f} ms   difference {on_ms - off_ms:+.2f} ms"
            )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or (8, 32, 128))
