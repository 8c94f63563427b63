"""minilib.explore.kernel_schedule: the figure of the kernel's schedule (the grid, the double
buffer), and the explorer, whose grid_step menu follows the planned grid."""

from __future__ import annotations

import dataclasses
import re

import pytest

widgets = pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from conftest import schedule_batch  # noqa: E402
from explorer_checks import IPYWIDGETS_7_COMMS, raised, shows_error, shows_figure  # noqa: E402
from figure_checks import assert_reads_well, draw  # noqa: E402

from minilib.errors import RPAInputError  # noqa: E402
from minilib.explore.kernel_schedule import (  # noqa: E402
    ALL_STEPS,
    kernel_schedule_explorer,
    kernel_schedule_figure,
)
from minilib.heads import check_head_counts  # noqa: E402
from minilib.schedule import plan_schedule  # noqa: E402
from minilib.validation import dynamic_validate_inputs  # noqa: E402

pytestmark = pytest.mark.filterwarnings(IPYWIDGETS_7_COMMS)


def planned(**overrides):
    """The batch of the explorer's defaults (conftest's schedule_batch), and its schedule with
    the explorer's default block sizes unless overridden."""
    batch = schedule_batch()
    options = dict(num_kv_pages_per_block=2, num_queries_per_block=8) | overrides
    return batch, plan_schedule(*batch.args(), **options)


# --- the figure ----------------------------------------------------------------------------


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
    _, schedule = planned(**options)
    fig = draw(lambda: kernel_schedule_figure(schedule, step), f"schedule_{step}")
    assert_reads_well(fig)
    grid_ax, time_ax = fig.axes
    assert f"{schedule.grid[0]} heads block" in fig.get_suptitle()
    # one solid compute bar per KV block computed in the step (or in all steps)
    computes = [e for e in schedule.computes()
                if step is None or (e.kernel == "mixed" and e.step == step)]  # fmt: skip
    solid = [p for p in time_ax.patches if p.get_facecolor()[:3] != (1.0, 1.0, 1.0)]
    lane_boxes = [p for p in solid if p.get_y() > 1.5]  # the grid-step lane on top
    assert len(solid) - len(lane_boxes) == len(computes)


def test_schedule_caption_names_a_tile_it_draws():
    for overrides in [{}, {"num_kv_pages_per_block": 1}, {"num_queries_per_block": 32}]:
        _, plan = planned(**overrides)
        fig = kernel_schedule_figure(plan)
        caption = fig.axes[0].get_xlabel()
        named = re.search(r"tile (s(\d+) b(\d+)): sequence \2, KV block \3", caption)
        drawn = {t.get_text() for t in fig.axes[0].texts}
        assert named and named.group(1) in drawn, (caption, sorted(drawn))


# --- the explorer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schedule():
    return kernel_schedule_explorer()


def test_schedule_shows_the_grid_and_steps(schedule):
    _, plan = planned()
    assert shows_figure(schedule)
    assert "grid = (2 heads blocks, 3 q blocks) = 6 grid steps" in schedule.text
    assert f"{len(plan.computes())} KV blocks computed" in schedule.text
    steps = schedule.controls["grid_step"].options
    assert list(steps) == [ALL_STEPS] + [str(s) for s in plan.steps()]
    schedule.controls["grid_step"].value = "(0, 1)"
    assert shows_figure(schedule) and "grid step (0, 1):" in schedule.text
    n = sum(e.kind == "compute" for e in plan.steps()[(0, 1)])
    assert schedule.text.count("compute    slot") == n


def test_schedule_block_sizes(schedule):
    schedule.controls["grid_step"].value = "(0, 2)"
    schedule.controls["num_queries_per_block"].value = "16"  # 2 q blocks: step (0, 2) is gone
    assert "= 4 grid steps" in schedule.text
    assert schedule.controls["grid_step"].value == ALL_STEPS
    schedule.controls["num_kv_pages_per_block"].value = "9"  # more than pages_per_seq=5
    batch, _ = planned()
    err = raised(dynamic_validate_inputs, *batch.args(), num_kv_pages_per_block=9)
    assert shows_error(schedule, err)
    schedule.controls["num_kv_pages_per_block"].value = "lots"
    assert "'lots' is not a whole number" in schedule.text
    schedule.controls["num_kv_pages_per_block"].value = ""  # the kernel's default
    assert shows_figure(schedule)
    schedule.controls["num_kv_pages_per_block"].value = "2"
    schedule.controls["num_queries_per_block"].value = "8"
    assert shows_figure(schedule) and "= 6 grid steps" in schedule.text


def test_schedule_grid_step_menu_follows_the_grid():
    ex = kernel_schedule_explorer()
    ex.controls["grid_step"].value = "(0, 1)"
    ex.controls["num_queries_per_block"].value = "16"  # a smaller grid that still has (0, 1)
    _, plan = planned(num_queries_per_block=16)
    assert list(ex.controls["grid_step"].options) == [ALL_STEPS] + [str(s) for s in plan.steps()]
    assert ex.controls["grid_step"].value == "(0, 1)" and "grid step (0, 1):" in ex.text
    ex.controls["num_kv_heads"].value = 6  # no plan: the menu offers all steps, the view why
    assert list(ex.controls["grid_step"].options) == [ALL_STEPS]
    assert shows_error(ex, raised(check_head_counts, 16, 6))


def test_schedule_bad_heads(schedule):
    schedule.controls["num_kv_heads"].value = 6
    assert shows_error(schedule, raised(check_head_counts, 16, 6))
    schedule.controls["num_kv_heads"].value = 8
    assert shows_figure(schedule)


def test_schedule_bad_lengths(schedule):
    """A kv_len shorter than its q_len, or negative: the validator's message, as the kernel
    gives it (not make_batch's)."""
    batch = schedule_batch()  # q_lens 12, 1, 6, 1
    cases = [
        ("10, 40, 30, 9", 0, 10, "q_len=12 must be less or equal to kv_len=10 at sequence 0."),
        ("12, 40, -3, 9", 2, -3, "kv_lens[2]=-3 must be non-negative."),
    ]
    for kv_lens, i, kv_len, message in cases:
        schedule.controls["kv_lens"].value = kv_lens
        typed = dataclasses.replace(batch, kv_lens=batch.kv_lens.at[i].set(kv_len))
        err = raised(dynamic_validate_inputs, *typed.args())
        assert isinstance(err, RPAInputError) and err.message == message
        assert shows_error(schedule, err), schedule.text
    schedule.controls["kv_lens"].value = "12, 40, 30, 9"
    assert shows_figure(schedule)


def test_schedule_is_planned_once_per_change(monkeypatch):
    """The grid_step menu and the render need the same plan: it is made once per change, and
    a problem that stops it is found once too."""
    from minilib.explore import kernel_schedule

    calls = []
    plan = kernel_schedule._plan
    monkeypatch.setattr(kernel_schedule, "_plan", lambda *a: calls.append(a) or plan(*a))
    kernel_schedule._planned.cache_clear()
    ex = kernel_schedule_explorer()
    assert len(calls) == 1 and shows_figure(ex)
    ex.controls["num_queries_per_block"].value = "16"  # the menu changes with the plan
    assert len(calls) == 2 and "= 4 grid steps" in ex.text
    ex.controls["grid_step"].value = "(1, 1)"  # a step of the same plan: nothing to plan
    assert len(calls) == 2 and "grid step (1, 1):" in ex.text
    ex.controls["num_kv_heads"].value = 6  # no plan: its problem is found once
    assert len(calls) == 3 and shows_error(ex, raised(check_head_counts, 16, 6))
