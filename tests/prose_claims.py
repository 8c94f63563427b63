"""What the notebooks' prose says about the figures their cells print, checked against them.

A sentence that states a measured figure or compares two ("between two and two and a half
times", "ahead", "falls behind", "nearly as many") carries a *claim* in its markdown cell: an
HTML comment, which the notebook does not show, that names the phrase, the code cell whose
output it rests on, the figures to read there and what must hold of them:

    <!-- claim: more than ten times less
    cell: 05-13
    static: static : ([\\d.]+) ms
    dynamic: dynamic: ([\\d.]+) ms
    holds: 10 * static < dynamic
    -->

* `claim:` a phrase of the cell's prose, word for word (line breaks aside): edit the phrase and
  the claim must follow.
* `cell:` the `id` of the code cell whose printed output holds the figures.
* every other `name: regex` line reads a figure: the regex's one group, found in that output
  (commas and a trailing % dropped). A name that matches several times is a list: `holds` is
  then checked for each value of it (at most one such name per claim). A regex without a
  group counts its matches (0 included): the name is the count.
* `holds:` a comparison of the names and numbers (+ - * /, < <= > >= == !=, and, or, not).

The claim stands as a block of its own: a blank line (or the cell's edge) before and after,
so that the markdown around it still renders.

`claims_in(cells)` reads them; `broken_claims(cells)` checks them on an executed notebook;
`unclaimed_comparisons(cells)` finds comparative words that carry no claim.
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass

CLAIM = re.compile(r"<!-- claim:(.*?)-->", re.DOTALL)
# The words that compare figures: a sentence using one needs a claim in its cell.
COMPARATIVES = re.compile(
    r"between [\w.,\s-]{1,40}? times"
    r"|\bahead\b|\b(?:falls?|fell|falling|lags?|lagging) behind\b|\bnearly as (?:many|much)\b"
    r"|\b(?:\d+(?:\.\d+)?|two|three|four|five|ten) times (?:as|faster|slower|more|fewer|less)\b"
    r"|\b\d+(?:\.\d+)?x (?:faster|slower|more|fewer|less|as)\b",
    re.IGNORECASE,
)
# What a claim's `holds` may contain: comparisons, and/or/not, + - * / and numbers.
OPERATORS = (ast.And, ast.Or, ast.Not, ast.USub, ast.Add, ast.Sub, ast.Mult, ast.Div)
COMPARISONS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq)
EXPRESSIONS = (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Constant)
ALLOWED_NODES = (*EXPRESSIONS, ast.Name, ast.Load, *OPERATORS, *COMPARISONS)


@dataclass(frozen=True)
class Claim:
    cell: int  # the markdown cell's index
    phrase: str
    source_id: str  # the id of the code cell whose output it reads
    figures: dict  # name -> regex with one group
    holds: str


def source(cell: dict) -> str:
    text = cell["source"]
    return "".join(text) if isinstance(text, list) else text


def output_text(cell: dict) -> str:
    texts = []
    for output in cell.get("outputs", []):
        text = output.get("text") or output.get("data", {}).get("text/plain", "")
        texts.append("".join(text) if isinstance(text, list) else text)
    return "".join(texts)


def squeeze(text: str) -> str:
    return " ".join(text.split())


def prose(text: str) -> str:
    """The markdown without its claims."""
    return CLAIM.sub(" ", text)


def parse_claim(index: int, body: str) -> Claim:
    """A claim from the text between `<!-- claim:` and `-->`; ValueError if a field is missing."""
    lines = body.strip().splitlines()
    fields = {"claim": lines[0].strip()}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name.strip().isidentifier():
            raise ValueError(f"cell {index}: claim line {line!r} is not 'name: value'")
        fields[name.strip()] = value.strip()
    for key in ("claim", "cell", "holds"):
        if not fields.get(key):
            raise ValueError(f"cell {index}: claim {fields['claim']!r} has no {key!r} line")
    figures = {k: v for k, v in fields.items() if k not in ("claim", "cell", "holds")}
    if not figures:
        raise ValueError(f"cell {index}: claim {fields['claim']!r} reads no figure")
    return Claim(index, fields["claim"], fields["cell"], figures, fields["holds"])


def claims_in(cells: list[dict]) -> list[Claim]:
    """Every claim of every markdown cell, in order."""
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "markdown":
            found += [parse_claim(i, m.group(1)) for m in CLAIM.finditer(source(cell))]
    return found


def as_number(text: str) -> float:
    return float(text.replace(",", "").rstrip("%"))


def holds(expression: str, values: dict) -> bool:
    """`expression` evaluated on `values`, only comparisons and arithmetic allowed."""
    tree = ast.parse(expression, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, ALLOWED_NODES):
            raise ValueError(f"{expression=}: {type(node).__name__} is not allowed in a claim")
        if isinstance(node, ast.Name) and node.id not in values:
            raise ValueError(f"{expression=}: {node.id!r} is not one of {sorted(values)}")
    return bool(eval(compile(tree, "<claim>", "eval"), {"__builtins__": {}}, dict(values)))


def check_claim(claim: Claim, cells: list[dict]) -> str | None:
    """What is wrong with `claim` in this executed notebook, or None."""
    where = f"cell {claim.cell}, claim {claim.phrase!r}"
    if squeeze(claim.phrase) not in squeeze(prose(source(cells[claim.cell]))):
        return f"{where}: the phrase is not in the cell's prose"
    by_id = {c.get("id"): c for c in cells}
    code = by_id.get(claim.source_id)
    if code is None or code["cell_type"] != "code":
        return f"{where}: no code cell has id {claim.source_id!r}"
    text = output_text(code)
    found = {}
    for name, pattern in claim.figures.items():
        matches = re.findall(pattern, text)
        if re.compile(pattern).groups == 0:
            found[name] = [len(matches)]  # a regex without a group counts its matches
            continue
        if not matches:
            return f"{where}: {name} ({pattern!r}) is not in the output of {claim.source_id}"
        found[name] = [as_number(m) for m in matches]
    several = [name for name, values in found.items() if len(values) > 1]
    if len(several) > 1:
        return f"{where}: {several} each match several times; at most one may"
    names = list(found)
    for combination in itertools.product(*(found[n] for n in names)):
        values = dict(zip(names, combination, strict=True))
        if not holds(claim.holds, values):
            return f"{where}: {claim.holds!r} is false for {values} (cell {claim.source_id})"
    return None


def broken_claims(cells: list[dict]) -> list[str]:
    """The claims of an executed notebook that its outputs contradict, each with why."""
    problems = [check_claim(claim, cells) for claim in claims_in(cells)]
    return [p for p in problems if p]


def misplaced_claims(cells: list[dict]) -> list[str]:
    """Claims that do not stand as a block of their own (a blank line or the cell's edge on
    each side): markdown would render the text beside them as raw HTML."""
    found = []
    for i, cell in enumerate(cells):
        text = source(cell) if cell["cell_type"] == "markdown" else ""
        for m in CLAIM.finditer(text):
            before, after = text[: m.start()], text[m.end() :]
            if not (before == "" or before.endswith("\n\n")):
                found.append(f"cell {i}: no blank line before claim {m.group(1).split()[:4]}")
            if not (after.strip() == "" or after.startswith("\n\n")):
                found.append(f"cell {i}: no blank line after claim {m.group(1).split()[:4]}")
    return found


def unclaimed_comparisons(cells: list[dict]) -> list[str]:
    """Comparative words in a markdown cell's prose that no claim of that cell names."""
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        text = squeeze(prose(source(cell)))
        phrases = [squeeze(c.phrase) for c in claims_in([cell])]
        for m in COMPARATIVES.finditer(text):
            spans = [(text.find(p), text.find(p) + len(p)) for p in phrases if p in text]
            if not any(start <= m.start() and m.end() <= end for start, end in spans):
                found.append(f"cell {i}: {text[max(0, m.start() - 50) : m.end() + 20]!r}")
    return found
