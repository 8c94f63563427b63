"""The machinery behind every `check_<name>(fn)`: run cases, compare, report in plain words.

A checker runs the learner's function and minilib's tested version on the same cases, cases
the notebook never showed, and prints one of three reports:

    Passed: <name> matches the reference on all N cases.
    Not attempted yet: <name> raises NotImplementedError. Fill it in, then ...
    FAILED: <name>, case 3 of N (<what the case is>) ... expected ..., got ...

It never lets an exception escape and never hangs:

* a learner's error is reported with the line of their code that raised it, `SystemExit` and
  `KeyboardInterrupt` included;
* each case has a time limit (`TIME_LIMIT_SECONDS`, or more for a slow reference): an endless
  loop is reported as "took too long";
* an answer of the wrong type (a string, an object array, a one-element array where a number
  is expected) fails with a message, even when its values would compare equal.

NumPy answers are as good as JAX ones. Each checker returns a `CheckResult`, which is truthy
only when it passed, so tests can `assert check_causal_mask(solution)`; in a notebook it shows
nothing more than the report already printed. A failure keeps the case it failed on
(`result.case`), and `result.rerun()` runs the learner's function and the reference on it
again (a `Rerun`: both outputs, and where they differ most).

The comparisons a checker passes to `run_check`, and the words they say a difference in, are
`minilib.exercises.comparisons`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import linecache
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minilib.exercises.comparisons import (
    Mismatch,
    answer_type_problem,
    describe,
    indent,
)

__all__ = [
    "SM_SCALE_IGNORED",
    "TIME_LIMIT_SECONDS",
    "Case",
    "CheckResult",
    "Rerun",
    "call_with_time_limit",
    "diagnose",
    "random_attention_case",
    "run_check",
]

MINILIB_DIR = str(Path(__file__).resolve().parents[1]) + os.sep

PASSED, FAILED, NOT_ATTEMPTED = "passed", "failed", "not attempted"

# How long the learner's function may take on one case: this many seconds, or
# SLOWER_THAN_REFERENCE times what the reference took on it (compiles included), if more.
# The limit only stops an endless loop, so it is generous: a right answer's first compile
# took over 5 s on a busy 2-core machine, where the reference, compiled once, is fast.
TIME_LIMIT_SECONDS = 30.0
SLOWER_THAN_REFERENCE = 20
STOP_GRACE_SECONDS = 5.0  # how long a stopped function may take to wind down

# The likely cause every checker of a function taking sm_scale names; each one's cases use an
# sm_scale other than head_dim ** -0.5 (the usual choice), so that this mistake shows.
# The last line of a failure's report, when the check kept its case.
RERUN_HINT = (
    "  Run this case again: `result.rerun()` (result: what this check returned) gives both "
    "outputs and where they differ most; `result.case.inputs()` gives its inputs."
)

SM_SCALE_IGNORED = (
    "the scores are scaled by 1 / sqrt(head_dim), not by the sm_scale argument: use sm_scale "
    "as given (a model may choose another scale; here it is not head_dim ** -0.5)."
)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What a checker found. `bool(result)` is True only when every case passed.

    Attributes:
      name: the exercise, e.g. "causal_mask".
      status: "passed", "failed" or "not attempted".
      report: the text the checker printed.
      cases_run: how many cases ran before the verdict.
      case: the case that failed (a `Case`: its description and its inputs), or None when
        nothing failed on a case (passed, not attempted).

    `result.rerun()` runs your function and the reference on the failing case again, and
    gives back both outputs and where they differ most (a `Rerun`).

    >>> result = CheckResult("add", status="passed", report="Passed: ...", cases_run=2)
    >>> result, bool(result), result.case
    (CheckResult('add', status='passed'), True, None)
    """

    name: str
    status: str
    report: str
    cases_run: int
    case: Case | None = None
    # How to run the case again: run(case) -> (expected, got). Set by the checker.
    run: Callable | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        if self.case is not None and self.run is not None:
            return (
                f"CheckResult({self.name!r}, status={self.status!r}; "
                "result.rerun() reruns the failing case)"
            )
        return f"CheckResult({self.name!r}, status={self.status!r})"

    def rerun(self) -> Rerun:
        """Run your function and the reference again on the case that failed: both outputs,
        and where they differ most. Your function really runs again, on `self.case`'s
        inputs; an error it raises is raised here, with its traceback.

        >>> from minilib.exercises.comparisons import compare_values
        >>> def compare(expected, got, case):
        ...     compare_values(expected, got, "sum")
        >>> cases = [Case("two small ints", (2, 3))]
        >>> result = run_check("add", lambda a, b: a - b, lambda a, b: a + b, cases, compare,
        ...                    verbose=False)
        >>> result.case.inputs()
        (2, 3)
        >>> result.rerun()
        Rerun(expected=5, got=-1, largest difference 6 at index (): expected 5, got -1)
        """
        if self.case is None or self.run is None:
            raise ValueError(
                f"{self.name}: status={self.status!r}, no failing case to rerun (only a "
                "check that failed on a case has one: result.case is None)"
            )
        expected, got = self.run(self.case)
        return Rerun(expected, got)

    def _ipython_display_(self) -> None:
        """As a notebook cell's value: nothing, as the checker printed its report already
        (no `CheckResult(...)` line under "Not attempted yet")."""


