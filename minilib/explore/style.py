"""What every figure of the course shares: the palette, the figure itself, boxes and their labels.

    OKABE_ITO, FILLS, GREY, ...     the colours (Okabe-Ito: safe with colour blindness)
    color(i), hatch(i)              the fill and hatching of item i (a group, a sequence)
    new_figure, figure_png          a figure without pyplot, and its PNG bytes
    rectangle, box_label            a box on an axes, and the text centred in it
    fit_labels                      shrink or hide what does not fit, then freeze the layout

The figures are `matplotlib.figure.Figure`s, not `pyplot` ones, so drawing one never opens a
window or leaves a figure behind; in a notebook a returned figure shows itself.
"""

from __future__ import annotations

import io
import math

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

__all__ = [
    "FAINT",
    "FILLS",
    "GREY",
    "LIGHT_GREY",
    "OKABE_ITO",
    "NotebookFigure",
    "box_label",
    "clean",
    "color",
    "darker",
    "figure_png",
    "fit_labels",
    "hatch",
    "ink",
    "int_ticks",
    "legend_patch",
    "new_figure",
    "rectangle",
    "shade",
    "tint",
]

# --- colours ---------------------------------------------------------------------------------

# Okabe & Ito (2008), "Color Universal Design". Black is left out of the fills: text on it and
# on its neighbours would be hard to read.
OKABE_ITO = {
    "orange": "#E69F00",
    "sky blue": "#56B4E9",
    "bluish green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish purple": "#CC79A7",
    "black": "#000000",
}
FILLS = [c for name, c in OKABE_ITO.items() if name != "black"]  # 7 colours, then they repeat
GREY, LIGHT_GREY, FAINT = "#7F7F7F", "#D9D9D9", "#F2F2F2"
# When colours repeat (more than 7 groups), the hatching changes, so groups stay apart.
REPEAT_HATCHES = ["", "//", "\\\\", ".."]


def color(i: int) -> str:
    """The fill colour of item `i` (a group, a sequence, a request): Okabe-Ito, repeating
    every 7.

    >>> color(0), color(1), color(7)
    ('#E69F00', '#56B4E9', '#E69F00')
    """
    return FILLS[i % len(FILLS)]


