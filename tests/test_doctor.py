from __future__ import annotations

import subprocess
import sys

from minilib.doctor import kernel_mode


def test_doctor_command_reports_and_passes():
    result = subprocess.run(
        [sys.executable, "-m", "minilib", "doctor"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    expected = ("backend:", "jax:", "jaxlib:", "libtpu:", "Pallas kernel:", "parity check: PASS")
    for line in (*expected, "TPU compile:"):
        assert line in out


def test_kernel_mode():
    assert kernel_mode("tpu").startswith("compiled")
    assert kernel_mode("cpu").startswith("interpreted")


def test_unknown_command_fails():
    result = subprocess.run(
        [sys.executable, "-m", "minilib", "frobnicate"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "unknown command" in result.stderr
