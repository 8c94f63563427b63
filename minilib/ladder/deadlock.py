"""A wait that nothing will end fails in seconds, not at a test's ten-minute watchdog.

In TPU interpret mode a kernel whose copies move fewer bytes than its wait takes (a copy of
`kv_len // page_size` pages where the wait expects `cdiv`) does not fail: the wait waits for
ever, as it would on the chip. `watch_kernel` (minilib.ladder.watch) catches that for the
checkers, beside its ledger of every copy. `fail_fast_on_deadlock` is the same check alone,
light enough to wrap every test that runs a kernel: while it is active, a wait whose semaphore
is short of bytes, with no copy queued to signal it and no other core that could, raises
`KernelDeadlock`, naming the semaphore, the bytes it wanted and had, and the wait's line
(where JAX says it).

A wait is judged twice: when it starts, and while it waits (a watcher thread looks every
`poll` seconds; in `dma_execution_mode="on_wait"` the copies run inside the wait, so only
then is it known that they were too few). Only a wait that stays stuck, its count unchanged
for `patience` seconds with nothing queued, is called a deadlock: a copy that is running
is never mistaken for one: a copy in interpret mode takes milliseconds, the patience is five
seconds, and a test's watchdog ten minutes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

from minilib.ladder.watch import (
    KernelDeadlock,
    _count,
    _interpreter_parts,
    _line,
    never_signalled,
    release,
)

__all__ = ["fail_fast_on_deadlock"]


@dataclasses.dataclass
class _Waiting:
    """One wait in progress: what it waits for, and since when its count has not moved."""

    sem: object
    value: int
    core: int
    is_dma: bool
    line: str
    count: int
    since: float
    stuck: str = ""  # the deadlock's description, once the watcher has found one


def _describe(wait: _Waiting, count: int) -> str:
    kind = "DMA semaphore" if wait.is_dma else "semaphore"
    where = f" (the wait at {wait.line})" if wait.line else ""
    return (
        f"deadlock: a wait on {kind} {wait.sem.id}{where}, core {wait.core}, for {wait.value} "
        f"bytes, and it holds {count}, with no copy in flight to signal it: the copies on it "
        "moved fewer bytes than the wait takes back, or none was started. On a TPU the kernel "
        "would hang here."
    )


@contextlib.contextmanager
def fail_fast_on_deadlock(*, patience: float = 5.0, poll: float = 0.25):
    """Inside this block, a kernel's wait that can never end raises `KernelDeadlock` (see
    the module docstring): at once when nothing was queued to signal it, after `patience`
    seconds when the copies queued ran and were too few. Resets the interpreter's state
    after a deadlock, as JAX asks after a kernel raised.

    >>> import jax, jax.numpy as jnp
    >>> from jax.experimental import pallas as pl
    >>> from jax.experimental.pallas import tpu as pltpu
    >>> def copies_half(x_hbm_ref, o_ref, buf, sem):
    ...     pltpu.make_async_copy(x_hbm_ref.at[:4], buf.at[:4], sem).start()  # 4 rows copied
    ...     pltpu.make_async_copy(x_hbm_ref, buf, sem).wait()  # 8 rows waited for
    ...     o_ref[...] = buf[...]
    >>> call = pl.pallas_call(copies_half, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
    ...     scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
    ...     interpret=pltpu.InterpretParams())
    >>> with fail_fast_on_deadlock():
    ...     try:
    ...         _ = jax.block_until_ready(call(jnp.ones((8, 128))))
    ...     except Exception as err:   # seconds, where the wait alone would never return
    ...         raised = err
    >>> "for 4096 bytes, and it holds 2048" in str(raised)
    True
    """
    parts = _interpreter_parts()
    original = parts.semaphore.wait
    waiting: dict[int, _Waiting] = {}  # thread id -> its wait
    lock = threading.Lock()
    done = threading.Event()
    found = []

    def guarded_wait(sem, value, global_core_id, *args, **kwargs):
        is_dma = bool(kwargs.get("is_dma") or kwargs.get("has_tasks"))
        core = int(global_core_id)
        info = kwargs.get("logging_info")
        line = _line(getattr(info, "source_info", None))
        count = _count(sem, core)
        wait = _Waiting(
            sem=sem,
            value=int(value),
            core=core,
            is_dma=is_dma,
            line=line,
            count=count,
            since=time.monotonic(),
        )
        if never_signalled(sem, int(value), core, is_dma, parts):
            found.append(wait)
            raise KernelDeadlock(_describe(wait, count))
        with lock:
            waiting[threading.get_ident()] = wait
        try:
            result = original(sem, value, global_core_id, *args, **kwargs)
        finally:
            with lock:
                waiting.pop(threading.get_ident(), None)
        if wait.stuck:
            found.append(wait)
            raise KernelDeadlock(wait.stuck)
        return result

    def watch_the_waits():
        while not done.wait(poll):
            with lock:
                waits = list(waiting.values())
            for wait in waits:
                count = _count(wait.sem, wait.core)
                if count != wait.count:  # a copy landed: it is not stuck
                    wait.count = count
                    wait.since = time.monotonic()
                    continue
                if not never_signalled(wait.sem, wait.value, wait.core, wait.is_dma, parts):
                    wait.since = time.monotonic()
                    continue
                if time.monotonic() - wait.since >= patience and not wait.stuck:
                    wait.stuck = _describe(wait, count)
                    release(wait.sem, wait.core, wait.value)  # it then raises

    watcher = threading.Thread(target=watch_the_waits, name="deadlock watcher", daemon=True)
    parts.semaphore.wait = guarded_wait
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        parts.semaphore.wait = original
        if found:
            parts.reset()
