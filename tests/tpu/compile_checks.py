"""What the `tpu_compile` test modules share: whether libtpu compiles here, and the checks of
a compile."""

from __future__ import annotations

import pytest

from minilib.tpu.compile import chip_unknown_here, chips_here, tpu_compile_available

AVAILABLE, REASON = tpu_compile_available()
# Every test of a module that compiles with libtpu: marker `tpu_compile`, skipped without it.
TPU_COMPILE = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not AVAILABLE, reason=f"no TPU compile here: {REASON}"),
]


def require_chip(chip):
    """Skip, saying why, when this libtpu has no compile-only device for `chip`."""
    if chip not in chips_here():
        pytest.skip(chip_unknown_here(chip))


def assert_compiled(report):
    assert report.compiled, f"Mosaic/XLA rejected the kernel on {report.chip}:\n{report.error}"
    assert report.total_bundles and report.total_bundles > 0, f"no bundles read: {report}"