def hatch(i: int) -> str:
    """The hatching of item `i`: none for the first 7, then a new pattern each time the
    colours repeat: item 7 has item 0's colour, told apart by its hatching.

    >>> hatch(0), hatch(6), hatch(7)
    ('', '', '//')
    """
    return REPEAT_HATCHES[(i // len(FILLS)) % len(REPEAT_HATCHES)]


def legend_patch(i: int, label: str) -> Patch:
    """A legend entry in item `i`'s colour and hatching.

    >>> legend_patch(7, "seq 7").get_hatch()
    '//'
    """
    return Patch(facecolor=color(i), hatch=hatch(i), edgecolor="white", label=label)


def ink(face) -> str:
    """The text colour that reads better on `face`: black on light colours, white on dark.

    >>> ink(OKABE_ITO["yellow"]), ink(OKABE_ITO["blue"])
    ('black', 'white')
    """
    r, g, b = to_rgb(face)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.4 else "white"


def tint(face, amount: float) -> tuple[float, float, float]:
    """`face` mixed with `amount` of white.

    >>> tint("#000000", 0.5)
    (0.5, 0.5, 0.5)
    """
    return tuple(c + (1 - c) * amount for c in to_rgb(face))


def shade(face) -> tuple[float, float, float]:
    """`face` a little darker: hatching in it stays visible on white, even for yellow.

    >>> shade("#FFFFFF")
    (0.8, 0.8, 0.8)
    """
    return tuple(0.8 * c for c in to_rgb(face))


def darker(face) -> tuple[float, float, float]:
    """`face` darkened enough to read as text on white.

    >>> darker("#FFFFFF")
    (0.6, 0.6, 0.6)
    """
    return tuple(0.6 * c for c in to_rgb(face))


# --- the figure ------------------------------------------------------------------------------


class NotebookFigure(Figure):
    """A matplotlib `Figure` that shows itself as a PNG when it ends a notebook cell, with or
    without pyplot's inline backend.

    >>> fig = new_figure(2, 1)
    >>> isinstance(fig, NotebookFigure), fig._repr_png_() == figure_png(fig)
    (True, True)
    """

    def _repr_png_(self) -> bytes:
        return figure_png(self)


def new_figure(width: float, height: float) -> NotebookFigure:
    """A figure of `width` x `height` inches with its own Agg canvas: no pyplot, no window,
    nothing left behind.

    >>> new_figure(11, 3.9).get_size_inches().tolist()
    [11.0, 3.9]
    """
    fig = NotebookFigure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (for `ipywidgets.Image`, or to save).

    >>> figure_png(new_figure(2, 1))[:8]
    b'\\x89PNG\\r\\n\\x1a\\n'
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return buf.getvalue()


def clean(ax) -> None:
    """No tick marks and no frame: for axes of boxes, where the boxes are the picture.

    >>> ax = new_figure(2, 1).add_subplot()
    >>> clean(ax)
    >>> any(spine.get_visible() for spine in ax.spines.values())
    False
    """
    ax.tick_params(length=0)
    for side in ax.spines:
        ax.spines[side].set_visible(False)


def int_ticks(n: int, most: int) -> list[int]:
    """At most `most` round integer ticks in [0, n).

    >>> int_ticks(20, 6), int_ticks(1, 6)
    ([0, 5, 10, 15], [0])
    """
    if n <= 1:
        return [0]
    step = max(1, math.ceil((n - 1) / (most - 1)))
    step = next(s for s in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, step) if s >= step)
    return list(range(0, n, step))


# --- boxes and their labels ------------------------------------------------------------------

# Measuring a label means drawing it, so `fit_labels` first estimates its size from its
# characters; the estimate settles the clear cases (most of them) without drawing.
LABEL_POINTS = (8, 7, 6)  # a label's font sizes: drawn at 8 pt, shrunk to 7 or 6, else hidden
GLYPH_WIDTH = 0.65  # average width of a character, as a fraction of the font size
LINE_HEIGHT = 1.25  # height of one line of text, as a multiple of the font size
WIDTH_ERROR, HEIGHT_ERROR = 0.2, 0.1  # how far off the estimate can be (a fraction of it)
# Pixels a label keeps clear of its box's sides (half as many above and below): a label on a
# background of its own needs more room.
BACKED_PADDING, PLAIN_PADDING = 8, 2


def rectangle(ax, x, y, width, height, face, hatch_pattern="", edge="white") -> Rectangle:
    """A rectangle on `ax` whose left edge is x and whose vertical centre is y.

    >>> ax = new_figure(2, 1).add_subplot()
    >>> rectangle(ax, 2, 0, 3, 0.8, color(0)).get_xy()
    (2, -0.4)
    """
    box = Rectangle(
        (x, y - height / 2),
        width,
        height,
        facecolor=face,
        edgecolor=edge,
        hatch=hatch_pattern or None,
        linewidth=1.0,
    )
    ax.add_artist(box)  # not add_patch, which would also update limits set by hand
    return box


def box_label(ax, box: Rectangle, text: str, face, backed: bool | None = None):
    """Text centred in `box`, black or white, whichever reads better on `face`. On a hatched
    box (or with `backed=True`) the text gets a small background of its own.

    >>> ax = new_figure(2, 1).add_subplot()
    >>> box = rectangle(ax, 0, 0, 1, 0.8, OKABE_ITO["blue"])
    >>> label = box_label(ax, box, "seq 0", OKABE_ITO["blue"])
    >>> label.get_position(), label.get_color()
    ((0.5, 0.0), 'white')
    """
    x, y = box.get_x() + box.get_width() / 2, box.get_y() + box.get_height() / 2
    backed = bool(box.get_hatch()) if backed is None else backed
    bbox = dict(facecolor=face, edgecolor="none", pad=1.0) if backed else None
    size = LABEL_POINTS[0]
    label = ax.text(x, y, text, ha="center", va="center", fontsize=size, color=ink(face), bbox=bbox)
    label.set_in_layout(False)  # it stays inside its box: the layout need not measure it
    return label


def fit_labels(fig: Figure, labels, tick_axes=()) -> None:
    """Make the text of `fig` fit: settle the layout, shrink or hide each label in `labels`
    (`(text, box)` pairs) that overflows its box, blank tick labels that would overlap the one
    before on each `(ax, "x" or "y")` of `tick_axes`. Then freeze the layout, so that saving
    the figure moves nothing.

    >>> fig = new_figure(2, 1)
    >>> ax = fig.add_subplot()
    >>> narrow = rectangle(ax, 0, 0, 0.02, 0.8, "white")
    >>> label = box_label(ax, narrow, "a label too long for its box", "white")
    >>> fit_labels(fig, [(label, narrow)])
    >>> label.get_visible()
    False
    """
    fig.get_layout_engine().execute(fig)  # places the axes, so the sizes below are final
    renderer = fig.canvas.get_renderer()
    for text, box in labels:
        _shrink_or_hide(text, box.get_window_extent(renderer), renderer)
    for ax, which in tick_axes:
        _thin_tick_labels(ax.xaxis if which == "x" else ax.yaxis, renderer)
    fig.set_layout_engine("none")


def _estimated_size(text, points: float, renderer) -> tuple[float, float]:
    """Width and height in pixels of `text` drawn at `points`, from its characters alone."""
    lines = text.get_text().split("\n")
    pixels = points * renderer.points_to_pixels(1.0)
    return max(len(line) for line in lines) * GLYPH_WIDTH * pixels, len(
        lines
    ) * LINE_HEIGHT * pixels


def _shrink_or_hide(text, room, renderer) -> None:
    """The largest of `LABEL_POINTS` at which `text` fits in `room` (a pixel extent), or
    hidden if it fits at none."""
    wide, tall = _estimated_size(text, LABEL_POINTS[0], renderer)
    clearly_fits = (
        wide * (1 + WIDTH_ERROR) < room.width - BACKED_PADDING
        and tall * (1 + HEIGHT_ERROR) < room.height - BACKED_PADDING / 2
    )
    if clearly_fits:
        return  # at the first size, as drawn
    narrowest, _ = _estimated_size(text, LABEL_POINTS[-1], renderer)
    if narrowest * (1 - WIDTH_ERROR) > room.width:
        text.set_visible(False)  # clearly too wide, even at the smallest size
        return
    padding = BACKED_PADDING if text.get_bbox_patch() else PLAIN_PADDING
    for size in LABEL_POINTS:
        text.set_fontsize(size)
        drawn = text.get_window_extent(renderer)
        if drawn.width <= room.width - padding and drawn.height <= room.height - padding / 2:
            return
    text.set_visible(False)


def _thin_tick_labels(axis, renderer) -> None:
    """Blank each tick label of `axis` that would overlap the last one kept."""
    ticks, texts = list(axis.get_majorticklocs()), axis.get_majorticklabels()
    kept, last = [], None
    for text in texts:
        extent = text.get_window_extent(renderer).padded(2)
        if last is not None and extent.overlaps(last):
            kept.append("")
        else:
            kept.append(text.get_text())
            last = extent
    axis.set_ticks(ticks, kept)