@dataclasses.dataclass(frozen=True)
class Rerun:
    """A failing case run again: the reference's output and yours, and where they differ
    most (`index`, `difference`: None when the outputs are not arrays of one shape). NaN on
    one side only comes first: its first index, difference NaN.

    >>> Rerun(expected=np.array([1.0, 2.0], np.float32), got=np.array([1.0, 2.5], np.float32))
    Rerun(expected=f32[2], got=f32[2], largest difference 0.5 at index (1,): expected 2, got 2.5)
    """

    expected: Any
    got: Any

    @property
    def index(self) -> tuple[int, ...] | None:
        difference = self._differences()
        if difference is None or difference.size == 0:
            return None
        if np.isnan(difference).any():  # NaN on one side only: the first one
            return tuple(int(i) for i in np.argwhere(np.isnan(difference))[0])
        return tuple(int(i) for i in np.unravel_index(np.argmax(difference), difference.shape))

    @property
    def difference(self) -> float | None:
        index = self.index
        return None if index is None else float(self._differences()[index])

    def _differences(self) -> np.ndarray | None:
        """|expected - got| elementwise, NaN where only one side is NaN (0 where both are)."""
        try:
            expected = np.asarray(self.expected, np.float64)
            got = np.asarray(self.got, np.float64)
        except (TypeError, ValueError):
            return None
        if expected.shape != got.shape:
            return None
        both_nan = np.isnan(expected) & np.isnan(got)
        return np.where(both_nan, 0.0, np.abs(expected - got))

    def __repr__(self) -> str:
        where = "the outputs are not arrays of one shape: compare them by eye"
        index = self.index
        if index is not None:
            expected = np.asarray(self.expected)[index]
            got = np.asarray(self.got)[index]
            largest = f"largest difference {self.difference:.6g}"
            if np.isnan(self.difference):
                largest = "NaN on one side only"
            where = f"{largest} at index {index}: expected {_number(expected)}, got {_number(got)}"
        return f"Rerun(expected={_brief(self.expected)}, got={_brief(self.got)}, {where})"


def _number(x) -> str:
    try:
        return f"{float(x):.6g}"
    except (TypeError, ValueError):
        return repr(x)


def _brief(x) -> str:
    """An array as dtype[shape] (its values are in the Rerun), anything else as it is."""
    if hasattr(x, "shape") and hasattr(x, "dtype") and np.ndim(x) > 0:
        name = np.dtype(x.dtype).name  # float32 -> f32, bfloat16 -> bf16, int32 -> i32
        name = name.replace("float", "f").replace("uint", "u").replace("int", "i")
        return f"{name}[{', '.join(map(str, x.shape))}]"
    return repr(x)


