"""tasks.py: the timing table (each phase's minutes and outcome, a failed phase included),
the workers, the compile flags and the TPU lane's output."""

from __future__ import annotations

import contextlib
import importlib.util
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_tasks():
    spec = importlib.util.spec_from_file_location("tasks", ROOT / "tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_has_each_phase_its_outcome_and_the_total(monkeypatch):
    tasks = load_tasks()
    clock = iter([0.0, 60.0, 150.0, 150.0, 330.0, 400.0])  # start; a; b; the table's end
    monkeypatch.setattr(tasks.time, "monotonic", lambda: next(clock))
    phases = tasks.Phases()
    with phases("make the venvs"):
        pass
    with pytest.raises(RuntimeError), phases(".venv: the tests"):
        raise RuntimeError("a test failed")
    lines = phases.table().splitlines()
    assert lines[0].split() == ["phase", "minutes", "outcome"]
    assert lines[1].split()[-2:] == ["1.5", "passed"] and lines[1].startswith("make the venvs")
    assert lines[2].split()[-2:] == ["3.0", "failed"] and lines[2].startswith(".venv: the tests")
    assert lines[3].split() == ["total", "6.7"]


def test_every_venv_gets_pytest_xdist_for_the_workers():
    tasks = load_tasks()
    assert tasks.WORKERS[0] == "-n"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in ("dev", "tpu-test"):
        needs = extras["optional-dependencies"][extra]
        assert any(need.startswith("pytest-xdist") for need in needs), (
            f"{extra} lacks pytest-xdist, which tasks.py's -n needs"
        )


def test_the_notebooks_run_without_the_cpu_test_runs_unoptimised_compiles():
    """The CPU suites compile at -O0 (tasks.FAST_CPU_COMPILES); the notebooks' kernels drop
    that flag, and the headless matplotlib backend, and keep every other flag."""
    from test_notebooks import learner_env

    tasks = load_tasks()
    devices = "--xla_force_host_platform_device_count=4"
    environ = {"XLA_FLAGS": f"{devices} {tasks.FAST_CPU_COMPILES}", "MPLBACKEND": "Agg", "A": "1"}
    assert learner_env(environ) == {"XLA_FLAGS": devices, "A": "1"}


def test_the_cpu_suites_keep_their_compiles_and_the_notebooks_do_not(tmp_path):
    """Each CPU venv's tests get a folder of JAX's persistent compilation cache; the
    notebooks' kernels get none of its variables (a learner's first run), and `off` sets
    none."""
    from test_notebooks import COMPILE_CACHE_ENV, learner_env

    tasks = load_tasks()
    assert tasks.COMPILE_CACHE_ENV == COMPILE_CACHE_ENV
    env = tasks.compile_cache_env(tmp_path / ".venv-oldest" / "bin" / "python", str(tmp_path))
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / ".venv-oldest")
    assert set(env) == set(COMPILE_CACHE_ENV)
    assert tasks.compile_cache_env(tmp_path / ".venv" / "bin" / "python", "off") == {}
    # a cache that could not be made (see open_compile_cache): none
    assert tasks.compile_cache_env(tmp_path / ".venv" / "bin" / "python", str(tmp_path / "x")) == {}
    assert learner_env({**env, "A": "1"}) == {"XLA_FLAGS": "", "A": "1"}


def test_the_tpu_lanes_keep_libtpus_dumps(tmp_path):
    """Each TPU venv's tests get a folder of `minilib.tpu.dump_cache` (the variable it
    reads); `off`, or a cache that could not be made, sets none."""
    from minilib.tpu import dump_cache

    tasks = load_tasks()
    env = tasks.tpu_compile_cache_env(tmp_path / ".venv-tpu" / "bin" / "python", str(tmp_path))
    assert env == {dump_cache.CACHE_ENV: str(tmp_path / ".venv-tpu")}
    assert tasks.tpu_compile_cache_env(tmp_path / ".venv-tpu" / "bin" / "python", "off") == {}
    missing = str(tmp_path / "x")
    assert tasks.tpu_compile_cache_env(tmp_path / ".venv-tpu" / "bin" / "python", missing) == {}


