"""A time limit on every test, so that a test that grows is seen at once, not when CI as a
whole runs over its budget.

CI (`.ci/run`, that is `python3 tasks.py test`) aims at 30 minutes on a 2-core machine; a
single test may take at most SHARE of that, timed around its body (fixtures apart), on the
test's own worker while the other core runs other tests. A test over it fails with its time
and the limit. The notebooks have their own, tighter limit (tests/test_notebooks.py). The
`tpu_compile` tests are exempt: they share each chip's compiles through a cache, so the first
test that asks for a chip pays for all of them.

MINILIB_TEST_SECONDS_LIMIT overrides the limit (in seconds), for a slower machine; it is read
once, when the run starts.
"""

from __future__ import annotations

import os

import pytest

CI_BUDGET_SECONDS = 30 * 60
SHARE = 1 / 15  # 120 s


def seconds_limit() -> float:
    return float(os.environ.get("MINILIB_TEST_SECONDS_LIMIT", CI_BUDGET_SECONDS * SHARE))


LIMIT = pytest.StashKey[float]()


def pytest_configure(config):
    config.stash[LIMIT] = seconds_limit()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    limit = item.config.stash[LIMIT]
    # The tpu_compile tests run in venvs of their own, and share compiles through caches: the
    # first test that asks for a chip's comparison compiles three kernels for it.
    exempt = item.get_closest_marker("tpu_compile") is not None
    if call.when == "call" and report.passed and call.duration > limit and not exempt:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} passed but took {call.duration:.3g} s, over the time limit of "
            f"{limit:.3g} s per test ({SHARE:.0%} of CI's {CI_BUDGET_SECONDS // 60}-minute "
            f"budget, tests/time_limit.py). Make it faster, or mark its larger cases `slow`."
        )
