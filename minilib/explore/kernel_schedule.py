"""The Pallas kernel's schedule: its grid, the KV blocks each grid step computes, and the double
buffer that feeds them, as a figure and an explorer. The one-token sequences are the decode
kernel's, which runs first: they have lanes of their own under the grid, and their ticks come
first in the double buffer.

    kernel_schedule_figure(schedule, step)   the grid, then the two VMEM slots over time
    kernel_schedule_explorer()               the schedule of your batch and block sizes

    >>> ex = kernel_schedule_explorer(q_lens="12, 1, 6, 1", kv_lens="12, 40, 30, 9")
    >>> ex.text.split(";")[0]
    'grid = (2 heads blocks, 3 q blocks) = 6 grid steps'
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from minilib.errors import InputProblem, ScheduleTooBig
from minilib.explore import style
from minilib.explore.explorer import (
    Explorer,
    check_at_least,
    check_at_most,
    dropdown,
    int_input,
    parse_optional_int,
    parse_q_and_kv_lens,
    text_input,
    typed_batch,
)
from minilib.explore.text import plural, pre, span, table
from minilib.heads import valid_num_kv_heads

__all__ = [
    "ALL_STEPS",
    "HEAD_DIM",
    "MAX_COMPUTES",
    "MAX_GRID_STEPS",
    "MAX_HEADS",
    "MAX_KV_LEN",
    "MAX_PAGE_SIZE",
    "MAX_SEQS",
    "MAX_TOKENS",
    "PLAN_INPUTS",
    "kernel_schedule_explorer",
    "kernel_schedule_figure",
]

# What the explorer plans and draws at most: a bigger input gets a message at once, not a
# slow figure. `_check_limits` checks the first five before anything is built or planned;
# `plan_schedule` counts the last two (they depend on the kernel's block sizes) before it
# lists any step.
MAX_SEQS = 16
MAX_TOKENS = 4096  # q rows in all
MAX_HEADS = 256  # q heads
MAX_PAGE_SIZE = 4096
MAX_KV_LEN = 8192
MAX_GRID_STEPS = 256  # grid steps: one entry each in the grid_step menu
MAX_COMPUTES = 400  # KV blocks computed: one tile each in the figure

ALL_STEPS = "all grid steps"  # the grid_step menu's first entry: no zoom
HEAD_DIM = 128  # q and kv_pages are shapes only (float32), so heads cost no memory
# The controls the schedule is planned from (all but grid_step, which picks a step to show).
PLAN_INPUTS = (
    "q_lens",
    "kv_lens",
    "num_q_heads",
    "num_kv_heads",
    "page_size",
    "num_kv_pages_per_block",
    "num_queries_per_block",
    "sliding_window",
)


# --- the figure ------------------------------------------------------------------------------


def kernel_schedule_figure(schedule, step: tuple[int, int] | None = None) -> Figure:
    """A `minilib.schedule.Schedule` drawn in two panels.

    Top, the grid: one row per heads block, one column per q block of
    `num_queries_per_block` rows, under each sequence's rows in the mixed kernel's q (where
    a sequence starts on a q block while the padding fits). In each grid step,
    one tile per KV block the kernel computes there, coloured by sequence (s1 b2: sequence 1,
    KV block 2). Below, a lane per heads block of the decode kernel: each one-token sequence's
    KV blocks at its row.

    Bottom, the double buffer over time: at each tick the kernel computes one KV block out of
    one VMEM slot (solid) while the DMA engine copies the next KV block into the other slot
    (hatched). `step=(heads_blk, q_blk)` zooms in on one grid step (outlined on the grid).

    >>> from minilib.batch import make_batch
    >>> from minilib.schedule import plan_schedule
    >>> s = plan_schedule(*make_batch([(5, 5), (1, 20)], page_size=8).args(),
    ...                   num_kv_pages_per_block=1, num_queries_per_block=4)
    >>> fig = kernel_schedule_figure(s, step=(0, 1))
    >>> fig.get_suptitle()
    'Kernel schedule: grid = 1 heads block x 2 q blocks, 5 KV blocks computed'
    """
    num_heads_blocks, num_q_blocks = schedule.grid
    lanes = num_heads_blocks + _decode_lanes(schedule)
    fig = style.new_figure(11, 3.9 + 0.55 * lanes)
    grid_ax, time_ax = fig.subplots(2, 1, height_ratios=[1.2 + 0.55 * lanes, 2.2])
    labels = _draw_grid(grid_ax, schedule, step)
    labels += _draw_double_buffer(time_ax, schedule, step)
    seqs = sorted({e.seq for e in schedule.computes()})
    handles = [style.legend_patch(s, f"seq {s}") for s in seqs[:12]]
    handles += [
        Patch(facecolor=style.GREY, edgecolor="white", label="compute: reads the slot"),
        Patch(
            facecolor="white", edgecolor=style.GREY, hatch="////", label="DMA: copies into the slot"
        ),
    ]
    grid_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(
        f"Kernel schedule: grid = {plural(num_heads_blocks, 'heads block')} x "
        f"{plural(num_q_blocks, 'q block')}, "
        f"{len(schedule.computes())} KV blocks computed"
    )
    style.fit_labels(fig, labels, [(grid_ax, "x"), (time_ax, "x")])
    return fig


def _decode_lanes(schedule) -> int:
    """Lanes for the decode kernel under the grid: one per heads block, if it computes."""
    return schedule.decode_grid[0] if any(e.kernel == "decode" for e in schedule.events) else 0


def _draw_grid(ax, schedule, selected) -> list:
    """Heads blocks down, q blocks across (in q rows), the computes of each step as tiles;
    under them the decode kernel's lanes."""
    num_heads_blocks, num_q_blocks = schedule.grid
    bq = schedule.num_queries_per_block
    labels = []
    # Each sequence's rows in the mixed kernel's q, on top (padding included).
    rows = {e.seq: schedule.mixed_q_rows[e.seq] for e in schedule.computes() if e.kernel == "mixed"}
    for seq, (start, end) in rows.items():
        box = style.rectangle(ax, start, 0, end - start, 0.7, style.color(seq), style.hatch(seq))
        labels.append((style.box_label(ax, box, f"seq {seq}", style.color(seq)), box))
    # The grid steps, with a tile per KV block computed.
    widest = None  # (width, compute) of a widest tile: the one the axis label names
    for (h, q_blk), events in schedule.steps().items():
        computes = [e for e in events if e.kind == "compute"]
        y, x0 = -(h + 1), q_blk * bq
        edge = style.OKABE_ITO["black"] if (h, q_blk) == selected else style.GREY
        cell = style.rectangle(ax, x0, y, bq, 0.8, "white", edge=edge)
        cell.set_linewidth(2.5 if (h, q_blk) == selected else 1.0)
        if not computes:
            labels.append((style.box_label(ax, cell, "no rows", "white"), cell))
        width = bq / max(len(computes), 1)
        for k, e in enumerate(computes):
            tile = style.rectangle(
                ax, x0 + k * width, y, width, 0.64, style.color(e.seq), style.hatch(e.seq)
            )
            labels.append(
                (style.box_label(ax, tile, f"s{e.seq} b{e.kv_blk}", style.color(e.seq)), tile)
            )
            if widest is None or width > widest[0]:
                widest = (width, e)
    decode_lanes = _decode_lanes(schedule)
    labels += _draw_decode_lanes(ax, schedule, -(num_heads_blocks + 1))
    ax.set_xlim(0, num_q_blocks * bq)
    ax.set_ylim(-num_heads_blocks - decode_lanes - 0.5, 0.5)
    q_heads, kv_heads = schedule.num_q_heads_per_block, schedule.num_kv_heads_per_block
    ax.set_yticks(
        [0] + [-(h + 1) for h in range(num_heads_blocks + decode_lanes)],
        ["q rows"]
        + [
            f"heads block {h}\nq heads {span(range(h * q_heads, (h + 1) * q_heads))}, "
            f"KV heads {span(range(h * kv_heads, (h + 1) * kv_heads))}"
            for h in range(num_heads_blocks)
        ]
        + [f"decode kernel,\nheads block {h}" for h in range(decode_lanes)],
        fontsize=8,
    )
    ticks = list(range(0, num_q_blocks * bq + 1, bq))
    ax.set_xticks(ticks, [str(t) for t in ticks])
    example = ""
    if widest is not None:
        e = widest[1]
        example = f" (tile s{e.seq} b{e.kv_blk}: sequence {e.seq}, KV block {e.kv_blk})"
    ax.set_xlabel(
        f"q row; grid axis 1 cuts them into q blocks of num_queries_per_block={bq} rows{example}"
    )
    ax.set_title(
        f"The grid: a tile per KV block computed (num_kv_pages_per_block="
        f"{schedule.num_kv_pages_per_block}: {plural(schedule.kv_tokens_per_block, 'token')})",
        fontsize=10,
    )
    style.clean(ax)
    return labels