def test_the_compile_cache_is_emptied_after_a_run_that_did_not_finish(tmp_path, monkeypatch):
    """A run stopped midway may leave a file cut short: the next run starts from an empty
    cache. One that finished leaves its compiles for the next; so does one too large, once
    emptied."""
    tasks = load_tasks()
    cache = tmp_path / "cache"
    mark = tasks.open_compile_cache(str(cache))
    (cache / ".venv").mkdir()
    (cache / ".venv" / "entry").write_bytes(b"x" * 100)
    tasks.close_compile_cache(mark)
    tasks.open_compile_cache(str(cache))  # the last run finished: kept
    assert (cache / ".venv" / "entry").exists()
    mark = tasks.open_compile_cache(str(cache))  # the last run did not: emptied
    assert not (cache / ".venv").exists() and mark.exists()
    (cache / "entry").write_bytes(b"x" * 100)
    tasks.close_compile_cache(mark)
    monkeypatch.setattr(tasks, "COMPILE_CACHE_MAX_BYTES", 99)
    tasks.open_compile_cache(str(cache))  # too large: emptied
    assert not (cache / "entry").exists()
    assert tasks.open_compile_cache("off") is None


def test_a_run_says_what_each_cache_held_when_it_began_and_ended(tmp_path, capsys):
    """The log tells a warm run from a cold one: each venv's files and the bytes in all."""
    tasks = load_tasks()
    cache = tmp_path / "cache"
    mark = tasks.open_compile_cache(str(cache))
    assert "at the start of this run: nothing (0 MiB)" in capsys.readouterr().out
    for venv, files in ((".venv-tpu", 3), (".venv-tpu-oldest", 1)):
        (cache / venv).mkdir()
        for n in range(files):
            (cache / venv / f"entry{n}").write_bytes(b"x" * (1 << 20))
    tasks.close_compile_cache(mark)
    said = capsys.readouterr().out
    assert f"compile cache {cache} at the end of this run: .venv-tpu 3 files, " in said
    assert ".venv-tpu-oldest 1 file (4 MiB)" in said


def test_colabs_stack_runs_the_notebooks_with_a_tpus_numerics_and_only_them():
    """tasks.py asks test_notebooks for a TPU's matmul numerics by name; the notebooks'
    kernels get the emulation's switch, the test process does not."""
    from test_notebooks import AS_ON_TPU, learner_env

    from minilib.tpu.numerics import ENV_VAR

    assert load_tasks().NOTEBOOKS_AS_ON_TPU == AS_ON_TPU
    kernel_env = learner_env({AS_ON_TPU: "1"})
    assert kernel_env[ENV_VAR] == "1" and AS_ON_TPU not in kernel_env
    assert ENV_VAR not in learner_env({})


def test_a_lane_command_prints_its_output_in_one_piece_and_still_fails(capsys):
    """The TPU lane runs beside the CPU suites: its commands' output is kept and printed whole
    when each ends, and a failing one still raises."""
    import subprocess
    import sys

    tasks = load_tasks()
    script = "print('first line'); print('second line'); raise SystemExit(3)"
    with pytest.raises(subprocess.CalledProcessError) as failure:
        tasks.run(sys.executable, "-c", script, in_one_piece=True)
    assert failure.value.returncode == 3
    out = capsys.readouterr().out
    assert out.index("+ ") < out.index("first line\nsecond line")


SLEEP = "time.sleep(593.25)"  # in the command line of each process these tests start, alone
GRANDCHILD = f"import time; print('grandchild', flush=True); {SLEEP}"
WAITS = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}], start_new_session=True)
def waiting_forever():
    {SLEEP}
