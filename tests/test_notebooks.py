"""The course notebooks: committed without outputs, shaped alike, and runnable top to bottom.

The execution tests (marker `notebooks`) run each notebook in a fresh kernel of *this*
interpreter, so CI's venv is the one tested, whatever kernels the machine has installed:

    pytest -m notebooks tests/test_notebooks.py

A failing cell fails the test with the cell's traceback. Each run's time and its three slowest
cells are printed at the end of the run (tests/conftest.py), with the sum of the runs.

A cell that compares an answer with a reference (JAX's, minilib's, a float64 one, the dense
model's tokens) asserts it, mostly with `minilib.parity.parity_error` under
`parity_tolerance()`, so that a wrong answer fails the run, on the CPU and under a TPU's
numerics, instead of printing a large error in a notebook that passes
(`test_every_printed_comparison_is_asserted`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from prose_claims import broken_claims, output_text
from prose_claims import source as cell_source
from time_limit import Cost

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
# An appendix goes deeper than its lesson: `09a_...` beside `09_...`, read after it. It runs top
# to bottom like a lesson, with no exercise of its own.
APPENDICES = sorted(NOTEBOOK_DIR.glob("[0-9][0-9][a-z]_*.ipynb"))
ALL_NOTEBOOKS = sorted(NOTEBOOKS + APPENDICES)
# A notebook must cost under four minutes, top to bottom, cost as tests/time_limit.py counts it:
# the smaller of its wall-clock and CPU seconds (the kernel's, reaped), so that a machine busy
# or slow that day does not fail it. On an idle 2-core machine notebook 10, the longest, took
# 94-99 s (123-131 CPU s), the others 11-57 s; under CI's load on a slow day notebook 10 took
# 225 s of wall time. This fails a notebook 10 that costs 2.5 times as much.
SECONDS_LIMIT = 240
KERNEL_NAME = "minilib-tests"
# Each executed notebook, outputs included, is kept in build/executed/<venv>/ (git-ignored):
# the book (`python3 tasks.py book`) is built from the newest stack's, build/executed/venv/.
EXECUTED_DIR = ROOT / "build" / "executed" / Path(sys.prefix).name.lstrip(".")
OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
# Set to 1 (tasks.py does, for Colab's TPU stack), the notebooks run with a TPU's numerics:
# their kernels get minilib.tpu.numerics' MINILIB_TPU_NUMERICS=1, so every float32 matmul at
# the default precision is one bfloat16 pass, as on Colab's TPU, and each notebook's parity
# cells and checkers must hold under it. (Not for this process: its tests expect the CPU's.)
AS_ON_TPU = "MINILIB_NOTEBOOKS_AS_ON_TPU"


# What tasks.py sets for JAX's persistent compilation cache (its COMPILE_CACHE_ENV).
COMPILE_CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")  # fmt: skip


def learner_env(environ=os.environ) -> dict[str, str]:
    """The notebooks' kernels get this environment as a learner's would: without the test
    suite's headless matplotlib backend (figures render as a learner sees them) and without
    the CPU test runs' unoptimised XLA compiles (tasks.py's FAST_CPU_COMPILES), which would
    slow the notebooks' jnp code and skew the machine figures notebook 09 measures, nor
    their persistent compilation cache (tasks.py's COMPILE_CACHE_ENV): a notebook's time is
    a learner's first run's. With AS_ON_TPU=1, with a TPU's matmul numerics."""
    from minilib.tpu.numerics import ENV_VAR

    dropped = ("MPLBACKEND", AS_ON_TPU, *COMPILE_CACHE_ENV)
    env = {k: v for k, v in environ.items() if k not in dropped}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(OPT_LEVEL_FLAG)]
    env["XLA_FLAGS"] = " ".join(flags)
    if environ.get(AS_ON_TPU) == "1":
        env[ENV_VAR] = "1"
    return env


