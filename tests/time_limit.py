"""Two time limits on every test: one that fails a test that grows, one that stops a test that
hangs.

CI (`.ci/run`, that is `python3 tasks.py test`) aims at 30 minutes on a 2-core machine; a
single test may cost at most SHARE of that, counted around its body (fixtures apart), on the
test's own worker while the other core runs other tests. A test over it fails with its cost
and the limit, when it ends. What a test costs is the smaller of its wall-clock seconds and its
CPU seconds (its process's, every thread, and those of the processes it started and waited
for): on a machine busy with other work, or slow that day, a test's wall time grows and its CPU
time hardly does (one CI run took three times its usual wall time); with several
threads, its CPU time grows and its wall time does not. A test that does twice the work costs
twice as much either way. The notebooks have their own limit (tests/test_notebooks.py). Three
kinds of test are exempt: the `tpu_compile` tests, which share each chip's compiles through a
cache, so the first test that asks for a chip pays for all of them; the `slow` sweeps, which CI
does not run (`pytest -m slow`); and the `notebooks`, with their limit.

A test that never ends would never reach that check: CI would stall until its own 90-minute
limit. So a watchdog thread stops any test, fixtures included, still running HANG_SECONDS
(ten minutes; 30 for a `slow` sweep) after it started, however slow the machine: it prints the
test's name and every thread's stack, then ends the process (`os._exit`), since a kernel stuck
in a compiled loop never returns to Python for an exception to reach it. Under pytest-xdist the
worker's end fails that test by name ("worker 'gw0' crashed while running ...") and a new worker
runs the rest; in a plain run the run ends there, with a non-zero exit.

CI runs the tests with `--dist loadfile`, whose scheduler in pytest-xdist 3.8.0 (the newest)
mishandles a worker's end: it queues again every file the worker had, the ones it finished and
the test it ended on included, and can give the new worker a single test, which a worker never
starts until a second one comes. The run then waits forever (pytest-xdist issues 1323, 1327,
1371, 1378). `CrashSafeLoadFile` is that scheduler, mended in those two places.

MINILIB_TEST_SECONDS_LIMIT overrides the limit (in seconds), for a slower machine, and
MINILIB_TEST_HANG_SECONDS the hang limit; both are read once, when the run starts.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

import pytest
from xdist.scheduler import LoadFileScheduling

CI_BUDGET_SECONDS = 30 * 60
SHARE = 1 / 15  # 120 s
HANG_SECONDS = 10 * 60
SLOW_HANG_SECONDS = CI_BUDGET_SECONDS
HUNG_EXIT_CODE = 70
EXEMPT = ("tpu_compile", "slow", "notebooks")


def seconds_limit() -> float:
    return float(os.environ.get("MINILIB_TEST_SECONDS_LIMIT", CI_BUDGET_SECONDS * SHARE))


def hang_seconds(marks: set[str]) -> float:
    """How long a test with these marks may run before it is stopped as hung."""
    if "MINILIB_TEST_HANG_SECONDS" in os.environ:
        return float(os.environ["MINILIB_TEST_HANG_SECONDS"])
    return SLOW_HANG_SECONDS if "slow" in marks else HANG_SECONDS


def cpu_seconds() -> float:
    """The CPU seconds of this process (every thread) and of the children it has waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class Cost:
    """What the code run since this was made costs: `seconds()`, the smaller of its wall-clock
    and CPU seconds."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), cpu_seconds()

    def wall_seconds(self) -> float:
        return time.perf_counter() - self.wall

    def seconds(self) -> float:
        return min(self.wall_seconds(), cpu_seconds() - self.cpu)


LIMIT = pytest.StashKey[float]()
COST = pytest.StashKey[float]()


def pytest_configure(config):
    config.stash[LIMIT] = seconds_limit()


def exempt_marks(item) -> set[str]:
    """The marks of `item` that exempt it from the time limit: `tpu_compile`, `slow`,
    `notebooks`."""
    return {mark for mark in EXEMPT if item.get_closest_marker(mark)}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    cost = Cost()
    yield
    item.stash[COST] = cost.seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    limit = item.config.stash[LIMIT]
    if call.when != "call" or not report.passed or exempt_marks(item):
        return
    cost = item.stash[COST]
    if cost > limit:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} passed but cost {cost:.3g} s (the smaller of its wall and CPU "
            f"seconds; {call.duration:.3g} s wall), over the time limit of {limit:.3g} s per "
            f"test ({SHARE:.0%} of CI's {CI_BUDGET_SECONDS // 60}-minute budget, "
            f"tests/time_limit.py). Make it faster, or mark its larger cases `slow`."
        )


def stop_hung_test(config, nodeid: str, seconds: float) -> None:
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # to the terminal, not to the captured output that dies with us
        capture.suspend_global_capture(in_=True)
    print(
        f"\n\nHUNG: {nodeid} was still running after {seconds:.3g} s: stopped, and this "
        f"process with it (tests/time_limit.py). Where each thread was:",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(HUNG_EXIT_CODE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = hang_seconds(exempt_marks(item))
    watchdog = threading.Timer(seconds, stop_hung_test, args=(item.config, item.nodeid, seconds))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
        watchdog.join()  # gone before the next test starts: tests count the threads they leave


class CrashSafeLoadFile(LoadFileScheduling):
    """pytest-xdist's `--dist loadfile` scheduler, but a worker's end queues again only the tests
    it had not run, less the one it ended on, and a worker never waits with a single test."""

    def remove_node(self, node):
        workload = self.assigned_work.pop(node)
        unfinished = {file: tests for file, tests in workload.items() if not all(tests.values())}
        if not unfinished:
            return None
        ended_on = next(test for tests in unfinished.values() for test, done in tests.items()
                        if not done)  # fmt: skip
        unfinished[self._split_scope(ended_on)][ended_on] = True  # failed by name, not run again
        self.workqueue.update({file: tests for file, tests in unfinished.items()
                               if not all(tests.values())})  # fmt: skip
        for other in self.assigned_work:
            self._reschedule(other)
        return ended_on

    def _reschedule(self, node):
        if node.shutting_down:
            return
        # More than two tests queued (a worker runs one only once it holds the next), or all.
        while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it (-p no:xdist), unused
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFile(config, log)
    return None