@dataclasses.dataclass(frozen=True)
class Case:
    """One input to try: a description for the report, and the arguments.

    >>> case = Case("one decode over 5 keys", args=(1, 5))
    >>> case.args, case.kwargs
    ((1, 5), {})
    """

    description: str
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)

    def inputs(self) -> tuple:
        """The arguments the function was called with on this case (the very arrays); its
        keyword arguments are `kwargs`.

        >>> Case("one decode over 5 keys", args=(1, 5)).inputs()
        (1, 5)
        """
        return self.args


def random_attention_case(
    rng: np.random.Generator,
    description: str,
    *,
    q_len: int,
    kv_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sm_scales: Iterable[float],
    **kwargs,
) -> Case:
    """One attention case `(q, k, v), sm_scale=..., **kwargs`, drawn from `rng`: q, k, v in
    that order, then an sm_scale picked from `sm_scales` (give none equal to
    head_dim ** -0.5, so that a function ignoring sm_scale shows). The description ends with
    every keyword argument.

      q:   f32[q_len, num_q_heads, head_dim]
      k,v: f32[kv_len, num_kv_heads, head_dim]

    >>> case = random_attention_case(np.random.default_rng(0), "3 new tokens after 4 cached",
    ...     q_len=3, kv_len=7, num_q_heads=4, num_kv_heads=2, head_dim=8, sm_scales=[0.5],
    ...     soft_cap=2.0)
    >>> case.description
    '3 new tokens after 4 cached, sm_scale=0.5, soft_cap=2.0'
    >>> [x.shape for x in case.args], case.kwargs
    ([(3, 4, 8), (7, 2, 8), (7, 2, 8)], {'sm_scale': 0.5, 'soft_cap': 2.0})
    """
    q, k, v = (
        jnp.asarray(rng.standard_normal((n, h, head_dim)), jnp.float32)
        for n, h in ((q_len, num_q_heads), (kv_len, num_kv_heads), (kv_len, num_kv_heads))
    )
    kwargs = {"sm_scale": float(rng.choice(list(sm_scales))), **kwargs}
    settings = ", ".join(f"{name}={value}" for name, value in kwargs.items())
    return Case(f"{description}, {settings}", (q, k, v), kwargs)


# A comparison takes (expected, got, case) and raises Mismatch when they differ.
Compare = Callable[[Any, Any, Case], None]


def run_check(
    name: str,
    fn: Callable,
    reference: Callable,
    cases: Iterable[Case],
    compare: Compare,
    *,
    verbose: bool = True,
    time_limit: float | None = None,
    check_answer_type: bool = True,
    explain_error: Callable[[BaseException, Case], str | None] | None = None,
) -> CheckResult:
    """Run `fn` and `reference` on every case; stop at the first mismatch, and report.

    `reference` is trusted: if it raises, that is a bug in the checker, and it propagates.
    `fn` is not: whatever it raises, returns or however long it runs, this returns a result.

    A case may take `time_limit` seconds; by default TIME_LIMIT_SECONDS, or
    SLOWER_THAN_REFERENCE times the reference's time if that is longer. `check_answer_type`
    off leaves the answer's type to `compare` (for checkers whose `fn` wraps the learner's
    answer, such as the kernel checkers). `explain_error(error, case)` may add the likely cause
    of an error the learner's function raised.

    >>> from minilib.exercises.comparisons import compare_values
    >>> cases = [Case("two small ints", (2, 3)), Case("a negative one", (-1, 4))]
    >>> def compare(expected, got, case):
    ...     compare_values(expected, got, "sum")
    >>> def add(a, b):
    ...     return a + b
    >>> result = run_check("add", add, add, cases, compare)
    Passed: add matches the reference on all 2 cases.
    >>> result = run_check("add", lambda a, b: a - b, add, cases, compare)
    FAILED: add, case 1 of 2: two small ints
      sum: expected 5, got -1
      Run this case again: `result.rerun()` (result: what this check returned) gives both ...
    >>> result.status, result.cases_run
    ('failed', 1)
    """
    cases = list(cases)
    rerun = functools.partial(run_again, fn, reference, time_limit=time_limit)
    for i, case in enumerate(cases):
        start = time.perf_counter()
        expected = reference(*case.args, **case.kwargs)
        limit = time_limit or max(
            TIME_LIMIT_SECONDS, SLOWER_THAN_REFERENCE * (time.perf_counter() - start)
        )
        heading = f"FAILED: {name}, case {i + 1} of {len(cases)}: {case.description}\n"
        finished, got, error = call_with_time_limit(fn, case.args, case.kwargs, limit)
        if not finished:
            report = (
                f"{heading}  took too long: stopped after {limit:.0f} s (the time limit of "
                "a case). An endless loop? Check that every loop moves towards its end."
            )
            return _finish(name, FAILED, report, i + 1, verbose, case, rerun)
        if isinstance(error, NotImplementedError):
            report = (
                f"Not attempted yet: {name} raises NotImplementedError. "
                "Fill it in, then run this check again."
            )
            return _finish(name, NOT_ATTEMPTED, report, i, verbose)
        if error is not None:  # the learner's bug: report it, don't raise it
            cause = explain_error(error, case) if explain_error is not None else None
            report = (
                f"{heading}  your function raised {type(error).__name__}: {error}"
                f"{_why_it_matters(error)}\n{_where_it_raised(error)}"
                + (f"\n  Likely cause: {cause}" if cause else "")
            )
            return _finish(name, FAILED, report, i + 1, verbose, case, rerun)
        type_problem = answer_type_problem if check_answer_type else lambda *_: None
        try:
            compare(expected, got, case)
            problem = type_problem(expected, got)
        except Mismatch as diff:
            problem = str(diff)
        except Exception as err:  # an answer the comparison could not even read
            problem = type_problem(expected, got) or (
                f"your answer could not be compared with the expected one "
                f"({type(err).__name__}: {err}).\nexpected {describe(expected)}, "
                f"got {describe(got)}"
            )
        if problem:
            report = heading + indent(problem)
            return _finish(name, FAILED, report, i + 1, verbose, case, rerun)
    report = f"Passed: {name} matches the reference on all {len(cases)} cases."
    return _finish(name, PASSED, report, len(cases), verbose)


