"""Checking a Pallas kernel the learner wrote: interpret mode, the DMA ledger, and Mosaic.

`check_kernel` runs the learner's kernel and a plain-jnp reference on the same cases, like every
checker (`checking.run_check`), with more:

* the kernel runs in the strictest TPU interpret mode this JAX has
  (`minilib.ladder.interpret.strict_interpret_params`: scratch starts as NaN, DMAs land
  eagerly, the race detector is on), watched by `minilib.ladder.watch`. These fail the check
  even when the numbers agree, each with what it means: a deadlock (reported the moment the
  kernel waits for a copy that nothing will signal, not after a timeout); a copy started and
  never waited for; two copies in flight on one semaphore; a copy into a slot that an earlier
  copy is still filling; a race;
* an out-of-bounds read, or any other error of the interpreter, becomes one paragraph that
  names the likely cause; the race detector's and the interpreter's own output is kept, and
  shown with `details=True`;
* when the output is wrong, the report says which sequences or rows differ, and which known
  mistake the output matches (`mistakes`), or what NaN in it usually means;
* when every case passes and libtpu is installed, the kernel is compiled for a real chip (v5e)
  with Mosaic (`minilib.tpu.compile.compile_for_tpu`): "will it compile on a TPU?" on a laptop.
  Without libtpu, JAX's own lowering for TPU checks the block shapes. A kernel refused fails.

Nothing outlives a check: a deadlocked or runaway kernel is stopped inside the interpreter, so
no thread is left waiting, and nothing it printed reaches a later cell.

The learner's function has the kernels' signature: `fn(*arrays, **options, interpret=...)`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import numpy as np

from minilib.exercises.checking import (
    FAILED,
    PASSED,
    Case,
    CheckResult,
    call_with_time_limit,
    run_check,
)
from minilib.exercises.comparisons import Mismatch, compare_arrays
from minilib.ladder.interpret import MISSING_OPTIONS, strict_interpret_params
from minilib.ladder.watch import Copy, Watch, watch_kernel

# `check_kernel` is what the checkers of notebooks 07 and 08 call; the others listed are its
# steps. `compile_on_tpu` and the two functions after it, its last step, are left out: what
# they do depends on whether libtpu is installed, and check_kernel's example runs them.
__all__ = [
    "KernelRun",
    "Names",
    "check_kernel",
    "compare_kernel_output",
    "dma_problem",
    "interpreter_error",
    "likely_cause",
    "run_in_strict_interpret_mode",
]

COMPILE_CHIP = "v5e"
MOSAIC_MESSAGE_LINES = 25
# A deadlock is caught the moment it happens; this limit only stops a kernel that loops for
# ever (a `while_loop` whose condition never turns false), and is generous so that a slow
# machine never makes a right answer look like one.
KERNEL_TIMEOUT_SECONDS = 60.0
DETAILS_HINT = "(JAX's own output: run the check again with details=True.)"

NAN_CAUSES = (
    "NaN in the output. In this interpret mode scratch memory starts as NaN, and unused page "
    "slots and the keys past kv_len hold NaN. Usual causes: m, l or acc not initialised before "
    "the first KV block (`pl.when(... == 0)`); V rows past kv_len not zeroed (a masked score "
    "gives p = 0, but 0 * NaN = NaN in p @ v); a page past the sequence's last one read or "
    "computed; or the output written before the last KV block."
)
INTERPRETER_SIGNS = ("Out-of-bounds", "CpuCallback", "Revisited block", "KernelDeadlock",
                     "KernelStopped")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Names:
    """How a report names the kernel's copies: its VMEM buffer, its semaphores in the order of
    `scratch_shapes`, and a page of `kv_pages` (a function of the page number).

    >>> names = Names(buffer="bufs", semaphores=("sems[0]", "sems[1]"))
    >>> names.copy(Copy(0, source=(7, ":"), destination=(1, ":"), buffer=0, semaphore=0, core=0))
    'the copy of kv_pages[7] into bufs[1]'
    """

    buffer: str = "buf"
    semaphores: tuple[str, ...] = ("sem",)
    page: Callable[[int], str] = "kv_pages[{}]".format

    def place(self, copy: Copy) -> str:
        return self.buffer if copy.slot is None else f"{self.buffer}[{copy.slot}]"

    def copy(self, copy: Copy) -> str:
        source = self.page(copy.page) if copy.page is not None else "kv_pages"
        return f"the copy of {source} into {self.place(copy)}"

    def semaphore(self, watch: Watch, sem_id: int) -> str:
        index = watch.semaphore_index(sem_id)
        return self.semaphores[index] if index < len(self.semaphores) else f"semaphore {index}"


@dataclasses.dataclass(frozen=True)
class KernelRun:
    """What one run of the learner's kernel produced.

    `error`: the interpreter's error as JAX wrote it (an out-of-bounds read, a deadlock, ...);
    `watch`: the ledger of its copies (`minilib.ladder.watch.Watch`); `grid`: the (grid point,
    core) pairs in the order the interpreter ran them, when recorded.

    >>> run = KernelRun(out=None, hung=True)   # stopped at its time limit
    >>> run.out is None and not run.raced
    True
    """

    out: object
    raced: bool = False
    hung: bool = False
    error: str | None = None
    watch: Watch | None = None
    grid: tuple = ()

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
):
    """`fn` run with `interpret=strict_interpret_params(...)`, watched; returns a KernelRun.

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
            return KernelRun(out=None, hung=True, watch=watch)
        if error is not None:
            if watch.deadlock is not None or _from_the_interpreter(error):
                return KernelRun(out=None, error=_error_text(error), watch=watch)
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


