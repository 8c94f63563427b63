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
nothing more than the report already printed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import numbers
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

__all__ = [
    "TIME_LIMIT_SECONDS",
    "Case",
    "CheckResult",
    "Mismatch",
    "answer_type_problem",
    "as_array",
    "as_int",
    "call_with_time_limit",
    "compare_arrays",
    "compare_values",
    "diagnose",
    "expected_vs_got",
    "random_attention_case",
    "run_check",
]

MINILIB_DIR = str(Path(__file__).resolve().parents[1]) + os.sep

PASSED, FAILED, NOT_ATTEMPTED = "passed", "failed", "not attempted"

# How long the learner's function may take on one case: this many seconds, or
# SLOWER_THAN_REFERENCE times what the reference took on it (compiles included), if more.
TIME_LIMIT_SECONDS = 5.0
SLOWER_THAN_REFERENCE = 20
STOP_GRACE_SECONDS = 5.0  # how long a stopped function may take to wind down


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What a checker found. `bool(result)` is True only when every case passed.

    Attributes:
      name: the exercise, e.g. "causal_mask".
      status: "passed", "failed" or "not attempted".
      report: the text the checker printed.
      cases_run: how many cases ran before the verdict.

    >>> result = CheckResult("add", status="passed", report="Passed: ...", cases_run=2)
    >>> result, bool(result)
    (CheckResult('add', status='passed'), True)
    """

    name: str
    status: str
    report: str
    cases_run: int

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"CheckResult({self.name!r}, status={self.status!r})"

    def _ipython_display_(self) -> None:
        """As a notebook cell's value: nothing, as the checker printed its report already
        (no `CheckResult(...)` line under "Not attempted yet")."""


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
    that order, then an sm_scale picked from `sm_scales`. The description ends with every
    keyword argument.

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


class Mismatch(Exception):
    """Raised by a comparison: `str()` says which output differs, and how.

    >>> try:
    ...     compare_values(3, 4, "num_pages")
    ... except Mismatch as diff:
    ...     print(diff)
    num_pages: expected 3, got 4
    """


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
    >>> result.status, result.cases_run
    ('failed', 1)
    """
    cases = list(cases)
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
            return _finish(name, FAILED, report, i + 1, verbose)
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
            return _finish(name, FAILED, report, i + 1, verbose)
        type_problem = answer_type_problem if check_answer_type else lambda *_: None
        try:
            compare(expected, got, case)
            problem = type_problem(expected, got)
        except Mismatch as diff:
            problem = str(diff)
        except Exception as err:  # an answer the comparison could not even read
            problem = type_problem(expected, got) or (
                f"your answer could not be compared with the expected one "
                f"({type(err).__name__}: {err}).\nexpected {_describe(expected)}, "
                f"got {_describe(got)}"
            )
        if problem:
            return _finish(name, FAILED, heading + _indent(problem), i + 1, verbose)
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


def _finish(name: str, status: str, report: str, cases_run: int, verbose: bool) -> CheckResult:
    if verbose:
        print(report)
    return CheckResult(name=name, status=status, report=report, cases_run=cases_run)


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


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


# --- comparisons ---------------------------------------------------------------------------


def as_array(x, name: str) -> np.ndarray:
    """Turn the learner's output (jax array, NumPy array, list, scalar) into NumPy, or raise
    Mismatch saying what came back instead.

    >>> as_array([1, 2], "kv_lens")
    array([1, 2])
    >>> try:
    ...     as_array(None, "kv_lens")
    ... except Mismatch as diff:
    ...     print(diff)
    kv_lens: got None. Did you forget to `return` it?
    """
    if x is None:
        raise Mismatch(f"{name}: got None. Did you forget to `return` it?")
    if isinstance(x, str | bytes | dict | set):
        raise Mismatch(f"{name}: got {_describe(x)}, which is not an array of numbers.")
    try:
        a = np.asarray(x)
    except Exception as err:
        raise Mismatch(f"{name}: got {type(x).__name__}, which is not an array ({err}).") from None
    if a.dtype.kind not in "biuf":
        raise Mismatch(f"{name}: got {_describe(x)}, which is not an array of numbers.")
    return a


