"""The machinery behind every `check_<name>(fn)`: run cases, compare, report in plain words.

A checker runs the learner's function and minilib's tested version on the same cases, cases
the notebook never showed, and prints one of three reports:

    Passed: <name> matches the reference on all N cases.
    Not attempted yet: <name> raises NotImplementedError. Fill it in, then ...
    FAILED: <name>, case 3 of N (<what the case is>) ... expected ..., got ...

It never lets an exception escape: a learner's error is reported with the line of their code
that raised it. Each checker returns a `CheckResult`, which is truthy only when it passed,
so tests can `assert check_causal_mask(solution)`.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

MINILIB_DIR = str(Path(__file__).resolve().parents[1]) + os.sep

PASSED, FAILED, NOT_ATTEMPTED = "passed", "failed", "not attempted"


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What a checker found. `bool(result)` is True only when every case passed.

    Attributes:
      name: the exercise, e.g. "causal_mask".
      status: "passed", "failed" or "not attempted".
      report: the text the checker printed.
      cases_run: how many cases ran before the verdict.
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

    def __repr__(self) -> str:  # the report itself was already printed
        return f"CheckResult({self.name!r}, status={self.status!r})"


@dataclasses.dataclass(frozen=True)
class Case:
    """One input to try: a description for the report, and the arguments."""

    description: str
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)


class Mismatch(Exception):
    """Raised by a comparison: `str()` says which output differs, and how."""


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
) -> CheckResult:
    """Run `fn` and `reference` on every case; stop at the first mismatch, and report.

    `reference` is trusted: if it raises, that is a bug in the checker, and it propagates.
    """
    cases = list(cases)
    for i, case in enumerate(cases):
        expected = reference(*case.args, **case.kwargs)
        try:
            got = fn(*case.args, **case.kwargs)
        except NotImplementedError:
            report = (
                f"Not attempted yet: {name} raises NotImplementedError. "
                "Fill it in, then run this check again."
            )
            return _finish(name, NOT_ATTEMPTED, report, i, verbose)
        except Exception as err:  # the learner's bug: report it, don't raise it
            report = (
                f"FAILED: {name}, case {i + 1} of {len(cases)}: {case.description}\n"
                f"  your function raised {type(err).__name__}: {err}\n"
                f"{_where_it_raised(err)}"
            )
            return _finish(name, FAILED, report, i + 1, verbose)
        try:
            compare(expected, got, case)
        except Mismatch as diff:
            report = (
                f"FAILED: {name}, case {i + 1} of {len(cases)}: {case.description}\n"
                f"{_indent(str(diff))}"
            )
            return _finish(name, FAILED, report, i + 1, verbose)
    report = f"Passed: {name} matches the reference on all {len(cases)} cases."
    return _finish(name, PASSED, report, len(cases), verbose)


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
    Mismatch saying what came back instead."""
    if x is None:
        raise Mismatch(f"{name}: got None. Did you forget to `return` it?")
    try:
        return np.asarray(x)
    except Exception as err:
        raise Mismatch(f"{name}: got {type(x).__name__}, which is not an array ({err}).") from None


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
    """
    want = np.asarray(expected)
    have = as_array(got, name)
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
        lines.append(f"  max abs error {float(np.nanmax(err)):.3g} (tolerance {atol:g})")
    if want.size <= show and want.ndim <= 2:
        lines += ["expected:", _indent(_format(want)), "got:", _indent(_format(have))]
    raise Mismatch("\n".join(lines))


def compare_values(expected, got, name: str = "output") -> None:
    """Exact comparison of small Python values (ints, tuples of ints)."""
    try:
        same = _plain(got) == _plain(expected)
    except Exception:
        same = False
    if not same:
        raise Mismatch(f"{name}: expected {_plain(expected)!r}, got {_plain_or_raw(got)!r}")


def as_int(x):
    """`int(x)` for ints, NumPy/jax integer scalars and integral floats; anything else is
    returned as it is, so that the comparison can show it ("expected 3, got None")."""
    try:
        value = int(x)
    except (TypeError, ValueError):
        return x
    return value if value == x else x


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
    arguments as the exercise)."""

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
    """Two aligned lines: '<label>, expected: <expected>' over 'got: <got>'."""
    head = f"{label}, expected: "
    return f"{head}{expected}\n{'got: '.rjust(len(head))}{got}"
