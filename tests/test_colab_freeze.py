"""constraints/colab_freeze.py: the committed constraint files are what Colab's published
package lists make, and its rules hold on a small freeze. No network: the lists are committed
in constraints/colab/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


colab_freeze = load(ROOT / "constraints" / "colab_freeze.py")
tasks = load(ROOT / "tasks.py")

FREEZE = """\
# a comment, as in Colab's file
absl-py==1.4.0
jax==0.7.2
ML_dtypes==0.6.0
torch @ https://download.pytorch.org/whl/cpu/torch-2.9.0.whl
"""
OS_INFO = "Ubuntu 22.04.5 LTS\nPython 3.13.15\n"
SOURCE = "googlecolab/backend-info a72407924822ea377410b69f0a290150bcb5c9c2 2026-08-19\n"


def test_the_committed_constraint_files_are_what_colabs_lists_make():
    files = colab_freeze.generated_files()
    assert set(files) == {"oldest.txt", "tpu-oldest.txt", "colab-2026.07.txt"}
    for name, text in files.items():
        committed = (ROOT / "constraints" / name).read_text()
        assert committed == text, f"{name} is stale: run python3 constraints/colab_freeze.py"


def test_the_course_packages_come_first_then_the_rest_of_the_freeze():
    text = colab_freeze.constraints("why", ["ml-dtypes", "jax"], True, FREEZE, OS_INFO, SOURCE)
    pins = [line for line in text.splitlines() if not line.startswith("#")]
    assert pins == ["ML_dtypes==0.6.0", "jax==0.7.2", "absl-py==1.4.0"]
    assert "of 2026-08-19" in text and "a72407924822" in text and "Python 3.13.15" in text
    only = colab_freeze.constraints("why", ["jax"], False, FREEZE, OS_INFO, SOURCE)
    assert [line for line in only.splitlines() if not line.startswith("#")] == ["jax==0.7.2"]


def test_a_version_that_does_not_install_is_replaced_by_the_nearest_saying_why(monkeypatch):
    nearest = {("ml-dtypes", "0.6.0"): ("0.5.4", "no wheel for Python 3.13.0")}
    monkeypatch.setattr(colab_freeze, "NEAREST", nearest)
    text = colab_freeze.constraints("why", ["ML-dtypes"], True, FREEZE, OS_INFO, SOURCE)
    assert "ML_dtypes==0.5.4  # Colab: 0.6.0; no wheel for Python 3.13.0" in text.splitlines()
    newer = FREEZE.replace("ML_dtypes==0.6.0", "ML_dtypes==0.6.1")  # a refreshed freeze
    assert "ML_dtypes==0.6.1" in colab_freeze.constraints("w", [], True, newer, OS_INFO, SOURCE)


def test_a_package_missing_from_the_freeze_is_named():
    with pytest.raises(ValueError, match=r"\['notebook'\] are not pinned"):
        colab_freeze.constraints("why", ["jax", "notebook"], True, FREEZE, OS_INFO, SOURCE)


def test_the_venvs_use_the_python_of_colabs_runtimes():
    for runtime, version in (("tpu", tasks.COLAB_PYTHON), ("2026.07", tasks.COLAB_2026_07_PYTHON)):
        os_info = (ROOT / "constraints" / "colab" / runtime / "os-info-tpu.txt").read_text()
        python = colab_freeze.python_version(os_info)
        assert python.startswith(f"{version}."), f"{runtime}: Colab {python}, tasks.py {version}"


def test_the_examples_run():
    import doctest

    assert doctest.testmod(colab_freeze).failed == 0
