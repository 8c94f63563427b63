"""Timing a JAX function honestly: compiles counted, warm calls apart, this device's figures.

    timed_call(fn, *args)            one call run to completion: seconds, XLA compiles and
                                     the seconds XLA's compiler spent, from JAX's own events
    time_implementation(fn, ...)     first call (cold), warm calls, then a new mix of lengths
    measure_matmul_flops()           this device's achievable matmul FLOP/s
    measure_read_bandwidth()         this device's achievable read bandwidth, bytes/s
    device_chip(dtype)               the roofline figures: the TPU's own, or these two, measured
    compiled_temp_bytes(fn, *args)   XLA's working memory of one compiled call (nothing runs)

`python -m minilib bench` times every implementation with these; chapter 06 uses
`timed_call` and `compiled_temp_bytes` directly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp

from minilib.batch import RaggedBatch
from minilib.perf.roofline import Chip, detect_chip

__all__ = [
    "Timing",
    "compiled_temp_bytes",
    "describe_chip",
    "device_chip",
    "measure_matmul_flops",
    "measure_read_bandwidth",
    "time_implementation",
    "timed_call",
]

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
    """(output, seconds, XLA compiles, XLA compile seconds) of one call, run to completion.

    >>> square = jax.jit(lambda x: x * x)
    >>> _, seconds, compiles, _ = timed_call(square, jnp.ones(3))
    >>> compiles, seconds > 0
    (1, True)
    >>> timed_call(square, jnp.ones(3))[2]  # the same shape again: no compile
    0
    """
    _listen_for_compiles()
    count, seconds = _compile_log["count"], _compile_log["seconds"]
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    elapsed = time.perf_counter() - start
    return out, elapsed, _compile_log["count"] - count, _compile_log["seconds"] - seconds


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one function on one batch, as `time_implementation` measures them.

    >>> t = Timing(first_s=2.0, first_compiles=1, first_xla_s=1.5, warm_s=0.01, warm_calls=5,
    ...            new_s=0.02, new_compiles=0, new_warm_s=0.01)
    >>> t.new_over_warm  # new lengths cost two warm calls here, and no compile
    2.0
    """

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
) -> tuple[Timing, jax.Array]:  # fmt: skip
    """Time `fn` on `batch` cold, then warm, then twice on `new_batch` (first, then warm).
    Returns (Timing, the output on `batch`).

    Cold: `jax.clear_caches()` runs first, so nothing compiled earlier is reused. Warm calls:
    `reps` of them, but no more than fit in `budget_s` once three are done.

    >>> from minilib import make_batch, ragged_paged_attention_jnp
    >>> a = make_batch([(3, 9), (1, 5)], max_num_batched_tokens=8, pages_per_seq=2)
    >>> b = make_batch([(2, 4), (4, 7)], max_num_batched_tokens=8, pages_per_seq=2, seed=1)
    >>> timing, out = time_implementation(ragged_paged_attention_jnp, a, b, reps=3)
    >>> timing.warm_calls, timing.new_compiles, out.shape
    (3, 0, (8, 4, 64))
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
    """This device's achievable matmul FLOP/s: the median of `reps` [n, n] @ [n, n] products.

    >>> measure_matmul_flops(n=64, reps=1) > 0
    True
    """
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)  # [n, n]
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, a))
    times = [timed_call(matmul, a, a)[1] for _ in range(reps)]
    return 2 * n**3 / statistics.median(times)


def measure_read_bandwidth(num_bytes: int = 256 * 2**20, reps: int = 5) -> float:
    """This device's achievable memory bandwidth, bytes/s: the sum of one big array.

    A read-only stream: writing a fresh output would time the allocator's page faults too.

    >>> measure_read_bandwidth(num_bytes=2**20, reps=1) > 0
    True
    """
    x = jnp.ones(num_bytes // 4, jnp.float32)  # [num_bytes // 4]
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    times = [timed_call(total, x)[1] for _ in range(reps)]
    return num_bytes / statistics.median(times)


def device_chip(dtype: str) -> Chip:
    """The roofline figures to compare against: the TPU's own, or this device, measured
    (a 2048x2048 `dtype` matmul for FLOP/s, the sum of 256 MiB for bandwidth).

    >>> chip = device_chip("float32")
    >>> chip.hbm_bytes_per_s > 0 and chip.peak_flops_per_s > 0
    True
    """
    chip = detect_chip()
    if chip is not None:
        return chip
    device = jax.devices()[0]
    return Chip(
        f"{device.device_kind} ({device.platform}, measured: {dtype} matmul, array sum)",
        hbm_bytes_per_s=measure_read_bandwidth(),
        peak_flops_per_s=measure_matmul_flops(dtype=jnp.dtype(dtype)),
    )


def describe_chip(chip: Chip) -> str:
    """One line: the roofline device and its figures.

    >>> describe_chip(Chip("toy", hbm_bytes_per_s=1e11, peak_flops_per_s=1e12))
    'roofline device: toy: 100.0 GB/s, 1.000 TFLOP/s, ridge 10.0 FLOP/byte'
    """
    return (
        f"roofline device: {chip.name}: {chip.hbm_bytes_per_s / 1e9:.1f} GB/s, "
        f"{chip.peak_flops_per_s / 1e12:.3f} TFLOP/s, ridge {chip.ridge_point:.1f} FLOP/byte"
    )


def compiled_temp_bytes(fn, *args, **kwargs) -> float:
    """XLA's `temp_size_in_bytes` of `fn(*args, **kwargs)` compiled, without running it.

    `args` may be arrays or `jax.ShapeDtypeStruct`s (then nothing is allocated); `kwargs` are
    fixed at compile time. nan when this backend does not report memory.

    >>> spec = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    >>> compiled_temp_bytes(lambda a, b: (a @ b).sum(), spec, spec) >= 0
    True
    """
    compiled = jax.jit(functools.partial(fn, **kwargs)).lower(*args).compile()
    analysis = compiled.memory_analysis()
    return math.nan if analysis is None else float(analysis.temp_size_in_bytes)
