"""The instructor's guide (docs/instructors.md): its tables are what docs/instructors_times.py
computes from the notebooks, the checkers and the recorded run times; the mistakes it lists
are the ones the checkers print. (That it is a page of the book: tests/test_book.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import instructors_times as times  # noqa: E402


def test_the_guides_tables_are_what_the_script_computes():
    guide = times.GUIDE.read_text()
    assert guide == times.filled(guide, times.generated()), (
        "docs/instructors.md is out of date: run `python docs/instructors_times.py write`"
    )


def test_the_guide_shows_the_recorded_run_time_of_every_notebook():
    recorded = times.run_times()
    assert set(recorded["seconds"]) == set(times.course())
    table = times.notebooks_table()
    for number, nb in times.course().items():
        assert f"| `{nb.name}` | {recorded['seconds'][number]:.0f} |" in table
    assert recorded["date"] in times.GUIDE.read_text()


def test_every_checker_of_the_package_is_an_exercise_of_a_notebook():
    import minilib.exercises

    checkers = {name for name in minilib.exercises.__all__ if name.startswith("check_")}
    called = {e.checker for nb in times.course().values() for e in nb.exercises}
    assert called == checkers


def test_a_notebooks_words_and_exercises_are_counted(tmp_path):
    cells = [
        {"cell_type": "markdown", "source": ["# 99 · A title\n", "\n", "Four more words here."]},
        {"cell_type": "markdown", "source": "## Exercise 99.1: a `thing`"},
        {"cell_type": "code", "source": "check_thing(thing)\n"},
        {"cell_type": "markdown", "source": "### Your turn, rung 9"},
        {"cell_type": "code", "source": "from minilib.exercises import check_rung\ncheck_rung(k)"},
    ]
    path = tmp_path / "99_test.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    nb = times.read_notebook(path)
    assert nb.words == 3 + 4 + 4 + 4  # `#` and `·` are not words
    assert [(e.checker, e.heading, e.is_rung) for e in nb.exercises] == [
        ("check_thing", "Exercise 99.1: a thing", False),
        ("check_rung", "Your turn, rung 9", True),
    ]
    assert [e.minutes for e in nb.exercises] == [times.EXERCISE_MINUTES, times.RUNG_MINUTES]


def test_run_time_is_the_sum_of_the_cells_recorded_times(tmp_path):
    def cell(start, end):
        execution = {"iopub.execute_input": start, "shell.execute_reply": end}
        return {"cell_type": "code", "source": "", "metadata": {"execution": execution}}

    cells = [
        cell("2026-01-01T10:00:00.000000Z", "2026-01-01T10:00:01.500000Z"),
        cell("2026-01-01T10:00:02.000000Z", "2026-01-01T10:01:02.000000Z"),
        {"cell_type": "markdown", "source": "no time", "metadata": {}},
    ]
    assert sum(times.cell_seconds(c) for c in cells) == 61.5


def test_run_times_need_every_notebook_executed(tmp_path):
    (tmp_path / "00_setup_and_tour.ipynb").write_text(json.dumps({"cells": []}))
    with pytest.raises(ValueError, match="01_attention_and_head_grouping|'01'"):
        times.measured_seconds(tmp_path)


def test_a_plan_naming_a_checker_its_notebook_lacks_is_refused():
    with pytest.raises(ValueError, match="notebook 01 checks no \\['check_causal_mask'\\]"):
        times.plan_rows({"01": ["check_causal_mask"]})


def test_each_plan_gives_every_exercise_of_its_notebooks_as_core_or_optional():
    for plan in times.PLANS.values():
        for row in times.plan_rows(plan):
            given = [e.checker for e in row["core"] + row["optional"]]
            assert sorted(given) == sorted(e.checker for e in row["notebook"].exercises)


def test_the_guide_names_the_cause_a_checker_prints():
    """A wrong answer to exercise 0.1 (q_len as cu_q_lens[i + 1]): its checker's `Likely
    cause:` is, word for word, a cause the guide lists under that checker."""
    from minilib.exercises import check_live_seq_lens

    def live_seq_lens(kv_lens, cu_q_lens, num_seqs):
        n = int(num_seqs[0])
        return [(int(cu_q_lens[i + 1]), int(kv_lens[i])) for i in range(n)]

    result = check_live_seq_lens(live_seq_lens, verbose=False)
    assert result.status == "failed"
    cause = result.report.split("Likely cause: ")[1].split("\n")[0]
    assert cause in times.catalogues()["check_live_seq_lens"]
    assert f"- {cause}" in times.GUIDE.read_text()


def test_the_ladders_wrong_answers_are_read_from_the_tests_table():
    rows = times.ladder_wrong_answers()
    assert ("1a", "no alpha rescale", "check_flash_attention", ["not rescaled"]) in rows
    checkers = {checker for _, _, checker, _ in rows}
    assert "check_ragged_paged_attention" in checkers and "check_next_work" in checkers


def test_a_missing_part_of_the_guide_is_named():
    with pytest.raises(ValueError, match="name='mistakes'"):
        times.filled("# Guide\n", {"mistakes": "text"})


def test_the_scripts_examples_run():
    import doctest

    assert doctest.testmod(times).failed == 0
