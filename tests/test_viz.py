"""The figures of minilib.explore.figures: each draws without a warning, and reads well.

"Reads well" is checked, not eyeballed: every axes has a title and labelled axes, the figure
has a legend, no two pieces of text overlap, and no text falls off the figure.

Set MINILIB_VIZ_DIR=/some/dir to also save every figure drawn here as a PNG, to look at.
"""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path

import pytest
from conftest import schedule_batch

pytest.importorskip("matplotlib")

from matplotlib.text import Text  # noqa: E402

from minilib.batch import make_batch  # noqa: E402
from minilib.errors import RPAInputError  # noqa: E402
from minilib.explore import figures as viz  # noqa: E402

# --- what every figure must satisfy --------------------------------------------------------


def draw(make, name: str):
    """Build a figure and render it to PNG with every warning an error; save it if asked."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = make()
        png = viz.figure_png(fig)
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


def test_figures_show_themselves_in_a_notebook():
    fig = viz.head_grouping_figure(8, 2)
    assert fig._repr_png_().startswith(b"\x89PNG")  # what IPython calls, with or without pyplot


# --- the palette ---------------------------------------------------------------------------


def test_palette_is_okabe_ito():
    assert viz.FILLS == [
        "#E69F00",
        "#56B4E9",
        "#009E73",
        "#F0E442",
        "#0072B2",
        "#D55E00",
        "#CC79A7",
    ]
    # After 7 colours they repeat, with a new hatching, so item 7 differs from item 0.
    assert viz.color(7) == viz.color(0) and viz.hatch(7) != viz.hatch(0)


# --- head grouping -------------------------------------------------------------------------


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(12, 4), (8, 8), (12, 1), (64, 16), (1, 1)])
def test_head_grouping_figure(num_q_heads, num_kv_heads):
    fig = draw(
        lambda: viz.head_grouping_figure(num_q_heads, num_kv_heads),
        f"heads_{num_q_heads}_{num_kv_heads}",
    )
    assert_reads_well(fig)
    title = fig.axes[0].get_title()
    assert f"{num_q_heads} q head" in title and f"{num_kv_heads} KV head" in title


def test_head_grouping_figure_shows_the_layout():
    fig = viz.head_grouping_figure(12, 4)
    shown = {t.get_text() for t in fig.axes[0].texts if t.get_visible()}
    assert {"q0", "q11", "KV 0", "KV 3", "K0\nslot 0", "V3\nslot 7"} <= shown


def test_head_grouping_figure_rejects_an_invalid_pair_with_the_validators_message():
    with pytest.raises(RPAInputError, match="num_q_heads=12 must be divisible by num_kv_heads=8"):
        viz.head_grouping_figure(12, 8)


# --- the paged KV cache --------------------------------------------------------------------


def test_slot_usage():
    usage = viz.slot_usage([37, 5, 120], page_size=16)
    assert (usage.tokens, usage.paged_slots, usage.paged_wasted) == (162, 192, 30)
    assert (usage.contiguous_slots, usage.contiguous_wasted) == (360, 198)
    assert viz.slot_usage([], page_size=16).paged_slots == 0


@pytest.mark.parametrize(
    "kv_lens, page_size, total, order",
    [
        ([37, 5, 120], 16, 24, "in order"),
        ([37, 5, 120, 64], 16, 30, "shuffled"),
        ([37, 5, 120], 16, 24, "after some frees"),
        ([90, 1, 17, 60, 50], 4, 64, "shuffled"),
        ([0, 3], 1, 4, "in order"),
    ],
)
def test_page_table_figure(kv_lens, page_size, total, order):
    from minilib.kv_cache import fill_cache

    cache, ids = fill_cache(kv_lens, page_size=page_size, total_num_pages=total, order=order)
    fig = draw(
        lambda: viz.page_table_figure(cache, ids),
        f"pages_{order.replace(' ', '_')}_{len(kv_lens)}_{total}",
    )
    assert_reads_well(fig)
    assert f"total_num_pages={total}" in fig.axes[0].get_title()


# --- the ragged batch ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq_lens, window, padding",
    [
        ([(6, 6), (1, 20), (4, 12), (1, 9)], 5, None),
        ([(6, 6), (1, 20), (4, 12), (1, 9)], None, 16),
        ([(60, 60), (1, 200), (40, 120), (1, 9), (1, 3), (7, 7), (3, 30), (2, 2), (1, 1)], 8, 128),
        ([(0, 5), (1, 1)], None, None),
    ],
)
def test_ragged_batch_figure(seq_lens, window, padding):
    batch = make_batch(seq_lens, max_num_batched_tokens=padding)
    fig = draw(lambda: viz.ragged_batch_figure(batch, window), f"ragged_{len(seq_lens)}_{window}")
    assert_reads_well(fig)
    assert len(fig.axes) == 1 + min(len(seq_lens), viz.MAX_MASKS)


def test_mask_numpy_is_the_causal_mask():
    import numpy as np

    from minilib.masking import causal_mask

    for q_len, kv_len in [(1, 9), (4, 12), (7, 7), (0, 3)]:
        for window in (None, 1, 3, 50):
            want = np.asarray(causal_mask(q_len, kv_len, window))
            np.testing.assert_array_equal(viz.mask_numpy(q_len, kv_len, window), want)


def test_ragged_batch_figure_draws_the_reference_mask():
    import numpy as np

    from minilib.masking import causal_mask

    batch = make_batch([(4, 12)])
    fig = viz.ragged_batch_figure(batch, sliding_window=3)
    image = fig.axes[1].get_images()[0].get_array()
    # 0 may attend, 1 a future key, 2 a key older than the window.
    assert ((image == 0) == ~np.asarray(causal_mask(4, 12, 3))).all()
    assert (image[0, :6] == 2).all() and (image[0, 9:] == 1).all()


# --- the kernel schedule -------------------------------------------------------------------


def _schedule(**options):
    from minilib.schedule import plan_schedule

    return plan_schedule(*schedule_batch().args(), **options)


@pytest.mark.parametrize(
    "options, step",
    [
        (dict(num_kv_pages_per_block=2, num_queries_per_block=8), None),
        (dict(num_kv_pages_per_block=2, num_queries_per_block=8), (0, 1)),
        (dict(num_kv_pages_per_block=1, num_queries_per_block=4, sliding_window=5), (1, 2)),
        (dict(num_kv_pages_per_block=1, num_queries_per_block=4), None),
    ],
)
def test_kernel_schedule_figure(options, step):
    schedule = _schedule(**options)
    fig = draw(lambda: viz.kernel_schedule_figure(schedule, step), f"schedule_{step}")
    assert_reads_well(fig)
    grid_ax, time_ax = fig.axes
    assert f"{schedule.grid[0]} heads block" in fig.get_suptitle()
    # one solid compute bar per KV block computed in the step (or in all steps)
    computes = [e for e in schedule.computes() if step is None or e.step == step]
    solid = [p for p in time_ax.patches if p.get_facecolor()[:3] != (1.0, 1.0, 1.0)]
    lane_boxes = [p for p in solid if p.get_y() > 1.5]  # the grid-step lane on top
    assert len(solid) - len(lane_boxes) == len(computes)