def _draw_decode_lanes(ax, schedule, y_first: int) -> list:
    """The decode kernel's computes: a lane per heads block, each sequence's KV blocks as
    tiles over its one q row."""
    labels = []
    for h in range(_decode_lanes(schedule)):
        computes = [e for e in schedule.computes() if e.kernel == "decode" and e.heads_blk == h]
        for seq, tiles in itertools.groupby(computes, key=lambda e: e.seq):
            tiles = list(tiles)
            width = 1 / len(tiles)
            for k, e in enumerate(tiles):
                x = e.q_rows[0] + k * width
                tile = style.rectangle(
                    ax, x, y_first - h, width, 0.64, style.color(seq), style.hatch(seq)
                )
                labels.append(
                    (style.box_label(ax, tile, f"s{seq} b{e.kv_blk}", style.color(seq)), tile)
                )
    return labels


def _draw_double_buffer(ax, schedule, selected) -> list:
    """Two VMEM slots over time, one tick per KV block computed: the compute reads one slot
    (solid) while the copy of the next KV block fills the other (hatched). On top, the grid
    step each tick belongs to."""
    pairs = schedule.in_flight()  # tick t: (the t-th compute, the copy running meanwhile)
    computed = [
        t
        for t, (c, _) in enumerate(pairs)
        if selected is None or (c.kernel == "mixed" and c.step == selected)
    ]
    # The tick before the first compute is shown too: the copy feeding it runs then. Before
    # tick 0 that is tick -1, the very first copy, with nothing to compute meanwhile.
    shown = [computed[0] - 1, *computed] if computed else []
    first_copy = next((e for e in schedule.events if e.kind == "start"), None)
    copies = [(t, pairs[t][1] if t >= 0 else first_copy) for t in shown]
    steps = [(t, _step_name(pairs[t][0])) for t in shown if t >= 0]

    labels = []
    for t, copy in copies:
        if copy is not None:
            labels.append(_slot_bar(ax, t, copy, copying=True))
    for t in computed:
        labels.append(_slot_bar(ax, t, pairs[t][0], copying=False))
    labels += _draw_step_lane(ax, steps)
    if not computed:
        ax.text(
            0.5,
            0.5,
            "no KV blocks in this grid step",
            transform=ax.transAxes,
            ha="center",
            va="center",
        )
    first, last = (shown[0], shown[-1]) if shown else (-1, 0)
    ax.set_xlim(first - 0.6, last + 0.6)
    ax.set_ylim(-0.5, 2.5)
    ax.set_yticks([2, 1, 0], ["grid step\n(heads blk, q blk)", "VMEM slot 0", "VMEM slot 1"])
    ax.set_xticks(_int_ticks_between(first, last, 12))
    where = "all grid steps" if selected is None else f"grid step {selected}"
    ax.set_xlabel(
        "tick t: the t-th KV block computed (t = -1: the first copy, nothing to hide it)"
        if first < 0
        else "tick t: the t-th KV block computed"
    )
    ax.set_title(
        f"Double buffering, {where}: compute from one slot while the next KV block "
        "is copied into the other",
        fontsize=10,
    )
    style.clean(ax)
    return labels


