"""The notebooks' prose agrees with the figures their cells print (tests/prose_claims.py).

The static tests read the committed notebooks: every claim is well formed, names a phrase of
its cell and a code cell that exists, stands as a block of its own, and every comparative word
("between X and Y times", "ahead", "falls behind", "nearly as many", "N times as") carries
one. The executed test reads each notebook as tests/test_notebooks.py last ran it,
build/executed/venv/ (test_notebook_runs also checks the claims of each notebook it runs). The
synthetic notebooks show that a contradiction planted in prose or output is found.
"""

from __future__ import annotations

import json

import pytest
from prose_claims import (
    broken_claims,
    claims_in,
    misplaced_claims,
    source,
    unclaimed_comparisons,
)
from test_notebooks import ALL_NOTEBOOKS, EXECUTED_DIR, _ids

CLAIM = """<!-- claim: between two and two and a half times
cell: loops
ratio: 32 q loop ([\\d.]+)x
holds: 2 <= ratio <= 2.5
-->"""


def markdown(text):
    return {"cell_type": "markdown", "id": "prose", "source": text}


def code(printed, cell_id="loops"):
    output = {"output_type": "stream", "name": "stdout", "text": printed}
    return {"cell_type": "code", "id": cell_id, "source": "print(...)", "outputs": [output]}


PROSE = "The 32-row loop is between two and two and a half times as long.\n\n" + CLAIM
OUTPUT = "ours: 32 q loop 2.15x the 8 q loop\nv3: 32 q loop 2.37x the 8 q loop\n"


def test_a_claim_the_output_bears_out_passes():
    cells = [code(OUTPUT), markdown(PROSE)]
    assert [c.phrase for c in claims_in(cells)] == ["between two and two and a half times"]
    assert broken_claims(cells) == []
    assert misplaced_claims(cells) == [] and unclaimed_comparisons(cells) == []


def test_a_figure_the_prose_contradicts_fails():
    """The planted contradiction of issue 68: prose says 1.5-2x, a cell prints 2.15x."""
    prose = PROSE.replace("two and two and a half", "one and a half and two")
    claim = CLAIM.replace("two and two and a half", "one and a half and two").replace(
        "2 <= ratio <= 2.5", "1.5 <= ratio <= 2"
    )
    cells = [code(OUTPUT), markdown(prose.split("<!--")[0] + claim)]
    (problem,) = broken_claims(cells)
    assert "'1.5 <= ratio <= 2' is false for {'ratio': 2.15}" in problem


def test_an_output_that_changed_fails():
    cells = [code(OUTPUT.replace("2.37x", "2.61x")), markdown(PROSE)]
    (problem,) = broken_claims(cells)
    assert "false for {'ratio': 2.61}" in problem


def test_prose_edited_away_from_its_claim_fails():
    prose = PROSE.replace("between two and", "between 2 and", 1)  # the prose, not its claim
    cells = [code(OUTPUT), markdown(prose)]
    (problem,) = broken_claims(cells)
    assert "the phrase is not in the cell's prose" in problem


def test_a_figure_missing_from_the_output_fails():
    cells = [code("the loops were not compiled\n"), markdown(PROSE)]
    (problem,) = broken_claims(cells)
    assert "ratio" in problem and "is not in the output of loops" in problem


def test_a_claim_on_a_cell_that_does_not_exist_fails():
    cells = [code(OUTPUT, cell_id="other"), markdown(PROSE)]
    (problem,) = broken_claims(cells)
    assert "no code cell has id 'loops'" in problem


def test_a_regex_without_a_group_counts_its_matches():
    claim = (
        "<!-- claim: copied again\ncell: loops\ncopies: DMA start .* seq 0\nholds: copies == 2\n-->"
    )
    prose = "Sequence 0's block is copied again.\n\n"
    twice = "DMA start slot 0 <- seq 0\nDMA start slot 1 <- seq 0\n"
    assert broken_claims([code(twice), markdown(prose + claim)]) == []
    (problem,) = broken_claims([code(twice.splitlines()[0]), markdown(prose + claim)])
    assert "{'copies': 1}" in problem


def test_two_figures_compared():
    claim = "<!-- claim: falls behind\ncell: loops\nstatic: static ([\\d.]+)\n"
    claim += "continuous: continuous ([\\d.]+)\nholds: static < continuous\n-->"
    prose = "Static batching falls behind.\n\n" + claim
    assert broken_claims([code("static 5.0 continuous 7.5"), markdown(prose)]) == []
    (problem,) = broken_claims([code("static 8.0 continuous 7.5"), markdown(prose)])
    assert "'static < continuous' is false" in problem


def test_a_comparison_without_a_claim_is_found():
    cells = [markdown("Static batching falls behind, and is nearly as fast.")]
    assert len(unclaimed_comparisons(cells)) == 1  # "falls behind"; "nearly as fast" is not listed
    cells = [markdown("It takes nearly as many operations, and is 2 times as long.")]
    assert len(unclaimed_comparisons(cells)) == 2


def test_a_claim_inside_a_paragraph_is_misplaced():
    cells = [markdown("Text before\n" + CLAIM + " text after")]
    assert len(misplaced_claims(cells)) == 2


@pytest.mark.parametrize("bad", ["__import__('os')", "ratio.real > 1", "[ratio][0] > 1", "x > 1"])
def test_a_condition_may_only_compare_the_figures(bad):
    cells = [code(OUTPUT), markdown(PROSE.replace("2 <= ratio <= 2.5", bad))]
    with pytest.raises(ValueError, match="expression="):
        broken_claims(cells)


def test_a_claim_without_a_condition_is_refused():
    with pytest.raises(ValueError, match="has no 'holds' line"):
        claims_in([markdown(PROSE.replace("holds: 2 <= ratio <= 2.5\n", ""))])


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=_ids(ALL_NOTEBOOKS))
def test_claims_are_well_formed(path):
    """Each claim names a phrase of its prose and an existing code cell, and stands alone;
    every comparative word carries a claim."""
    cells = _cells(path)
    ids = {c.get("id") for c in cells if c["cell_type"] == "code"}
    for claim in claims_in(cells):
        assert claim.source_id in ids, f"{path.name} cell {claim.cell}: {claim.source_id=}"
    assert misplaced_claims(cells) == [], path.name
    assert unclaimed_comparisons(cells) == [], (
        f"{path.name}: comparative words without a claim (tests/prose_claims.py says how to "
        "write one)"
    )


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=_ids(ALL_NOTEBOOKS))
def test_executed_notebook_agrees_with_its_prose(path):
    """The claims of the notebook as last executed, with the committed prose: run
    `pytest tests/test_notebooks.py -k runs` first."""
    executed = EXECUTED_DIR / path.name
    if not executed.exists():
        pytest.skip(f"{executed} does not exist: run tests/test_notebooks.py -k {path.stem}")
    cells = _cells(path)
    ran = {c.get("id"): c for c in _cells(executed)}
    code_cells = [c for c in cells if c["cell_type"] == "code"]
    changed = [
        c["id"] for c in code_cells if c["id"] not in ran or source(c) != source(ran[c["id"]])
    ]
    if changed:
        pytest.skip(f"{executed} is older than the notebook (cells {changed}): run it again")
    with_outputs = [ran.get(c.get("id"), c) if c["cell_type"] == "code" else c for c in cells]
    assert broken_claims(with_outputs) == [], path.name
