"""minilib.explore.text: counts, runs and lists in words, written once for every figure and
explorer, and the explorers' HTML."""

from __future__ import annotations

import pathlib
import re

import minilib.explore
from minilib.explore.text import and_join, array_rows, message_box, plural, pre, span, table

EXPLORE = pathlib.Path(minilib.explore.__file__).parent


def test_plural():
    assert [plural(n, "page") for n in (0, 1, 2)] == ["0 pages", "1 page", "2 pages"]
    assert plural(1, "q head", count=False) == "q head"
    assert plural(4, "q head", count=False) == "q heads"


def test_there_is_one_plural():
    """No figure or explorer writes an s by hand: each count goes through `plural`."""
    by_hand = re.compile(r"""['"]s['"] if |else ['"]s['"]""")
    for path in sorted(EXPLORE.glob("*.py")):
        if path.name == "text.py":
            continue
        lines = [line for line in path.read_text().splitlines() if by_hand.search(line)]
        assert not lines, f"{path.name} writes a plural by hand: {lines}"
    assert by_hand.search("f\"head{'s' if n > 1 else ''}\"")  # the check can fail


def test_span_and_and_join():
    assert [span([3, 4, 5]), span(range(16, 32)), span([7])] == ["3..5", "16..31", "7"]
    assert [and_join([1, 2, 3]), and_join(["a", "b"]), and_join([8])] == [
        "1, 2 and 3",
        "a and b",
        "8",
    ]


def test_html_pieces_escape_what_they_show():
    assert "&lt;script&gt;" in table(["<script>"], [["a & b"]]) and "a &amp; b" in table(
        ["h"], [["a & b"]]
    )
    assert pre("x < y").endswith(">x &lt; y</pre>")
    assert message_box("<b>ok</b>", "#009E73").count("<b>ok</b>") == 1  # HTML goes in as is


def test_array_rows_line_up_under_the_first():
    import numpy as np

    text = "page_indices = " + array_rows(np.arange(6).reshape(3, 2), indent=len("page_indices = "))
    first, *rest = text.splitlines()
    assert first == "page_indices = [[0, 1],"
    assert all(line.index("[") == first.index("[[") + 1 for line in rest)