# --- what went wrong, in plain words -------------------------------------------------------


def dma_problem(
    run: KernelRun, names: Names, advice: Callable[[str], str | None] | None = None
) -> str | None:
    """The first DMA problem in the run's ledger, as a paragraph, or None.

    `advice(kind)` may replace the likely cause of a "deadlock", "overwrite", "shared" or
    "never_waited" with the rung's own words (None keeps the general one).

    >>> print(dma_problem(KernelRun(out=None), Names()))
    None
    """
    watch = run.watch
    if watch is None:
        return None

    def cause(kind: str, general: str) -> str:
        return f"Likely cause: {(advice(kind) if advice else None) or general}"

    first = min(watch.found, key=watch.found.get, default=None)  # what went wrong first
    if first == "deadlock":
        return _deadlock(watch, names, cause)
    if first == "overwrite":
        new, old = watch.overwrite
        if old.outstanding > 0:  # and nothing ever waited for the old one
            return (
                f"a copy was started and never waited for: {names.copy(old)}; the next copy "
                f"into the same place, {names.copy(new)}, then overwrote it. "
                + cause("never_waited", "every `start()` needs its `wait()` before the buffer "
                        "is read, or the next copy into it is started.")
            )  # fmt: skip
        return (
            f"the next copy overwrote a slot still in use: {names.copy(new)} started while "
            f"{names.copy(old)}, into the same place, had not been waited for. "
            + cause(
                "overwrite",
                "the next page must go into the *other* slot (`1 - slot`), the one the page "
                "before has finished with; a slot is free again only after its copy was "
                "waited for and its page computed.",
            )
        )
    if first == "shared":
        a, b = watch.shared[:2]
        sem = names.semaphore(watch, a.semaphore)
        return (
            f"two slots share one semaphore: {names.copy(a)} and {names.copy(b)} were in "
            f"flight together, both signalling {sem}. A wait on it returns as soon as "
            "*either* has landed, so the kernel may read a slot whose copy is still running "
            "(here the counts balance at exit and, since copies land at once in interpret "
            "mode, no race shows). "
            + cause(
                "shared",
                "each slot needs its own semaphore: copy into `bufs.at[slot]` with "
                "`sems.at[slot]`, and wait on the same one.",
            )
        )
    never = watch.never_waited()
    if never:
        listed = "; ".join(names.copy(c) for c in never[:3])
        more = f" (and {len(never) - 3} more)" if len(never) > 3 else ""
        return (
            f"a copy was started and never waited for: {listed}{more}. It is still in flight "
            "when the kernel exits, writing into VMEM that no longer belongs to it (JAX's "
            'interpreter only prints "Semaphore ... has non-zero count ... at kernel exit"). '
            + cause(
                "never_waited",
                "a copy started when there is nothing left to compute (the page after the "
                "last page, a page started again on every grid step): guard each start with "
                "the same condition as its wait, so that every copy started is waited for.",
            )
        )
    return None