def _slot_bar(ax, t: int, event, copying: bool) -> tuple:
    """The bar of a compute (solid) or a copy (hatched) at tick t, on its slot's row (slot 0
    above slot 1), and its label: the (label, bar) pair `fit_labels` takes."""
    face = style.color(event.seq)
    y = 1 - event.slot
    if copying:
        bar = style.rectangle(ax, t - 0.46, y, 0.92, 0.6, "white", "////", style.shade(face))
        label = style.box_label(ax, bar, f"s{event.seq} b{event.kv_blk}", "white", True)
    else:
        bar = style.rectangle(ax, t - 0.46, y, 0.92, 0.6, face, style.hatch(event.seq))
        label = style.box_label(ax, bar, f"s{event.seq} b{event.kv_blk}", face)
    return label, bar


def _step_name(event) -> str:
    """A grid step as the step lane names it: "(0, 1)", or "decode (0, 0)"."""
    return f"{event.step}" if event.kernel == "mixed" else f"decode {event.step}"


def _draw_step_lane(ax, steps: list[tuple[int, str]]) -> list:
    """The top lane: a box over each run of ticks of one grid step, labelled with the step.
    `steps` holds (tick, grid step name) pairs, in tick order."""
    labels = []
    for i, (name, run) in enumerate(itertools.groupby(steps, key=lambda tick_step: tick_step[1])):
        ticks = [t for t, _ in run]
        fill = style.FAINT if i % 2 == 0 else style.LIGHT_GREY  # neighbours alternate
        box = style.rectangle(ax, ticks[0] - 0.48, 2, ticks[-1] + 1 - ticks[0] - 0.04, 0.6, fill)
        labels.append((style.box_label(ax, box, name, fill), box))
    return labels


