"""The per-test time limit (tests/time_limit.py) fails a test that runs over it, and only
that one."""

from __future__ import annotations

pytest_plugins = ["pytester"]

SLOW_AND_FAST = """
import time

import pytest

def test_slow():
    time.sleep(0.6)

def test_fast():
    pass

@pytest.mark.tpu_compile
def test_slow_compile():
    time.sleep(0.6)

def test_slow_failure():
    time.sleep(0.6)
    assert False, "its own failure"
"""


def test_a_test_over_the_limit_fails_with_its_time(pytester, monkeypatch):
    monkeypatch.setenv("MINILIB_TEST_SECONDS_LIMIT", "0.3")
    pytester.makepyfile(SLOW_AND_FAST)
    result = pytester.runpytest("-p", "time_limit", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)  # test_fast, and test_slow_compile (exempt)
    result.stdout.fnmatch_lines(["*test_slow passed but took * s, over the time limit of 0.3 s*"])
    result.stdout.fnmatch_lines(["*its own failure*"])


def test_under_the_limit_nothing_changes(pytester, monkeypatch):
    monkeypatch.setenv("MINILIB_TEST_SECONDS_LIMIT", "30")
    pytester.makepyfile(SLOW_AND_FAST)
    result = pytester.runpytest("-p", "time_limit", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)


def test_the_default_limit_is_a_share_of_ci_budget(monkeypatch):
    import time_limit

    monkeypatch.delenv("MINILIB_TEST_SECONDS_LIMIT", raising=False)
    assert time_limit.seconds_limit() == time_limit.CI_BUDGET_SECONDS * time_limit.SHARE == 120