def _deadlock(watch: Watch, names: Names, cause) -> str:
    d = watch.deadlock
    sem = names.semaphore(watch, d["semaphore"])
    if not d["copies"]:
        history = f"No copy was ever started on {sem}."
    else:
        history = (
            f"The copies started on {sem} were all waited for already (the last: "
            f"{names.copy(d['copies'][-1])})."
        )
    return (
        f"a deadlock: a `.wait()` on {sem} waits for {d['wanted']} bytes, {d['count']} have "
        f"arrived, and no copy in flight will signal it: on a TPU the kernel would hang here "
        f"for ever. {history} "
        + cause(
            "deadlock",
            "a wait for a copy that was never started (the first copy, or one skipped by a "
            "`pl.when`), or a wait on the other slot's semaphore.",
        )
    )


def race_report(run: KernelRun, names: Names) -> str:
    """The race detector's first race, condensed: the buffer, the two accesses, the fix."""
    races = run.watch.races() if run.watch is not None else []
    if not races:
        return (
            "the race detector of TPU interpret mode found a DMA race. Every `start()` "
            "needs its `wait()` before the buffer is read, and the next copy may go only into "
            f"the slot nobody reads. {DETAILS_HINT}"
        )
    race = races[0]
    accesses = []
    for kind, who, line in (race.first, race.second):
        copy = run.watch.copy_by_dma_id(who)
        if copy is not None:
            accesses.append(f"{names.copy(copy)} ({kind}s it; started at {_short(line)})")
        else:
            accesses.append(f"the kernel {kind}s it at {_short(line)}")
    slot = race.slot if names.buffer == "bufs" else None
    buffer = names.buffer + (f"[{slot}]" if slot is not None else "")
    return (
        f"a DMA race on {buffer}: {accesses[0]}, while {accesses[1]}, and no wait orders "
        "the two. A buffer may be read only after `.wait()` for the copy into it, and a copy "
        f"may be started only into a slot nobody reads any more. {DETAILS_HINT}"
    )


def _short(line: str) -> str:
    """'/long/path/x.py:12:4 (fn)' as 'x.py line 12 (fn)'."""
    m = re.match(r"(.*?):(\d+)(?::\d+)? \((.*)\)$", line.strip())
    if not m:
        return line.strip() or "a line JAX does not name"
    path, number, function = m.groups()
    where = "your code" if ("ipykernel" in path or "<" in path) else path.rsplit("/", 1)[-1]
    return f"{where} line {number} ({function})"


_OOB_BLOCK = re.compile(
    r"Out-of-bounds block index \(([^)]*)\) for (?:input|output) \"(\w+)\" in iteration "
    r"\(([^)]*)\).*?(?:input|output) has shape \(([^)]*)\)"
)
_OOB_ACCESS = re.compile(
    r"Out-of-bounds (read|write|swap) of \((\S+) (\S+) (\S+) (\d+)\): (?:reading|writing)? ?"
    r"\[(.*?)\] but buffer has shape \(([^)]*)\)"
)
_INDEX = re.compile(r"slice\((-?\d+), (-?\d+), -?\d+\)|(-?\d+)")