def _int_ticks_between(lo: int, hi: int, most: int) -> list[int]:
    """About `most` round integer ticks from lo to hi (multiples of a round step), and -1 if
    lo is -1 (the tick of the first copy)."""
    step = style.int_ticks(hi - lo + 1, most)[1:2] or [1]
    ticks = [t for t in range(lo, hi + 1) if t % step[0] == 0]
    return [-1, *ticks] if lo == -1 and step[0] > 1 else ticks


# --- the explorer ----------------------------------------------------------------------------


def kernel_schedule_explorer(
    q_lens: str = "12, 1, 6, 1",
    kv_lens: str = "12, 40, 30, 9",
    num_q_heads: int = 16,
    num_kv_heads: int = 8,
    page_size: int = 8,
    num_kv_pages_per_block: str = "2",
    num_queries_per_block: str = "8",
    sliding_window: str = "",
) -> Explorer:
    """The Pallas kernel's schedule for your batch and block sizes, from
    `minilib.schedule.plan_schedule`: the grid (heads blocks x q blocks), the sequences and KV
    blocks each grid step computes, and the double-buffered DMAs that feed them. Pick a grid
    step to zoom in. Empty block sizes mean the kernel's defaults.

    >>> ex = kernel_schedule_explorer(q_lens="12, 1, 6, 1", kv_lens="12, 40, 30, 9")
    >>> ex.controls["grid_step"].options  # the steps of that grid, to zoom in on
    ('all grid steps', '(0, 0)', '(0, 1)', '(0, 2)', '(1, 0)', '(1, 1)', '(1, 2)')
    """
    controls = {
        "q_lens": text_input("q_lens", q_lens, "e.g. 12, 1, 6"),
        "kv_lens": text_input("kv_lens", kv_lens, "e.g. 12, 40, 30"),
        "num_q_heads": int_input("num_q_heads", num_q_heads),
        "num_kv_heads": int_input("num_kv_heads", num_kv_heads),
        "page_size": int_input("page_size", page_size),
        "num_kv_pages_per_block": text_input(
            "num_kv_pages_per_block", num_kv_pages_per_block, "default"
        ),
        "num_queries_per_block": text_input(
            "num_queries_per_block", num_queries_per_block, "default"
        ),
        "sliding_window": text_input("sliding_window", sliding_window, "empty: None"),
        "grid_step": dropdown("grid_step", [ALL_STEPS], ALL_STEPS),
    }
    return Explorer(
        "The kernel's schedule: grid, KV blocks, double buffering",
        controls,
        _render_schedule,
        "Change the block sizes and watch the grid and the copies change. "
        f"head_dim={HEAD_DIM}, float32; empty block sizes use the kernel's defaults.",
        choices=_grid_step_choices,
    )