class _TookTooLong(BaseException):
    """Raised inside a learner's function that ran past its time limit, to stop it."""


def call_with_time_limit(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    seconds: float,
    *,
    on_timeout: Callable[[], None] | None = None,
) -> tuple[bool, Any, BaseException | None]:
    """Run fn(*args, **kwargs) for at most `seconds`: (finished, result, exception raised).

    The call runs in a worker thread while this one waits, so the wait ends on time whatever
    the function does, even inside compiled code or a C call: the notebook cell returns.
    A function still running at the deadline is then stopped where Python can stop it (an
    exception is injected into its thread: this ends a Python `while True:` loop), after
    `on_timeout()` had its chance to stop it in its own way (the kernel checkers stop a
    kernel inside TPU interpret mode); a loop inside compiled XLA code that calls back into
    nothing cannot be stopped, and runs on in the background. Every
    exception, `SystemExit` and `KeyboardInterrupt` included, comes back as a value. The
    result is waited for (`jax.block_until_ready`), so the time limit covers JAX's
    asynchronous work too.

    >>> call_with_time_limit(lambda x: x + 1, (1,), {}, 1.0)
    (True, 2, None)
    """
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = _ready(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001  (reported to the learner)
            outcome["error"] = err

    worker = threading.Thread(target=run, name="minilib-check", daemon=True)
    worker.start()
    try:
        worker.join(seconds)
    except KeyboardInterrupt as err:  # the Stop button, while waiting: stop the learner's
        if on_timeout is not None:  # function and report it, as if it had raised
            on_timeout()
        _stop(worker)
        return True, None, err
    if worker.is_alive():
        if on_timeout is not None:
            on_timeout()
            worker.join(STOP_GRACE_SECONDS)
        _stop(worker)
        return False, None, None
    return True, outcome.get("result"), outcome.get("error")


def _ready(result):
    try:
        return jax.block_until_ready(result)
    except Exception:  # not arrays, or nothing to wait for: the result as it is
        return result


def _stop(worker: threading.Thread) -> None:
    """Ask `worker` to raise _TookTooLong at its next Python instruction."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(worker.ident), ctypes.py_object(_TookTooLong)
    )
    worker.join(0.5)


def _why_it_matters(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return (
            "\n  (exit() or sys.exit() ends the whole program, or restarts a notebook's kernel: "
            "return a value, or raise an exception with a message)"
        )
    if isinstance(error, KeyboardInterrupt):
        return "\n  (interrupted: the check stopped here; run it again to finish it)"
    return ""


def _finish(
    name: str,
    status: str,
    report: str,
    cases_run: int,
    verbose: bool,
    case: Case | None = None,
    run: Callable | None = None,
) -> CheckResult:
    if case is not None:
        report = f"{report}\n{RERUN_HINT}"
    if verbose:
        print(report)
    return CheckResult(name, status, report, cases_run, case=case, run=run)


def run_again(
    fn: Callable, reference: Callable, case: Case, *, time_limit: float | None = None
) -> tuple[Any, Any]:
    """(expected, got): `reference` and `fn` run on `case` once more, for `CheckResult.rerun`.
    What `fn` raises is raised; a run past `time_limit` (default TIME_LIMIT_SECONDS) raises
    TimeoutError.

    >>> run_again(lambda a, b: a - b, lambda a, b: a + b, Case("two small ints", (2, 3)))
    (5, -1)
    """
    expected = reference(*case.args, **case.kwargs)
    limit = time_limit or TIME_LIMIT_SECONDS
    finished, got, error = call_with_time_limit(fn, case.args, case.kwargs, limit)
    if not finished:
        raise TimeoutError(f"{case.description}: your function took more than {limit:.0f} s")
    if error is not None:
        raise error
    return expected, got


def _has_source(frame: traceback.FrameSummary) -> bool:
    """Whether the frame's line can be shown: a file, a notebook cell, or code run by exec
    whose source linecache holds. Code that Python or a library generated ("<string>" of a
    dataclass's __init__, of a namedtuple) has none: it is not the learner's."""
    if not frame.filename.startswith("<"):
        return True
    if "ipython-input" in frame.filename:
        return True
    return bool((frame.line or linecache.getline(frame.filename, frame.lineno)).strip())


def _where_it_raised(err: Exception) -> str:
    """The innermost frame of the traceback that is not minilib's or a library's: the
    learner's own line (a notebook cell, or a solution file)."""
    frames = traceback.extract_tb(err.__traceback__)
    own = [
        f
        for f in frames
        if "site-packages" not in f.filename
        and "dist-packages" not in f.filename
        and not str(Path(f.filename).resolve()).startswith(MINILIB_DIR)
        and not f.filename.startswith("<frozen")
        and _has_source(f)
    ]
    if not own:
        return (
            "  (it was raised in library code: check the arguments your function passes to "
            "library calls, and the type and shape of what it returns)"
        )
    f = own[-1]
    notebook = "ipykernel" in f.filename or "ipython-input" in f.filename
    where = "your code" if notebook else Path(f.filename).name
    return f"  at line {f.lineno} of {where}: {f.line}"


def diagnose(compare: Compare, mistakes: dict[str, Callable]) -> Compare:
    """Wrap `compare` so that a failure also says which known mistake, if any, the output
    matches: `mistakes` maps an explanation to a function that makes that mistake (same
    arguments as the exercise).

    >>> from minilib.exercises.comparisons import compare_values
    >>> def compare(expected, got, case):
    ...     compare_values(expected, got, "pages")
    >>> mistakes = {"floor division: a partial page needs a page too.": lambda n, size: n // size}
    >>> try:
    ...     diagnose(compare, mistakes)(3, 2, Case("10 tokens, pages of 4", (10, 4)))
    ... except Mismatch as diff:
    ...     print(diff)
    pages: expected 3, got 2
    Likely cause: floor division: a partial page needs a page too.
    """

    def compare_and_diagnose(expected, got, case: Case) -> None:
        try:
            compare(expected, got, case)
        except Mismatch as diff:
            for explanation, mistaken in mistakes.items():
                try:
                    compare(mistaken(*case.args, **case.kwargs), got, case)
                except Exception:
                    continue
                raise Mismatch(f"{diff}\nLikely cause: {explanation}") from None
            raise

    return compare_and_diagnose
