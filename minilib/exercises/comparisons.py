"""Comparing an answer with the expected one, and saying in plain words how they differ.

A checker's comparison raises `Mismatch` when the learner's answer differs; its message is
what the report shows under "FAILED": which output differs, expected versus got.

* `compare_arrays`: shape, dtype kind and values (within a tolerance for floats); the first
  differing element, how many differ, and both arrays in full when they are small;
* `compare_masks`: `compare_arrays` for a boolean mask, which must be a boolean array (0/1
  numbers or a Python list are not a mask `jnp.where` and `~` can use);
* `compare_values`: small Python values (ints, tuples of ints), where True is not 1;
* `answer_type_problem`: an answer whose values would compare equal, but of the wrong type (a
  string for a number, a one-element array for a scalar).

NumPy answers are as good as JAX ones, and NumPy integers as good as Python ints.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np

__all__ = [
    "Mismatch",
    "answer_type_problem",
    "as_array",
    "as_int",
    "compare_arrays",
    "compare_masks",
    "compare_values",
    "describe",
    "expected_vs_got",
    "indent",
]


class Mismatch(Exception):
    """Raised by a comparison: `str()` says which output differs, and how.

    >>> try:
    ...     compare_values(3, 4, "num_pages")
    ... except Mismatch as diff:
    ...     print(diff)
    num_pages: expected 3, got 4
    """


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
        raise Mismatch(f"{name}: got {describe(x)}, which is not an array of numbers.")
    try:
        a = np.asarray(x)
    except Exception as err:
        raise Mismatch(f"{name}: got {type(x).__name__}, which is not an array ({err}).") from None
    if a.dtype.kind not in "biuf":
        raise Mismatch(f"{name}: got {describe(x)}, which is not an array of numbers.")
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
        raise Mismatch(f"{name}: expected a single number, got {describe(have)}")
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
        lines += ["expected:", indent(_format(want)), "got:", indent(_format(have))]
    raise Mismatch("\n".join(lines))


def compare_masks(expected, got, name: str = "mask") -> None:
    """`compare_arrays` for a mask, True where masked: the answer must be a boolean jax or
    NumPy array. Float or int 0s and 1s, or a Python list, are refused even where their values
    match: `~` on numbers flips their bits, not True and False, and `jnp.where` takes no list.

    >>> compare_masks([True, False], np.array([True, False]))   # a boolean array: silent
    >>> try:
    ...     compare_masks([True, False], np.array([1.0, 0.0]))
    ... except Mismatch as diff:
    ...     print(diff)
    mask: expected a boolean jax or NumPy array (dtype bool), got an array of dtype float64.
      A comparison gives one (k_pos > q_pos); to convert numbers or a list, use
      jnp.asarray(mask, dtype=bool).
    """
    if got is None or isinstance(got, str | bytes):
        compare_arrays(expected, got, name)  # its own message: "got None. Did you forget ..."
    if isinstance(got, np.ndarray | jax.Array):
        if got.dtype == bool:
            compare_arrays(expected, got, name)
            return
        what = f"an array of dtype {got.dtype}"
    else:
        what = describe(got)
    raise Mismatch(
        f"{name}: expected a boolean jax or NumPy array (dtype bool), got {what}.\n"
        "  A comparison gives one (k_pos > q_pos); to convert numbers or a list, use\n"
        "  jnp.asarray(mask, dtype=bool)."
    )


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
            return f"{name}: expected {describe(expected)}, got {describe(got)}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            problem = answer_type_problem(e, g, f"{name}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(expected, bool | np.bool_ | numbers.Number | np.ndarray | jax.Array):
        want = np.asarray(expected)
        if isinstance(got, str | bytes) or got is None or not _is_numeric(got):
            return f"{name}: expected {describe(expected)}, got {describe(got)}"
        have = np.asarray(got)
        if want.ndim == 0 and have.ndim != 0:
            return f"{name}: expected {describe(expected)}, got {describe(got)}"
        if want.dtype == bool and want.ndim == 0 and have.dtype != bool:
            return f"{name}: expected {describe(expected)}, got {describe(got)}"
    return None


def _is_numeric(x) -> bool:
    try:
        return np.asarray(x).dtype.kind in "biuf"
    except Exception:
        return False


def describe(x) -> str:
    """A short description of a value's type and shape, for messages.

    >>> describe(3), describe(np.zeros((2, 3))), describe("abc"), describe((1, 2))
    ('an int', 'an array of shape (2, 3)', "a str ('abc')", 'a tuple of 2')
    """
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


def expected_vs_got(label: str, expected, got) -> str:
    """Two aligned lines: '<label>, expected: <expected>' over 'got: <got>'.

    >>> print(expected_vs_got("row 3", (1, 0), (0, 3)))
    row 3, expected: (1, 0)
                got: (0, 3)
    """
    head = f"{label}, expected: "
    return f"{head}{expected}\n{'got: '.rjust(len(head))}{got}"


def indent(text: str, prefix: str = "  ") -> str:
    """Every line of `text` after `prefix`: how a report nests one message in another.

    >>> print(indent(expected_vs_got("row 3", (1, 0), (0, 3))))
      row 3, expected: (1, 0)
                  got: (0, 3)
    """
    return "\n".join(prefix + line for line in text.splitlines())
