"""Working memory as the cache grows: each implementation compiled (not run) for growing
max_kv_len, and XLA's `memory_analysis().temp_size_in_bytes` read for each.

The gather-all jnp version holds K and V of every page of every sequence slot, so its
working memory grows with the cache; the blockwise one holds one KV block. On a CPU the
Pallas kernels run in TPU interpret mode, whose buffers say nothing about the kernel's memory
on a TPU: they are left out, with a note. `python -m minilib bench` prints and plots it.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax

from minilib.perf.implementations import IMPLEMENTATIONS, prepare_implementation
from minilib.perf.timing import compiled_temp_bytes
from minilib.perf.workloads import TARGET_CASE, BenchCase

__all__ = ["MemoryPoint", "format_memory_table", "memory_sweep", "save_memory_plot"]


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    """One implementation's compiled working memory at one max_kv_len, as `memory_sweep`
    reads it from XLA.

    >>> tiny = BenchCase("mixed", 2, (4, 2, 64), page_size=8, max_num_batched_tokens=8)
    >>> (point,), _ = memory_sweep([16], ["jnp"], base=tiny, log=lambda *a, **k: 0)
    >>> point.impl, point.max_kv_len, point.temp_bytes > 0
    ('jnp', 16, True)
    """

    impl: str
    max_kv_len: int
    temp_bytes: float  # XLA's temp buffers of the compiled call; nan if not reported
    kv_cache_bytes: int  # the kv_pages argument, for scale


def memory_sweep(
    max_kv_lens, impl_names=("jnp", "blockwise", "kernel", "jax-kernel"), *,
    base: BenchCase = TARGET_CASE, log=print
) -> tuple[list[MemoryPoint], list[str]]:  # fmt: skip
    """Compiled working memory of each implementation as max_kv_len grows. Returns the points
    and notes on the implementations left out (unavailable, or interpreted: an interpreter's
    buffers say nothing about the kernel's memory on a TPU).

    >>> tiny = BenchCase("mixed", 2, (4, 2, 64), page_size=8, max_num_batched_tokens=8)
    >>> points, _ = memory_sweep([16, 64], ["jnp"], base=tiny, log=lambda *a, **k: 0)
    >>> [p.max_kv_len for p in points], points[1].temp_bytes > points[0].temp_bytes
    ([16, 64], True)
    """
    backend = jax.default_backend()
    points, notes = [], []
    for impl in IMPLEMENTATIONS:
        if impl.name not in impl_names:
            continue
        fn, note = prepare_implementation(impl, backend)
        if fn is None or (impl.mode == "pallas" and backend != "tpu"):
            notes.append(f"{impl.name}: {note or 'skipped'}")
            continue
        for max_kv_len in max_kv_lens:
            case = dataclasses.replace(base, pages_per_seq=max(1, max_kv_len // base.page_size))
            log(f"  memory: {impl.name} max_kv_len={max_kv_len} ...", file=sys.stderr, flush=True)
            try:
                temp = compiled_temp_bytes(fn, *case.specs(), sm_scale=case.heads[2] ** -0.5)
            except Exception as error:  # noqa: BLE001
                notes.append(f"{impl.name} at max_kv_len={max_kv_len}: failed: {error}")
                continue
            points.append(MemoryPoint(impl.name, case.max_kv_len, temp, case.kv_cache_bytes()))
    return points, notes


def format_memory_table(points: list[MemoryPoint], notes: list[str]) -> str:
    """The sweep as a text table, then the notes.

    >>> print(format_memory_table([MemoryPoint("jnp", 256, 2**21, 2**20)], ["kernel: skipped"]))
    impl         max_kv_len   temp_MiB kv_cache_MiB
    jnp                 256        2.0          1.0
      (kernel: skipped)
    """
    lines = [f"{'impl':12s} {'max_kv_len':>10s} {'temp_MiB':>10s} {'kv_cache_MiB':>12s}"]
    for p in points:
        lines.append(
            f"{p.impl:12s} {p.max_kv_len:10d} {p.temp_bytes / 2**20:10.1f} "
            f"{p.kv_cache_bytes / 2**20:12.1f}"
        )
    return "\n".join(lines + [f"  ({note})" for note in notes])


def save_memory_plot(points: list[MemoryPoint], path: Path) -> Path:
    """`minilib.perf.plots.working_memory_figure` of the sweep, saved.

    >>> import tempfile
    >>> points = [MemoryPoint("jnp", n, 2 * n * 2**10, n * 2**10) for n in (256, 1024)]
    >>> save_memory_plot(points, Path(tempfile.mkdtemp()) / "memory.png").exists()
    True
    """
    from minilib.perf.plots import save_figure, working_memory_figure  # matplotlib: lazily

    temp_bytes: dict[str, dict[int, float]] = {}
    for p in points:
        temp_bytes.setdefault(p.impl, {})[p.max_kv_len] = p.temp_bytes
    kv_cache_bytes = {p.max_kv_len: p.kv_cache_bytes for p in points}
    return save_figure(working_memory_figure(temp_bytes, kv_cache_bytes), path)