def _grid_step_choices(values: dict) -> dict:
    """The grid_step menu: all steps, then each step of the planned grid (none without a plan:
    the render shows why)."""
    schedule = _planned(*(values[name] for name in PLAN_INPUTS))
    steps = [] if isinstance(schedule, Exception) else [str(s) for s in schedule.steps()]
    return {"grid_step": [ALL_STEPS, *steps]}


def _render_schedule(values: dict):
    schedule = _planned(*(values[name] for name in PLAN_INPUTS))
    if isinstance(schedule, Exception):
        raise schedule
    chosen = values["grid_step"]
    step = None if chosen == ALL_STEPS else tuple(int(x) for x in chosen.strip("()").split(","))
    return (
        _schedule_status(schedule),
        kernel_schedule_figure(schedule, step),
        _schedule_details(schedule, step),
    )


# Each change needs the plan twice, for the grid_step menu and then for the render, and the
# same plan both times. So the last one is kept, keyed on the inputs it was planned from; a
# problem that stopped it is kept too, so that a bad input is not planned twice either.
@functools.lru_cache(maxsize=1)
def _planned(*inputs):
    """The schedule of `inputs` (the values of PLAN_INPUTS), or the problem that stopped it."""
    try:
        return _plan(*inputs)
    except Exception as err:  # noqa: BLE001 (the render raises it, and the explorer shows it)
        return err.with_traceback(None)


def _plan(
    q_lens: str,
    kv_lens: str,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    num_kv_pages_per_block: str,
    num_queries_per_block: str,
    sliding_window: str,
):
    """The schedule of the typed batch and block sizes, the limits checked first."""
    from minilib.schedule import plan_schedule  # imports the Pallas kernel

    q_lens, kv_lens = parse_q_and_kv_lens(q_lens, kv_lens)
    _check_limits(q_lens, kv_lens, num_q_heads, page_size)
    # Only the shapes and dtypes of q and kv_pages matter to the schedule: the index arrays
    # come from a real batch, q and kv_pages are shapes, so big head counts cost no memory.
    # The typed kv_lens are the validator's to judge, as in the kernel (typed_batch).
    batch = typed_batch(q_lens, kv_lens, num_q_heads=1, num_kv_heads=1, head_dim=1,
                        page_size=page_size)  # fmt: skip
    num_tokens, total_num_pages = batch.q.shape[0], batch.kv_pages.shape[0]
    q = jax.ShapeDtypeStruct((num_tokens, num_q_heads, HEAD_DIM), jnp.float32)
    kv_pages = jax.ShapeDtypeStruct(
        (total_num_pages, page_size, 2 * num_kv_heads, HEAD_DIM), jnp.float32
    )
    try:
        return plan_schedule(  # validates with dynamic_validate_inputs
            q,
            kv_pages,
            *batch.args()[2:],
            sliding_window=parse_optional_int(sliding_window, "sliding_window"),
            num_kv_pages_per_block=parse_optional_int(
                num_kv_pages_per_block, "num_kv_pages_per_block"
            ),
            num_queries_per_block=parse_optional_int(
                num_queries_per_block, "num_queries_per_block"
            ),
            max_computes=MAX_COMPUTES,  # counted before anything is planned or drawn
            max_grid_steps=MAX_GRID_STEPS,
        )
    except ScheduleTooBig as err:
        limits = f"{MAX_COMPUTES} KV blocks and {MAX_GRID_STEPS} grid steps"
        raise InputProblem(
            f"{err} This explorer draws at most {limits}.",
            title=f"The schedule is too large: this explorer draws at most {limits}",
        ) from None


