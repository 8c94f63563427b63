"""The kernel with its trace on: the same kernel, with a copier and a walker that record.

`minilib.schedule.record_schedule` runs the kernel with a trace (`minilib.kernel_trace`), to
show that the walk it plans in Python is what the kernel does. Tracing is a wrapper around the
kernel body (`with_trace`), so the body and its KV-block loop never mention it: the copier
records each DMA start and wait (`traced_copier`), and the walker each KV block's compute
(`traced_walker`). Without a trace, none of this is in the compiled kernel.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from minilib.kernel_trace import TRACE_COMPUTE, TRACE_START, TRACE_WAIT, Trace

__all__: list[str] = []  # used by `pallas_call.rpa_pallas_call`: see `with_trace`


def with_trace(kernel, capacity: int, points):
    """`kernel` (`plain.rpa_kernel`, its refs by name) taking a trace output, `trace_ref`, and
    run with `points` whose copier and walker record into it, up to `capacity` events."""

    def traced_kernel(*, trace_ref, **refs):
        trace = Trace(trace_ref, capacity)
        step = (pl.program_id(0), pl.program_id(1))  # (heads_blk, q_blk)

        @pl.when((step[0] == 0) & (step[1] == 0))
        def _reset_the_trace():
            trace.reset()

        traced = dataclasses.replace(
            points,
            copier=traced_copier(points.copier, trace, step),
            walker=traced_walker(points.walker, trace),
        )
        kernel(**refs, points=traced)

    return traced_kernel


def traced_copier(copier_class, trace: Trace, step):
    """`copier_class`, recording each DMA start and each wait of a KV block."""

    class TracedCopier(copier_class):
        def start(self, work, slot):
            super().start(work, slot)
            trace.record(TRACE_START, step, work, slot)

        def wait(self, work, slot):
            super().wait(work, slot)
            trace.record(TRACE_WAIT, step, work, slot)

    return TracedCopier


def traced_walker(walker_class, trace: Trace):
    """`walker_class`, recording each KV block's compute once it is issued."""

    class TracedWalker(walker_class):
        def compute(self, here, slot, span, masked=True):
            super().compute(here, slot, span, masked)
            trace.record(TRACE_COMPUTE, (self.heads_blk, self.q_blk), here, slot)

    return TracedWalker
