"""Checking a Pallas kernel the learner wrote: interpret mode, the DMA ledger, and Mosaic.

`check_kernel` runs the learner's kernel and a plain-jnp reference on the same cases, like every
checker (`checking.run_check`), with more:

* the kernel runs in the strictest TPU interpret mode this JAX has
  (`minilib.ladder.interpret.strict_interpret_params`: scratch starts as NaN, DMAs land
  eagerly, the race detector is on), watched by `minilib.ladder.watch`
  (`minilib.exercises.kernel_run`). These fail the check even when the numbers agree, each
  with what it means: a deadlock (reported the moment the kernel waits for a copy that nothing
  will signal, not after a timeout); a copy started and never waited for; two copies in flight
  on one semaphore; a copy into a slot that an earlier copy is still filling; a race;
* an out-of-bounds read, or any other error of the interpreter, becomes one paragraph that
  names the likely cause (`minilib.exercises.kernel_failures`); the race detector's and the
  interpreter's own output is kept, and shown with `details=True`;
* when the output is wrong, the report says which sequences or rows differ, and which known
  mistake the output matches (`mistakes`), or what NaN in it usually means;
* when every case passes and libtpu is installed, the kernel is compiled for a real chip (v5e)
  with Mosaic (`minilib.tpu.compile.compile_for_tpu`): "will it compile on a TPU?" on a laptop.
  Without libtpu (a Mac, Windows, or a Linux host without it), JAX's own lowering for TPU,
  told the chip, checks the block shapes (`lower_for_tpu`). A kernel refused fails; but where
  that lowering stops only to ask which TPU it lowers for, which this machine cannot say, the
  check passes on the interpret-mode result, and says in one line what was not checked.

Nothing outlives a check: a deadlocked or runaway kernel is stopped inside the interpreter, so
no thread is left waiting, and nothing it printed reaches a later cell.

The learner's function has the kernels' signature: `fn(*arrays, **options, interpret=...)`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import traceback
import types
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import jax
import numpy as np

from minilib.exercises.checking import FAILED, PASSED, Case, CheckResult, run_check
from minilib.exercises.comparisons import Mismatch, compare_arrays, indent
from minilib.exercises.kernel_failures import (
    REQUIRED,
    Names,
    dma_problem,
    interpreter_error,
    likely_cause,
    race_report,
)
from minilib.exercises.kernel_run import (
    KERNEL_TIMEOUT_SECONDS,
    KernelRun,
    run_in_strict_interpret_mode,
)
from minilib.ladder.interpret import MISSING_OPTIONS
from minilib.tpu.numerics import BF16_PASS_TOLERANCE, one_bf16_pass

# `check_kernel` is what the checkers of notebooks 07 and 08 call, and `compare_kernel_output`
# its comparison. `compile_on_tpu` and the functions after it, its last step, are left out:
# what they do depends on whether libtpu is installed, and check_kernel's example runs them.
__all__ = ["TableRead", "check_kernel", "compare_kernel_output", "index_map_read_outside"]

COMPILE_CHIP = "v5e"
MOSAIC_MESSAGE_LINES = 25


def compare_kernel_output(
    mistakes: dict[str, Callable],
    atol: float,
    rtol: float,
    *,
    names: Callable[[Case], Names] | None = None,
    locate: Callable | None = None,
    advice: Callable[[str], str] | None = None,
    diagnose: Callable | None = None,
    details: bool = False,
    ledger_check: Callable | None = None,
    block_cause: Callable | None = None,
    pattern: Callable | None = None,
    error_ledger_check: Callable | None = None,
):
    """Compare a KernelRun with the reference; on any problem, say what it means.

    In order: a run that hung; a deadlock or other interpreter error; a DMA problem of the
    ledger, then the rung's own `ledger_check(run, case)`; a race; a wrong output, with
    `locate(expected, got, case)` (which sequences or rows
    differ) and the likely cause: `diagnose(got, case)` (a rung's own probe), else the first
    of `mistakes` (explanation -> a jnp function making that mistake) that the output matches,
    else `pattern(expected, got, case)` (what the rung reads in which rows, heads or sequences
    are wrong). `block_cause(step, index, case)` names the cause of an out-of-bounds block
    from the grid step and the block the index map chose. `error_ledger_check(run, case)` may
    name, from the copies made before it, the cause of a run that stopped with an error.

    >>> import numpy as np
    >>> compare = compare_kernel_output(mistakes={}, atol=1e-5, rtol=1e-5)
    >>> try:
    ...     compare(np.ones(2), KernelRun(np.array([1.0, np.nan])), Case("x", ()))
    ... except Mismatch as diff:
    ...     print(diff)
    output: got nan at index (1,) (expected 1); 1 of 2 elements are not finite.
    Likely cause: NaN in the output. In this interpret mode scratch memory starts as NaN, ...
    """

    def compare(expected, got: KernelRun, case: Case) -> None:
        named = names(case) if names is not None else Names()
        shown = "\n".join(x for x in (got.output, got.error or "") if x)
        raw = f"\nJAX's own output:\n{indent(shown)}" if details and shown else ""
        if got.hung:
            raise Mismatch(
                f"expected the kernel to finish; it was stopped after "
                f"{got.stopped_after:.0f} s.\nLikely cause: an endless loop (a "
                "`while_loop` whose condition never turns false?)." + raw
            )
        if got.error is not None and error_ledger_check is not None and got.watch is not None:
            early = error_ledger_check(got, case)
            if early is not None:
                then = interpreter_error(got, named, advice).split(" Likely cause:")[0]
                raise Mismatch(f"{early}\n(The kernel then stopped with {then})" + raw)
        if got.error is not None:
            cause = functools.partial(block_cause, case=case) if block_cause else None
            raise Mismatch(interpreter_error(got, named, advice, cause) + raw)
        problem = dma_problem(got, named, advice)
        schedule = False  # a problem of the copies' schedule alone, no hazard to the data
        if problem is None and ledger_check is not None and got.watch is not None:
            problem = ledger_check(got, case)
            schedule = problem is not None
        if problem is None and got.raced:
            problem = race_report(got, named)
        if problem is not None:
            output = _output_too(expected, got, case, atol, rtol, locate, problem, schedule)
            raise Mismatch(problem + output + raw)
        try:
            compare_arrays(expected, got.out, "output", atol=atol, rtol=rtol)
        except Mismatch as diff:
            where = f"\n{locate(expected, got.out, case)}" if locate is not None else ""
            cause = diagnose(got, case) if diagnose is not None else None
            read = pattern(expected, got.out, case) if pattern is not None else None
            cause = cause or likely_cause(got.out, case, mistakes, read)
            raise Mismatch(f"{diff}{where}\nLikely cause: {cause}" + raw) from None

    return compare


def _output_too(
    expected, got: KernelRun, case: Case, atol, rtol, locate, problem: str, schedule: bool = False
) -> str:
    """What the output says besides `problem`: wrong too, or right (checked here). A right
    output with a schedule problem (no overlap; `schedule`: the rung's check of the copies'
    order, with no hazard to the data: no race, no copy left in flight or overwritten) is a
    right kernel that skips what the rung is about: said so, with what the rung requires."""
    try:
        compare_arrays(expected, got.out, "output", atol=atol, rtol=rtol)
    except Mismatch:
        where = locate(expected, got.out, case) if locate is not None else ""
        return f"\n(The output is wrong too{': ' + where if where else '.'})"
    except Exception:
        return ""
    for words, required in REQUIRED.items():
        if words in problem:
            return (
                "\n(Your kernel's output is right on this case, checked against the reference: "
                f"the numbers are not the problem; {required}.)"
            )
    if schedule:
        return (
            "\n(Your kernel's output is right on this case, checked against the reference: "
            "the numbers are not the problem; the schedule of its copies is.)"
        )
    return "\n(The output happens to be right on this case; on a chip it need not be.)"


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
    details: bool = False,
    record_grid: bool = False,
    extra_check: Callable | None = None,
    explain_error: Callable | None = None,
    **explainers: Callable | None,
) -> CheckResult:
    """Run `fn` against `reference` on `cases` in strict TPU interpret mode, watched, then
    compile it for v5e on `compile_case` (shapes and dtypes only) when libtpu is installed.

    `explainers`, passed on to `compare_kernel_output`: `names`, `locate`, `advice`,
    `diagnose`, `ledger_check`, `block_cause`, `pattern`: how a rung names its copies, places
    a wrong output, explains an out-of-bounds access, probes a wrong output, checks its
    copies further, explains an out-of-bounds block, and reads the rows a wrong output has.
    `record_grid`: record the kernel's grid steps (`KernelRun.grid`, and `Copy.step` of each
    copy); `extra_check(run, case)` may then fail a run whose output is right (a "parallel"
    axis that carries state).
    `explain_error(error, case)` may name the likely cause of an error the learner's code
    raised. `details`: add JAX's own output (race detector, interpreter) to a failure.

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
    if one_bf16_pass():
        # The kernel's float32 dots at the default precision run as one bfloat16 pass (a TPU,
        # or its emulation); the reference's are exact float32 (Precision.HIGHEST).
        atol, rtol = max(atol, BF16_PASS_TOLERANCE), max(rtol, BF16_PASS_TOLERANCE)
    compare = compare_kernel_output(mistakes, atol, rtol, details=details, **explainers)
    if extra_check is not None:
        compare = _then(compare, extra_check)
    # The kernel run has its own time limit and stops the kernel at it; the check's own
    # limit only backs it up. The answer is a KernelRun, whose type `compare` checks.
    watched = run_in_strict_interpret_mode(fn, record_grid=record_grid)
    result = run_check(
        name,
        watched,
        reference,
        cases,
        compare,
        verbose=False,
        time_limit=KERNEL_TIMEOUT_SECONDS + 30,
        check_answer_type=False,
        explain_error=explain_error,
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
    run = functools.partial(_run_kernel_again, watched, reference)
    return CheckResult(name, status, report, result.cases_run, case=result.case, run=run)


def _run_kernel_again(watched: Callable, reference: Callable, case: Case) -> tuple:
    """(expected, got) for `CheckResult.rerun`: the kernel run again in strict interpret
    mode, watched; a run that stopped (an error of the interpreter, a deadlock, its time
    limit) raises RuntimeError with what stopped it."""
    expected = reference(*case.args, **case.kwargs)
    run = watched(*case.args, **case.kwargs)
    if run.hung:
        raise RuntimeError(f"the kernel was stopped after {run.stopped_after:.0f} s")
    if run.error is not None:
        raise RuntimeError(f"the kernel stopped with an error:\n{run.error}")
    return expected, run.out


def _then(compare, extra_check):
    def compare_then_check(expected, got, case):
        compare(expected, got, case)
        problem = extra_check(got, case)
        if problem:
            raise Mismatch(problem)

    return compare_then_check


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


def lower_for_tpu(
    fn: Callable, case: Case, reason: str, chip: str | None = COMPILE_CHIP
) -> tuple[str, str]:
    """(status, note) without libtpu: JAX's own lowering of the kernel for a TPU
    (`jax.export`), told it lowers for `chip` (`described_chip`), which checks the block
    shapes against the (8, 128) tiles. Mosaic's compile passes need libtpu. `chip=None`
    lowers as `jax.export` alone does, for this machine's own device.

    A refusal fails the check, except when the lowering stopped to ask JAX which TPU it lowers
    for and this machine has none to name (`asked_which_tpu`): that says nothing of the
    kernel, so the check passes on its interpret-mode result, and the note says what was not
    checked and how to check it. (Not told the chip, jax 0.12 cannot lower `//` on a traced
    integer: its lowering of the sign asks for the chip's generation.)

    >>> import jax.numpy as jnp
    >>> from jax.experimental import pallas as pl
    >>> from jax.experimental.pallas import tpu as pltpu
    >>> def kernel(n_ref, o_ref):   # [1] int32 -> [1] int32: n // 8, n a traced integer
    ...     o_ref[0] = n_ref[0] // 8
    >>> smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    >>> out_shape = jax.ShapeDtypeStruct((1,), jnp.int32)
    >>> fn = pl.pallas_call(kernel, out_shape=out_shape, in_specs=[smem], out_specs=smem)
    >>> status, note = lower_for_tpu(fn, Case("n = 17", (jnp.array([17], jnp.int32),)), "")
    >>> status, note.split(";")[0]
    ('passed', 'It lowers for v5e (n = 17)')
    """
    from jax import export

    told = jax.sharding.use_abstract_mesh(described_chip(chip)) if chip else nullcontext()
    where = f"for {chip or 'a TPU not named'} ({case.description})"
    try:
        with told, frames_kept():
            export.export(jax.jit(fn), platforms=["tpu"])(*case.args)
    except Exception as err:
        if asked_which_tpu(err):
            return PASSED, (
                f"The TPU compile was not checked here ({case.description}): JAX's lowering "
                "asked which TPU it compiles for, which it cannot know here without libtpu. "
                f"{reason} (libtpu is for Linux on x86-64; elsewhere, run the check on "
                "Colab's TPU runtime.)"
            )
        message = f"{type(err).__name__}: {err}".split("See details")[0].strip()
        return FAILED, f"JAX's lowering for TPU refuses it {where}:\n  {message}"
    return PASSED, f"It lowers {where}; Mosaic's own compile was not run: {reason}"


def described_chip(chip: str):
    """A one-device abstract mesh of `chip` (a key of `minilib.chips.FACTS`), described by its
    device kind alone: no libtpu needed. Inside `jax.sharding.use_abstract_mesh(...)` of it,
    JAX's TPU lowering lowers for that chip, not for this machine's own device.

    >>> described_chip("v5e").abstract_device.device_kind
    'TPU v5 lite'
    """
    from minilib.chips import DEVICE_KINDS, FACTS
    from minilib.tpu.compile import abstract_mesh

    kinds = [kind for kind, name in DEVICE_KINDS.items() if name == chip]
    if not kinds:
        raise ValueError(f"{chip=} is not a chip of minilib.chips; use one of {list(FACTS)}")
    return abstract_mesh(types.SimpleNamespace(device_kind=kinds[0]))


def asked_which_tpu(err: BaseException) -> bool:
    """Whether `err` is JAX's TPU lowering asking which TPU it lowers for and finding none:
    raised where JAX describes the TPU it lowers for (`get_tpu_info`, read from the device
    kind), on a machine whose JAX backend is not a TPU. (Only with the traceback's JAX frames
    kept: `frames_kept`.)

    >>> asked_which_tpu(ValueError("Unsupported TPU device kind: cpu"))  # raised here
    False
    """
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return False
    raised_in = frames[-1]
    in_tpu_info = Path(raised_in.filename).name == "tpu_info.py"
    asked = in_tpu_info and raised_in.name == "get_tpu_info"
    return asked and jax.default_backend() != "tpu"


def frames_kept():
    """JAX's own frames kept in the traceback of an error inside the block (JAX removes them
    by default), for `asked_which_tpu` to see where the error was raised."""
    from jax._src import config as jax_config

    return jax_config.traceback_filtering("off")


def compile_in_this_process(fn: Callable, args: tuple, chip: str) -> tuple[bool, str | None]:
    """(compiled, error): `jax.jit(fn)` lowered and compiled for a compile-only `chip` device
    in this process (libtpu must be installed). Only whether it compiles, no statistics."""
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from minilib.tpu.compile import abstract_mesh, default_layouts_assumed

    try:
        topology = topologies.get_topology_desc(
            topology_name=f"{chip}:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1)
        )
        device = topology.devices[0]
        sharding = SingleDeviceSharding(device)
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
        # The lowering asks which chip it lowers for (jax 0.12's `//` on a traced integer
        # does); off a TPU, this process's device is a CPU: tell it the chip.
        with jax.sharding.use_abstract_mesh(abstract_mesh(device)):
            lowered = jax.jit(fn).lower(*structs)
        with default_layouts_assumed():  # Colab's libtpu 0.0.21.1 crashes jax's layout query
            lowered.compile()
    except Exception as err:  # Mosaic's (or XLA's) refusal is the result
        return False, f"{type(err).__name__}: {err}"
    return True, None


# --- what an index map reads from the scalar-prefetch tables ------------------------------------


@dataclasses.dataclass(frozen=True)
class TableRead:
    """An index map's read outside a scalar-prefetch table: at grid step `step`, the index map
    of block mapping `mapping` read `table` (its position among the scalar-prefetch operands)
    at `index`, outside its `shape`.

    >>> read = TableRead(step=(2, 0), mapping=1, table=1, index=(2, -1), shape=(8, 4))
    >>> read.index[1] < 0   # column -1 of page_indices: before row 2
    True
    """

    step: tuple[int, ...]
    mapping: int
    table: int
    index: tuple[int, ...]
    shape: tuple[int, ...]


class _CannotCheck(Exception):
    """An index map this evaluator does not follow (a slice, a ref passed on): not checked."""


@dataclasses.dataclass(frozen=True)
class _Table:
    position: int
    values: np.ndarray


def index_map_read_outside(fn: Callable, case: Case) -> TableRead | None:
    """The first read of an index map outside a scalar-prefetch table (`kv_lens`,
    `page_indices`), over every grid step of `fn`'s pallas_call on `case`; None if there is
    none, or if it cannot be checked.

    TPU interpret mode stops on a read past a table's end, but before jax 0.12.1 a negative
    index wraps around to the axis's end, and the run goes on; on a chip an index map reads
    SMEM unchecked: another row, another array, or whatever lies beyond. So the index maps are
    evaluated here, step by step, with every read of a table checked against its shape, which
    also names the read that stopped the interpreter, whichever it met first.

    >>> from minilib.ladder.scalar_prefetch import paged_decode_attention
    >>> from minilib.batch import make_batch
    >>> b = make_batch([(1, 5), (1, 12)], num_q_heads=2, num_kv_heads=1, head_dim=128,
    ...                page_size=8)
    >>> case = Case("", (b.q, b.kv_pages, b.kv_lens, b.page_indices), {"sm_scale": 0.1})
    >>> print(index_map_read_outside(paged_decode_attention, case))
    None
    """
    try:
        jaxpr = jax.make_jaxpr(functools.partial(fn, interpret=False, **case.kwargs))(*case.args)
    except Exception:
        return None
    call = next((e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"), None)
    if call is None:
        return None
    grid_mapping = call.params["grid_mapping"]
    num_tables = grid_mapping.num_index_operands
    given = dict(zip(jaxpr.jaxpr.invars, case.args, strict=True))
    if num_tables == 0 or any(v not in given for v in call.invars[:num_tables]):
        return None  # no tables, or tables computed inside fn: not followed
    tables = [_Table(k, np.asarray(given[v])) for k, v in enumerate(call.invars[:num_tables])]
    try:
        grid = tuple(int(n) for n in grid_mapping.grid)
    except TypeError:  # a dynamic grid
        return None
    found: list[TableRead] = []
    try:
        for step in itertools.product(*(range(n) for n in grid)):
            for m, mapping in enumerate(grid_mapping.block_mappings):
                closed = mapping.index_map_jaxpr

                def check(table: _Table, index: tuple[int, ...], step=step, m=m) -> None:
                    shape = table.values.shape
                    if any(not 0 <= i < n for i, n in zip(index, shape, strict=True)):
                        found.append(TableRead(step, m, table.position, index, shape))
                        raise _CannotCheck  # the first is enough

                indices = [np.int32(i) for i in step]
                _evaluate(closed.jaxpr, closed.consts, [*indices, *tables], check)
    except _CannotCheck:
        pass
    except Exception:  # an index map this evaluator cannot run: not checked
        return None
    return found[0] if found else None


def _evaluate(jaxpr, consts, args, check) -> list:
    """Evaluate `jaxpr`, each read of a `_Table` (a `get`) checked by `check(table, index)`."""
    from jax import tree_util
    from jax._src import core

    env = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "get" and isinstance(values[0], _Table):
            table, *flat = values
            (indexer,) = tree_util.tree_unflatten(eqn.params["tree"], flat)
            index = tuple(int(np.asarray(i)) if np.ndim(i) == 0 else None
                          for i in indexer.indices)  # fmt: skip
            if None in index or len(index) != table.values.ndim:
                raise _CannotCheck
            check(table, index)
            out = [table.values[index]]
        elif name in ("pjit", "jit", "closed_call", "core_call"):
            inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            inner_consts = getattr(inner, "consts", ())
            out = _evaluate(getattr(inner, "jaxpr", inner), inner_consts, values, check)
        elif any(isinstance(x, _Table) for x in values):
            raise _CannotCheck
        else:
            out = eqn.primitive.bind(*values, **eqn.params)
            out = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, out, strict=True))
    return [read(v) for v in jaxpr.outvars]