def compare_arrays(
    expected,
    got,
    name: str = "output",
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    show: int = 64,
) -> None:
    """Raise Mismatch unless `got` has `expected`'s shape and values (within tolerance).

    The message names the first differing element (index, expected, got), counts the
    differing elements and, for small 1-D and 2-D arrays (at most `show` elements), prints
    both in full.
    Booleans and integers must match exactly; floats within atol + rtol * |expected|.

    >>> compare_arrays([1.0, 2.0], np.array([1.0, 2.0000001]))   # within tolerance: silent
    >>> try:
    ...     compare_arrays([[True, False], [True, True]], [[True, True], [True, True]], "mask")
    ... except Mismatch as diff:
    ...     print(diff)
    mask: 1 of 4 elements differ; the first at index (0, 1):
      expected False, got True
    expected:
      [[1 0]
       [1 1]]
    got:
      [[1 1]
       [1 1]]
    """
    want = np.asarray(expected)
    have = as_array(got, name)
    if want.ndim == 0 and have.ndim != 0:
        raise Mismatch(f"{name}: expected a single number, got {_describe(have)}")
    if have.shape != want.shape:
        hint = ""
        if sorted(have.shape) == sorted(want.shape):
            hint = "\n  (the same sizes in another order: are two axes swapped?)"
        raise Mismatch(f"{name}: shape expected {want.shape}, got {have.shape}{hint}")
    if want.dtype == bool:
        if have.dtype != bool and not np.isin(have, [0, 1]).all():
            raise Mismatch(f"{name}: expected booleans, got {have.dtype} values {_brief(have)}")
        bad = want != have.astype(bool)
    elif np.issubdtype(want.dtype, np.integer):
        if not np.issubdtype(have.dtype, np.integer) and not np.all(have == np.round(have)):
            raise Mismatch(f"{name}: expected integers, got {have.dtype} values {_brief(have)}")
        bad = want != have
    else:
        w, h = want.astype(np.float64), have.astype(np.float64)
        if not np.isfinite(h).all() and np.isfinite(w).all():
            idx = tuple(int(i) for i in np.argwhere(~np.isfinite(h))[0])
            raise Mismatch(
                f"{name}: got {h[idx]} at index {idx} (expected {w[idx]:.6g}); "
                f"{int((~np.isfinite(h)).sum())} of {h.size} elements are not finite."
            )
        bad = ~np.isclose(h, w, atol=atol, rtol=rtol, equal_nan=True)
    if not bad.any():
        return
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    lines = [
        f"{name}: {int(bad.sum())} of {bad.size} elements differ; the first at index {idx}:",
        f"  expected {_scalar(want[idx])}, got {_scalar(have[idx])}",
    ]
    if want.dtype.kind == "f":
        err = np.abs(have.astype(np.float64) - want.astype(np.float64))
        if np.isfinite(err).any():  # both NaN everywhere: no error to show
            largest = float(np.max(err[np.isfinite(err)]))
            lines.append(f"  max abs error {largest:.3g} (tolerance {atol:g})")
    if want.size <= show and want.ndim <= 2:
        lines += ["expected:", _indent(_format(want)), "got:", _indent(_format(have))]
    raise Mismatch("\n".join(lines))


def compare_values(expected, got, name: str = "output") -> None:
    """Exact comparison of small Python values (ints, tuples of ints).

    >>> compare_values((0, 2), (np.int32(0), 2))     # NumPy ints are ints: silent
    >>> try:
    ...     compare_values((0, 2), (0, 3), "kv block range")
    ... except Mismatch as diff:
    ...     print(diff)
    kv block range: expected (0, 2), got (0, 3)
    """
    try:
        same = _same_values(_plain(expected), _plain(got))
    except Exception:
        same = False
    if not same:
        raise Mismatch(f"{name}: expected {_plain(expected)!r}, got {_plain_or_raw(got)!r}")


def as_int(x):
    """`int(x)` for ints, NumPy/jax integer scalars and integral floats; anything else is
    returned as it is, so that the comparison can show it ("expected 3, got None").

    >>> as_int(np.int32(3)), as_int(3.0), as_int(3.5), as_int(True), as_int("3")
    (3, 3, 3.5, True, '3')
    """
    if isinstance(x, bool | np.bool_ | str | bytes) or np.ndim(x) != 0:
        return x  # True is not 1, "3" is not 3, [3] is not 3
    try:
        value = int(x)
    except (TypeError, ValueError, OverflowError):
        return x
    return value if value == x else x


def _same_values(expected, got) -> bool:
    """== on plain values, but a bool is not an int: True does not match 1."""
    if isinstance(expected, tuple) or isinstance(got, tuple):
        return (
            isinstance(expected, tuple)
            and isinstance(got, tuple)
            and len(expected) == len(got)
            and all(_same_values(e, g) for e, g in zip(expected, got, strict=True))
        )
    if isinstance(expected, bool) != isinstance(got, bool):
        return False
    return bool(expected == got)


