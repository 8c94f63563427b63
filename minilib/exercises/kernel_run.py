"""A learner's kernel, run in the strictest TPU interpret mode and watched: `KernelRun`.

`run_in_strict_interpret_mode(fn)` runs the kernel with `interpret=strict_interpret_params(...)`
(`minilib.ladder.interpret`: scratch starts as NaN, DMAs land eagerly, the race detector is on),
inside `minilib.ladder.watch.watch_kernel`, which keeps the ledger of its copies and waits. A run
gives back a `KernelRun`: the output or the interpreter's error, the race detector's verdict,
the ledger, and the grid steps in the order they ran.

A deadlock is caught by the ledger the moment the kernel waits for a copy that nothing will
signal. A kernel that loops for ever is stopped inside the interpreter after
`KERNEL_TIMEOUT_SECONDS`, so that no thread is left waiting.

`minilib.exercises.kernel_failures` says in plain words what went wrong in a run;
`minilib.exercises.kernel_checking` compares runs with the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np

from minilib.exercises.checking import call_with_time_limit
from minilib.ladder.interpret import strict_interpret_params
from minilib.ladder.watch import Watch, watch_kernel

__all__ = ["KERNEL_TIMEOUT_SECONDS", "KernelRun", "run_in_strict_interpret_mode"]

# A deadlock is caught the moment it happens; this limit only stops a kernel that loops for
# ever (a `while_loop` whose condition never turns false), and is generous so that a slow
# machine never makes a right answer look like one.
KERNEL_TIMEOUT_SECONDS = 60.0
INTERPRETER_SIGNS = ("Out-of-bounds", "CpuCallback", "Revisited block", "KernelDeadlock",
                     "KernelStopped")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KernelRun:
    """What one run of the learner's kernel produced.

    `stopped_after`: the seconds after which a run that did not finish was stopped (its time
    limit); `error`: the interpreter's error as JAX wrote it (an out-of-bounds read, a
    deadlock, ...); `watch`: the ledger of its copies (`minilib.ladder.watch.Watch`); `grid`:
    the (grid point, core) pairs in the order the interpreter ran them, when recorded.

    >>> run = KernelRun(out=None, stopped_after=60.0)   # stopped at its time limit
    >>> run.hung, run.out is None and not run.raced
    (True, True)
    """

    out: object
    raced: bool = False
    stopped_after: float | None = None
    error: str | None = None
    watch: Watch | None = None
    grid: tuple = ()

    @property
    def hung(self) -> bool:
        """The run did not finish: it was stopped at its time limit."""
        return self.stopped_after is not None

    @property
    def output(self) -> str:
        """Everything the interpreter printed or logged during the run."""
        return self.watch.output if self.watch is not None else ""


def run_in_strict_interpret_mode(
    fn: Callable,
    timeout: float | None = None,
    *,
    num_cores: int = 1,
    random_seed: int | None = None,
    record_grid: bool = False,
    uninitialized_memory: str = "nan",
):
    """`fn` run with `interpret=strict_interpret_params(...)`, watched; returns a KernelRun.
    (`uninitialized_memory="zero"`: scratch and outputs start as 0, for a checker's probe.)

    A learner's error while tracing (a TypeError in their code, NotImplementedError) is
    raised, for `run_check` to report with their line. An error of the interpreter while the
    kernel runs (out of bounds, a deadlock) comes back in `KernelRun.error`. After `timeout`
    seconds (default KERNEL_TIMEOUT_SECONDS) the kernel is stopped and the run is `hung`.

    >>> import jax.numpy as jnp
    >>> from minilib.pallas_basics import add_vectors
    >>> x = jnp.arange(8.0)
    >>> run = run_in_strict_interpret_mode(add_vectors)(x, x, block_size=8)
    >>> run.out.tolist(), run.raced, run.hung, run.error
    ([0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0], False, False, None)
    """

    # One jitted function per set of options: cases of the same shapes share one compile (a
    # compile in interpret mode takes seconds, a run a fraction of one). The recorder is the
    # same function for every run, so that a compiled kernel calls the current run's.
    now = {"points": [], "watch": None}

    def record(*point):  # (token,) grid point, core; from jax 0.8, return the token
        now["points"].append((tuple(int(x) for x in np.asarray(point[-2])), int(point[-1])))
        now["watch"].step = len(now["points"]) - 1  # the copies started now are this step's
        return point[0] if len(point) == 3 else None

    params = strict_interpret_params(
        num_cores=num_cores,
        random_seed=random_seed,
        grid_point_recorder=record if record_grid else None,
        uninitialized_memory=uninitialized_memory,
    )
    compiled = {}

    def jitted(kwargs: dict):
        key = tuple(sorted(kwargs.items()))
        if key not in compiled:
            compiled[key] = jax.jit(functools.partial(fn, interpret=params, **kwargs))
        return compiled[key]

    def run(*args, **kwargs):
        points = now["points"] = []
        seconds = KERNEL_TIMEOUT_SECONDS if timeout is None else timeout
        with watch_kernel() as watch:
            now["watch"] = watch

            def kernel_run():
                return jax.block_until_ready(jitted(kwargs)(*args))

            finished, out, error = call_with_time_limit(
                kernel_run, (), {}, seconds, on_timeout=watch.stop
            )
        if not finished:
            return KernelRun(out=None, stopped_after=seconds, watch=watch)
        if error is not None:
            if watch.deadlock is not None or _from_the_interpreter(error):
                return KernelRun(
                    out=None, error=_error_text(error), watch=watch, grid=tuple(points)
                )
            raise error
        return KernelRun(out, raced=watch.raced, watch=watch, grid=tuple(points))

    return run


def _from_the_interpreter(error: BaseException) -> bool:
    if type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError"):
        return True
    return any(sign in _error_text(error) for sign in INTERPRETER_SIGNS)


def _error_text(error: BaseException) -> str:
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n".join(parts)
