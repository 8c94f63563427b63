"""No test family runs only under `slow` (tests/markers.py): what CI's default run skips is a
larger sweep of something it also checks, never the only check of it."""

from __future__ import annotations

import markers

pytest_plugins = ["pytester"]


def test_no_family_runs_only_under_slow(request):
    slow_only = markers.slow_only(request.config)
    assert not slow_only, (
        f"these tests run only under `pytest -m slow`, which CI skips: {slow_only}. Give each "
        "a fast case in the default run (a parameter without the mark, or a fast test beside "
        "its `_sweep`)"
    )


FAMILIES = """
import pytest

@pytest.mark.slow
def test_alone():
    pass

@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_with_a_fast_case(n):
    pass

def test_check():
    pass

@pytest.mark.slow
def test_check_sweep():
    pass

def test_markers_seen(request):
    import markers
    assert markers.slow_only(request.config) == ["test_markers_seen.py::test_alone"]
"""


def test_a_slow_only_family_is_found(pytester):
    """The check can fail: a slow test with no fast case is found, and nothing else is."""
    pytester.makeini("[pytest]\nmarkers =\n    slow: larger sweeps\naddopts = -m 'not slow'\n")
    pytester.makepyfile(test_markers_seen=FAMILIES)
    result = pytester.runpytest("-p", "markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, deselected=3)