def _past_the_end(where: str, shape: str) -> str:
    """'index 1007 of axis 0 (it has 7)' for the first axis an index runs past."""
    dims = [int(x) for x in shape.replace(",", " ").split()]
    for axis, (m, dim) in enumerate(zip(_INDEX.finditer(where), dims, strict=False)):
        start, stop, single = m.groups()
        if single is not None and not 0 <= int(single) < dim:
            return f"index {single} of axis {axis} (it has {dim})"
        if start is not None and (int(start) < 0 or int(stop) > dim):
            return f"indices {start}..{int(stop) - 1} of axis {axis} (it has {dim})"
    return "an index past its end"


def interpreter_error(
    run: KernelRun, names: Names, advice: Callable[[str], str] | None = None
) -> str:
    """The interpreter's error as one paragraph: what happened, then the likely cause.

    `advice(kind)` gives the rung's likely cause for an out-of-bounds "block" (an index map),
    "copy" (a DMA source), "smem" or "vmem" access (None: the general one).

    >>> text = ('IndexError: Out-of-bounds block index (1007, 0, 0, 0) for input "page_ref" in '
    ...         'iteration (0, 1) on device 0 (core 0): reading [...] but input has shape '
    ...         '(7, 8, 4, 128).')
    >>> message = interpreter_error(KernelRun(out=None, error=text), Names())
    >>> print(message[:82])
    an out-of-bounds read: at grid step (0, 1) the index map of `page_ref` chose block
    >>> "Likely cause: an index past the end" in message
    True
    """
    text = run.error or ""
    general = _general_advice

    def advice_for(kind: str) -> str:
        return (advice(kind) if advice else None) or general(kind)

    if run.watch is not None and run.watch.deadlock is not None:
        return dma_problem(run, names, advice)
    block = _OOB_BLOCK.search(text)
    if block:
        index, ref, step, shape = block.groups()
        what = (
            f"an out-of-bounds read: at grid step ({step}) the index map of `{ref}` chose "
            f"block ({index}), but the array has shape ({shape})."
        )
        return f"{what} Likely cause: {advice_for('block')} {DETAILS_HINT}"
    access = _OOB_ACCESS.search(text)
    if access:
        kind, space, where, shape = (access.group(i) for i in (1, 4, 6, 7))
        copies = run.watch.copies if run.watch is not None else []
        source = next((c for c in reversed(copies) if c.page is not None), None)
        in_hbm = space in ("hbm", "any")
        if kind == "read" and in_hbm and source is not None:
            what = (
                f"an out-of-bounds read: a copy read {names.page(source.page)}, but kv_pages "
                f"has shape ({shape})."
            )
            return f"{what} Likely cause: {advice_for('copy')} {DETAILS_HINT}"
        past = _past_the_end(where, shape)
        if kind == "write" and in_hbm:  # an output block written back past the output's end
            what = f"an out-of-bounds write: an output block went to {past} of the output."
            return f"{what} Likely cause: {advice_for('block')} {DETAILS_HINT}"
        memory = {"smem": "SMEM", "vmem": "VMEM"}.get(space, space)
        what = f"an out-of-bounds {kind} of a {memory} array of shape ({shape}), at {past}."
        return f"{what} Likely cause: {advice_for(space)} {DETAILS_HINT}"
    if "Revisited block" in text:
        line = next(x for x in text.splitlines() if "Revisited block" in x)
        return (
            f"an output block was revisited: {line.split('Revisited', 1)[1].strip()} Pallas "
            "copies an output block back to HBM when the block index changes, so coming back to "
            "it later overwrites what was written first. Likely cause: the output's index map "
            f"depends on an axis it should not (the KV axis?). {DETAILS_HINT}"
        )
    first = next((x for x in text.splitlines() if x.strip()), "an unknown error")
    return (
        f"JAX's TPU interpreter stopped with an internal error: {first[:300]}. Likely cause: "
        "a ref indexed with a shape or dtype it does not have, or a value read from a ref "
        f"outside the kernel's grid step. {DETAILS_HINT}"
    )


