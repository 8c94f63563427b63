"""Set up and run the course, or its tests, on a machine that has only python3.

    python3 tasks.py course   # make .venv, install, open JupyterLab on notebooks/
    python3 tasks.py test     # make the venvs, install, lint, run every test

`test` runs in two environments:
  * .venv         the newest supported jax (constraints/newest.txt): lint, then every test
                  (notebooks included; the slow sweeps stay opt-in, see README);
  * .venv-oldest  the oldest supported jax, 0.7.2, as on Colab's TPU runtime
                  (constraints/oldest.txt): the fast tests;
  * .venv-tpu     the newest jax with its libtpu, pinned (constraints/tpu.txt): the
                  `tpu_compile` tests, which compile every kernel for four TPU chips here,
                  without a TPU, and print our kernel's bundle ratios against JAX's;
  * .venv-tpu-oldest  jax 0.7.2 with its libtpu, Colab's stack (constraints/tpu-oldest.txt):
                  a few of those compiles (COLAB_TPU_TESTS).

Extra arguments after `test` go to pytest in the first environment, e.g.
`python3 tasks.py test -m slow`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
NEWEST = (ROOT / ".venv", ROOT / "constraints" / "newest.txt")
OLDEST = (ROOT / ".venv-oldest", ROOT / "constraints" / "oldest.txt")
TPU = (ROOT / ".venv-tpu", ROOT / "constraints" / "tpu.txt")
TPU_OLDEST = (ROOT / ".venv-tpu-oldest", ROOT / "constraints" / "tpu-oldest.txt")
# On Colab's stack, one kernel configuration per chip, the comparison with JAX's kernel and
# the harness's own failure tests: the whole matrix runs once, on the newest stack.
# The test files holding `tpu_compile` tests (the TPU venvs lack the course's packages, so
# only these are collected there).
TPU_COMPILE_TESTS = ("tests/test_tpu_compile.py", "tests/test_ladder.py")
COLAB_TPU_TESTS = "gqa-bf16 or against_jax or bad_kernel or vmem_overflow or by_design"


def run(*cmd: str | Path, env: dict | None = None) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True, env=env)


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def make_venv(venv: Path, constraints: Path, extra: str) -> Path:
    """Create `venv` if needed and install minilib[extra] into it, pinned by `constraints`."""
    python = venv_python(venv)
    if not python.exists():
        run(sys.executable, "-m", "venv", venv)
        run(python, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    run(python, "-m", "pip", "install", "--quiet", "-c", constraints, "-e", f".[{extra}]")
    return python


def pytest(python: Path, *args: str) -> None:
    # pytest exits 5 when it collected no tests: that is a failure here, as any non-zero code.
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    run(python, "-m", "pytest", *args, env=env)


def test(args: list[str]) -> None:
    python = make_venv(*NEWEST, extra="dev")
    run(python, "-m", "ruff", "check", ".")
    run(python, "-m", "ruff", "format", "--check", ".")
    pytest(python, *args)

    oldest = make_venv(*OLDEST, extra="dev")
    pytest(oldest, "-m", "not slow and not notebooks", "-p", "no:cacheprovider")

    tpu = make_venv(*TPU, extra="tpu-test")
    pytest(tpu, "-m", "tpu_compile", "-p", "no:cacheprovider", *TPU_COMPILE_TESTS)

    tpu_oldest = make_venv(*TPU_OLDEST, extra="tpu-test")
    pytest(tpu_oldest, "-m", "tpu_compile", "-k", COLAB_TPU_TESTS, "-p", "no:cacheprovider",
           "tests/test_tpu_compile.py")  # fmt: skip


def course(args: list[str]) -> None:
    python = make_venv(*NEWEST, extra="course")
    # Jupyter refuses to start as root (containers, some cloud VMs) unless told it may.
    as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    run(python, "-m", "jupyter", "lab", "notebooks/", *as_root, *args)


def main() -> None:
    commands = {"test": test, "course": course}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    try:
        commands[sys.argv[1]](sys.argv[2:])
    except subprocess.CalledProcessError as err:
        sys.exit(err.returncode or 1)


if __name__ == "__main__":
    main()
