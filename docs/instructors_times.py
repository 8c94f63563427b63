"""The numbers of the instructor's guide (docs/instructors.md), computed from the course itself.

    python docs/instructors_times.py record build/executed/venv "a loaded 2-core machine"
    python docs/instructors_times.py write                        # the guide's tables, again
    python docs/instructors_times.py check                        # are they up to date?

What is measured and what is estimated:

  * run time (measured): the seconds each notebook's code cells took when it was run top to
    bottom (tests/test_notebooks.py keeps the executed notebooks, with the start and end of
    each cell, in build/executed/venv/). `record` reads them into RUN_TIMES, a JSON file,
    with the date, the jax that ran them and the machine (as told): the guide shows these.
  * check time (measured): the seconds each checker takes on its worked solution, its first
    call (compiles included), timed by `record` too.
  * reading time (estimated): the words of a notebook's markdown cells at READING_WPM.
  * exercise time (estimated): an allowance per exercise, EXERCISE_MINUTES for a function to
    fill in, RUNG_MINUTES for a rung of the kernel ladder. Nobody has timed a fresh learner
    yet: these are assumptions, and the guide says so.

The guide's generated parts sit between `<!-- begin NAME -->` and `<!-- end NAME -->`;
`write` fills them in, and tests/test_instructors.py fails when one differs from what this
script computes now (a notebook or a checker changed, and the guide did not).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "instructors.md"
RUN_TIMES = ROOT / "docs" / "instructors_run_times.json"
NOTEBOOKS = ROOT / "notebooks"
EXERCISES = ROOT / "minilib" / "exercises"
WRONG_ANSWERS = ROOT / "tests" / "ladder_wrong_answers.py"

READING_WPM = 150  # words a minute: a careful pace for technical prose (an assumption)
EXERCISE_MINUTES = 10  # an "Exercise N.M": one function to fill in (an assumption)
RUNG_MINUTES = 25  # a rung of the kernel ladder: a Pallas kernel to fill in (an assumption)


@dataclass(frozen=True)
class Exercise:
    """One checked task of a notebook: the checker its cell calls, and the heading above it."""

    checker: str  # "check_flash_attention"
    heading: str  # "Your turn, rung 1, part 1: the flash-attention kernel body"

    @property
    def is_rung(self) -> bool:
        return self.heading.startswith("Your turn")

    @property
    def minutes(self) -> int:
        return RUNG_MINUTES if self.is_rung else EXERCISE_MINUTES


@dataclass(frozen=True)
class Notebook:
    name: str  # "08_tpu_kernel"
    words: int  # in its markdown cells
    exercises: tuple[Exercise, ...]

    @property
    def number(self) -> str:
        return self.name[:2]

    @property
    def reading_minutes(self) -> int:
        return round(self.words / READING_WPM)


def cell_text(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def read_notebook(path: Path) -> Notebook:
    """The words of a notebook's markdown and the exercises its code cells check. A word is
    a run of characters between spaces that holds a letter or a digit: a heading's `#` and a
    table's `|---|` are not words.

    >>> nb = read_notebook(NOTEBOOKS / "00_setup_and_tour.ipynb")
    >>> [e.checker for e in nb.exercises]
    ['check_live_seq_lens']
    """
    cells = json.loads(path.read_text())["cells"]
    words, heading, exercises = 0, "", {}
    for cell in cells:
        text = cell_text(cell)
        if cell["cell_type"] == "markdown":
            words += len(re.findall(r"\S*\w\S*", text))
            headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
            heading = headings[-1] if headings else heading
            continue
        # A checker called twice (a worked example of a failure, then the exercise) is one
        # exercise, under the heading of its last call.
        for checker in re.findall(r"\b(check_\w+)\(", text):
            exercises.pop(checker, None)
            exercises[checker] = Exercise(checker, heading.replace("`", ""))
    return Notebook(path.stem, words, tuple(exercises.values()))


def course() -> dict[str, Notebook]:
    """{"08": Notebook(...)} for each numbered notebook."""
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    return {path.name[:2]: read_notebook(path) for path in paths}


def cell_seconds(cell: dict) -> float:
    """A code cell's run time, from the times nbclient records in its metadata (0 if none)."""
    execution = cell.get("metadata", {}).get("execution", {})
    start = execution.get("iopub.execute_input")
    end = execution.get("shell.execute_reply")
    if not (start and end):
        return 0.0
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def measured_seconds(executed: Path) -> dict[str, float]:
    """{"08": seconds} from the executed notebooks in `executed`: the sum of their cells' times."""
    seconds = {}
    for path in sorted(executed.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        seconds[path.name[:2]] = round(sum(cell_seconds(c) for c in cells), 1)
    missing = sorted(set(course()) - set(seconds))
    if missing:
        raise ValueError(
            f"{executed=} lacks the executed notebooks {missing}: run them with "
            "`pytest -m notebooks tests/test_notebooks.py -k runs` first"
        )
    return seconds


def check_seconds() -> dict[str, float]:
    """{checker: seconds} that each checker took on its worked solution (solutions/), in this
    process, first call (its compiles included, as a learner's first check). The pairs of
    checker and solution are the tests' (tests/exercise_answers.py)."""
    import time

    sys.path.insert(0, str(ROOT / "tests"))
    import exercise_answers

    seconds = {}
    for checker, module, name, *_ in exercise_answers.EXERCISES + exercise_answers.MORE_EXERCISES:
        if checker.__name__ in seconds:
            continue
        answer = exercise_answers.solution(module, name)
        start = time.perf_counter()
        result = checker(answer, verbose=False)
        seconds[checker.__name__] = round(time.perf_counter() - start, 1)
        if result.status != "passed":
            raise ValueError(f"{checker.__name__} did not pass solutions/{module}.py: {result}")
    return seconds


def record(executed: Path, machine: str) -> None:
    """Write RUN_TIMES: the notebooks' run times, from the executed notebooks in `executed`,
    and each checker's time on its worked solution, measured now."""
    import jax

    seconds = measured_seconds(executed)
    checks = check_seconds()
    stamp = datetime.fromtimestamp(max(p.stat().st_mtime for p in executed.glob("*.ipynb")))
    data = {
        "date": stamp.date().isoformat(),
        "jax": jax.__version__,
        "machine": machine,
        "seconds": seconds,
        "check_seconds": checks,
    }
    RUN_TIMES.write_text(json.dumps(data, indent=1) + "\n")


def run_times() -> dict:
    return json.loads(RUN_TIMES.read_text())


# --- the plans ---------------------------------------------------------------------------------

# Each plan: {notebook number: the checkers given as core exercises}; the notebook's other
# checkers are optional (for those who finish early, or after the workshop).
ONE_DAY = {
    "00": ["check_live_seq_lens"],
    "01": ["check_grouped_query_attention"],
    "02": ["check_write_new_tokens"],
    "03": ["check_causal_mask"],
    "04": [],
    "05": [],
    "06": ["check_online_softmax_update"],
    "07": ["check_flash_attention", "check_flash_pallas_call"],
    "08": [
        "check_paged_decode_attention",
        "check_paged_decode_async_copy",
        "check_double_buffered_decode",
    ],
}
HALF_DAY = {
    "00": [],
    "01": ["check_grouped_query_attention"],
    "02": ["check_write_new_tokens"],
    "03": ["check_causal_mask"],
    "04": [],
    "06": ["check_online_softmax_update"],
    "07": ["check_flash_attention"],
}
PLANS = {"one-day": ONE_DAY, "half-day": HALF_DAY}


def exercise_label(exercise: Exercise) -> str:
    """`check_causal_mask` (Exercise 3.1: the causal mask)."""
    return f"`{exercise.checker}` ({exercise.heading})"


def plan_rows(plan: dict[str, list[str]]) -> list[dict]:
    """One row per notebook of `plan`: its measured seconds, estimated minutes, exercises."""
    notebooks, seconds, checks = course(), run_times()["seconds"], run_times()["check_seconds"]
    rows, total = [], 0.0
    for number, core in plan.items():
        nb = notebooks[number]
        known = {e.checker for e in nb.exercises}
        unknown = sorted(set(core) - known)
        if unknown:
            raise ValueError(f"notebook {number} checks no {unknown}: it checks {sorted(known)}")
        core_exercises = [e for e in nb.exercises if e.checker in core]
        optional = [e for e in nb.exercises if e.checker not in core]
        exercise_minutes = sum(e.minutes for e in core_exercises)
        check = sum(checks[e.checker] for e in core_exercises)
        measured = (seconds[number] + check) / 60
        minutes = measured + nb.reading_minutes + exercise_minutes
        total += minutes
        rows.append(
            {
                "notebook": nb,
                "seconds": seconds[number],
                "core": core_exercises,
                "optional": optional,
                "exercise_minutes": exercise_minutes,
                "check_seconds": check,
                "minutes": round(minutes),
                "total": round(total),
            }
        )
    return rows


def plan_table(plan: dict[str, list[str]]) -> str:
    """A plan as a table: per notebook, its times, its core and optional exercises."""
    lines = [
        "| notebook | run (s, measured) | reading (min, est.) | core exercises | "
        "their checks (s, measured) | their work (min, est.) | optional exercises | "
        "minutes | running total |",
        "|---|--:|--:|---|--:|--:|---|--:|--:|",
    ]
    for row in plan_rows(plan):
        nb = row["notebook"]
        core = "<br>".join(exercise_label(e) for e in row["core"]) or "none"
        optional = "<br>".join(exercise_label(e) for e in row["optional"]) or "none"
        lines.append(
            f"| `{nb.name}` | {row['seconds']:.0f} | {nb.reading_minutes} | {core} | "
            f"{row['check_seconds']:.0f} | {row['exercise_minutes']} | {optional} | "
            f"{row['minutes']} | {row['total']} |"
        )
    return "\n".join(lines)


def notebooks_table() -> str:
    """Every notebook: run time and its checkers' time (measured), words, reading and
    exercise time (estimated)."""
    data = run_times()
    lines = [
        "| notebook | run (s, measured) | markdown words | reading (min, est.) | exercises | "
        "of them kernel-ladder rungs | checks on the solutions (s, measured) | "
        "exercises (min, est.) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for number, nb in course().items():
        rungs = sum(e.is_rung for e in nb.exercises)
        checks = sum(data["check_seconds"][e.checker] for e in nb.exercises)
        minutes = sum(e.minutes for e in nb.exercises)
        lines.append(
            f"| `{nb.name}` | {data['seconds'][number]:.0f} | {nb.words} | "
            f"{nb.reading_minutes} | {len(nb.exercises)} | {rungs} | {checks:.0f} | {minutes} |"
        )
    return "\n".join(lines)


def assumptions() -> str:
    data = run_times()
    return (
        f"Measured on {data['date']} with jax {data['jax']}, {data['machine']}. Run time: "
        "the sum of a notebook's code cells' times as recorded in the executed notebook (the "
        "kernel's start is not counted), every exercise left unattempted. Checks: the "
        "seconds each checker took on its worked solution, all run one after another in one "
        "process, compiles included (a learner runs a checker more than once). "
        f"Estimated: reading, the words of the notebook's markdown cells at {READING_WPM} "
        f"words a minute; exercises, {EXERCISE_MINUTES} minutes for an exercise and "
        f"{RUNG_MINUTES} for a rung of the kernel ladder. These two are assumptions, not "
        "timings: no fresh learner has been timed yet. A plan's minutes add the measured "
        "seconds of the notebook and of its core exercises' checks to the estimates."
    )


# --- the mistakes the checkers name ----------------------------------------------------------


def called_names(function: ast.FunctionDef) -> set[str]:
    """The names of the functions `function` calls (or passes on, as `mistakes=_mistakes()`)."""
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            names.add(node.func.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            names.add(node.func.attr)
    return names


def catalogue_dicts(tree: ast.Module):
    """(function, dict node) for each `mistakes = {...}` in a function, and each dict a
    function named `..._mistakes` returns."""
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            assigned = isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "mistakes" for t in node.targets
            )
            returned = isinstance(node, ast.Return) and function.name.endswith("mistakes")
            if (assigned or returned) and isinstance(node.value, ast.Dict):
                yield function, node.value


def explanation(key: ast.expr, module) -> str | None:
    """A catalogue key's text: a string, or a constant of the module (SM_SCALE_IGNORED)."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return key.value
    if isinstance(key, ast.Name) and isinstance(getattr(module, key.id, None), str):
        return getattr(module, key.id)
    return None


def catalogues() -> dict[str, list[str]]:
    """{checker: the causes its report can name}, from each `mistakes` dict of
    minilib/exercises whose keys are explanations (sentences, ending in a full stop), given to
    each checker that reaches the function holding it.

    >>> causes = catalogues()["check_live_seq_lens"]
    >>> any("Loop over range(num_seqs[0])" in cause for cause in causes)
    True
    """
    import importlib

    calls, held = {}, {}  # function name -> names it calls; -> the causes it holds
    for path in sorted(EXERCISES.glob("*.py")):
        tree = ast.parse(path.read_text())
        module = importlib.import_module(f"minilib.exercises.{path.stem}")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                calls.setdefault(node.name, set()).update(called_names(node))
        for function, mapping in catalogue_dicts(tree):
            texts = [explanation(key, module) for key in mapping.keys]
            if all(text and text.rstrip(")").endswith(".") for text in texts):
                held.setdefault(function.name, []).extend(texts)
    found = {}
    for checker in [name for name in calls if name.startswith("check_")]:
        seen, todo = set(), [checker]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo += calls.get(name, set())
        causes = [cause for name in sorted(seen) for cause in held.get(name, [])]
        if causes:
            found[checker] = list(dict.fromkeys(causes))
    return found


def ladder_wrong_answers() -> list[tuple[str, str, str, list[str]]]:
    """(rung, the wrong answer, checker, words its report contains) for each row of
    tests/ladder_wrong_answers.py's WRONG_ANSWERS (read, not imported: it builds kernels)."""
    tree = ast.parse(WRONG_ANSWERS.read_text())
    table = next(
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "WRONG_ANSWERS"
    )
    rows = []
    for call in table.value.elts:
        rung, name, checker, _make, *expect = call.args
        words = [e.value for e in expect]
        rows.append((rung.value, name.value, checker.attr, words))
    return rows


def code(words: str) -> str:
    """`words` as inline code, `` with ` inside `` too."""
    return f"`` {words} ``" if "`" in words else f"`{words}`"


def mistakes_section() -> str:
    """Per notebook, per checker: the causes it names (a cause shared with a checker above is
    named by that checker); for the ladder, the wrong answers the tests give it and the words
    its report then contains."""
    causes, wrong = catalogues(), ladder_wrong_answers()
    out, shown = [], {}  # shown: cause -> the checker that listed it first
    for number, nb in course().items():
        out.append(f"### Notebook {number}\n")
        for exercise in nb.exercises:
            out.append(f"**{exercise_label(exercise)}**\n")
            mine = causes.get(exercise.checker, [])
            for cause in mine:
                if cause not in shown:
                    shown[cause] = exercise.checker
                    out.append(f"- {cause}")
            earlier = [shown[c] for c in mine if shown[c] != exercise.checker]
            for checker in dict.fromkeys(earlier):
                count = earlier.count(checker)
                out.append(f"- and {count} of the causes listed for `{checker}` above")
            rows = [row for row in wrong if row[2] == exercise.checker]
            if rows:
                out.append("\nWrong answers the tests give it, and words its report contains:\n")
                out.append("| wrong answer | the report says |\n|---|---|")
                for _rung, name, _checker, words in rows:
                    said = " … ".join(code(w) for w in words)
                    out.append(f"| {name} | {said} |")
            if not mine and not rows:
                out.append("- no catalogue: its report shows the case and the values that differ")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


# --- the guide's generated parts -------------------------------------------------------------


def generated() -> dict[str, str]:
    """{name: text} of each generated part of the guide."""
    return {
        "assumptions": assumptions(),
        "notebooks": notebooks_table(),
        "one-day": plan_table(ONE_DAY),
        "half-day": plan_table(HALF_DAY),
        "mistakes": mistakes_section(),
    }


def block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- begin {name} -->\n).*?(\n<!-- end {name} -->)", flags=re.S)


def filled(guide: str, parts: dict[str, str]) -> str:
    """`guide` with each `<!-- begin NAME -->...<!-- end NAME -->` holding parts[NAME].

    >>> filled("a\\n<!-- begin x -->\\nold\\n<!-- end x -->\\nb", {"x": "new"})
    'a\\n<!-- begin x -->\\nnew\\n<!-- end x -->\\nb'
    """
    for name, text in parts.items():
        if not block(name).search(guide):
            raise ValueError(
                f"the guide has no part {name=}: add `<!-- begin {name} -->` and "
                f"`<!-- end {name} -->` on lines of their own"
            )
        start, end = block(name).search(guide).span()
        begin, close = f"<!-- begin {name} -->\n", f"\n<!-- end {name} -->"
        guide = guide[:start] + begin + text.strip("\n") + close + guide[end:]
    return guide


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "record" and len(argv) == 3:
        record(Path(argv[1]), machine=argv[2])
    elif command == "write":
        GUIDE.write_text(filled(GUIDE.read_text(), generated()))
    elif command == "check":
        stale = GUIDE.read_text() != filled(GUIDE.read_text(), generated())
        print(
            f"{GUIDE} is out of date: run `python docs/instructors_times.py write`"
            if stale
            else f"{GUIDE} is up to date"
        )
        return int(stale)
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