def _general_advice(kind: str) -> str:
    return (
        "an index past the end of an array. Entries of page_indices past a sequence's last "
        "page hold garbage (so does a whole row for an empty slot); a sequence index may run "
        "past the last sequence; a slot index past the last slot."
    )


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
):
    """Compare a KernelRun with the reference; on any problem, say what it means.

    In order: a run that hung; a deadlock or other interpreter error; a DMA problem of the
    ledger, then the rung's own `ledger_check(run, case)`; a race; a wrong output, with
    `locate(expected, got, case)` (which sequences or rows
    differ) and the likely cause: `diagnose(got, case)` (a rung's own probe), else the first
    of `mistakes` (explanation -> a jnp function making that mistake) that the output matches.

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
        raw = f"\nJAX's own output:\n{_indent(shown)}" if details and shown else ""
        if got.hung:
            raise Mismatch(
                f"expected the kernel to finish; it was stopped after "
                f"{KERNEL_TIMEOUT_SECONDS:.0f} s.\nLikely cause: an endless loop (a "
                "`while_loop` whose condition never turns false?)." + raw
            )
        if got.error is not None:
            raise Mismatch(interpreter_error(got, named, advice) + raw)
        problem = dma_problem(got, named, advice)
        if problem is None and ledger_check is not None and got.watch is not None:
            problem = ledger_check(got, case)
        if problem is None and got.raced:
            problem = race_report(got, named)
        if problem is not None:
            raise Mismatch(problem + _output_too(expected, got, case, atol, rtol, locate) + raw)
        try:
            compare_arrays(expected, got.out, "output", atol=atol, rtol=rtol)
        except Mismatch as diff:
            where = f"\n{locate(expected, got.out, case)}" if locate is not None else ""
            cause = diagnose(got, case) if diagnose is not None else None
            cause = cause or likely_cause(got.out, case, mistakes)
            raise Mismatch(f"{diff}{where}\nLikely cause: {cause}" + raw) from None

    return compare


def _output_too(expected, got: KernelRun, case: Case, atol, rtol, locate) -> str:
    try:
        compare_arrays(expected, got.out, "output", atol=atol, rtol=rtol)
    except Mismatch:
        where = locate(expected, got.out, case) if locate is not None else ""
        return f"\n(The output is wrong too{': ' + where if where else '.'})"
    except Exception:
        return ""
    return "\n(The output happens to be right on this case; on a chip it need not be.)"


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


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
    details: bool = False,
    names: Callable[[Case], Names] | None = None,
    locate: Callable | None = None,
    advice: Callable[[str], str] | None = None,
    diagnose: Callable | None = None,
    record_grid: bool = False,
    extra_check: Callable | None = None,
    explain_error: Callable | None = None,
    ledger_check: Callable | None = None,
) -> CheckResult:
    """Run `fn` against `reference` on `cases` in strict TPU interpret mode, watched, then
    compile it for v5e on `compile_case` (shapes and dtypes only) when libtpu is installed.

    `names`, `locate`, `advice`, `diagnose`, `ledger_check`: how a rung names its copies,
    places a wrong output, explains an out-of-bounds access, probes a wrong output and checks
    its copies further (see `compare_kernel_output`). `record_grid`: record the kernel's grid
    steps (`KernelRun.grid`, and `Copy.step` of each copy); `extra_check(run,
    case)` may then fail a run whose output is right (a "parallel" axis that carries state).
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
    compare = compare_kernel_output(
        mistakes, atol, rtol, names=names, locate=locate, advice=advice, diagnose=diagnose,
        details=details, ledger_check=ledger_check,
    )  # fmt: skip
    if extra_check is not None:
        compare = _then(compare, extra_check)
    # The kernel run has its own time limit and stops the kernel at it; the check's own
    # limit only backs it up. The answer is a KernelRun, whose type `compare` checks.
    result = run_check(
        name,
        run_in_strict_interpret_mode(fn, record_grid=record_grid),
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
    return CheckResult(name=name, status=status, report=report, cases_run=result.cases_run)


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