def _check_limits(q_lens: list[int], kv_lens: list[int], num_q_heads: int, page_size: int):
    """The limits at the top of this module, and the two counts the batch is built from,
    checked before anything is built or planned."""
    check_at_most("len(q_lens)", len(q_lens), MAX_SEQS, "Type fewer sequences.")
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        check_at_most(f"q_lens[{i}]", q_len, MAX_TOKENS, "Type a shorter q_len.")
        check_at_most(f"kv_lens[{i}]", kv_len, MAX_KV_LEN, "Type a shorter kv_len.")
    check_at_most("sum(q_lens)", sum(q_lens), MAX_TOKENS, "Type shorter q_lens: q rows in all.")
    check_at_most("num_q_heads", num_q_heads, MAX_HEADS, "Use fewer heads.")
    valid_num_kv_heads(num_q_heads)  # raises for num_q_heads < 1
    check_at_least("page_size", page_size, 1, "A page holds at least one token: try 8 or 16.")
    check_at_most("page_size", page_size, MAX_PAGE_SIZE, "Use smaller pages.")


def _schedule_status(schedule) -> str:
    computes = schedule.computes()
    starts = [e for e in schedule.events if e.kind == "start"]
    fetched = [(e.heads_blk, e.seq, e.kv_blk) for e in starts]
    again = len(fetched) - len(set(fetched))
    heads, q_blocks = schedule.grid
    decode_seqs = {e.seq for e in computes if e.kernel == "decode"}
    return (
        f"grid = ({plural(heads, 'heads block')}, {plural(q_blocks, 'q block')}) = "
        f"{plural(heads * q_blocks, 'grid step')}; "
        f"{plural(len(decode_seqs), 'one-token sequence')} in the decode kernel first; "
        f"{plural(len(computes), 'KV block')} computed, {plural(len(starts), 'DMA')}, {again} "
        "of them for a KV block already copied for another q block of the same sequence. "
        f"num_queries_per_block={schedule.num_queries_per_block}, "
        f"num_kv_pages_per_block={schedule.num_kv_pages_per_block} "
        f"({plural(schedule.kv_tokens_per_block, 'token')} per KV block)."
    )


def _schedule_details(schedule, step) -> str:
    from minilib.schedule import describe_event

    bq = schedule.num_queries_per_block
    rows = []
    for (h, blk), events in schedule.steps("decode").items():
        computes = [e for e in events if e.kind == "compute"]
        if computes:
            seqs = dict.fromkeys(e.seq for e in computes)
            pages = sum(len(e.pages) for e in events if e.kind == "start")
            q_rows = ", ".join(str(r) for r in dict.fromkeys(e.q_rows[0] for e in computes))
            sequences = ", ".join(f"seq {s}" for s in seqs)
            rows.append((f"decode ({h}, {blk})", q_rows, sequences, len(computes), pages))
    for (h, q_blk), events in schedule.steps().items():
        computes = [e for e in events if e.kind == "compute"]
        seqs = dict.fromkeys(e.seq for e in computes)
        pages = sum(len(e.pages) for e in events if e.kind == "start")
        rows.append(
            (
                f"({h}, {q_blk})",
                f"[{q_blk * bq}, {(q_blk + 1) * bq})",
                ", ".join(f"seq {s}" for s in seqs) or "no rows",
                len(computes),
                pages,
            )
        )
    steps_table = table(
        ("grid step", "q rows", "sequences", "KV blocks computed", "pages copied (DMAs started)"),
        rows,
    )
    if step is None:
        listing = schedule.describe()
    else:
        listing = f"grid step {step}:\n" + "\n".join(
            "  " + describe_event(e) for e in schedule.steps()[step]
        )
    return steps_table + pre(listing)