def _ids(paths):
    return [p.stem for p in paths]


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def test_there_are_ten_numbered_notebooks():
    numbers = [p.name[:2] for p in NOTEBOOKS]
    assert len(NOTEBOOKS) >= 10, [p.name for p in NOTEBOOKS]
    assert numbers == [f"{i:02d}" for i in range(len(NOTEBOOKS))], "numbers must run 00, 01, ..."


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=_ids(ALL_NOTEBOOKS))
def test_outputs_are_stripped(path):
    """Committed notebooks carry no outputs, execution counts or widget state."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert cell.get("outputs") == [], f"{path.name} cell {i} has stored outputs"
        assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.get("metadata", {}), f"{path.name} stores widget state"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_shape(path):
    """Opens with what you will learn, then the shared setup cell; ends with a summary and an
    exercise that a checker from minilib.exercises checks."""
    cells = _cells(path)
    first_code = next(c for c in cells if c["cell_type"] == "code")
    text = "\n".join(cell_source(c) for c in cells)
    assert cells[0]["cell_type"] == "markdown"
    assert cell_source(cells[0]).startswith(f"# {path.name[:2]} ")
    assert "What you will learn" in cell_source(cells[0])
    assert "MINILIB_SOURCE" in cell_source(first_code), "the first code cell must be the setup cell"
    assert cell_source(first_code) == cell_source(_first_code_cell(NOTEBOOKS[0])), (
        f"{path.name}: the setup cell differs from 00's; keep them identical"
    )
    assert "## Summary" in text
    assert 'NotImplementedError("FILL ME IN")' in text
    assert "from minilib.exercises import check_" in text
    # nbformat 4.5 gives every cell a unique id; a cell without one is a warning today, an
    # error in later nbformat versions.
    ids = [c.get("id") for c in cells]
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: a cell id missing or twice"


@pytest.mark.parametrize("path", APPENDICES, ids=_ids(APPENDICES))
def test_appendix_shape(path):
    """An appendix opens with its title and the shared setup cell, and links to its lesson,
    which links to it."""
    cells = _cells(path)
    number = path.name.split("_")[0]  # "09a"
    lesson = next(p for p in NOTEBOOKS if p.name.startswith(f"{number[:2]}_"))
    first_code = next(c for c in cells if c["cell_type"] == "code")
    assert cell_source(cells[0]).startswith(f"# {number} ")
    assert cell_source(first_code) == cell_source(_first_code_cell(NOTEBOOKS[0]))
    assert f"]({lesson.name})" in cell_source(cells[0]), f"{path.name} links its lesson"
    lesson_text = "\n".join(cell_source(c) for c in _cells(lesson))
    assert f"]({path.name})" in lesson_text, f"{lesson.name} links its appendix"
    ids = [c.get("id") for c in cells]
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: a cell id missing or twice"


# What a cell prints when it compares an answer with a reference: "max |minilib - JAX| = ...",
# "max |error|", "max error", "max difference", "engine == dense".
PRINTED_COMPARISON = re.compile(r"max \||max (abs )?error|max difference|== dense", re.IGNORECASE)


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=_ids(ALL_NOTEBOOKS))
def test_every_printed_comparison_is_asserted(path):
    """A cell that prints how far an answer is from a reference also asserts it: through
    `minilib.parity.parity_error` (which raises over the tolerance, or on NaN) or an `assert`.
    Printed alone, a wrong answer's 6.5e-01 once passed the notebook test."""
    unasserted = [
        i
        for i, cell in enumerate(_cells(path))
        if cell["cell_type"] == "code"
        and PRINTED_COMPARISON.search(cell_source(cell))
        and "parity_error(" not in cell_source(cell)
        and not re.search(r"^\s*assert ", cell_source(cell), re.MULTILINE)
    ]
    assert not unasserted, (
        f"{path.name}: cells {unasserted} print a comparison with a reference but assert "
        f"nothing; check it with minilib.parity.parity_error(out, expected, "
        f"tolerance=parity_tolerance())"
    )


# What a cell prints where this stack cannot compute its result (no libtpu, or a jax without
# its table of TPU chips), and the marker of the recorded result it must then show beside it
# (`minilib.tpu.recorded`, `minilib.tpu.memory`, `minilib.tpu.comparison`, `minilib.tpu.listing`).
NOT_HERE = re.compile(r"Not computed|has no table|not installed", re.IGNORECASE)
RECORDED_MARKER = re.compile(r"Recorded on \d{4}-\d{2}-\d{2} with jax \d")
# Cells that report what is installed, and claim no result: the doctor's report.
REPORTS_WHAT_IS_INSTALLED = re.compile(r"^doctor_ok = doctor\(\)", re.MULTILINE)


def unrecorded_fallbacks(cells: list[dict]) -> list[str]:
    """The code cells of an executed notebook that print that their result could not be
    computed here ("Not computed", "has no table", "not installed") without showing the
    recorded result beside it ("Recorded on <date> with jax X"): "cell i: its first line"."""
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code" or REPORTS_WHAT_IS_INSTALLED.search(cell_source(cell)):
            continue
        text = output_text(cell)
        if NOT_HERE.search(text) and not RECORDED_MARKER.search(text):
            found.append(f"cell {i}: {text.strip().splitlines()[0][:160]}")
    return found


def test_unrecorded_fallbacks_are_found():
    def cell(source, text):
        return {"cell_type": "code", "source": source, "outputs": [{"text": text}]}

    label = "Recorded on 2026-12-05 with jax 0.12.0.1, libtpu 0.0.50.1 by `...`"
    cells = [
        cell("print(why)", "Not computed: libtpu is not installed (jax 0.12.0.1)."),
        cell("print(label, verdict)", f"{label}, not computed here: libtpu is not installed."),
        cell("print(rows)", "jax 0.7.2 has no table of TPU chips"),
        cell("doctor_ok = doctor()", "libtpu:       not installed"),
        cell("print(out)", "max |pallas - reference| = 3.6e-07"),
    ]
    assert [line.split(":")[0] for line in unrecorded_fallbacks(cells)] == ["cell 0", "cell 2"]


