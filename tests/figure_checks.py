"""What every figure of the course must satisfy, for the figure tests (test_explore_*.py,
test_perf_plots.py).

"Reads well" is checked, not eyeballed: every axes has a title and labelled axes, the figure
has a legend, no two pieces of text overlap, and no text falls off the figure.

Set MINILIB_VIZ_DIR=/some/dir to also save every figure drawn by `draw` as a PNG, to look at.
"""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path

from matplotlib.text import Text

from minilib.explore.style import figure_png


def draw(make, name: str):
    """Build a figure and render it to PNG with every warning an error; save it if asked."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # matplotlib 3.10.0 (Colab's) calls pyparsing 3.3 by names pyparsing has deprecated:
        # their quarrel, not a fault of the figure.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="pyparsing")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="matplotlib")
        fig = make()
        png = figure_png(fig)
    assert png.startswith(b"\x89PNG")
    out = os.environ.get("MINILIB_VIZ_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.png").write_bytes(png)
    return fig


def assert_reads_well(fig) -> None:
    assert fig.get_suptitle() or all(ax.get_title() for ax in fig.axes), "a title"
    for ax in fig.axes:
        assert ax.get_title(), "every panel has a title"
        assert ax.get_xlabel(), f"x axis of {ax.get_title()!r} is labelled"
        has_y = ax.get_ylabel() or any(t.get_text() for t in ax.get_yticklabels())
        assert has_y or not ax.get_yticks().size, f"y axis of {ax.get_title()!r} is labelled"
    assert fig.legends or any(ax.get_legend() for ax in fig.axes), "a legend"
    texts = visible_texts(fig)
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    page = fig.bbox
    for text, box in boxes:
        assert box.x0 >= page.x0 - 1 and box.x1 <= page.x1 + 1, f"{text!r} falls off the figure"
        assert box.y0 >= page.y0 - 1 and box.y1 <= page.y1 + 1, f"{text!r} falls off the figure"
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        overlap_w = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
        overlap_h = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
        assert overlap_w <= 1 or overlap_h <= 1, f"{a!r} overlaps {b!r}"


def visible_texts(fig) -> list[Text]:
    """Every piece of text that is drawn: titles, labels, tick labels in view, annotations,
    legends."""
    texts = [fig._suptitle] if fig._suptitle else []
    texts += fig.texts
    for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
        texts += legend.get_texts()
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick, loc in zip(axis.get_major_ticks(), axis.get_majorticklocs(), strict=False):
                if low - 1e-9 <= loc <= high + 1e-9 and tick.label1.get_visible():
                    texts.append(tick.label1)
    unique = {id(t): t for t in texts}.values()  # the suptitle is in fig.texts too
    return [t for t in unique if t.get_visible() and t.get_text().strip()]
