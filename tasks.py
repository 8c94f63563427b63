"""Set up and run the course, or its tests, on a machine that has only python3.

    python3 tasks.py course   # make .venv, install, open JupyterLab on notebooks/
    python3 tasks.py test     # make the venvs, install, lint, run every test

`test` runs in four environments:
  * .venv         the newest supported jax (constraints/newest.txt): lint, then every test
                  (notebooks included; the slow sweeps stay opt-in, see README);
  * .venv-oldest  Colab's TPU runtime: jax 0.7.2 and ipywidgets 7.7.1
                  (constraints/oldest.txt) on Python 3.13 when this machine has it: the
                  fast tests, notebooks and explorers included;
  * .venv-tpu     the newest jax with its libtpu, pinned (constraints/tpu.txt): the
                  `tpu_compile` tests, which compile every kernel for four TPU chips here,
                  without a TPU, and print our kernel's bundle ratios against JAX's;
  * .venv-tpu-oldest  jax 0.7.2 with its libtpu, Colab's stack (constraints/tpu-oldest.txt):
                  a few of those compiles (COLAB_TPU_TESTS).
then the browser test in .venv and .venv-oldest (tests/browser: the explorers in
JupyterLab, or the classic notebook for ipywidgets 7, in headless Chromium), which needs
Debian's `chromium` and is skipped, loudly, without it.

Extra arguments after `test` go to pytest in the first environment, e.g.
`python3 tasks.py test -m slow`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
NEWEST = (ROOT / ".venv", ROOT / "constraints" / "newest.txt")
OLDEST = (ROOT / ".venv-oldest", ROOT / "constraints" / "oldest.txt")
COLAB_PYTHON = "3.13"  # the Python of Colab's TPU runtime, for .venv-oldest
# The course's JupyterLab settings: no news pop-up (labconfig/default_setting_overrides.json).
JUPYTER_CONFIG = ROOT / "jupyter_config"
TPU = (ROOT / ".venv-tpu", ROOT / "constraints" / "tpu.txt")
TPU_OLDEST = (ROOT / ".venv-tpu-oldest", ROOT / "constraints" / "tpu-oldest.txt")
# The test files holding `tpu_compile` tests (the TPU venvs lack the course's packages, so
# only these are collected there).
TPU_COMPILE_TESTS = ("tests/test_tpu_compile.py", "tests/test_ladder.py")
# On Colab's stack, one kernel configuration per chip, the comparison with JAX's kernel and
# the harness's own failure tests: the whole matrix runs once, on the newest stack.
COLAB_TPU_TESTS = "gqa-bf16 or against_jax or bad_kernel or vmem_overflow or by_design"


def run(*cmd: str | Path, env: dict | None = None) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True, env=env)


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def make_venv(venv: Path, constraints: Path, extra: str, base_python: str = sys.executable) -> Path:
    """Create `venv` from `base_python` if needed (again if it has another Python version)
    and install minilib[extra] into it, pinned by `constraints`."""
    python = venv_python(venv)
    if python.exists() and python_version(python) != python_version(base_python):
        shutil.rmtree(venv)
    if not python.exists():
        run(base_python, "-m", "venv", venv)
        run(python, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    run(python, "-m", "pip", "install", "--quiet", "-c", constraints, "-e", f".[{extra}]")
    return python


def python_version(python: str | Path) -> str:
    command = [str(python), "-c", "import sys; print(sys.version.split()[0])"]
    return subprocess.run(command, capture_output=True, text=True).stdout.strip()


def colab_python() -> str:
    """A python3.13 of this machine (Colab's version), on PATH or installed by pyenv; else
    this Python, with a note."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python{COLAB_PYTHON}")]  # a pyenv shim may not run: check
    candidates += sorted(pyenv.glob(f"{COLAB_PYTHON}*/bin/python{COLAB_PYTHON}"), reverse=True)
    for candidate in filter(None, candidates):
        if python_version(candidate).startswith(f"{COLAB_PYTHON}."):
            print(f"Colab's Python: {candidate} ({python_version(candidate)})", flush=True)
            return str(candidate)
    print(
        f"NOTE: no python{COLAB_PYTHON} on this machine (Colab's TPU runtime has it): "
        f".venv-oldest uses {sys.executable} ({python_version(sys.executable)}) instead.",
        flush=True,
    )
    return sys.executable


def pytest(python: Path, *args: str) -> None:
    # pytest exits 5 when it collected no tests: that is a failure here, as any non-zero code.
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    run(python, "-m", "pytest", *args, env=env)


def test(args: list[str]) -> None:
    python = make_venv(*NEWEST, extra="dev,browser")
    run(python, "-m", "ruff", "check", ".")
    run(python, "-m", "ruff", "format", "--check", ".")
    pytest(python, *args)

    oldest = make_venv(*OLDEST, extra="dev,browser", base_python=colab_python())
    pytest(oldest, "-m", "not slow and not browser", "-p", "no:cacheprovider")

    tpu = make_venv(*TPU, extra="tpu-test")
    pytest(tpu, "-m", "tpu_compile", "-p", "no:cacheprovider", *TPU_COMPILE_TESTS)

    tpu_oldest = make_venv(*TPU_OLDEST, extra="tpu-test")
    pytest(tpu_oldest, "-m", "tpu_compile", "-k", COLAB_TPU_TESTS, "-p", "no:cacheprovider",
           "tests/test_tpu_compile.py")  # fmt: skip

    for env in (python, oldest):
        browser_test(env)


def browser_test(python: Path) -> None:
    """The explorers in JupyterLab in headless Chromium (tests/browser)."""
    if shutil.which("chromium") is None:
        banner = "!" * 78
        print(
            f"{banner}\nBROWSER TEST SKIPPED: Debian's `chromium` is not installed, so the "
            f"explorers\nwere not checked in a browser. Install it: apt-get install chromium"
            f"\n{banner}",
            flush=True,
        )
        return
    # -s: print the versions tried, each Run All's time and how fast the explorers reacted.
    pytest(python, "-m", "browser", "tests/browser", "-p", "no:cacheprovider", "-s")


def course(args: list[str]) -> None:
    """JupyterLab on notebooks/ (`course notebook`: Notebook 7 instead)."""
    python = make_venv(*NEWEST, extra="course")
    app, args = (args[0], args[1:]) if args[:1] == ["notebook"] else ("lab", args)
    # Jupyter refuses to start as root (containers, some cloud VMs) unless told it may.
    as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    env = dict(os.environ, JUPYTER_CONFIG_PATH=os.pathsep.join(jupyter_config_path()))
    run(python, "-m", "jupyter", app, "notebooks/", *as_root, *args, env=env)


def jupyter_config_path() -> list[str]:
    """Jupyter's extra config folders, with the course's (its JupyterLab settings) first."""
    extra = os.environ.get("JUPYTER_CONFIG_PATH", "")
    return [str(JUPYTER_CONFIG), *filter(None, extra.split(os.pathsep))]


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