waiting_forever()
"""
LEAVES = f"""
import subprocess, sys
subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}], start_new_session=True)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="tasks.py finds them in /proc")
@pytest.mark.parametrize("script", [WAITS, LEAVES], ids=["hangs", "leaves its output held"])
def test_a_command_past_the_deadline_is_stopped_with_its_stacks_and_nothing_of_it_left(
    script, capsys, monkeypatch
):
    """A command that hangs, or ends leaving a process (in a session of its own) that holds the
    lane's output, is stopped at tasks.py's deadline: every Python process under it prints
    where it was, none is left running, and the phase fails by name."""
    import sys

    tasks = load_tasks()
    monkeypatch.setattr(tasks, "DEADLINE", time.monotonic() + 4)
    before = sleepers()
    with pytest.raises(tasks.DeadlinePassed) as stopped:
        tasks.run(sys.executable, "-c", script, in_one_piece=True)
    out = capsys.readouterr().out
    assert "DEADLINE: stopping process" in out and "grandchild" in out
    assert 'File "<string>", line' in out  # a stack, from faulthandler
    if script == WAITS:
        assert "in waiting_forever" in out  # the command's own stack
    assert not sleepers() - before  # nothing of it left running
    assert "STOPPED: still running" in str(stopped.value) and sys.executable in str(stopped.value)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="tasks.py finds them in /proc")
def test_stopped_from_outside_a_test_run_leaves_nothing_it_started(tmp_path):
    """CI's limit stops `tasks.py test` with SIGTERM; its commands run in sessions of their own,
    which that does not reach: tasks.py stops them, and what they started."""
    import signal
    import subprocess
    import sys

    child = f"subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}])"
    command = "; ".join(["import subprocess, sys, time", child, SLEEP])
    driver = tmp_path / "driver.py"
    driver.write_text(
        f"import sys, time\nsys.path.insert(0, {str(ROOT)!r})\nimport tasks\n"
        "tasks.stop_all_on_sigterm()\ntasks.DEADLINE = time.monotonic() + 600\n"
        f"tasks.run(sys.executable, '-c', {command!r}, in_one_piece=True)\n"
    )
    before = sleepers()
    tasks = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    under = set()
    for _ in range(100):  # until the grandchild runs
        time.sleep(0.1)
        under = sleepers() - before
        if len(under) == 2:
            break
    assert len(under) == 2, "the command and its child did not start"
    tasks.send_signal(signal.SIGTERM)
    assert tasks.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    assert not sleepers() & under


def sleepers() -> set[Path]:
    """This file's sleepers (SLEEP) that are living, as their /proc folders."""
    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            state = proc.joinpath("stat").read_text().rsplit(")")[-1].split()[0]
            if state != "Z" and SLEEP in proc.joinpath("cmdline").read_text():
                found.add(proc)
    return found


def test_without_node_the_book_is_skipped_loudly_and_no_old_book_is_left(
    monkeypatch, tmp_path, capsys
):
    tasks = load_tasks()
    old_book = tmp_path / "html"
    old_book.mkdir()
    (old_book / "index.html").write_text("an old build")
    monkeypatch.setattr(tasks, "BOOK_HTML", old_book)
    monkeypatch.setenv("PATH", str(tmp_path))  # no node on it
    tasks.build_book(tmp_path / "no-python", tmp_path / "no-book-python")  # runs nothing
    assert "BOOK SKIPPED" in capsys.readouterr().out
    assert not old_book.exists()


def test_the_book_reads_the_notebooks_that_the_newest_venv_executed():
    """tests/test_notebooks.py keeps them in build/executed/<its venv's name, no dot>."""
    tasks = load_tasks()
    assert tasks.EXECUTED == ROOT / "build" / "executed" / tasks.NEWEST[0].name.lstrip(".")


