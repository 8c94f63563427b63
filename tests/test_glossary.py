"""Terms before use: no notebook uses a term of the glossary (docs/glossary.md) before the
notebook that introduces it, unless that mention links to the glossary.

The glossary: each `### ` heading is a term; a heading `Term (ALIAS)` gives two spellings; the
first notebook that the entry's *Introduced in* line names is where the term is introduced.

What is read: the markdown cells of notebooks/NN_*.ipynb and the comments of their code cells
(a learner reads both as the course's text), without their inline code, fenced code blocks and
link targets: code is names, not terms.

How a spelling matches: as a whole word (a letter, digit, `_` or `-` on either side is part of
another word, so "lane" is not in "cross-lane"), followed by an optional s, es, ed or ing
("refs", "double-buffered"); a space in it matches a space or a hyphen. Its first letter
matches in either case ("Megacore" finds "megacore"); the rest matches exactly when it holds a
capital (an acronym: "MXU", "KV cache"), and in either case otherwise.

Not guarded (UNGUARDED): words of everyday English, or of earlier notebooks in their everyday
sense, whose every use would otherwise need a link.

A mention before the term's notebook is allowed only inside the text of a link to the
glossary, `[MXU](../docs/glossary.md#mxu)`, or after such a link in the same cell: a cell
links a term once, where it first uses it, as a page would.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"
NOTEBOOKS = ROOT / "notebooks"
# Terms whose spelling is an everyday word: "page", "slot", "padding", "tile" and "pop" are
# used in their plain sense before (and besides) their course sense, "scratch" as in "from
# scratch", and "tolerance" in every comparison, whose notebooks point to notebook 04.
UNGUARDED = {"Page", "Slot", "Padding", "Tile", "Pop", "Scratch", "Tolerance"}
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)\)")


@dataclass(frozen=True)
class Term:
    name: str  # the heading, e.g. "Cross-lane unit (XLU)"
    spellings: tuple[str, ...]  # ("Cross-lane unit", "XLU")
    notebook: str  # "09": where it is introduced
    anchor: str  # "cross-lane-unit-xlu": the heading's id, in the book and on GitHub


def slug(heading: str) -> str:
    """A heading's id, as MyST (the book) and GitHub make it: lower case, spaces as hyphens,
    other punctuation dropped.

    >>> slug("Cross-lane unit (XLU)")
    'cross-lane-unit-xlu'
    """
    kept = re.sub(r"[^\w\s-]", "", heading.lower())
    return re.sub(r"\s+", "-", kept.strip())


def glossary_terms(text: str) -> list[Term]:
    """The glossary's terms, in its order. Raises ValueError for an entry that names no
    notebook, or a heading used twice."""
    terms = []
    entries = re.split(r"^### ", text, flags=re.M)[1:]
    for entry in entries:
        heading, _, body = entry.partition("\n")
        heading = heading.strip()
        found = re.search(r"\*Introduced in \[notebook (\d\d)\]", body)
        if found is None:
            raise ValueError(
                f"glossary entry {heading=} has no '*Introduced in [notebook NN]' line: "
                "add one naming the notebook that introduces the term"
            )
        alias = re.fullmatch(r"(.+?) \((.+)\)", heading)
        spellings = (alias[1], alias[2]) if alias else (heading,)
        terms.append(Term(heading, spellings, found[1], slug(heading)))
    anchors = [term.anchor for term in terms]
    repeated = sorted({a for a in anchors if anchors.count(a) > 1})
    if repeated:
        raise ValueError(f"glossary headings used twice: {repeated=}; merge the entries")
    return terms


def spelling_pattern(spelling: str) -> re.Pattern:
    """The regex that finds `spelling` as a word in prose (see the module's docstring)."""
    first, rest = spelling[0], spelling[1:]
    words = [re.escape(word) for word in rest.split(" ")]
    body = f"[{first.lower()}{first.upper()}]" + r"[\s-]+".join(words)
    flags = 0 if any(c.isupper() for c in rest) else re.IGNORECASE
    return re.compile(rf"(?<![\w-]){body}(?:s|es|ed|ing)?(?![\w-])", flags)


def blanked(text: str, pattern: str, flags: int = 0) -> str:
    """`text` with each match of `pattern` replaced by spaces, so offsets stay put."""
    return re.sub(pattern, lambda m: re.sub(r"\S", " ", m[0]), text, flags=flags)


def comments(source: str) -> str:
    """The comments of a code cell, each on its own line, or the cell's lines that start with
    `#` when it is not plain Python (an IPython magic)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return "\n".join(line for line in source.splitlines() if line.lstrip().startswith("#"))
    return "\n".join(token.string for token in tokens if token.type == tokenize.COMMENT)


def cell_prose(cell: dict) -> str:
    """What a learner reads of a cell as text: a markdown cell's source, a code cell's comments,
    either without fenced code blocks and inline code."""
    source = "".join(cell["source"])
    text = source if cell["cell_type"] == "markdown" else comments(source)
    text = blanked(text, r"^\s*```.*?^\s*```", flags=re.M | re.S)
    return blanked(text, r"`[^`\n]*`")


def glossary_link_spans(prose: str) -> list[tuple[int, int]]:
    """Where the text of each link to the glossary sits in `prose`."""
    return [m.span(1) for m in LINK.finditer(prose) if "glossary.md" in m[2]]


def unlinked_mentions(prose: str, term: Term) -> list[re.Match]:
    """The mentions of `term` in a cell's `prose` that come before the cell's first link of it
    to the glossary (all of them when it has none)."""
    linked = glossary_link_spans(prose)
    prose = blanked(prose, r"\]\([^)\s]*\)")  # link targets are not prose
    matches = [m for s in term.spellings for m in spelling_pattern(s).finditer(prose)]
    in_links = [m.start() for m in matches if any(a <= m.start() < b for a, b in linked)]
    first_link = min(in_links, default=len(prose))
    return [m for m in matches if m.start() < first_link]


def forward_uses(notebooks: list[tuple[str, dict]], terms: list[Term]) -> list[str]:
    """Each unlinked mention of a guarded term in a notebook before the one that introduces it:
    "notebook 00 cell 5 (markdown): 'MXU', introduced in notebook 07, in '...'".
    `notebooks`: (number, notebook as JSON) pairs, e.g. ("01", json.load(...))."""
    found = []
    guarded = [term for term in terms if term.name not in UNGUARDED]
    for number, nb in notebooks:
        for index, cell in enumerate(nb["cells"]):
            prose = cell_prose(cell)
            for term in [t for t in guarded if number < t.notebook]:
                for match in unlinked_mentions(prose, term):
                    around = " ".join(prose[max(0, match.start() - 40) : match.end() + 40].split())
                    where = f"notebook {number} cell {index} ({cell['cell_type']})"
                    link = f"../docs/glossary.md#{term.anchor}"
                    found.append(
                        f"{where}: {match[0]!r}, introduced in notebook {term.notebook}, "
                        f"in '...{around}...': link it to the glossary ({link}) or move it"
                    )
    return found


def course() -> list[tuple[str, dict]]:
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))  # an appendix (09a_) after its lesson
    return [(path.name[:2], json.loads(path.read_text())) for path in paths]


def markdown_notebook(*cells: str, code: str = "") -> dict:
    """A notebook of markdown cells (and a code cell, when `code` is given)."""
    made = [{"cell_type": "markdown", "metadata": {}, "source": [text]} for text in cells]
    if code:
        made.append({"cell_type": "code", "metadata": {}, "source": [code], "outputs": []})
    return {"cells": made}


@pytest.fixture(scope="module")
def terms() -> list[Term]:
    return glossary_terms(GLOSSARY.read_text())


def test_no_notebook_uses_a_term_before_the_notebook_that_introduces_it(terms):
    problems = forward_uses(course(), terms)
    assert not problems, "\n".join(problems)


def test_a_planted_forward_use_is_reported():
    """A synthetic course: notebook 00 names the MXU (introduced in 07) in prose and in a code
    comment; notebook 01 links it, then names it again in the same cell and in code; notebook
    07 names it where it is introduced. Only notebook 00's two are forward uses."""
    planted = [
        ("00", markdown_notebook("The MXU multiplies.", code="x = 1  # on the MXU")),
        (
            "01",
            markdown_notebook("The [MXU](../docs/glossary.md#mxu), again the MXU, `pltpu.MXU`."),
        ),
        ("07", markdown_notebook("The MXU, defined here.")),
    ]
    terms = glossary_terms("### MXU\n\n*Introduced in [notebook 07](07.ipynb).*\n\nThe unit.\n")
    problems = forward_uses(planted, terms)
    assert len(problems) == 2, problems
    assert problems[0].startswith("notebook 00 cell 0 (markdown): 'MXU', introduced in notebook 07")
    assert problems[1].startswith("notebook 00 cell 1 (code): 'MXU'")
    assert "../docs/glossary.md#mxu" in problems[0]


def test_spellings_match_as_words_plurals_and_hyphens():
    lane = spelling_pattern("Lane")
    assert lane.findall("lanes, Lane, a lane") == ["lanes", "Lane", "lane"]
    assert lane.findall("the cross-lane unit, planes") == []
    assert spelling_pattern("Double buffer").findall("it double-buffers them") == ["double-buffers"]
    assert spelling_pattern("MXU").findall("mxu MXUs") == ["MXUs"]
    assert spelling_pattern("KV cache").findall("the kv cache, the KV cache") == ["KV cache"]


def test_an_entry_without_its_notebook_is_named():
    with pytest.raises(ValueError, match="heading='MXU'"):
        glossary_terms("# Glossary\n\n### MXU\n\nThe matrix unit.\n")


def test_each_term_is_in_the_prose_of_the_notebook_said_to_introduce_it(terms):
    prose_of = {}  # a notebook's number: its prose, and its appendix's (09: 09_ and 09a_)
    for number, nb in course():
        cells = "\n".join(cell_prose(cell) for cell in nb["cells"])
        prose_of[number] = prose_of.get(number, "") + "\n" + cells
    missing = []
    for term in terms:
        prose = prose_of[term.notebook]
        if not any(spelling_pattern(s).search(prose) for s in term.spellings):
            missing.append(f"{term.name} (notebook {term.notebook})")
    assert not missing, f"not in the notebook the glossary names: {missing}"


def test_every_link_to_the_glossary_reaches_an_entry(terms):
    anchors = {term.anchor for term in terms} | {
        slug(h) for h in re.findall(r"^#+ (.+)$", GLOSSARY.read_text(), flags=re.M)
    }
    broken = []
    for number, nb in course():
        for index, cell in enumerate(nb["cells"]):
            for match in LINK.finditer("".join(cell["source"])):
                path, _, anchor = match[2].partition("#")
                if "glossary" not in path:
                    continue
                if (NOTEBOOKS / path).resolve() != GLOSSARY or (anchor and anchor not in anchors):
                    broken.append(f"notebook {number} cell {index}: {match[0]}")
    assert not broken, f"links that miss the glossary or its entries: {broken}"


def test_the_book_has_the_glossary_where_the_notebooks_link_it():
    import sys

    sys.path.insert(0, str(ROOT / "docs"))
    import book

    toc = book.toc([], [], [])["project"]["toc"]
    assert {"file": book.GLOSSARY} in toc
    assert ROOT / book.GLOSSARY == GLOSSARY
