"""A failed check keeps its case, and `result.rerun()` really runs the learner's function and
the reference on it again: the rerun reproduces the difference the check reported."""

from __future__ import annotations

import numpy as np
import pytest
from exercise_answers import solution
from ladder_wrong_answers import rung2

import minilib.exercises as ex
from minilib.exercises.checking import RERUN_HINT, Case, Rerun
from minilib.exercises.ex01_heads import _gqa_attention
from minilib.ladder.scalar_prefetch import paged_decode_reference


def counted(fn):
    """fn, counting its calls in `calls`."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return wrapper, calls


def off_by_a_percent(q, k, v, *, sm_scale):
    return _gqa_attention(q, k, v, sm_scale=sm_scale) * 1.01


def test_a_failure_keeps_its_case_and_the_rerun_runs_the_function_again():
    fn, calls = counted(off_by_a_percent)
    result = ex.check_grouped_query_attention(fn, verbose=False)
    assert result.status == "failed", result.report
    assert isinstance(result.case, Case)
    assert result.case.description in result.report
    q, k, v = result.case.inputs()
    calls_before = len(calls)
    rerun = result.rerun()
    assert len(calls) == calls_before + 1, "rerun() did not call the learner's function"
    assert calls[-1][0] is q
    want = _gqa_attention(q, k, v, **result.case.kwargs)
    np.testing.assert_array_equal(rerun.expected, want)
    np.testing.assert_array_equal(rerun.got, off_by_a_percent(q, k, v, **result.case.kwargs))
    # the largest difference is the one the report's "max abs error" gave
    assert f"max abs error {rerun.difference:.3g}" in result.report, (rerun, result.report)
    i = rerun.index
    assert rerun.difference == pytest.approx(abs(float(want[i]) - float(rerun.got[i])))


def test_a_failed_result_says_rerun_exists():
    result = ex.check_grouped_query_attention(off_by_a_percent, verbose=False)
    assert "result.rerun()" in repr(result)
    assert result.report.endswith(RERUN_HINT)


def test_a_passed_result_has_no_case_and_says_so():
    result = ex.check_grouped_query_attention(
        solution("ex01_heads", "grouped_query_attention"), verbose=False
    )
    assert result.passed and result.case is None
    assert "rerun" not in repr(result) and RERUN_HINT not in result.report
    with pytest.raises(ValueError, match="no failing case to rerun"):
        result.rerun()


def test_the_rerun_raises_the_learners_error():
    def raises(q, k, v, *, sm_scale):
        raise ZeroDivisionError("the learner's bug")

    result = ex.check_grouped_query_attention(raises, verbose=False)
    assert result.status == "failed" and result.case is not None
    with pytest.raises(ZeroDivisionError, match="the learner's bug"):
        result.rerun()


def test_rerun_finds_the_largest_difference_and_nan_on_one_side():
    rerun = Rerun(np.array([[0.0, 1.0], [2.0, 3.0]]), np.array([[0.0, 1.5], [2.0, 1.0]]))
    assert rerun.index == (1, 1) and rerun.difference == 2.0
    nan = Rerun(np.array([1.0, 2.0, np.nan]), np.array([1.0, np.nan, np.nan]))
    assert nan.index == (1,)
    assert "not arrays of one shape" in repr(Rerun(np.zeros(2), np.zeros(3)))


def test_a_kernel_failure_reruns_the_kernel():
    """Rung 2's kernel that counts every page's positions from 0: the rerun runs the kernel
    again, in interpret mode, and reproduces the wrong output."""
    result = ex.check_paged_decode_attention(rung2("positions_from_zero"), verbose=False)
    assert result.status == "failed" and "first_pos" in result.report, result.report
    rerun = result.rerun()
    expected = paged_decode_reference(*result.case.inputs(), **result.case.kwargs)
    np.testing.assert_array_equal(rerun.expected, expected)
    assert rerun.got.shape == expected.shape
    # the report's first difference is NaN in the output, at the index the rerun finds first
    i = rerun.index
    assert np.isnan(rerun.got[i]) and not np.isnan(expected[i]), rerun
    assert f"got nan at index {i}" in result.report, (rerun, result.report)
    assert "NaN on one side only" in repr(rerun)