def alone(tmp_path: Path) -> dict[str, str]:
    """An environment in which tasks.py finds no other Python: nothing on PATH, no pyenv."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    return {"PATH": str(tmp_path / "bin"), "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path)}


def real_python_3_11() -> str:
    """This machine's Python 3.11, found as tasks.py finds one, by its own path (a pyenv shim
    runs only with pyenv on PATH). CI's machine has one."""
    import subprocess

    found = load_tasks().find_python("3.11")
    if found is None:
        pytest.skip("no python3.11 on this machine (on PATH or in pyenv)")
    command = [found, "-c", "import sys; print(sys.executable)"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def run_alone(python: str, tmp_path: Path, *args: str) -> tuple[object, float]:
    """`python tasks.py args` where it is the only Python, and its seconds."""
    import subprocess

    start = time.monotonic()
    done = subprocess.run(
        [python, str(ROOT / "tasks.py"), *args],
        env=alone(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, time.monotonic() - start


def test_on_python_3_11_alone_the_course_takes_the_newest_jax_for_3_11_and_says_which(tmp_path):
    """jax 0.12 needs Python 3.12: with only 3.11, `course` takes constraints/python3.11.txt and
    names it in one line, within a second or two (`--check` stops there)."""
    tasks = load_tasks()
    done, seconds = run_alone(real_python_3_11(), tmp_path, "course", "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    jax = tasks.pinned(tasks.PYTHON_3_11, "jax")
    assert done.stdout.startswith(f"The course's stack: jax {jax} (constraints/python3.11.txt)")
    assert "on Python 3.11." in done.stdout and len(done.stdout.splitlines()) == 1
    assert seconds < 2, f"it took {seconds:.1f} s to choose"


def test_on_python_3_12_or_newer_the_course_takes_the_newest_stack(tmp_path):
    import sys

    if sys.version_info < (3, 12):
        pytest.skip("this Python is older than 3.12")
    tasks = load_tasks()
    done, _ = run_alone(sys.executable, tmp_path, "course", "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    jax = tasks.pinned(tasks.NEWEST[1], "jax")
    assert done.stdout.startswith(f"The course's stack: jax {jax} (constraints/newest.txt)")


def test_on_python_3_11_alone_the_test_run_stops_at_once_saying_what_it_needs(tmp_path):
    """`tasks.py test` (and `book`) need the newest stack: on 3.11 alone, one plain line naming
    the Python found and the one to install, before any venv is made. Run as a function, so
    that a broken check cannot start a whole test run here."""
    import subprocess

    script = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import tasks; "
    script += "tasks.newest_python_for('test')"
    start = time.monotonic()
    done = subprocess.run(
        [real_python_3_11(), "-c", script],
        env=alone(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    seconds = time.monotonic() - start
    assert done.returncode == 1 and done.stdout == ""
    line = done.stderr.strip()
    assert line.startswith(
        "tasks.py test needs Python 3.12 or newer; this machine has Python 3.11."
    )
    assert "pyenv install 3.13" in line and len(line.splitlines()) == 1
    assert seconds < 2, f"it took {seconds:.1f} s to stop"


def test_a_constraint_file_without_the_pin_is_named():
    tasks = load_tasks()
    with pytest.raises(ValueError, match="does not pin package='ipywidgets'"):
        tasks.pinned(tasks.NEWEST[1], "ipywidgets")


def test_the_run_says_which_caches_were_cold(tmp_path, monkeypatch):
    """The line under the phase table: a cache with files is warm (their count), an empty or
    absent one cold, one switched off says so."""
    tasks = load_tasks()
    warm = tmp_path / "jax-cpu" / ".venv"
    warm.mkdir(parents=True)
    (warm / "a compile").write_bytes(b"x" * 10)
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "no-uv-cache"))
    monkeypatch.setattr(tasks, "COMPILE_CACHE", str(tmp_path / "jax-cpu"))
    monkeypatch.setattr(tasks, "TPU_COMPILE_CACHE", "off")
    lines = tasks.cache_states().splitlines()
    assert lines[0].split() == [
        "uv",
        "downloads",
        "cold:",
        "empty",
        f"({tmp_path / 'no-uv-cache'})",
    ]
    assert "XLA CPU compiles  warm: 1 files, 0 MiB" in lines[1]
    assert lines[2].split() == ["libtpu", "dumps", "off"]
