"""The per-test time limits (tests/time_limit.py): a test that runs over its limit fails, and
only that one; a test that hangs is stopped, and fails by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import time_limit

pytest_plugins = ["pytester"]

SLOW_AND_FAST = """
import time

import pytest

def work(seconds):  # CPU seconds of work, as a test's computation
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass

def test_slow():
    work(0.6)

def test_fast():
    pass

def test_waits():  # as on a loaded machine: the wall clock runs, the test does no work
    time.sleep(0.6)

@pytest.mark.tpu_compile
def test_slow_compile():
    work(0.6)

@pytest.mark.slow
def test_slow_sweep():
    work(0.6)

@pytest.mark.notebooks
def test_slow_notebook():
    work(0.6)

def test_slow_failure():
    work(0.6)
    assert False, "its own failure"
"""


def test_a_test_over_the_limit_fails_with_its_cost(pytester, monkeypatch):
    monkeypatch.setenv("MINILIB_TEST_SECONDS_LIMIT", "0.3")
    pytester.makepyfile(SLOW_AND_FAST)
    result = pytester.runpytest("-p", "time_limit", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, failed=2)  # test_fast, _waits; the three exempt
    result.stdout.fnmatch_lines(
        [
            "*test_slow passed but cost * s (the smaller of its wall and "
            "CPU seconds; * s wall), over the time limit of 0.3 s*"
        ]
    )
    result.stdout.fnmatch_lines(["*its own failure*"])


def test_under_the_limit_nothing_changes(pytester, monkeypatch):
    monkeypatch.setenv("MINILIB_TEST_SECONDS_LIMIT", "30")
    pytester.makepyfile(SLOW_AND_FAST)
    result = pytester.runpytest("-p", "time_limit", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6, failed=1)


def test_a_cost_counts_the_processes_a_test_waited_for():
    cost = time_limit.Cost()
    subprocess.run([sys.executable, "-c", WORK_IN_A_CHILD], check=True)
    assert cost.seconds() >= 0.5  # the child's CPU seconds, not only this process's


WORK_IN_A_CHILD = """
import time
start = time.process_time()
while time.process_time() - start < 0.5:
    pass
"""


def test_the_default_limit_is_a_share_of_ci_budget(monkeypatch):
    monkeypatch.delenv("MINILIB_TEST_SECONDS_LIMIT", raising=False)
    assert time_limit.seconds_limit() == time_limit.CI_BUDGET_SECONDS * time_limit.SHARE == 120


HANGS = """
import threading

def test_before():
    pass

def test_hangs():
    threading.Event().wait()  # waits forever, in C, as a kernel stuck in a compiled loop does

def test_after():
    pass
"""


def test_a_hung_test_is_stopped_and_named(pytester, monkeypatch):
    """In a plain run, the hung test ends the run: its name is printed, the exit code is not 0."""
    monkeypatch.setenv("MINILIB_TEST_HANG_SECONDS", "1")
    monkeypatch.setenv("PYTHONPATH", str(Path(time_limit.__file__).parent))  # the plugin
    pytester.makepyfile(HANGS)
    result = pytester.runpytest_subprocess("-p", "time_limit", "-p", "no:cacheprovider", timeout=60)
    assert result.ret == time_limit.HUNG_EXIT_CODE
    result.stderr.fnmatch_lines(["*HUNG: test_a_hung_test_is_stopped_and_named.py::test_hangs "
                                 "was still running after 1 s: stopped*"])  # fmt: skip


def test_under_xdist_a_hung_test_fails_by_name_and_the_rest_run(pytester, monkeypatch):
    """As CI runs the tests (pytest-xdist): the hung test fails by name, the others pass."""
    monkeypatch.setenv("MINILIB_TEST_HANG_SECONDS", "1")
    monkeypatch.setenv("PYTHONPATH", str(Path(time_limit.__file__).parent))  # the plugin
    pytester.makepyfile(HANGS)
    result = pytester.runpytest_subprocess(
        "-p", "time_limit", "-p", "no:cacheprovider", "-n", "1", timeout=60
    )
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*crashed while running*::test_hangs*"])


QUICK = "def test_1():\n    pass\n\ndef test_2():\n    pass\n"


def test_as_ci_runs_them_a_hung_test_fails_by_name_and_every_other_file_runs(pytester, monkeypatch):
    """Two workers, each given whole files (`--dist loadfile`): the worker with the hung test
    ends; the test fails by name, is not run again, and its file's last test and every other
    file run, on a new worker. (pytest-xdist's own loadfile scheduler waited forever here.)"""
    monkeypatch.setenv("MINILIB_TEST_HANG_SECONDS", "1")
    monkeypatch.setenv("PYTHONPATH", str(Path(time_limit.__file__).parent))  # the plugin
    pytester.makepyfile(**{f"test_{name}": QUICK for name in "abcdef"}, test_c_hangs=HANGS)
    result = pytester.runpytest_subprocess(
        "-p", "time_limit", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile", timeout=120
    )
    result.assert_outcomes(passed=14, failed=1)  # run again, it would fail again
    result.stdout.fnmatch_lines(["*crashed while running*test_c_hangs.py::test_hangs*"])


def test_the_hang_limit_is_ten_minutes_but_for_the_slow_sweeps(monkeypatch):
    monkeypatch.delenv("MINILIB_TEST_HANG_SECONDS", raising=False)
    assert time_limit.hang_seconds(set()) == time_limit.hang_seconds({"tpu_compile"}) == 600
    assert time_limit.hang_seconds({"slow"}) == time_limit.SLOW_HANG_SECONDS == 30 * 60
