"""minilib.explore.style: the palette, figures that show themselves, and labels that fit their
boxes (shrunk, then hidden) with tick labels that do not overlap."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from minilib.explore import style  # noqa: E402
from minilib.explore.style import box_label, fit_labels, new_figure, rectangle  # noqa: E402


def test_palette_is_okabe_ito():
    assert style.FILLS == [
        "#E69F00",
        "#56B4E9",
        "#009E73",
        "#F0E442",
        "#0072B2",
        "#D55E00",
        "#CC79A7",
    ]
    # After 7 colours they repeat, with a new hatching, so item 7 differs from item 0.
    assert style.color(7) == style.color(0) and style.hatch(7) != style.hatch(0)


def test_figures_show_themselves_in_a_notebook():
    from minilib.explore.head_grouping import head_grouping_figure

    fig = head_grouping_figure(8, 2)
    assert fig._repr_png_().startswith(b"\x89PNG")  # what IPython calls, with or without pyplot


def test_text_is_black_on_light_fills_and_white_on_dark_ones():
    assert style.ink("white") == "black" and style.ink("black") == "white"
    assert [style.ink(c) for c in style.FILLS[:4]] == ["black"] * 4  # orange .. yellow


# --- labels that fit -----------------------------------------------------------------------


def labelled_box(width: float):
    """A figure with one box `width` data units wide (of 40) and the label "seq 12" in it."""
    fig = new_figure(4, 1)
    ax = fig.add_subplot()
    ax.set_xlim(0, 40)
    ax.set_ylim(-1, 1)
    box = rectangle(ax, 0, 0, width, 1.5, "white")
    return fig, box, box_label(ax, box, "seq 12", "white")


def fits(label, box, renderer, size) -> bool:
    label.set_fontsize(size)
    label.set_visible(True)  # a hidden text measures as nothing
    drawn, room = label.get_window_extent(renderer), box.get_window_extent(renderer)
    return drawn.width <= room.width - style.PLAIN_PADDING and drawn.height <= room.height


def test_each_label_is_drawn_at_the_largest_size_that_fits_or_hidden():
    outcomes = set()
    for width in (1, 2, 3, 3.25, 3.5, 3.75, 4, 4.5, 5, 8):
        fig, box, label = labelled_box(width)
        fit_labels(fig, [(label, box)])
        renderer = fig.canvas.get_renderer()
        size, visible = label.get_fontsize(), label.get_visible()
        if visible:
            assert fits(label, box, renderer, size), width
            larger = [s for s in style.LABEL_POINTS if s > size]
            assert not any(fits(label, box, renderer, s) for s in larger), width
            outcomes.add(size)
        else:
            assert not fits(label, box, renderer, style.LABEL_POINTS[-1]), width
            outcomes.add("hidden")
    assert outcomes == {8, 7, 6, "hidden"}, "every outcome is reached by some width"


def test_overlapping_tick_labels_are_thinned_and_the_layout_frozen():
    fig = new_figure(3, 1)
    ax = fig.add_subplot()
    ax.set_xlim(0, 100)
    ax.set_xticks(range(0, 101, 2), [f"tick {t}" for t in range(0, 101, 2)])
    fit_labels(fig, [], [(ax, "x")])
    renderer = fig.canvas.get_renderer()
    kept = [t for t in ax.get_xticklabels() if t.get_text()]
    assert 1 < len(kept) < 51 and kept[0].get_text() == "tick 0"
    extents = [t.get_window_extent(renderer) for t in kept]
    assert not any(a.overlaps(b) for a, b in zip(extents, extents[1:], strict=False))
    where = ax.get_position().bounds
    style.figure_png(fig)  # saving draws the figure again: nothing moves
    assert ax.get_position().bounds == where
