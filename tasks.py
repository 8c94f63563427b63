"""Set up and run the course, or its tests, on a machine that has only python3.

    python3 tasks.py course   # make .venv, install, open JupyterLab on notebooks/
    python3 tasks.py test     # make the venvs, install, lint, run every test
    python3 tasks.py book     # build the course as a book, build/book/html (--serve: serve it)

`course` makes .venv with this machine's python3.13 (else its python3.12, else the Python
running tasks.py) on the newest stack (newest.txt); where that Python is 3.11, on the newest
jax for 3.11 instead, 0.10.2 (python3.11.txt: not one of the stacks `test` runs). It prints
which stack in one line (`course --check` prints only that). `test` and `book` need Python
3.12 or newer, and stop at once without it, saying how to get it.

Every environment is made by `uv` (from the package index, into .venv-uv the first time:
it installs a venv in seconds where pip takes minutes, and shares one download cache among
all of them). `test` runs in five environments (and builds the book in a sixth), each
pinned by a file of constraints/ (docs/testing.md: "The environments"):
  * .venv         the newest supported jax (newest.txt) on Python 3.13 when this machine
                  has it (jax 0.12 needs 3.12 or newer): lint, then every test (notebooks
                  included; the slow sweeps stay opt-in, see docs/testing.md), on both cores
                  (pytest-xdist);
  * .venv-oldest  Colab's TPU runtime, package for package (oldest.txt, made from the
                  package list Colab publishes, constraints/colab/tpu/, by
                  constraints/colab_freeze.py) on Python 3.13 when this machine has it:
                  the fast tests and the notebooks (these, and the kernels' parity
                  tests, with a TPU's matmul numerics, as on Colab's TPU: one bfloat16
                  pass, minilib.tpu.numerics), with each interpret-mode matrix and each
                  sweep shared by every checker or field cut to one case per path (the
                  tests marked `matrix` run on .venv alone);
  * .venv-tpu     the newest jax whose libtpu the package index has, with it, pinned
                  (tpu.txt), on Python 3.13 as .venv: the `tpu_compile`
                  tests, which compile every kernel for five TPU chips here, without a TPU,
                  and print our kernel against JAX's and vLLM's RPA v3 (whose wheel,
                  tpu-inference 0.32.0, is fetched alone into .venv-tpu/minilib-v3, not
                  installed: `python -m minilib.tpu.v3 fetch`);
  * .venv-tpu-oldest  Colab's jax 0.7.2 and libtpu 0.0.21.1 (tpu-oldest.txt, from the same
                  list): every kernel of the course compiles for v5e and v6e with minilib's
                  two fixes for this pair, and each fix is checked to be still needed;
  * .venv-tpu-jax-0.7.2  jax 0.7.2 with the libtpu its `jax[tpu]` pins (tpu-jax-0.7.2.txt):
                  a few of those compiles (JAX_0_7_2_TPU_TESTS);
then the course's book (`book`, below) from the notebooks .venv executed, and, beside the
suites that follow it, the browser test in .venv and .venv-oldest (tests/browser: the explorers
in JupyterLab, or the classic notebook for ipywidgets 7, in headless Chromium; in .venv, the
book too), which needs Debian's `chromium` and is skipped, loudly, without it. The three
TPU venvs' compiles run beside the CPU venvs' tests (one process, one core), each phase's
output printed when it ends. At the end it prints a table of each phase's minutes, passed or not.
A command still running 85 minutes after `test` began is stopped, and says where it was (run).

    python3 tasks.py test-colab-2026.07   # the fast tests on Colab's past runtime 2026.07

runs the fast tests, notebooks included, in .venv-colab-2026.07 (colab-2026.07.txt, from
constraints/colab/2026.07/: Python 3.12, numpy 2.0.2, jax 0.7.2). It is not part of `test`,
whose time it would add to CI's.

    python3 tasks.py book [--serve]

builds the course as a static site with Jupyter Book 2 (.venv-book, pinned by
constraints/book.txt; it needs Node.js: Debian's `nodejs`): docs/book.py writes its source
from the executed notebooks (build/executed/venv/, which tests/test_notebooks.py keeps, and
runs first if they are missing), `jupyter book build --site` makes each page's content, and
docs/book_html.py the HTML, in build/book/html. `--serve` then serves it on localhost.

Extra arguments after `test` (or `test-colab-2026.07`) go to pytest in its first
environment, e.g. `python3 tasks.py test -m slow`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# uv, pinned, in a venv of its own: the one tool installed with pip.
UV_VENV, UV_VERSION = ROOT / ".venv-uv", "0.13.9"
# The venvs' bytecode, written by the first process that imports a module and read by every
# later one. uv installs no .pyc (pip does), and where PYTHONDONTWRITEBYTECODE is set, as on
# CI's machine, each of a run's hundred-odd Python processes (pytest workers, notebook
# kernels, the tests' own subprocesses) compiled jax and the rest from source again: 3-6 s
# each (`import jax, minilib, ipykernel`: 6.0 s, then 2.4 s from here). A folder of its own,
# so the checkout gets no __pycache__.
BYTECODE = ROOT / ".venv-bytecode"
NEWEST = (ROOT / ".venv", ROOT / "constraints" / "newest.txt")
# The newest stack's Python, for .venv and .venv-tpu: jax 0.12 needs 3.12 or newer, whatever
# Python runs tasks.py. Where this machine has no python3.13, its python3.12 does.
NEWEST_PYTHON = "3.13"
NEWEST_NEEDS = (3, 12)
# The course on Python 3.11, where this machine has no Python 3.12 or newer: the newest jax
# for 3.11, 0.10.2 (jax 0.12 needs 3.12), with the rest newest, as newest.txt has it.
# Not one of the tested stacks of `tasks.py test`.
PYTHON_3_11 = ROOT / "constraints" / "python3.11.txt"
# Colab's TPU runtime and its past runtime 2026.07, pinned from the package lists Colab
# publishes (constraints/colab/, made into constraint files by constraints/colab_freeze.py),
# each with the Python it has (os-info-tpu.txt).
OLDEST = (ROOT / ".venv-oldest", ROOT / "constraints" / "oldest.txt")
COLAB_PYTHON = "3.13"
COLAB_2026_07 = (ROOT / ".venv-colab-2026.07", ROOT / "constraints" / "colab-2026.07.txt")
COLAB_2026_07_PYTHON = "3.12"
# The course's JupyterLab settings: no news pop-up (labconfig/default_setting_overrides.json).
JUPYTER_CONFIG = ROOT / "jupyter_config"
# The course as a book: Jupyter Book 2, built from the notebooks executed on the newest stack.
BOOK = (ROOT / ".venv-book", ROOT / "constraints" / "book.txt")
EXECUTED = ROOT / "build" / "executed" / "venv"  # kept by tests/test_notebooks.py in .venv
BOOK_SOURCE, BOOK_HTML = ROOT / "build" / "book" / "source", ROOT / "build" / "book" / "html"
TPU = (ROOT / ".venv-tpu", ROOT / "constraints" / "tpu.txt")
# Colab's jax 0.7.2 and libtpu 0.0.21.1 (from its list): every kernel of the course compiles
# with minilib's two fixes for the pair, each still needed (tests/tpu/test_tpu_colab_pair.py).
TPU_OLDEST = (ROOT / ".venv-tpu-oldest", ROOT / "constraints" / "tpu-oldest.txt")
# jax 0.7.2 with the libtpu its `jax[tpu]` extra pins, 0.0.23: the kernels through the
# oldest jax's Pallas lowering, compiled by Mosaic.
TPU_JAX_0_7_2 = (ROOT / ".venv-tpu-jax-0.7.2", ROOT / "constraints" / "tpu-jax-0.7.2.txt")
# Set for .venv-oldest's run: the notebooks' kernels get a TPU's matmul numerics (one bfloat16
# pass, minilib.tpu.numerics), as on Colab's TPU runtime; tests/test_notebooks.py reads it.
NOTEBOOKS_AS_ON_TPU = "MINILIB_NOTEBOOKS_AS_ON_TPU"
# The TPU lane's marker expression: `-m` replaces pyproject's "not slow", so it is said again.
TPU_COMPILE = "tpu_compile and not slow"
# The test files holding `tpu_compile` tests (the TPU venvs lack the course's packages, so
# only these are collected there).
# The kernels against JAX's reference: on .venv-oldest, as a TPU rounds its matmuls.
KERNEL_PARITY_TESTS = (
    "tests/kernel/test_kernel.py",
    "tests/kernel/test_kv_write.py",
    "tests/kernel/test_plain_kernel.py",
    "tests/kernel/test_mixed_layout.py",
    "tests/kernel/test_levers.py",
)
TPU_COMPILE_TESTS = (
    "tests/tpu/test_tpu_compile.py",
    "tests/tpu/test_tpu_comparison.py",
    "tests/tpu/test_tpu_at_defaults.py",
    "tests/tpu/test_tpu_suite.py",
    "tests/tpu/test_tpu_vmem_model.py",
    "tests/ladder/test_ladder.py",
    "tests/tpu/test_tpu_listing.py",
    "tests/tpu/test_tpu_recorded.py",
    "tests/tpu/test_tpu_levers.py",
    "tests/tpu/test_tpu_kv_write.py",
    "tests/tpu/test_tpu_dump_cache.py",
    "tests/exercises/test_kernel_constructs.py",
)
# With jax 0.7.2, one kernel configuration per chip, the comparison with JAX's kernel and
# the harness's own failure tests: the whole matrix runs once, on the newest stack.
JAX_0_7_2_TPU_TESTS = "gqa-bf16 or against_jax or bad_kernel or vmem_overflow or by_design"
# On Colab's own pair: those, every ladder rung (test_ladder.py's tpu_compile tests), the
# pair's tests, and the kernels writing the new tokens into the cache (not the test of the
# no-copy check itself, a compile of its own that tests the check, not the stack).
COLAB_TPU_TESTS = (f"({JAX_0_7_2_TPU_TESTS} or add_vectors or test_ladder or colab_pair or "
                   "kv_write) and not no_copy_check_can_fail")  # fmt: skip
# pytest on both cores of CI's machine (pytest-xdist): "auto" is one worker per core. Each test
# file runs whole in one worker (loadfile), so that its tests share their compiles (jitted
# functions, JAX's reference per batch): tests/exercises/test_exercises.py took 230 s of CPU
# spread over two workers, 195 s with loadfile. Not for the tpu_compile runs: their tests share
# each chip's compiles through a per-process cache, which every worker would fill again.
WORKERS = ("-n", os.environ.get("MINILIB_TEST_WORKERS", "auto"), "--dist", "loadfile")
# XLA's CPU compiles of the CPU suites, kept between runs on this machine (JAX's persistent
# compilation cache, as uv keeps its downloads in ~/.cache/uv): half the time of a kernel test
# is XLA compiling it (tests/kernel/test_kernel.py -k strided_kv_loads: 56 of 96 s), and a
# compile found there takes a fifth of that (tests/exercises/test_ladder_checkers.py: 300 ->
# 188 s, its 235 compiles 136 -> 29 s). A compile is found only for the same program, jaxlib
# and XLA flags, so what a test checks is unchanged; a run's first compiles are as slow as
# before. Not for the notebooks (tests/test_notebooks.py: they time this machine as a
# learner's first run does) nor the TPU compiles (their tests read libtpu's dumps, which a
# compile found in a cache does not write). A folder per venv; it is emptied when a run did
# not finish (a file cut short by a kill) or it outgrew COMPILE_CACHE_MAX_BYTES.
# MINILIB_COMPILE_CACHE=off runs without it.
COMPILE_CACHE = os.environ.get("MINILIB_COMPILE_CACHE",
                               str(Path.home() / ".cache" / "minilib" / "jax-cpu"))  # fmt: skip
# libtpu's dumps of the TPU lanes' compiles, kept the same way (minilib.tpu.dump_cache): a
# compile for a compile-only device is most of those tests' time, and libtpu's own files are
# what they read, so JAX's cache cannot serve. An entry is found only by the same program,
# chip, jax, jaxlib, libtpu and flags, and holds every file that compile dumped: a test reads
# what a fresh compile gives. MINILIB_TPU_COMPILE_CACHE=off runs without it.
TPU_COMPILE_CACHE = os.environ.get("MINILIB_TPU_COMPILE_CACHE",
                                   str(Path.home() / ".cache" / "minilib" / "libtpu"))  # fmt: skip
TPU_COMPILE_CACHE_ENV = "MINILIB_TPU_DUMP_CACHE"  # minilib.tpu.dump_cache.CACHE_ENV
COMPILE_CACHE_MAX_BYTES = 4 << 30
COMPILE_CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")  # fmt: skip


# CI stops a run at 90 minutes and keeps only part of what it printed, so a command that hangs
# outside any test's own watchdog (tests/time_limit.py: the book's build, a process left holding
# a lane's output) would leave no trace. In `test`, a command still running DEADLINE_MINUTES
# after it started is stopped first: each Python process under it prints where each of its
# threads was (SIGABRT: faulthandler, which PYTHONFAULTHANDLER turns on), then every process
# under it is killed and its phase fails by name. MINILIB_DEADLINE_MINUTES overrides it.
DEADLINE_MINUTES = float(os.environ.get("MINILIB_DEADLINE_MINUTES", 85))
DEADLINE: float | None = None  # set by `test`, a time.monotonic(); the course has none
STACKS_GRACE_SECONDS = 15  # for the aborted processes to print their stacks
# The commands running now (under a deadline, each in a session of its own, out of Ctrl-C's
# reach: tasks.py stops them all).
RUNNING: set[subprocess.Popen] = set()


def run(*cmd: str | Path, env: dict | None = None, in_one_piece: bool = False,
        cwd: Path = ROOT) -> None:  # fmt: skip
    """Run `cmd` from `cwd` (the project's root unless told); a non-zero exit raises, as does
    the deadline (DEADLINE). `in_one_piece` keeps its output and prints it when it
    ends, so that it does not interleave with a command running beside it."""
    line = "+ " + " ".join(str(c) for c in cmd)
    if not in_one_piece:
        print(line, flush=True)
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if in_one_piece else {}
    process = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, text=True,
                               start_new_session=DEADLINE is not None, **pipe)  # fmt: skip
    RUNNING.add(process)
    try:
        output, _ = process.communicate(timeout=seconds_left())
    except subprocess.TimeoutExpired:
        stop(process)
        output = finish(process)
        print(f"{line}\n{output}" if in_one_piece else "", flush=True)
        raise DeadlinePassed(line, DEADLINE_MINUTES) from None
    except BaseException:  # Ctrl-C, say: nothing it started is left running, in either lane
        for running in list(RUNNING):
            kill_tree(running, signal.SIGKILL)
        raise
    finally:
        RUNNING.discard(process)
    if in_one_piece:
        print(f"{line}\n{output}", flush=True)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, cmd)


class DeadlinePassed(subprocess.CalledProcessError):
    def __init__(self, line: str, minutes: float):
        super().__init__(124, line)
        self.minutes = minutes

    def __str__(self) -> str:
        return (f"STOPPED: still running {self.minutes:g} minutes after `tasks.py test` started "
                f"(tasks.DEADLINE_MINUTES), before CI's own limit: {self.cmd}\n(each of its "
                "Python processes printed its threads' stacks above)")  # fmt: skip


def seconds_left() -> float | None:
    return None if DEADLINE is None else max(0.0, DEADLINE - time.monotonic())


def processes_under(process: subprocess.Popen) -> list[int]:
    """The living processes started from `process`: those of its session, those holding its
    output's pipe (the ones in a session of their own, whose parent ended, hold it yet), and
    whatever descends from them. By /proc (Linux; elsewhere, `process` alone)."""
    if not Path("/proc/self/stat").exists():
        return [process.pid]
    pipe = f"pipe:[{os.fstat(process.stdout.fileno()).st_ino}]" if process.stdout else None
    found, parents = set(), {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            stat = proc.joinpath("stat").read_text().rsplit(")")[-1].split()
            state, parent, session = stat[0], stat[1], stat[3]
            if state == "Z" or proc.name == str(os.getpid()):  # ended, not reaped; or this one
                continue
            pid = int(proc.name)
            parents[pid] = int(parent)
            if int(session) == process.pid or pid == process.pid:
                found.add(pid)
            elif pipe and any(os.readlink(fd) == pipe for fd in proc.joinpath("fd").iterdir()):
                found.add(pid)
    while new := {pid for pid, parent in parents.items() if parent in found} - found:
        found |= new
    return sorted(found)


def kill_tree(process: subprocess.Popen, sig: int, only_python: bool = False) -> list[int]:
    """Sends `sig` to the processes under `process` (only the Python ones if `only_python`)."""
    signalled = []
    for pid in processes_under(process):
        with contextlib.suppress(OSError):
            if only_python and "python" not in Path(f"/proc/{pid}/exe").resolve().name:
                continue
            os.kill(pid, sig)
            signalled.append(pid)
    return signalled


def stop(process: subprocess.Popen) -> None:
    """Every Python process under `process` prints its stacks and ends; the rest is killed."""
    print(f"\n{'!' * 78}\nDEADLINE: stopping process {process.pid} and those under it: "
          f"where each Python thread was\n{'!' * 78}", flush=True)  # fmt: skip
    aborted = set(kill_tree(process, signal.SIGABRT, only_python=True))
    end = time.monotonic() + STACKS_GRACE_SECONDS
    while time.monotonic() < end and aborted & set(processes_under(process)):
        time.sleep(0.2)
    kill_tree(process, signal.SIGKILL)


def finish(process: subprocess.Popen) -> str:
    """What the stopped `process` printed, if kept."""
    try:
        return process.communicate(timeout=10)[0] or ""
    except subprocess.TimeoutExpired:
        process.kill()
        return "(its output could not be read: a process outside its tree still holds it)"


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def uv() -> Path:
    """The uv of .venv-uv, installed there with pip the first time."""
    tool = UV_VENV / ("Scripts/uv.exe" if os.name == "nt" else "bin/uv")
    if not tool.exists():
        run(sys.executable, "-m", "venv", UV_VENV)
        run(venv_python(UV_VENV), "-m", "pip", "install", "--quiet", f"uv=={UV_VERSION}")
    return tool


def make_venv(venv: Path, constraints: Path, extra: str, base_python: str = sys.executable) -> Path:
    """Create `venv` from `base_python` if needed (again if it has another Python version)
    and install minilib[extra] into it, pinned by `constraints`. The venv has pip too
    (`--seed`): the notebooks' setup cell and `minilib.tpu.v3 fetch` call it."""
    python = venv_python(venv)
    if python.exists() and python_version(python) != python_version(base_python):
        shutil.rmtree(venv)
    if not python.exists():
        run(uv(), "venv", "--quiet", "--seed", "--python", base_python, venv)
    run(uv(), "pip", "install", "--quiet", "--python", python, "-c", constraints,
        "-e", f".[{extra}]")  # fmt: skip
    return python


def python_version(python: str | Path) -> str:
    command = [str(python), "-c", "import sys; print(sys.version.split()[0])"]
    return subprocess.run(command, capture_output=True, text=True).stdout.strip()


def find_python(version: str) -> str | None:
    """A python`version` of this machine (say 3.13, Colab's), on PATH or installed by pyenv;
    None if it has none."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python{version}")]  # a pyenv shim may not run: check
    candidates += sorted(pyenv.glob(f"{version}.*/bin/python{version}"), reverse=True)
    for candidate in filter(None, candidates):
        if python_version(candidate).startswith(f"{version}."):
            return str(candidate)
    return None


def python_for(version: str) -> str:
    """A python`version` of this machine (find_python); else this Python, with a note.
    Prints which one."""
    found = find_python(version)
    if found is not None:
        print(f"Python {version}: {found} ({python_version(found)})", flush=True)
        return found
    print(
        f"NOTE: no python{version} on this machine: using {sys.executable} "
        f"({python_version(sys.executable)}) instead.",
        flush=True,
    )
    return sys.executable


def colab_python() -> str:
    """The Python of Colab's TPU runtime (COLAB_PYTHON), or the nearest this machine has."""
    return python_for(COLAB_PYTHON)


def newest_python() -> str:
    """This machine's python3.13 (NEWEST_PYTHON), else its python3.12, else the Python running
    tasks.py, whatever its version."""
    for version in (NEWEST_PYTHON, "3.12"):
        found = find_python(version)
        if found is not None:
            return found
    return sys.executable


def version_tuple(version: str) -> tuple[int, int]:
    """A version's major and minor numbers: "3.11.7" gives (3, 11)."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def needs_python(command: str, python: str, needs: tuple[int, int]) -> str:
    """One plain line: the Python `tasks.py command` needs, the one found, and how to get it."""
    need = ".".join(str(part) for part in needs)
    return (
        f"tasks.py {command} needs Python {need} or newer; this machine has Python "
        f"{python_version(python)} ({python}) and no python3.13 or python3.12 (on PATH or "
        "in pyenv). Install Python 3.13 (python.org, your system's packages, or `pyenv "
        f"install 3.13`), then run `python3.13 tasks.py {command}`."
    )


def newest_python_for(command: str) -> str:
    """newest_python(), for `tasks.py command` (test, book), which needs the newest stack:
    stops at once, with needs_python's line, if it is older than NEWEST_NEEDS."""
    python = newest_python()
    version = python_version(python)
    if version_tuple(version) < NEWEST_NEEDS:
        sys.exit(needs_python(command, python, NEWEST_NEEDS))
    print(f"Python for the newest stack: {python} ({version})", flush=True)
    return python


def pinned(constraints: Path, package: str) -> str:
    """The version that `constraints` pins `package` to: "jax==0.12.1" gives "0.12.1"."""
    for line in constraints.read_text().splitlines():
        if line.startswith(f"{package}=="):
            return line.removeprefix(f"{package}==").strip()
    raise ValueError(f"{constraints} does not pin {package=}: add a line {package}==<version>")


def course_stack() -> tuple[str, Path, str]:
    """The Python and the constraint file of `tasks.py course`, and one line that names them:
    the newest stack (newest.txt) on newest_python() if it is 3.12 or newer; on Python 3.11,
    jax 0.10.2 (PYTHON_3_11); older, it stops at once with needs_python's line."""
    python = newest_python()
    version = python_version(python)
    if version_tuple(version) >= NEWEST_NEEDS:
        constraints, why = NEWEST[1], "the newest stack"
    elif version_tuple(version) >= (3, 11):
        constraints = PYTHON_3_11
        why = "the newest jax for Python 3.11 (jax 0.12 needs 3.12, which this machine lacks)"
    else:
        sys.exit(needs_python("course", python, (3, 11)))
    jax = pinned(constraints, "jax")
    where = constraints.relative_to(ROOT)
    line = f"The course's stack: jax {jax} ({where}), {why}, on Python {version} ({python})"
    return python, constraints, line


# The CPU test runs have XLA compile for the CPU without optimising (-O0). Their time goes
# mostly to compiling interpret-mode kernels that then run once or twice: an optimised program
# would save less than its optimising costs (tests/kernel/test_kernel_garbage.py: 497 s -> 333 s).
# The notebooks' kernels drop the flag (tests/test_notebooks.py), so they run, and time this
# machine, as a learner's do; the TPU compiles never get it.
FAST_CPU_COMPILES = "--xla_backend_optimization_level=0"


def venv_cache_folder(python: Path, cache: str) -> str | None:
    """`python`'s venv's folder of `cache`; None with `off`, or when `cache` was not made (see
    open_compile_cache)."""
    if cache == "off" or not Path(cache).is_dir():
        return None
    return str(Path(cache) / python.parent.parent.name)  # .venv/bin/python: .venv


def compile_cache_env(python: Path, cache: str = COMPILE_CACHE) -> dict[str, str]:
    """The variables that give `python`'s tests JAX's persistent compilation cache: a folder
    of `cache` per venv, every compile kept (however short or small). None with `off`."""
    folder = venv_cache_folder(python, cache)
    return {} if folder is None else dict(zip(COMPILE_CACHE_ENV, (folder, "0", "0"), strict=True))


def tpu_compile_cache_env(python: Path, cache: str = TPU_COMPILE_CACHE) -> dict[str, str]:
    """The variable that keeps the libtpu dumps of `python`'s compiles in a folder of `cache`
    per venv (minilib.tpu.dump_cache). None with `off`."""
    folder = venv_cache_folder(python, cache)
    return {} if folder is None else {TPU_COMPILE_CACHE_ENV: folder}


def cache_contents(folder: Path) -> tuple[dict[str, int], int]:
    """The files in each venv's folder of the cache `folder`, and their bytes in all."""
    files = [f for f in folder.rglob("*") if f.is_file()] if folder.exists() else []
    venvs = (f.relative_to(folder).parts[0] for f in files if f.parent != folder)
    counts = collections.Counter(venvs)
    return dict(sorted(counts.items())), sum(f.stat().st_size for f in files)


def describe_cache(folder: Path, when: str, contents: tuple[dict[str, int], int]) -> str:
    """One line for the run's log: what `folder` holds `when` (its `cache_contents`), so that a
    phase's minutes can be read as a warm or a cold run's."""
    counts, size = contents
    held = ", ".join(f"{venv} {n:,} file{'s' * (n != 1)}" for venv, n in counts.items())
    held = held or "nothing"
    return f"compile cache {folder} {when}: {held} ({size / 2**20:,.0f} MiB)"


def open_compile_cache(cache: str = COMPILE_CACHE) -> Path | None:
    """Empty `cache` if the run that used it last did not finish or it holds more than
    COMPILE_CACHE_MAX_BYTES, and mark it in use; returns the mark (None with `off`), which
    `close_compile_cache` removes at the end of a run. Prints what it holds."""
    if cache == "off":
        return None
    folder = Path(cache)
    mark = folder / "a run is using this cache"
    contents = cache_contents(folder)
    size = contents[1]
    try:
        if mark.exists() or size > COMPILE_CACHE_MAX_BYTES:
            print(f"emptying {folder}: " + ("its last run did not finish" if mark.exists() else
                  f"{size / 2**30:.1f} GiB"), flush=True)  # fmt: skip
            shutil.rmtree(folder)
            contents = {}, 0
        folder.mkdir(parents=True, exist_ok=True)
        mark.touch()
        print(describe_cache(folder, "at the start of this run", contents), flush=True)
    except OSError as err:  # a home one cannot write: the run goes on without the cache
        print(f"no compile cache in {folder}: {err}", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return mark


def close_compile_cache(mark: Path | None) -> None:
    if mark is not None:
        mark.unlink(missing_ok=True)
        contents = cache_contents(mark.parent)
        print(describe_cache(mark.parent, "at the end of this run", contents), flush=True)


def pytest(python: Path, *args: str, fast_cpu_compiles: bool = False,
           notebooks_as_on_tpu: bool = False, tpu_numerics: bool = False,
           compile_cache: bool = False, tpu_compile_cache: bool = False,
           **run_options) -> None:  # fmt: skip
    # pytest exits 5 when it collected no tests: that is a failure here, as any non-zero code.
    # --durations: the slowest tests of each run, where CI's time goes.
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    if fast_cpu_compiles:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_CPU_COMPILES}".strip()
    if compile_cache:
        env.update(compile_cache_env(python))
    if tpu_compile_cache:
        env.update(tpu_compile_cache_env(python))
    if notebooks_as_on_tpu:
        env[NOTEBOOKS_AS_ON_TPU] = "1"
    if tpu_numerics:  # every float32 matmul at default precision one bfloat16 pass, as on a TPU
        env["MINILIB_TPU_NUMERICS"] = "1"
    run(python, "-m", "pytest", "--durations=15", *args, env=env, **run_options)


class Phases:
    """Times each phase of a run; `table()` gives each one's minutes, in order."""

    def __init__(self):
        self.rows: list[tuple[str, float, str]] = []
        self.start = time.monotonic()

    @contextlib.contextmanager
    def __call__(self, name: str):
        start, outcome = time.monotonic(), "failed"
        try:
            yield
            outcome = "passed"
        finally:
            self.rows.append((name, time.monotonic() - start, outcome))

    def table(self) -> str:
        width = max(len(name) for name, _, _ in self.rows)
        lines = [f"{'phase':<{width}}  minutes  outcome"]
        lines += [f"{name:<{width}}  {s / 60:7.1f}  {outcome}" for name, s, outcome in self.rows]
        lines.append(f"{'total':<{width}}  {(time.monotonic() - self.start) / 60:7.1f}")
        return "\n".join(lines)


def test(args: list[str]) -> None:
    global DEADLINE
    newest = newest_python_for("test")  # before anything else: it may stop the run at once
    DEADLINE = time.monotonic() + DEADLINE_MINUTES * 60
    phases = Phases()
    caches = cache_states()  # before the run fills them
    try:
        run_tests(args, phases, newest)
    finally:
        print(f"\nEach phase of `tasks.py test`:\n{phases.table()}", flush=True)
        print(f"\nThe caches when this run began:\n{caches}", flush=True)


def uv_cache_folder() -> Path:
    """Where uv keeps its downloads: UV_CACHE_DIR, else under XDG_CACHE_HOME or ~/.cache."""
    if os.environ.get("UV_CACHE_DIR"):
        return Path(os.environ["UV_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "uv"


def cache_states() -> str:
    """One line per cache the run reads: cold (empty or absent) or warm (its files and MiB),
    so that the phase table reads as a cold run's or a warm one's (docs/testing.md has both
    figures)."""
    caches = [
        ("uv downloads", uv_cache_folder()),
        ("XLA CPU compiles", Path(COMPILE_CACHE)),
        ("libtpu dumps", Path(TPU_COMPILE_CACHE)),
    ]
    lines = []
    for name, folder in caches:
        if str(folder) == "off":
            lines.append(f"  {name:17} off")
            continue
        files = [f for f in folder.rglob("*") if f.is_file()] if folder.is_dir() else []
        size = sum(f.stat().st_size for f in files) / 2**20
        state = f"warm: {len(files):,} files, {size:,.0f} MiB" if files else "cold: empty"
        lines.append(f"  {name:17} {state}  ({folder})")
    return "\n".join(lines)


def run_tests(args: list[str], phases: Phases, newest: str) -> None:
    """Every suite, in its venv: .venv and .venv-tpu on `newest` (newest_python_for)."""
    colab = colab_python()
    with phases("make the six venvs (uv, in parallel)"):
        uv()
        with ThreadPoolExecutor() as pool:
            venvs = [
                pool.submit(make_venv, *NEWEST, extra="dev,browser", base_python=newest),
                pool.submit(make_venv, *OLDEST, extra="dev,browser", base_python=colab),
                pool.submit(make_venv, *TPU, extra="tpu-test", base_python=newest),
                pool.submit(make_venv, *TPU_OLDEST, extra="tpu-test", base_python=colab),
                pool.submit(make_venv, *TPU_JAX_0_7_2, extra="tpu-test", base_python=colab),
                pool.submit(make_venv, *BOOK, extra="book"),
            ]
            python, oldest, tpu, tpu_oldest, tpu_jax, book = (venv.result() for venv in venvs)
        run(tpu, "-m", "minilib.tpu.v3", "fetch")  # the v3 kernel's wheel, alone, into the venv

    with phases(".venv: lint"):
        run(python, "-m", "ruff", "check", ".")
        run(python, "-m", "ruff", "format", "--check", ".")
    # The TPU compiles keep one core busy (their tests share each chip's compiles in one
    # process), so they run beside the CPU suites, which take both cores and leave gaps: a
    # lane of their own, its output printed when each phase ends.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tpu_lane = pool.submit(run_tpu_compiles, phases, tpu, tpu_oldest, tpu_jax)
        try:
            mark = open_compile_cache()
            run_cpu_suites(args, phases, python, oldest, book)
            close_compile_cache(mark)  # not after a failure: it may have been a kill
        finally:
            wait([tpu_lane])
    tpu_lane.result()


def run_cpu_suites(args: list[str], phases: Phases, python: Path, oldest: Path,
                   book: Path) -> None:  # fmt: skip
    with phases(".venv: the tests and the notebooks"):
        pytest(python, *WORKERS, *args, fast_cpu_compiles=True, compile_cache=True)
    with phases(".venv-book: the book, from the executed notebooks"):
        build_book(python, book)
    # The browser tests mostly wait for their Jupyter servers and browsers (their notebooks'
    # Run All allows 600 s, the slowest took 79 s): beside the suites that follow, not after.
    with ThreadPoolExecutor(max_workers=1) as pool:
        browser_lane = pool.submit(browser_tests, phases, python, oldest)
        try:
            with phases(".venv-oldest: the tests (one case per matrix path) and the notebooks "
                        "as on a TPU"):  # fmt: skip
                pytest(oldest, *WORKERS, "-m", "not slow and not browser and not matrix",
                       "-p", "no:cacheprovider", *(f"--ignore={t}" for t in KERNEL_PARITY_TESTS),
                       fast_cpu_compiles=True, notebooks_as_on_tpu=True,
                       compile_cache=True)  # fmt: skip
            # Colab's stack runs the kernels as its TPU does: their parity there is checked
            # under TPU numerics (in .venv, with float32 matmuls as they are).
            with phases(".venv-oldest: the kernels' parity under TPU numerics "
                        "(MINILIB_TPU_NUMERICS=1)"):  # fmt: skip
                pytest(oldest, *WORKERS, "-m", "not slow and not matrix", "-p", "no:cacheprovider",
                       *KERNEL_PARITY_TESTS, fast_cpu_compiles=True, tpu_numerics=True,
                       compile_cache=True)  # fmt: skip
        finally:
            wait([browser_lane])
    browser_lane.result()


def browser_tests(phases: Phases, python: Path, oldest: Path) -> None:
    """The two browser tests side by side: each mostly waits for its Jupyter server and
    browser; .venv's checks the book as well."""
    with phases("beside them, .venv and .venv-oldest: the browser tests, side by side"):
        with ThreadPoolExecutor() as pool:
            tests = [pool.submit(browser_test, env, book=env == python) for env in (python, oldest)]
            for done in tests:
                done.result()


def run_tpu_compiles(phases: Phases, tpu: Path, tpu_oldest: Path, tpu_jax: Path) -> None:
    mark = open_compile_cache(TPU_COMPILE_CACHE)
    with phases("beside them, .venv-tpu: the tpu_compile tests"):
        pytest(tpu, "-m", TPU_COMPILE, "-p", "no:cacheprovider", *TPU_COMPILE_TESTS,
               in_one_piece=True, tpu_compile_cache=True)  # fmt: skip
    # On Colab's pair: the jax 0.7.2 compiles, every ladder rung, and the pair's own tests.
    with phases("beside them, .venv-tpu-oldest: Colab's pair"):
        pytest(tpu_oldest, "-m", TPU_COMPILE, "-k", COLAB_TPU_TESTS,
               "-p", "no:cacheprovider", "-rs", "tests/tpu/test_tpu_compile.py",
               "tests/tpu/test_tpu_comparison.py", "tests/ladder/test_ladder.py",
               "tests/tpu/test_tpu_colab_pair.py", "tests/tpu/test_tpu_kv_write.py",
               in_one_piece=True, tpu_compile_cache=True)  # fmt: skip
    with phases("beside them, .venv-tpu-jax-0.7.2: a few compiles"):
        pytest(tpu_jax, "-m", TPU_COMPILE, "-k", JAX_0_7_2_TPU_TESTS,
               "-p", "no:cacheprovider", "tests/tpu/test_tpu_compile.py",
               "tests/tpu/test_tpu_comparison.py", in_one_piece=True,
               tpu_compile_cache=True)  # fmt: skip
    close_compile_cache(mark)  # not after a failure: it may have been a kill


def test_colab_2026_07(args: list[str]) -> None:
    """The fast tests, notebooks included, on Colab's past runtime 2026.07 (Python 3.12,
    numpy 2.0.2, jax 0.7.2). Not part of `test`: it would add its time to CI's."""
    python = python_for(COLAB_2026_07_PYTHON)
    past = make_venv(*COLAB_2026_07, extra="dev,browser", base_python=python)
    pytest(past, *WORKERS, "-m", "not slow and not browser", "-p", "no:cacheprovider", *args,
           fast_cpu_compiles=True)  # fmt: skip


def browser_test(python: Path, book: bool = True) -> None:
    """The explorers in JupyterLab in headless Chromium (tests/browser); the book too, unless
    `book` is False."""
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
    skip_book = [] if book else ["--ignore", "tests/browser/test_book_in_browser.py"]
    pytest(python, "-m", "browser", "tests/browser", "-p", "no:cacheprovider", "-s", *skip_book,
           in_one_piece=True)  # fmt: skip


def build_book(python: Path, book_python: Path) -> None:
    """The course as a book, in BOOK_HTML, from the notebooks in EXECUTED: `python` (with
    minilib) writes its source, Jupyter Book 2 in `book_python` its pages, then their HTML."""
    shutil.rmtree(BOOK_HTML, ignore_errors=True)
    if shutil.which("node") is None:
        banner = "!" * 78
        print(f"{banner}\nBOOK SKIPPED: Jupyter Book needs Node.js, which is not installed."
              f"\nInstall it: apt-get install nodejs\n{banner}", flush=True)  # fmt: skip
        return
    run(python, "docs/book.py", EXECUTED, BOOK_SOURCE)
    run(book_python, "-m", "jupyter_book", "build", "--site", "--ci", cwd=BOOK_SOURCE)
    run(book_python, "docs/book_html.py", BOOK_SOURCE / "_build" / "site", BOOK_HTML)
    print(f"The book: {BOOK_HTML / 'index.html'}", flush=True)


def book(args: list[str]) -> None:
    """Builds the book (executing the notebooks first if no test run has); `--serve` serves
    it on localhost."""
    python = make_venv(*NEWEST, extra="dev,browser", base_python=newest_python_for("book"))
    if not list(EXECUTED.glob("*.ipynb")):
        # A notebook over the tests' time limit is kept all the same; one that raised is not,
        # and docs/book.py says which are missing.
        with contextlib.suppress(subprocess.CalledProcessError):
            pytest(python, *WORKERS, "-m", "notebooks", "-p", "no:cacheprovider",
                   "tests/test_notebooks.py")  # fmt: skip
    build_book(python, make_venv(*BOOK, extra="book"))
    if "--serve" in args:
        print("Serving the book on http://localhost:8000/ (Ctrl-C stops it)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            run(sys.executable, "-m", "http.server", "--bind", "localhost", "--directory",
                BOOK_HTML, "8000")  # fmt: skip


def course(args: list[str]) -> None:
    """JupyterLab on notebooks/ (`course notebook`: Notebook 7 instead), in .venv, on the stack
    that course_stack() chooses and names (`course --check`: only that)."""
    base_python, constraints, stack = course_stack()
    print(stack, flush=True)
    if args[:1] == ["--check"]:
        return
    python = make_venv(NEWEST[0], constraints, extra="course", base_python=base_python)
    app, args = (args[0], args[1:]) if args[:1] == ["notebook"] else ("lab", args)
    # Jupyter refuses to start as root (containers, some cloud VMs) unless told it may.
    as_root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    env = dict(os.environ, JUPYTER_CONFIG_PATH=os.pathsep.join(jupyter_config_path()))
    run(python, "-m", "jupyter", app, "notebooks/", *as_root, *args, env=env)


def jupyter_config_path() -> list[str]:
    """Jupyter's extra config folders, with the course's (its JupyterLab settings) first."""
    extra = os.environ.get("JUPYTER_CONFIG_PATH", "")
    return [str(JUPYTER_CONFIG), *filter(None, extra.split(os.pathsep))]


def stop_all_on_sigterm() -> None:
    """Stopped from outside (CI's limit), as by Ctrl-C: what `run` started, in sessions of their
    own, is stopped too (run's `except BaseException`)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main() -> None:
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(BYTECODE)  # for every command run from here
    stop_all_on_sigterm()
    commands = {"test": test, "test-colab-2026.07": test_colab_2026_07, "course": course,
                "book": book}  # fmt: skip
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    try:
        commands[sys.argv[1]](sys.argv[2:])
    except subprocess.CalledProcessError as err:
        if isinstance(err, DeadlinePassed):
            print(err, flush=True)
        sys.exit(err.returncode or 1)


if __name__ == "__main__":
    main()
