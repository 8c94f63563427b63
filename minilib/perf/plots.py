"""The benchmark's plots: `python -m minilib bench`'s times, and its working memory against
max_kv_len. Each function returns a matplotlib `Figure` (no pyplot), in the course's palette.

    bench_times_figure(timings)                        first, warm and new-lengths calls
    working_memory_figure(temp_bytes, kv_cache_bytes)  XLA's working memory as max_kv_len grows
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from minilib.explore.style import color, hatch, new_figure

__all__ = ["bench_times_figure", "save_figure", "working_memory_figure"]


def bench_times_figure(timings, title: str = "Ragged paged attention") -> Figure:
    """Three panels, first call / warm call / new-lengths call, log scale, one bar per
    implementation in each case.

    `timings` maps a case label to {implementation name: `minilib.perf.timing.Timing`}.

    >>> from minilib.perf.timing import Timing
    >>> t = Timing(2.0, 9, 1.5, 0.004, 5, 0.005, 0, 0.004)
    >>> fig = bench_times_figure({"mixed 8 seqs 32/8/128": {"jnp": t, "blockwise": t}})
    >>> [ax.get_title() for ax in fig.axes]
    ['first call, compile included', 'warm call (median)', 'new mix of lengths, same shapes']
    """
    cases = list(timings)
    impls = list(dict.fromkeys(name for by_impl in timings.values() for name in by_impl))
    panels = [
        ("first call, compile included", "seconds", lambda t: t.first_s),
        ("warm call (median)", "milliseconds", lambda t: t.warm_s * 1e3),
        ("new mix of lengths, same shapes", "milliseconds", lambda t: t.new_s * 1e3),
    ]
    fig = new_figure(6 + 1.6 * len(cases) * 3, 4.8)
    axes = fig.subplots(1, 3, squeeze=False)[0]
    width = 0.8 / max(len(impls), 1)
    for ax, (panel_title, unit, value) in zip(axes, panels, strict=True):
        for k, impl in enumerate(impls):
            shift = (k - (len(impls) - 1) / 2) * width
            placed = [(i + shift, value(timings[c][impl])) for i, c in enumerate(cases)
                      if impl in timings[c]]  # fmt: skip
            xs, ys = zip(*placed, strict=True) if placed else ((), ())
            bars = ax.bar(xs, ys, width, label=impl, color=color(k), hatch=hatch(k))
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)), [c.replace(" seqs ", " seqs\n") for c in cases],
                      fontsize=8)  # fmt: skip
        ax.set_title(panel_title)
        ax.set_ylabel(unit + " (log scale)")
        ax.set_xlabel("workload, sequences, heads q/kv/dim")
    axes[0].legend(title="implementation")
    fig.suptitle(title)
    return fig


def working_memory_figure(temp_bytes, kv_cache_bytes) -> Figure:
    """XLA's working memory of one compiled call against max_kv_len, one line per
    implementation, with the KV cache's own size for scale.

    `temp_bytes` maps an implementation name to {max_kv_len: bytes}; `kv_cache_bytes` maps
    each max_kv_len to the bytes of the kv_pages argument.

    >>> fig = working_memory_figure({"jnp": {256: 2**22, 1024: 2**24}, "blockwise": {256: 2**20,
    ...                              1024: 2**20}}, {256: 2**23, 1024: 2**25})
    >>> fig.axes[0].get_title()
    'Working memory of one compiled call as max_kv_len grows'
    """
    fig = new_figure(7, 4.8)
    ax = fig.subplots()
    for k, (impl, by_len) in enumerate(temp_bytes.items()):
        ax.plot(list(by_len), [b / 2**20 for b in by_len.values()], marker="o",
                color=color(k), label=f"{impl}: temp memory")  # fmt: skip
    cache_mib = [b / 2**20 for b in kv_cache_bytes.values()]
    ax.plot(list(kv_cache_bytes), cache_mib, "k--", label="the KV cache itself (argument)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(kv_cache_bytes), [str(n) for n in kv_cache_bytes])
    ax.set_yscale("symlog", linthresh=1.0)  # linear below 1 MiB, so that 0 can be shown
    ax.set_ylim(bottom=0)
    ax.set_xlabel("max_kv_len = pages_per_seq * page_size (log scale)")
    ax.set_ylabel("MiB (log scale above 1)")
    ax.set_title("Working memory of one compiled call as max_kv_len grows")
    ax.legend()
    return fig


def save_figure(fig: Figure, path: Path) -> Path:
    """Save `fig` as a PNG at `path`, making its folder if needed; returns the path.

    >>> import tempfile
    >>> fig = working_memory_figure({"jnp": {256: 2**22}}, {256: 2**23})
    >>> save_figure(fig, Path(tempfile.mkdtemp()) / "plots" / "memory.png").exists()
    True
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
