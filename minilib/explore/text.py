"""How figures and explorers put things in words, and the few HTML pieces the explorers show.

    plural(n, noun), span(items), and_join(items)    counts, runs and lists in words
    code_without_docstrings(obj)                      a function's or class's code, to read
    message_box, pre, table, array_rows               the explorers' HTML

Every count in the figures and explorers goes through `plural`, so "1 page" and "2 pages" are
written once.
"""

from __future__ import annotations

import ast
import html
import inspect
import textwrap
from collections.abc import Iterable, Sequence

__all__ = [
    "and_join",
    "array_rows",
    "code_without_docstrings",
    "message_box",
    "plural",
    "pre",
    "span",
    "table",
]


def plural(n: int, noun: str, count: bool = True) -> str:
    """`n` and `noun`, with an s unless `n` is 1: how figures and explorers count things.
    With `count=False`, the noun alone, for a list that follows it ("q heads 3..5").

    >>> plural(1, "page"), plural(3, "page"), plural(3, "q head", count=False)
    ('1 page', '3 pages', 'q heads')
    """
    noun = noun if n == 1 else f"{noun}s"
    return f"{n} {noun}" if count else noun


def span(items: Sequence[int]) -> str:
    """The first and last of consecutive numbers, both included, as "first..last": how figures
    and explorers name a run of heads, pages or keys.

    >>> span([3, 4, 5]), span(range(16, 32)), span([7])
    ('3..5', '16..31', '7')
    """
    return str(items[0]) if len(items) == 1 else f"{items[0]}..{items[-1]}"


def and_join(items: Iterable) -> str:
    """The items as a list in words, the last two joined by "and".

    >>> and_join([1, 2, 3]), and_join([16, 32]), and_join([8])
    ('1, 2 and 3', '16 and 32', '8')
    """
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def code_without_docstrings(obj) -> str:
    """The source of a function or class as the notebooks print it: its `def` or `class` line
    and its code, each docstring in it (its own, its methods') left out.

    >>> print(code_without_docstrings(plural))
    def plural(n: int, noun: str, count: bool = True) -> str:
        noun = noun if n == 1 else f"{noun}s"
        return f"{n} {noun}" if count else noun
    """
    source = textwrap.dedent(inspect.getsource(obj))
    dropped = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        first = node.body[0]
        is_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        if is_docstring and isinstance(first.value.value, str) and first.lineno > node.lineno:
            dropped.update(range(first.lineno, first.end_lineno + 1))  # 1-based line numbers
    lines = source.splitlines()
    after = [number + 1 for number in dropped if number + 1 not in dropped]
    dropped.update(n for n in after if n <= len(lines) and not lines[n - 1].strip())
    kept = [line for number, line in enumerate(lines, start=1) if number not in dropped]
    return "\n".join(kept)


# --- HTML ------------------------------------------------------------------------------------


def message_box(inner_html: str, colour: str) -> str:
    """`inner_html` in a box with a `colour` bar on its left: an explorer's status line.

    >>> message_box("Valid.", "#009E73")
    "<div style='border-left:4px solid #009E73;padding:4px 10px;margin:6px 0'>Valid.</div>"
    """
    return (
        f"<div style='border-left:4px solid {colour};padding:4px 10px;margin:6px 0'>"
        f"{inner_html}</div>"
    )


def pre(text: str) -> str:
    """`text` as preformatted HTML (escaped) whose long lines wrap between words.

    Notebook front ends give output `<pre>` blocks `word-break: break-all`, which splits words
    and numbers anywhere; this style overrides it.

    >>> shown = pre("a < b")
    >>> shown.endswith(">a &lt; b</pre>"), "word-break:normal" in shown
    (True, True)
    """
    style = "white-space:pre-wrap;word-break:normal;overflow-wrap:break-word;margin:4px 0"
    return f"<pre style='{style}'>{html.escape(text)}</pre>"


def table(header: Sequence, rows: Iterable[Sequence]) -> str:
    """An HTML table: one header row, then `rows`, every cell escaped.

    >>> html_table = table(("seq", "kv_len"), [(0, 37), (1, 5)])
    >>> html_table.count("<tr>"), "<td style='padding:2px 10px;text-align:left;" in html_table
    (3, True)
    """
    cell = "style='padding:2px 10px;text-align:left;border-bottom:1px solid #ddd'"
    head = "".join(f"<th {cell}>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td {cell}>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in rows
    )
    return f"<table style='border-collapse:collapse;margin:6px 0'><tr>{head}</tr>{body}</table>"


def array_rows(array, indent: int) -> str:
    """A 2-D array as a list of rows, one row a line, lined up under the first when the array
    starts at column `indent` (after `indent` characters of text).

    >>> import numpy as np
    >>> print("x = " + array_rows(np.array([[1, 2], [3, 4]]), indent=len("x = ")))
    x = [[1, 2],
         [3, 4]]
    """
    return "[" + f",\n{' ' * (indent + 1)}".join(str(r) for r in array.tolist()) + "]"