def _first_code_cell(path: Path) -> dict:
    return next(c for c in _cells(path) if c["cell_type"] == "code")


def run_setup_cell(tmp_path: Path, *python_flags: str, **env: str):
    """The setup cell as a script in `tmp_path/notebooks` (outside the repository), with only
    `env` set: (return code, stderr)."""
    import subprocess

    folder = tmp_path / "notebooks"
    folder.mkdir(exist_ok=True)
    script = folder / "setup_cell.py"
    script.write_text(cell_source(_first_code_cell(NOTEBOOKS[0])))
    done = subprocess.run([sys.executable, *python_flags, str(script)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return done.returncode, done.stderr


def test_setup_cell_refuses_the_package_index_minilib(tmp_path):
    """`pip install minilib` brings an unrelated project: the cell says so, and how to fix it."""
    other = tmp_path / "other" / "minilib"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("# not the course's minilib\n")
    code, stderr = run_setup_cell(tmp_path, PYTHONPATH=str(other.parent))
    assert code != 0
    assert "is not the course's" in stderr and "pip uninstall -y minilib" in stderr


@pytest.mark.parametrize("source", ["", "minilib", "minilib[course]"])
def test_setup_cell_refuses_a_package_name_as_minilib_source(tmp_path, source):
    """Outside the repository, with no minilib (no site-packages: `-S`), a package name is
    refused before anything is installed."""
    code, stderr = run_setup_cell(tmp_path, "-S", MINILIB_SOURCE=source)
    assert code != 0
    assert f"MINILIB_SOURCE={source!r}" in stderr and "git+https://" in stderr


@pytest.fixture(scope="session")
def kernel_manager_factory(tmp_path_factory):
    """Kernels of the current interpreter, from a kernelspec in a temporary directory."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = tmp_path_factory.mktemp("kernels") / KERNEL_NAME
    spec_dir.mkdir()
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"minilib tests ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)])

    def make():
        return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)

    return make


def slowest_cells(nb) -> list[tuple[float, int]]:
    """(seconds, index) of each code cell that ran, slowest first, from the times nbclient
    records in the cells' metadata."""
    from datetime import datetime

    times = []
    for i, cell in enumerate(nb.cells):
        execution = cell.get("metadata", {}).get("execution", {})
        start, end = execution.get("iopub.execute_input"), execution.get("shell.execute_reply")
        if start and end:
            seconds = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
            times.append((seconds, i))
    return sorted(times, reverse=True)


@pytest.mark.notebooks
@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=_ids(ALL_NOTEBOOKS))
def test_notebook_runs(path, kernel_manager_factory, record_property):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    km = kernel_manager_factory()
    client = NotebookClient(
        nb,
        km=km,
        timeout=600,  # per cell
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},  # run from notebooks/, as Jupyter
    )
    (EXECUTED_DIR / path.name).unlink(missing_ok=True)  # no stale copy if this run fails
    cost = Cost()
    try:
        client.execute(env=learner_env())
    finally:  # nbclient leaves a kernel it was given running: each held 300-600 MB to the end
        if km.has_kernel:
            km.shutdown_kernel(now=True)  # and waits for it: its CPU seconds count
    seconds, cost = cost.wall_seconds(), cost.seconds()
    EXECUTED_DIR.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, EXECUTED_DIR / path.name)
    slowest = ", ".join(f"cell {i} {s:.1f} s" for s, i in slowest_cells(nb)[:3])
    record_property("seconds", round(seconds, 1))
    record_property("notebook_time", (path.name, round(seconds, 1), round(cost, 1), slowest))
    print(f"{path.name}: {seconds:.1f} s, cost {cost:.1f} s (slowest: {slowest})")
    unrecorded = unrecorded_fallbacks(nb.cells)
    assert not unrecorded, (
        f"{path.name}: a cell says its result is not computed here without showing the "
        "recorded one beside it (labelled 'Recorded on <date> with jax X', e.g. by "
        "minilib.tpu.recorded.recorded_result):\n" + "\n".join(unrecorded)
    )
    contradicted = broken_claims(nb.cells)
    assert not contradicted, (
        f"{path.name}: the prose says what a cell's output does not (its `<!-- claim: -->`, "
        "tests/prose_claims.py):\n" + "\n".join(contradicted)
    )
    assert cost < SECONDS_LIMIT, (
        f"{path.name} cost {cost:.0f} s (the smaller of its wall and CPU seconds; {seconds:.0f} s "
        f"wall); the budget is {SECONDS_LIMIT} s"
    )
