"""Notebook 05's exercise: a dynamic check, q_len <= kv_len for every live sequence."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from minilib.exercises.checking import Case, CheckResult, Mismatch, diagnose, run_check

RETURNED = "returned"


def _first_bad_sequence(kv_lens, cu_q_lens, num_seqs, *, live_only=True, strict=True):
    kv_lens, cu = np.asarray(kv_lens), np.asarray(cu_q_lens)
    n = int(np.asarray(num_seqs)[0]) if live_only else len(kv_lens)
    for i in range(n):
        q_len, kv_len = int(cu[i + 1] - cu[i]), int(kv_lens[i])
        if q_len > kv_len or (not strict and q_len >= kv_len):
            return f"sequence {i} has q_len={q_len} > kv_len={kv_len}"
    return None


def _outcome(fn: Callable) -> Callable:
    """Run a validator; say whether it raised ValueError (and with what) or returned.

    Any other exception propagates, and the checker reports it as the learner's bug."""

    def run(kv_lens, cu_q_lens, num_seqs):
        try:
            fn(kv_lens, cu_q_lens, num_seqs)
        except ValueError as err:
            return ("raised", f"{type(err).__name__}: {err}")
        except AssertionError as err:
            return ("asserted", str(err))
        return (RETURNED, None)

    return run


def _reference(kv_lens, cu_q_lens, num_seqs):
    bad = _first_bad_sequence(kv_lens, cu_q_lens, num_seqs)
    return (RETURNED, None) if bad is None else ("raised", bad)


def check_validate_q_lens(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(kv_lens, cu_q_lens, num_seqs)`: it must raise ValueError (or a subclass,
    such as RPAInputError) when a live sequence i < num_seqs[0] has
    q_len = cu_q_lens[i+1] - cu_q_lens[i] greater than kv_lens[i], and return quietly
    otherwise, whatever the padding slots past num_seqs hold.

    >>> def validate(kv_lens, cu_q_lens, num_seqs):
    ...     for i in range(int(num_seqs[0])):
    ...         if cu_q_lens[i + 1] - cu_q_lens[i] > kv_lens[i]:
    ...             raise ValueError(f"sequence {i}: q_len > kv_len")
    >>> check_validate_q_lens(validate)
    Passed: validate_q_lens matches the reference on all 9 cases.
    CheckResult('validate_q_lens', status='passed')
    """
    rng = np.random.default_rng(600 + seed)
    batches = [  # (kv_lens, cu_q_lens, num_seqs): padding past num_seqs is garbage
        ([5, 9, 3, 0, 0], [0, 5, 6, 8, 40, 3], 3),
        ([3, 2, 7, 0], [0, 3, 7, 8, 8], 3),
        ([12, 30, 7, -1, -1], [0, 1, 2, 3, 3, 3], 3),
        ([4, 4, 2], [0, 1, 2, 5], 3),
        ([6, 0, 8, 99], [0, 6, 6, 14, 0], 3),
        ([1, 1], [0, 1, 2], 2),
        ([2, 10, 5], [0, 3, 4, 4], 2),
        ([0, 0, 0], [0, 0, 7, 9], 1),
    ]
    lens = rng.integers(1, 20, size=4)
    q_lens = [int(rng.integers(1, k + 1)) for k in lens]
    batches.append((lens.tolist() + [-5, 3], [0, *np.cumsum(q_lens).tolist(), 1, 1000], 4))
    cases = []
    for kv_lens, cu_q_lens, n in batches:
        verdict = _first_bad_sequence(kv_lens, cu_q_lens, [n]) or "valid"
        padding = f", padding slots {len(kv_lens) - n}" if len(kv_lens) > n else ""
        cases.append(
            Case(
                f"kv_lens={kv_lens}, cu_q_lens={cu_q_lens}, num_seqs=[{n}]{padding} ({verdict})",
                tuple(jnp.asarray(a, jnp.int32) for a in (kv_lens, cu_q_lens, [n])),
            )
        )

    def compare(want, got, case):
        (want_kind, why), (got_kind, message) = want, got
        if got_kind == "asserted":
            raise Mismatch(
                f"your function failed an assert ({message or 'no message'}). Raise ValueError "
                "instead: `python -O` removes asserts, and an error should name the values."
            )
        if want_kind == RETURNED and got_kind != RETURNED:
            raise Mismatch(
                f"this batch is valid, but your function raised {message}\n"
                "(entries past num_seqs are padding and may hold anything)"
            )
        if want_kind != RETURNED and got_kind == RETURNED:
            raise Mismatch(f"{why}, but your function returned without raising ValueError.")

    def checks_every_slot(kv_lens, cu_q_lens, num_seqs):
        if _first_bad_sequence(kv_lens, cu_q_lens, num_seqs, live_only=False):
            raise ValueError("bad")

    def rejects_equal(kv_lens, cu_q_lens, num_seqs):
        if _first_bad_sequence(kv_lens, cu_q_lens, num_seqs, strict=False):
            raise ValueError("bad")

    def skips_last(kv_lens, cu_q_lens, num_seqs):
        n = int(np.asarray(num_seqs)[0])
        _reference_raise(kv_lens, cu_q_lens, [max(n - 1, 0)])

    mistakes = {
        "only the first num_seqs[0] slots are live; loop over range(num_seqs[0]), not over "
        "every slot of kv_lens.": _outcome(checks_every_slot),
        "q_len == kv_len is fine (a prefill: every token is new); only q_len > kv_len is an "
        "error.": _outcome(rejects_equal),
        "the last live sequence is i = num_seqs[0] - 1: check it too.": _outcome(skips_last),
    }
    return run_check(
        "validate_q_lens",
        _outcome(fn),
        _reference,
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )


def _reference_raise(kv_lens, cu_q_lens, num_seqs):
    bad = _first_bad_sequence(kv_lens, cu_q_lens, num_seqs)
    if bad:
        raise ValueError(bad)
