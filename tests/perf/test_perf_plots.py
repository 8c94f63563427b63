"""minilib.perf.plots: the benchmark's plots draw without a warning, and read well."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from figure_checks import assert_reads_well, draw  # noqa: E402

from minilib.perf.plots import bench_times_figure, working_memory_figure  # noqa: E402
from minilib.perf.timing import Timing  # noqa: E402


def test_bench_times_figure():
    fast, slow = (
        Timing(2.0, 9, 1.5, 0.004, 5, 0.005, 0, 0.004),
        Timing(9.0, 9, 7, 0.3, 5, 0.4, 0, 0.3),
    )
    timings = {
        "mixed 8 seqs 32/8/128": {"jnp": slow, "kernel": fast},
        "decode 4 seqs 8/1/64": {"jnp": slow},
    }
    fig = draw(lambda: bench_times_figure(timings, "A title"), "bench_times")
    assert_reads_well(fig)
    assert fig.get_suptitle() == "A title"
    # A bar per implementation and case it ran; an implementation missing from a case has none.
    assert [len(c) for c in fig.axes[0].containers] == [2, 1]


def test_working_memory_figure():
    fig = draw(
        lambda: working_memory_figure(
            {"jnp": {256: 2**22, 1024: 2**24}, "blockwise": {256: 2**20, 1024: 2**20}},
            {256: 2**23, 1024: 2**25},
        ),
        "working_memory",
    )
    assert_reads_well(fig)
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == [
        "jnp: temp memory",
        "blockwise: temp memory",
        "the KV cache itself (argument)",
    ]
    assert list(lines[0].get_ydata()) == [4.0, 16.0]  # MiB
