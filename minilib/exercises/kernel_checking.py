"""Checking a Pallas kernel the learner wrote: interpret mode, the race detector, and Mosaic.

`check_kernel` runs the learner's kernel and a plain-jnp reference on the same cases, like every
checker (`checking.run_check`), with three more things:

* the kernel runs in the strictest TPU interpret mode this JAX has
  (`minilib.ladder.interpret.strict_interpret_params`): scratch starts as NaN, DMAs land
  eagerly, and the race detector is on; a race fails the check even when the numbers agree;
* when the output is wrong, the report says what the output looks like (NaN, a known mistake)
  and what usually causes that;
* when every case passes and libtpu is installed, the kernel is compiled for a real chip (v5e)
  with Mosaic (`minilib.tpu.compile.compile_for_tpu`): "will it compile on a TPU?" on a laptop.
  A kernel Mosaic rejects fails the check, with Mosaic's message.

The learner's function has the kernels' signature: `fn(*arrays, **options, interpret=...)`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np

from minilib.exercises.checking import (
    FAILED,
    PASSED,
    Case,
    CheckResult,
    Mismatch,
    call_with_time_limit,
    compare_arrays,
    run_check,
)
from minilib.ladder.interpret import MISSING_OPTIONS, races_found, strict_interpret_params

# `check_kernel` is what the checkers of notebooks 07 and 08 call; the others listed are its
# steps. `compile_on_tpu` and the two functions after it, its last step, are left out: what
# they do depends on whether libtpu is installed, and check_kernel's example runs them.
__all__ = [
    "KernelRun",
    "check_kernel",
    "compare_kernel_output",
    "likely_cause",
    "run_in_strict_interpret_mode",
]

COMPILE_CHIP = "v5e"
MOSAIC_MESSAGE_LINES = 25
KERNEL_TIMEOUT_SECONDS = 60.0

NAN_CAUSES = (
    "NaN in the output. In this interpret mode scratch memory starts as NaN, and unused page "
    "slots and the keys past kv_len hold NaN. Usual causes: m, l or acc not initialised before "
    "the first KV block (`pl.when(... == 0)`); V rows past kv_len not zeroed (a masked score "
    "gives p = 0, but 0 * NaN = NaN in p @ v); a page past the sequence's last one read or "
    "computed; or the output written before the last KV block."
)
RACE_CAUSE = (
    "the race detector of TPU interpret mode found a DMA race: a copy wrote a VMEM buffer that "
    "the kernel was reading, or was read before it was waited for (the detector's lines above "
    "name both). Every `start()` needs its `wait()` before the buffer is read; start the copy "
    "of the next block only into the *other* slot, and wait on that slot's semaphore."
)

DEADLOCK_CAUSE = (
    "a deadlock: a `.wait()` on a semaphore that no started copy signals (a wait on the wrong "
    "slot's semaphore, or for a copy that was never started). It would hang on the chip too."
)


@dataclasses.dataclass(frozen=True)
class KernelRun:
    """What one run of the learner's kernel produced, and whether it raced.

    >>> run = KernelRun(out=None, raced=False, hung=True)   # stopped at its time limit
    >>> run.out is None and not run.raced
    True
    """

    out: object
    raced: bool
    hung: bool = False


def run_in_strict_interpret_mode(fn: Callable, timeout: float | None = None):
    """`fn` run with `interpret=strict_interpret_params()`; returns a KernelRun.

    A kernel that waits on a semaphore nobody signals hangs, in interpret mode as on the chip.
    The run happens in a worker thread (`call_with_time_limit`); after `timeout` seconds the
    check gives up on it, stops it where Python can, and reports a likely deadlock.
    `timeout` defaults to KERNEL_TIMEOUT_SECONDS.

    >>> import jax.numpy as jnp
    >>> from minilib.pallas_basics import add_vectors
    >>> x = jnp.arange(8.0)
    >>> run = run_in_strict_interpret_mode(add_vectors)(x, x, block_size=8)
    >>> run.out.tolist(), run.raced, run.hung
    ([0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0], False, False)
    """

    def run(*args, **kwargs):
        def kernel_run():
            out = fn(*args, interpret=strict_interpret_params(), **kwargs)
            jax.block_until_ready(out)
            return KernelRun(out, races_found())

        seconds = KERNEL_TIMEOUT_SECONDS if timeout is None else timeout
        finished, result, error = call_with_time_limit(kernel_run, (), {}, seconds)
        if not finished:
            return KernelRun(out=None, raced=False, hung=True)
        if error is not None:
            raise error
        return result

    return run


def compare_kernel_output(mistakes: dict[str, Callable], atol: float, rtol: float):
    """Compare a KernelRun with the reference; on a difference, name the likely cause.

    `mistakes` maps an explanation to a jnp function that makes that mistake (the kernel's
    arguments, no `interpret`).

    >>> compare = compare_kernel_output(mistakes={}, atol=1e-5, rtol=1e-5)
    >>> try:
    ...     compare(np.ones(2), KernelRun(np.array([1.0, np.nan]), raced=False), Case("x", ()))
    ... except Mismatch as diff:
    ...     print(diff)
    output: got nan at index (1,) (expected 1); 1 of 2 elements are not finite.
    Likely cause: NaN in the output. In this interpret mode scratch memory starts as NaN, ...
    """

    def compare(expected, got: KernelRun, case: Case) -> None:
        if got.hung:
            raise Mismatch(
                f"expected the kernel to finish; it was stopped after "
                f"{KERNEL_TIMEOUT_SECONDS:.0f} s.\n"
                f"Likely cause: an endless loop, or {DEADLOCK_CAUSE}"
            )
        if got.raced:
            raise Mismatch(
                "race detector: expected no DMA race, got one (its report is printed above)."
                f"\nLikely cause: {RACE_CAUSE}"
            )
        try:
            compare_arrays(expected, got.out, "output", atol=atol, rtol=rtol)
        except Mismatch as diff:
            cause = likely_cause(got.out, case, mistakes)
            raise Mismatch(f"{diff}\nLikely cause: {cause}") from None

    return compare


def likely_cause(out, case: Case, mistakes: dict[str, Callable]) -> str:
    """The explanation of the first mistake in `mistakes` whose output `out` matches; else
    what NaN in the output usually means; else advice to compare row by row.

    >>> case = Case("x = 1", (np.array([1.0]),))
    >>> likely_cause(np.array([2.0]), case, {"x was doubled.": lambda x: 2 * x})
    'x was doubled.'
    >>> likely_cause(np.array([np.nan]), case, {}) == NAN_CAUSES
    True
    """
    for explanation, mistaken in mistakes.items():
        try:
            compare_arrays(mistaken(*case.args, **case.kwargs), out, "output", atol=1e-3)
        except Exception:
            continue
        return explanation
    try:
        if not np.isfinite(np.asarray(out, np.float64)).all():
            return NAN_CAUSES
    except Exception:
        pass
    return (
        "none of the usual mistakes. Run the reference and your kernel on this case, and compare "
        "them row by row (which rows, heads or positions differ?)."
    )


def check_kernel(
    name: str,
    fn: Callable,
    reference: Callable,
    cases: list[Case],
    *,
    compile_case: Case,
    mistakes: dict[str, Callable],
    atol: float = 2e-5,
    rtol: float = 1e-4,
    verbose: bool = True,
) -> CheckResult:
    """Run `fn` against `reference` on `cases` in strict TPU interpret mode, then compile it for
    v5e on `compile_case` (shapes and dtypes only) when libtpu is installed.

    Prints (unless `verbose=False`) and returns a CheckResult; never raises for the learner's
    mistakes.

    >>> import jax.numpy as jnp
    >>> from jax.experimental import pallas as pl
    >>> def double_kernel(x_ref, o_ref):
    ...     o_ref[...] = 2 * x_ref[...]
    >>> def double(x, *, interpret=False):   # [8, 128] -> [8, 128]
    ...     out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     return pl.pallas_call(double_kernel, out_shape=out_shape, interpret=interpret)(x)
    >>> cases = [Case("8 x 128 ones", (jnp.ones((8, 128)),))]
    >>> result = check_kernel("double", double, lambda x: 2 * x, cases,
    ...                       compile_case=cases[0], mistakes={}, verbose=False)
    >>> result.status, result.report.splitlines()[0]
    ('passed', 'Passed: double matches the reference on all 1 cases.')
    """
    compare = compare_kernel_output(mistakes, atol, rtol)
    # The kernel run has its own time limit (a deadlock is reported as such); the check's
    # own limit only backs it up. The answer is a KernelRun, whose type `compare` checks.
    result = run_check(
        name,
        run_in_strict_interpret_mode(fn),
        reference,
        cases,
        compare,
        verbose=False,
        time_limit=KERNEL_TIMEOUT_SECONDS + 10,
        check_answer_type=False,
    )
    notes = []
    if MISSING_OPTIONS:
        notes.append(
            f"(This JAX's interpret mode has no {', '.join(MISSING_OPTIONS)}: not checked.)"
        )
    status, report = result.status, result.report
    if result.passed:
        status, compile_note = compile_on_tpu(name, fn, compile_case)
        notes.append(compile_note)
        if status == FAILED:
            report = f"FAILED: {name} is right in interpret mode, but not for a TPU."
    report = "\n".join([report, *notes])
    if verbose:
        print(report)
    return CheckResult(name=name, status=status, report=report, cases_run=result.cases_run)


def compile_on_tpu(name: str, fn: Callable, case: Case) -> tuple[str, str]:
    """(status, note): compile `fn` for v5e with Mosaic if libtpu is installed."""
    try:
        from minilib.tpu.compile import compile_for_tpu, dump_here, tpu_compile_available
    except ImportError:  # pragma: no cover - the module ships with minilib
        return PASSED, "Not compiled for a TPU: minilib.tpu.compile is missing."
    ok, reason = tpu_compile_available()
    compiled_fn = functools.partial(fn, interpret=False, **case.kwargs)
    if not ok:
        return lower_for_tpu(compiled_fn, case, reason)
    if dump_here():
        report = compile_for_tpu(compiled_fn, *case.args, chip=COMPILE_CHIP)
        compiled, error = report.compiled, report.error
    else:
        # libtpu already started in this process (any JAX call starts it where it is
        # installed), so compile_for_tpu would compile in a fresh process, for its bundle
        # statistics, and needs a picklable fn; a kernel defined in a notebook is not. Whether
        # Mosaic accepts the kernel needs no statistics: compile it here.
        compiled, error = compile_in_this_process(compiled_fn, case.args, COMPILE_CHIP)
    if compiled:
        return PASSED, f"Mosaic compiles it for {COMPILE_CHIP} ({case.description})."
    lines = error.strip().splitlines()
    shown = "\n".join("  " + line for line in lines[:MOSAIC_MESSAGE_LINES])
    hidden = len(lines) - MOSAIC_MESSAGE_LINES
    more = f"\n  ... ({hidden} more lines)" if hidden > 0 else ""
    where = f"compiling for {COMPILE_CHIP} ({case.description})"
    return FAILED, f"Mosaic's message, {where}:\n{shown}{more}"


def lower_for_tpu(fn: Callable, case: Case, reason: str) -> tuple[str, str]:
    """Without libtpu: JAX's own lowering of the kernel for a TPU (`jax.export`), which already
    checks the block shapes against the (8, 128) tiles; Mosaic's compile passes need libtpu."""
    from jax import export

    try:
        export.export(jax.jit(fn), platforms=["tpu"])(*case.args)
    except Exception as err:
        message = f"{type(err).__name__}: {err}".split("See details")[0].strip()
        return FAILED, f"JAX's lowering for TPU refuses it ({case.description}):\n  {message}"
    return PASSED, (
        f"It lowers for TPU ({case.description}); Mosaic's own compile was not run: {reason}"
    )


def compile_in_this_process(fn: Callable, args: tuple, chip: str) -> tuple[bool, str | None]:
    """(compiled, error): `jax.jit(fn)` lowered and compiled for a compile-only `chip` device
    in this process (libtpu must be installed). Only whether it compiles, no statistics."""
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    try:
        topology = topologies.get_topology_desc(
            topology_name=f"{chip}:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1)
        )
        sharding = SingleDeviceSharding(topology.devices[0])
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
        jax.jit(fn).lower(*structs).compile()
    except Exception as err:  # Mosaic's (or XLA's) refusal is the result
        return False, f"{type(err).__name__}: {err}"
    return True, None
