"""The kernel's trace: one row per DMA start, DMA wait and compute, written into SMEM.

`minilib.schedule.record_schedule` runs the kernel with its trace on, to show that the plan it
works out in Python is what the kernel really does. The kernel records into a `Trace` through
`minilib.kernel.tracing`, a wrapper around the kernel body; with no trace asked for, the wrapper
is not there, and nothing of this is in the compiled kernel. (`Trace(None, 0)` records nothing.)

The trace output is i32[1 + capacity, TRACE_FIELDS]: `trace[0, 0]` counts the events, and rows
1.. are (kind, step heads block, step q block, heads block, seq, kv block, slot).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["TRACE_COMPUTE", "TRACE_FIELDS", "TRACE_START", "TRACE_WAIT", "Trace"]

# Event kinds.
TRACE_START, TRACE_WAIT, TRACE_COMPUTE = 1, 2, 3
TRACE_FIELDS = 7  # kind, step heads block, step q block, heads block, seq, kv block, slot


class Trace:
    """Appends events to the SMEM trace output; does nothing when no trace was asked for.

    `record` takes the grid step (heads_blk, q_blk) and the KV block's work (anything with
    `heads_blk`, `seq` and `kv_blk`, such as the kernel's `Work`).

    >>> Trace(None, 0).record(TRACE_START, (0, 0), None, 0) is None   # no trace: nothing to do
    True
    """

    def __init__(self, trace_ref, capacity: int):
        self.trace_ref = trace_ref  # i32[1 + capacity, TRACE_FIELDS]; [0, 0] counts the events
        self.capacity = capacity

    def reset(self):
        if self.trace_ref is not None:
            self.trace_ref[0, 0] = 0

    def record(self, kind: int, step, work, slot):
        if self.trace_ref is None:
            return
        n = self.trace_ref[0, 0]

        @pl.when(n < self.capacity)
        def _():
            fields = (kind, *step, work.heads_blk, work.seq, work.kv_blk, slot)
            for j, value in enumerate(fields):
                self.trace_ref[n + 1, j] = jnp.asarray(value, jnp.int32)

        self.trace_ref[0, 0] = n + 1