def answer_type_problem(expected, got, name: str = "output") -> str | None:
    """What is wrong with the *type* of `got`, given the `expected` answer, or None.

    Values are the comparison's business; this catches answers that compare equal but are
    not what the exercise asks for: a string for a number, a one-element array for a
    scalar, an object array, a list for a tuple of a different length. NumPy and JAX arrays,
    Python and NumPy numbers are all fine where the expected answer has that kind.

    >>> answer_type_problem(3, "3")
    "output: expected an int, got a str ('3')"
    >>> answer_type_problem(3, np.array([3]))
    'output: expected an int, got an array of shape (1,)'
    >>> answer_type_problem((1, 2), (np.int64(1), 2)) is None
    True
    """
    if expected is None or isinstance(expected, str):
        return None
    if isinstance(expected, tuple | list):
        if not isinstance(got, tuple | list) or len(got) != len(expected):
            return f"{name}: expected {_describe(expected)}, got {_describe(got)}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            problem = answer_type_problem(e, g, f"{name}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(expected, bool | np.bool_ | numbers.Number | np.ndarray | jax.Array):
        want = np.asarray(expected)
        if isinstance(got, str | bytes) or got is None or not _is_numeric(got):
            return f"{name}: expected {_describe(expected)}, got {_describe(got)}"
        have = np.asarray(got)
        if want.ndim == 0 and have.ndim != 0:
            return f"{name}: expected {_describe(expected)}, got {_describe(got)}"
        if want.dtype == bool and want.ndim == 0 and have.dtype != bool:
            return f"{name}: expected {_describe(expected)}, got {_describe(got)}"
    return None


def _is_numeric(x) -> bool:
    try:
        return np.asarray(x).dtype.kind in "biuf"
    except Exception:
        return False


def _describe(x) -> str:
    """A short description of a value's type and shape, for messages."""
    if isinstance(x, bool | np.bool_):
        return "a bool"
    if isinstance(x, numbers.Integral):
        return "an int"
    if isinstance(x, numbers.Real):
        return "a float"
    if isinstance(x, str | bytes):
        text = repr(x) if len(x) <= 20 else repr(x[:20]) + "..."
        return f"a {type(x).__name__} ({text})"
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    if x is None:
        return "None"
    if isinstance(x, np.ndarray | jax.Array | np.generic):
        kind = {"b": "bool", "i": "int", "u": "int", "f": "float"}.get(x.dtype.kind)
        if kind is None:
            return f"an array of dtype {x.dtype} (not numbers)"
        if x.ndim == 0:
            return f"a {kind} (0-d array)"
        return f"an array of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _plain(x):
    """NumPy/jax scalars and arrays to Python ints/floats/lists, for printing and ==."""
    if isinstance(x, tuple | list):
        return tuple(_plain(v) for v in x)
    a = np.asarray(x)
    return a.item() if a.ndim == 0 else a.tolist()


def _plain_or_raw(x):
    try:
        return _plain(x)
    except Exception:
        return x


def _scalar(x) -> str:
    x = np.asarray(x)
    if x.dtype == bool:
        return str(bool(x))
    if x.dtype.kind == "f":
        return f"{float(x):.6g}"
    return str(x.item())


def _brief(a: np.ndarray) -> str:
    return np.array2string(a.ravel()[:8], precision=4) + (" ..." if a.size > 8 else "")


def _format(a: np.ndarray) -> str:
    if a.dtype == bool:
        a = a.astype(int)
    return np.array2string(a, precision=4, suppress_small=True, max_line_width=100)


def diagnose(compare: Compare, mistakes: dict[str, Callable]) -> Compare:
    """Wrap `compare` so that a failure also says which known mistake, if any, the output
    matches: `mistakes` maps an explanation to a function that makes that mistake (same
    arguments as the exercise).

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


def expected_vs_got(label: str, expected, got) -> str:
    """Two aligned lines: '<label>, expected: <expected>' over 'got: <got>'.

    >>> print(expected_vs_got("row 3", (1, 0), (0, 3)))
    row 3, expected: (1, 0)
                got: (0, 3)
    """
    head = f"{label}, expected: "
    return f"{head}{expected}\n{'got: '.rjust(len(head))}{got}"
