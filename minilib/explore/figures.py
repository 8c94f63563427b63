"""Figures of the course: each function draws one idea and returns a matplotlib `Figure`.

The figures are made with `matplotlib.figure.Figure`, not `pyplot`, so that calling one never
opens a window or leaves a figure behind; in a notebook a returned figure shows itself, and
`figure_png(fig)` turns it into PNG bytes (which is how the explorers in `minilib.explore.widgets`
show them).

    head_grouping_figure(num_q_heads, num_kv_heads)   which q heads share each KV head, and
                                                       where K and V live in kv_pages
    page_table_figure(cache, seq_ids)                  the page pool, the page table, and the
                                                       slots a paged cache wastes
    ragged_batch_figure(batch, sliding_window)         the packed q rows and each sequence's
                                                       causal mask
    kernel_schedule_figure(schedule, step)             the kernel's grid, what each step
                                                       computes, and the double buffer
    bench_times_figure(timings)                        `python -m minilib bench`'s times
    working_memory_figure(temp_bytes, kv_cache_bytes)  its working memory against max_kv_len

Colours come from the Okabe-Ito palette, which stays distinguishable with the common kinds of
colour blindness. Every figure has a title, labelled axes and a legend; text that does not fit
in its box is shrunk, then hidden, rather than drawn over its neighbours.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Hashable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minilib.batch import RaggedBatch, seq_kind
from minilib.heads import attention_kind, head_groups
from minilib.kv_cache import cdiv, pool_pages_needed
from minilib.masking import is_masked, q_position

__all__ = [
    "FILLS",
    "MAX_MASKS",
    "OKABE_ITO",
    "NotebookFigure",
    "SlotUsage",
    "bench_times_figure",
    "color",
    "figure_png",
    "hatch",
    "head_grouping_figure",
    "kernel_schedule_figure",
    "mask_numpy",
    "page_table_figure",
    "plural",
    "ragged_batch_figure",
    "slot_usage",
    "span",
    "working_memory_figure",
]

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
    """The fill colour of item `i` (a group, a sequence): Okabe-Ito, repeating every 7.

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


def plural(n: int, noun: str) -> str:
    """`n` and `noun`, with an s unless `n` is 1: how figures and explorers count things.

    >>> plural(1, "page"), plural(3, "page")
    ('1 page', '3 pages')
    """
    return f"{n} {noun}{'' if n == 1 else 's'}"


def span(items: Sequence[int]) -> str:
    """The first and last of consecutive numbers, both included, as "first..last": how figures
    and explorers name a run of heads, pages or keys.

    >>> span([3, 4, 5]), span(range(16, 32)), span([7])
    ('3..5', '16..31', '7')
    """
    return str(items[0]) if len(items) == 1 else f"{items[0]}..{items[-1]}"


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (for `ipywidgets.Image`, or to save).

    >>> figure_png(head_grouping_figure(4, 2))[:8]
    b'\\x89PNG\\r\\n\\x1a\\n'
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return buf.getvalue()


# --- head grouping -------------------------------------------------------------------------


def head_grouping_figure(num_q_heads: int, num_kv_heads: int) -> Figure:
    """Which q heads share each KV head, and where each K and V head sits in `kv_pages`.

    Three rows, lined up: the q heads (`q.shape[1]`), the KV heads (each as wide as the group
    of q heads it serves), and the combined head axis of `kv_pages` (`kv_pages.shape[2]`),
    where KV head h keeps K in slot 2*h and V in slot 2*h + 1. One colour per group.

    Raises `RPAInputError` (the validator's own message) for an invalid pair.

    >>> fig = head_grouping_figure(12, 4)
    >>> fig.axes[0].get_title()
    'GQA: 12 q heads share 4 KV heads, 3 q heads per KV head'
    """
    groups = head_groups(num_q_heads, num_kv_heads)  # validates the pair
    group = num_q_heads // num_kv_heads
    kind = attention_kind(num_q_heads, num_kv_heads)

    fig = _new_figure(11, 3.9)
    ax = fig.add_subplot()
    labels = []  # (text, box) pairs, to shrink or hide where they do not fit
    height = 0.72
    for h, q_heads in enumerate(groups):
        face = color(h)
        for q in q_heads:  # row 2: the q heads
            box = _box(ax, q, 2, 1, height, face, hatch(h))
            labels.append((_label(ax, box, f"q{q}", face), box))
        x0 = h * group  # row 1: the KV head, under its group
        box = _box(ax, x0, 1, group, height, face, hatch(h))
        labels.append((_label(ax, box, f"KV {h}", face), box))
        for j, kv_kind in enumerate(("K", "V")):  # row 0: its K and V slots
            slot_face = face if kv_kind == "K" else _tint(face, 0.55)
            box = _box(ax, x0 + j * group / 2, 0, group / 2, height, slot_face, hatch(h))
            text = f"{kv_kind}{h}\nslot {2 * h + j}"
            labels.append((_label(ax, box, text, slot_face), box))

    ax.set_xlim(0, num_q_heads)
    ax.set_ylim(-0.5, 2.5)
    ax.set_yticks(
        [0, 1, 2],
        [
            f"kv_pages head axis\n2*num_kv_heads = {2 * num_kv_heads}",
            f"KV heads\nnum_kv_heads = {num_kv_heads}",
            f"q heads\nnum_q_heads = {num_q_heads}",
        ],
    )
    step = max(1, math.ceil(num_q_heads / 24))
    ax.set_xticks([q + 0.5 for q in range(0, num_q_heads, step)], range(0, num_q_heads, step))
    ax.set_xlabel("q head index (each KV head sits under the q heads it serves)")
    ax.set_title(
        f"{kind}: {plural(num_q_heads, 'q head')} {'share' if num_q_heads > 1 else 'uses'} "
        f"{plural(num_kv_heads, 'KV head')}, "
        f"{plural(group, 'q head')} per KV head"
    )
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    handles = _group_handles(groups)
    handles += [
        Patch(facecolor=GREY, edgecolor="white", label="K of KV head h: slot 2*h"),
        Patch(facecolor=_tint(GREY, 0.55), edgecolor="white", label="V of KV head h: slot 2*h+1"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    _fit_labels(fig, labels, [(ax, "x")])
    return fig


def _group_handles(groups: list[list[int]]) -> list[Patch]:
    shown = groups if len(groups) <= 8 else groups[:6]
    handles = [
        Patch(
            facecolor=color(h),
            hatch=hatch(h),
            edgecolor="white",
            label=f"KV head {h}: q head{'s' if len(q_heads) > 1 else ''} {span(q_heads)}",
        )
        for h, q_heads in enumerate(shown)
    ]
    if len(shown) < len(groups):
        handles.append(
            Patch(
                facecolor="none",
                edgecolor="none",
                label=f"... {len(groups) - len(shown)} more groups\n(colours repeat, hatched)",
            )
        )
    return handles


# --- the paged KV cache ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlotUsage:
    """KV slots (one slot holds one token's K and V) reserved by a paged and by a contiguous
    cache for the same sequences.

    >>> u = SlotUsage(tokens=162, paged_slots=192, contiguous_slots=360)
    >>> u.paged_wasted, u.contiguous_wasted
    (30, 198)
    """

    tokens: int  # tokens actually stored: sum(kv_lens)
    paged_slots: int  # pages used * page_size
    contiguous_slots: int  # num_seqs * longest sequence

    @property
    def paged_wasted(self) -> int:
        """Empty slots at the end of each sequence's last page."""
        return self.paged_slots - self.tokens

    @property
    def contiguous_wasted(self) -> int:
        """Empty slots behind each sequence shorter than the longest."""
        return self.contiguous_slots - self.tokens


def slot_usage(kv_lens: Sequence[int], page_size: int) -> SlotUsage:
    """Slots a paged cache and a contiguous cache (one buffer per sequence, sized to the
    longest) reserve for sequences of `kv_lens` tokens.

    >>> u = slot_usage([37, 5, 120], page_size=16)
    >>> u.paged_slots, u.paged_wasted, u.contiguous_slots, u.contiguous_wasted
    (192, 30, 360, 198)
    """
    longest = max(kv_lens, default=0)
    return SlotUsage(
        tokens=sum(kv_lens),
        paged_slots=pool_pages_needed(kv_lens, page_size) * page_size,
        contiguous_slots=len(kv_lens) * longest,
    )


def page_table_figure(cache, seq_ids: Sequence[Hashable] | None = None) -> Figure:
    """A `minilib.kv_cache.PagedKVCache` drawn three ways.

    1. The page pool: every page of `kv_pages`, coloured by the sequence that owns it, the
       used part of each page filled and its empty slots hatched. Pages of sequences not in
       `seq_ids` are grey; free pages are white.
    2. The page table, `page_indices[:num_seqs]`: sequence i's logical page j is physical page
       `page_indices[i, j]`.
    3. The KV slots reserved, against a contiguous cache sized to the longest sequence.

    `seq_ids` (default: every live sequence) are the sequences of the batch, in order.

    >>> from minilib.kv_cache import PagedKVCache
    >>> import jax.numpy as jnp
    >>> cache = PagedKVCache(total_num_pages=8, page_size=4, num_kv_heads=1, head_dim=1,
    ...                      max_num_seqs=2, pages_per_seq=3)
    >>> cache.add_sequence("a"); cache.append("a", jnp.zeros((5, 1, 1)), jnp.zeros((5, 1, 1)))
    >>> fig = page_table_figure(cache)
    >>> fig.axes[0].get_title()
    'The page pool: 2 of total_num_pages=8 pages in use (page_size=4 slots each)'
    """
    seq_ids = list(cache.seq_ids if seq_ids is None else seq_ids)
    page_size, total = cache.page_size, cache.total_num_pages
    lens = [cache.seq_len(s) for s in seq_ids]
    pages = [cache.pages(s) for s in seq_ids]
    index = {s: i for i, s in enumerate(seq_ids)}

    cols = min(total, 16 if total <= 128 else 32)
    pool_rows = cdiv(total, cols)
    table_rows = max(len(seq_ids), 1)
    fig = _new_figure(11, 2.2 + 0.42 * pool_rows + 0.42 * table_rows + 1.5)
    grid = fig.add_gridspec(
        3, 1, height_ratios=[0.9 + 0.42 * pool_rows, 0.5 + 0.42 * table_rows, 1.3]
    )
    pool_ax, table_ax, slots_ax = (fig.add_subplot(grid[i]) for i in range(3))

    # 1. The pool. Page p sits in row p // cols, column p % cols.
    used_in_page = {}
    for s, seq_pages, n in zip(seq_ids, pages, lens, strict=True):
        for j, page in enumerate(seq_pages):
            used_in_page[page] = (s, min(page_size, n - j * page_size))
    labels = []
    for page, owner in enumerate(cache.allocator.owners):
        x, y = page % cols, -(page // cols)
        if page in used_in_page:
            s, used = used_in_page[page]
            face = color(index[s])
            box = _box(pool_ax, x, y, 1, 0.8, "white", "", edge=face)
            inner_edge = "white" if hatch(index[s]) else "none"  # hatching is drawn in it
            _box(pool_ax, x, y, used / page_size, 0.8, face, hatch(index[s]), edge=inner_edge)
            if used < page_size:  # the empty slots of a last page: reserved, wasted
                _box(
                    pool_ax,
                    x + used / page_size,
                    y,
                    1 - used / page_size,
                    0.8,
                    "white",
                    "////",
                    edge=_shade(face),
                )
            # On a partly empty page the number sits on the hatching: give it a background.
            text_face = face if used == page_size else "white"
            backed = used < page_size
        elif owner is not None:
            box = _box(pool_ax, x, y, 1, 0.8, LIGHT_GREY, "", edge="white")
            text_face, backed = LIGHT_GREY, False
        else:
            box = _box(pool_ax, x, y, 1, 0.8, "white", "", edge=GREY)
            text_face, backed = "white", False
        labels.append((_label(pool_ax, box, str(page), text_face, backed), box))
    pool_ax.set_xlim(-0.05, cols + 0.05)
    pool_ax.set_ylim(-pool_rows + 0.5, 0.5)
    pool_ax.set_xticks([c + 0.5 for c in range(cols)], range(cols))
    pool_ax.set_yticks(
        [-r for r in range(pool_rows)],
        [span(range(r * cols, min(total, (r + 1) * cols))) for r in range(pool_rows)],
    )
    pool_ax.set_xlabel("column: page number = first page of the row + column")
    pool_ax.set_ylabel("pages")
    pool_ax.set_title(
        f"The page pool: {cache.allocator.num_used} of total_num_pages={total} pages in use "
        f"(page_size={plural(page_size, 'slot')} each)",
        fontsize=10,
    )
    _clean(pool_ax)

    # 2. The page table.
    pages_per_seq = cache.pages_per_seq
    for i, seq_pages in enumerate(pages):
        for j in range(pages_per_seq):
            if j < len(seq_pages):
                box = _box(table_ax, j, -i, 1, 0.8, color(i), hatch(i))
                labels.append((_label(table_ax, box, str(seq_pages[j]), color(i)), box))
            else:
                _box(table_ax, j, -i, 1, 0.8, FAINT, "", edge="white")
    table_ax.set_xlim(-0.05, pages_per_seq + 0.05)
    table_ax.set_ylim(-table_rows + 0.5, 0.5)
    step = max(1, math.ceil(pages_per_seq / 32))
    table_ax.set_xticks(
        [j + 0.5 for j in range(0, pages_per_seq, step)], range(0, pages_per_seq, step)
    )
    table_ax.set_yticks(
        [-i for i in range(len(seq_ids))],
        [f"seq {s}: kv_len={n}" for s, n in zip(seq_ids, lens, strict=True)],
    )
    table_ax.set_xlabel(f"logical page j: tokens j*{page_size} to (j+1)*{page_size}-1")
    table_ax.set_title(
        f"The page table page_indices[:num_seqs]: physical page of each logical page "
        f"(pages_per_seq={pages_per_seq}; empty cells are padding, never read)",
        fontsize=10,
    )
    _clean(table_ax)

    # 3. Slots reserved, paged against contiguous.
    usage = slot_usage(lens, page_size)
    bars = [
        (
            f"contiguous\n{len(lens)} x longest ({max(lens, default=0)})",
            usage.contiguous_slots,
            usage.contiguous_wasted,
        ),
        (
            f"paged\n{usage.paged_slots // page_size} pages x {page_size}",
            usage.paged_slots,
            usage.paged_wasted,
        ),
    ]
    for y, (_, reserved, wasted) in enumerate(bars):
        slots_ax.barh(
            y,
            reserved - wasted,
            color=OKABE_ITO["blue"],
            height=0.6,
            label="used slots (tokens)" if y == 0 else None,
        )
        slots_ax.barh(
            y,
            wasted,
            left=reserved - wasted,
            color="white",
            hatch="////",
            edgecolor=OKABE_ITO["vermillion"],
            height=0.6,
            label="reserved but empty (wasted)" if y == 0 else None,
        )
        pct = 100 * wasted / reserved if reserved else 0.0
        slots_ax.text(
            reserved, y, f"  {wasted} wasted of {reserved} ({pct:.0f}%)", va="center", fontsize=9
        )
    slots_ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    slots_ax.set_xlim(0, max(usage.contiguous_slots, usage.paged_slots, 1) * 1.4)
    slots_ax.set_ylim(-0.6, len(bars) - 0.4)
    slots_ax.set_xlabel("KV slots (one slot holds one token's K and V)")
    slots_ax.set_title(
        "Memory reserved: paged cache against one contiguous buffer per sequence", fontsize=10
    )
    slots_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    for side in ("top", "right"):
        slots_ax.spines[side].set_visible(False)

    handles = [
        Patch(facecolor=color(i), hatch=hatch(i), edgecolor="white", label=f"seq {s}")
        for i, s in enumerate(seq_ids)
    ]
    handles.append(
        Patch(facecolor="white", edgecolor=GREY, hatch="////", label="empty slots of a last page")
    )
    if cache.allocator.num_used > sum(len(p) for p in pages):
        handles.append(
            Patch(facecolor=LIGHT_GREY, edgecolor="white", label="page of another sequence")
        )
    if cache.allocator.num_free:
        handles.append(Patch(facecolor="white", edgecolor=GREY, label="free page"))
    pool_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle("Paged KV cache: where each sequence's tokens live")
    _fit_labels(fig, labels, [(pool_ax, "x"), (table_ax, "x"), (slots_ax, "x")])
    return fig


# --- the ragged batch -----------------------------------------------------------------------

MASK_COLORS = {
    "may attend": OKABE_ITO["blue"],
    "masked: future key (causal)": FAINT,
    "masked: older than sliding_window": OKABE_ITO["vermillion"],
}
MAX_MASKS = 8  # sequences drawn with their mask


def ragged_batch_figure(batch: RaggedBatch, sliding_window: int | None = None) -> Figure:
    """The packed q rows of a ragged batch, and each sequence's causal mask.

    Top: the rows of `q`, sequence after sequence, cut at `cu_q_lens`. Below: for each live
    sequence (up to 8), which keys each of its q rows may see. The q rows are the sequence's
    *last* q_len tokens, so row r sits at position `kv_len - q_len + r` (row 0 is right of the
    dashed line) and sees keys up to it; with `sliding_window=w`, only the last w of them.

    >>> from minilib.batch import make_batch
    >>> fig = ragged_batch_figure(make_batch([(4, 4), (1, 9), (3, 7)]), sliding_window=4)
    >>> [ax.get_title().splitlines()[0] for ax in fig.axes[1:]]
    ['seq 0: prefill', 'seq 1: decode', 'seq 2: chunk']
    """
    cu_q_lens = np.asarray(batch.cu_q_lens)
    kv_lens = np.asarray(batch.kv_lens)
    num_seqs = int(np.asarray(batch.num_seqs)[0])
    max_tokens = batch.q.shape[0]
    shown = min(num_seqs, MAX_MASKS)
    cols = min(max(shown, 1), 4)
    mask_rows = cdiv(shown, cols)

    fig = _new_figure(11, 2.0 + 2.7 * mask_rows)
    grid = fig.add_gridspec(1 + mask_rows, cols, height_ratios=[0.8] + [2.0] * mask_rows)
    rows_ax = fig.add_subplot(grid[0, :])
    labels = _draw_packed_rows(rows_ax, cu_q_lens, num_seqs, max_tokens)

    cmap = ListedColormap(list(MASK_COLORS.values()))
    tick_axes = [(rows_ax, "x")]
    for i in range(shown):
        ax = fig.add_subplot(grid[1 + i // cols, i % cols])
        start = int(cu_q_lens[i])
        q_len, kv_len = int(cu_q_lens[i + 1]) - start, int(kv_lens[i])
        # 0: may attend, 1: a future key, 2: a past key outside the window.
        causal = mask_numpy(q_len, kv_len, None)
        windowed = mask_numpy(q_len, kv_len, sliding_window)
        image = np.where(causal, 1, np.where(windowed, 2, 0))
        if q_len and kv_len:
            ax.imshow(
                image,
                cmap=cmap,
                vmin=-0.5,
                vmax=2.5,
                aspect="auto",
                interpolation="nearest",
                extent=(-0.5, kv_len - 0.5, q_len - 0.5, -0.5),
            )
            ax.axvline(
                kv_len - q_len - 0.5, color=OKABE_ITO["black"], linestyle="--", linewidth=1.2
            )
        ax.set_xlim(-0.5, max(kv_len, 1) - 0.5)
        ax.set_ylim(max(q_len, 1) - 0.5, -0.5)
        ax.set_xticks(_int_ticks(kv_len, 6))
        ax.set_yticks(_int_ticks(q_len, 5))
        ax.set_title(
            f"seq {i}: {seq_kind(q_len, kv_len)}\nq_len={q_len}, kv_len={kv_len}",
            fontsize=9,
            color=_darker(color(i)),
        )
        ax.set_xlabel("key position", fontsize=8)
        ax.set_ylabel(f"q row r\n(packed row {start}+r)", fontsize=8)
        ax.tick_params(labelsize=8)
        tick_axes += [(ax, "x"), (ax, "y")]

    window = "no sliding_window" if sliding_window is None else f"sliding_window={sliding_window}"
    more = f" (masks of the first {shown} of {num_seqs})" if shown < num_seqs else ""
    fig.suptitle(f"A ragged batch of {num_seqs} sequences and their causal masks, {window}{more}")
    if shown:
        kinds = list(MASK_COLORS.items())[: 2 if sliding_window is None else 3]
        handles = [Patch(facecolor=c, edgecolor=GREY, label=k) for k, c in kinds]
        handles.append(_line_handle("dashed: kv_len - q_len, where q row 0 sits"))
        fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8)
    _fit_labels(fig, labels, tick_axes)
    return fig


def mask_numpy(q_len: int, kv_len: int, sliding_window: int | None = None) -> np.ndarray:
    """`minilib.masking.causal_mask` on NumPy positions (a test checks that they agree): the
    figure then needs no compiling for each new shape. True where q row i may NOT see key j.

    >>> mask_numpy(2, 4).astype(int).tolist()
    [[0, 0, 0, 1], [0, 0, 0, 0]]
    """
    q_pos = q_position(np.arange(q_len)[:, None], q_len, kv_len)  # [q_len, 1]
    return is_masked(q_pos, np.arange(kv_len)[None, :], sliding_window)


def _draw_packed_rows(ax, cu_q_lens: np.ndarray, num_seqs: int, max_tokens: int) -> list:
    """The rows of q, one coloured run per sequence, then the padding rows."""
    labels = []
    for i in range(num_seqs):
        start, end = int(cu_q_lens[i]), int(cu_q_lens[i + 1])
        if end > start:
            box = _box(ax, start, 0, end - start, 0.8, color(i), hatch(i))
            labels.append((_label(ax, box, f"seq {i}", color(i)), box))
    used = int(cu_q_lens[num_seqs])
    if used < max_tokens:
        _box(ax, used, 0, max_tokens - used, 0.8, "white", "xx", edge=LIGHT_GREY)
    ax.set_xlim(0, max(max_tokens, 1))
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ticks = sorted({int(c) for c in cu_q_lens[: num_seqs + 1]} | {max_tokens})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel(
        f"q row; sequence i owns rows cu_q_lens[i] to cu_q_lens[i+1]-1 "
        f"(cu_q_lens = {cu_q_lens[: num_seqs + 1].tolist()})"
    )
    ax.set_title(f"Packed q rows: {used} of max_num_batched_tokens={max_tokens} used", fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    handles = [
        Patch(facecolor=color(i), hatch=hatch(i), edgecolor="white", label=f"seq {i}")
        for i in range(min(num_seqs, 12))
    ]
    if num_seqs > 12:
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"... {num_seqs - 12} more"))
    if used < max_tokens:
        handles.append(
            Patch(facecolor="white", hatch="xx", edgecolor=LIGHT_GREY, label="padding rows")
        )
    if handles:
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.2),
            fontsize=8,
            ncol=1 + (len(handles) - 1) // 5,
        )
    return labels


def _int_ticks(n: int, most: int) -> list[int]:
    """At most `most` round integer ticks in [0, n)."""
    if n <= 1:
        return [0]
    step = max(1, math.ceil((n - 1) / (most - 1)))
    step = next(s for s in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, step) if s >= step)
    return list(range(0, n, step))


# --- the kernel schedule --------------------------------------------------------------------


def kernel_schedule_figure(schedule, step: tuple[int, int] | None = None) -> Figure:
    """A `minilib.schedule.Schedule` drawn in two panels.

    Top, the grid: one row per heads block, one column per q block of
    `num_queries_per_block` rows, under the packed q rows of each sequence. In each grid step,
    one tile per KV block the kernel computes there, coloured by sequence (s1 b2: sequence 1,
    KV block 2).

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
    fig = _new_figure(11, 3.9 + 0.55 * num_heads_blocks)
    grid_ax, time_ax = fig.subplots(2, 1, height_ratios=[1.2 + 0.55 * num_heads_blocks, 2.2])
    labels = _draw_grid(grid_ax, schedule, step)
    labels += _draw_double_buffer(time_ax, schedule, step)
    seqs = sorted({e.seq for e in schedule.computes()})
    handles = [
        Patch(facecolor=color(s), hatch=hatch(s), edgecolor="white", label=f"seq {s}")
        for s in seqs[:12]
    ]
    handles += [
        Patch(facecolor=GREY, edgecolor="white", label="compute: reads the slot"),
        Patch(facecolor="white", edgecolor=GREY, hatch="////", label="DMA: copies into the slot"),
    ]
    grid_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(
        f"Kernel schedule: grid = {plural(num_heads_blocks, 'heads block')} x "
        f"{plural(num_q_blocks, 'q block')}, "
        f"{len(schedule.computes())} KV blocks computed"
    )
    _fit_labels(fig, labels, [(grid_ax, "x"), (time_ax, "x")])
    return fig


def _draw_grid(ax, schedule, selected) -> list:
    """Heads blocks down, q blocks across (in q rows), the computes of each step as tiles."""
    num_heads_blocks, num_q_blocks = schedule.grid
    bq = schedule.num_queries_per_block
    labels = []
    # The packed q rows of each sequence, on top.
    rows = {}
    for e in schedule.computes():
        start, end = rows.get(e.seq, e.q_rows)
        rows[e.seq] = (min(start, e.q_rows[0]), max(end, e.q_rows[1]))
    for seq, (start, end) in rows.items():
        box = _box(ax, start, 0, end - start, 0.7, color(seq), hatch(seq))
        labels.append((_label(ax, box, f"seq {seq}", color(seq)), box))
    # The grid steps, with a tile per KV block computed.
    widest = None  # (width, compute) of a widest tile: the one the axis label names
    for (h, q_blk), events in schedule.steps().items():
        computes = [e for e in events if e.kind == "compute"]
        y, x0 = -(h + 1), q_blk * bq
        edge = OKABE_ITO["black"] if (h, q_blk) == selected else GREY
        cell = _box(ax, x0, y, bq, 0.8, "white", edge=edge)
        cell.set_linewidth(2.5 if (h, q_blk) == selected else 1.0)
        if not computes:
            labels.append((_label(ax, cell, "no rows", "white"), cell))
        width = bq / max(len(computes), 1)
        for k, e in enumerate(computes):
            tile = _box(ax, x0 + k * width, y, width, 0.64, color(e.seq), hatch(e.seq))
            labels.append((_label(ax, tile, f"s{e.seq} b{e.kv_blk}", color(e.seq)), tile))
            if widest is None or width > widest[0]:
                widest = (width, e)
    ax.set_xlim(0, num_q_blocks * bq)
    ax.set_ylim(-num_heads_blocks - 0.5, 0.5)
    q_heads, kv_heads = schedule.num_q_heads_per_block, schedule.num_kv_heads_per_block
    ax.set_yticks(
        [0] + [-(h + 1) for h in range(num_heads_blocks)],
        ["q rows"]
        + [
            f"heads block {h}\nq heads {span(range(h * q_heads, (h + 1) * q_heads))}, "
            f"KV heads {span(range(h * kv_heads, (h + 1) * kv_heads))}"
            for h in range(num_heads_blocks)
        ],
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
    _clean(ax)
    return labels


def _draw_double_buffer(ax, schedule, selected) -> list:
    """Two VMEM slots over time: compute from one, copy into the other."""
    pairs = schedule.in_flight()
    first_start = next((e for e in schedule.events if e.kind == "start"), None)
    ticks = [t for t, (c, _) in enumerate(pairs) if selected is None or c.step == selected]
    labels = []
    if not ticks:
        ax.text(
            0.5,
            0.5,
            "no KV blocks in this grid step",
            transform=ax.transAxes,
            ha="center",
            va="center",
        )
        lo, hi = -1, 0
    else:
        lo, hi = ticks[0] - 1, ticks[-1]
    # The copy feeding tick lo + 1 runs during tick lo (t = -1: the first copy, alone).
    copies = [(lo, pairs[lo][1] if lo >= 0 else first_start)] if ticks else []
    copies += [(t, pairs[t][1]) for t in ticks]
    for t, start in copies:  # bars are centred on their tick
        if start is not None:
            face = color(start.seq)
            box = _box(ax, t - 0.46, 1 - start.slot, 0.92, 0.6, "white", "////", _shade(face))
            labels.append((_label(ax, box, f"s{start.seq} b{start.kv_blk}", "white", True), box))
    for t in ticks:
        c = pairs[t][0]
        box = _box(ax, t - 0.46, 1 - c.slot, 0.92, 0.6, color(c.seq), hatch(c.seq))
        labels.append((_label(ax, box, f"s{c.seq} b{c.kv_blk}", color(c.seq)), box))
    # The grid step of each tick, on a lane of its own (tick lo belongs to the step before).
    lane = ([lo] if ticks and lo >= 0 else []) + ticks
    for k, t in enumerate(lane):
        step = pairs[t][0].step
        if k == 0 or pairs[lane[k - 1]][0].step != step:
            end = next((u for u in lane[k:] if pairs[u][0].step != step), hi + 1)
            shade = FAINT if (step[0] + step[1]) % 2 == 0 else LIGHT_GREY
            box = _box(ax, t - 0.48, 2, end - t - 0.04, 0.6, shade, edge="white")
            labels.append((_label(ax, box, f"{step}", shade), box))
    ax.set_xlim(lo - 0.6, hi + 0.6)
    ax.set_ylim(-0.5, 2.5)
    ax.set_yticks([2, 1, 0], ["grid step\n(heads blk, q blk)", "VMEM slot 0", "VMEM slot 1"])
    ax.set_xticks(_int_ticks_between(lo, hi, 12))
    where = "all grid steps" if selected is None else f"grid step {selected}"
    ax.set_xlabel(
        "tick t: the t-th KV block computed (t = -1: the first copy, nothing to hide it)"
        if lo < 0
        else "tick t: the t-th KV block computed"
    )
    ax.set_title(
        f"Double buffering, {where}: compute from one slot while the next KV block "
        "is copied into the other",
        fontsize=10,
    )
    _clean(ax)
    return labels


def _int_ticks_between(lo: int, hi: int, most: int) -> list[int]:
    """About `most` round integer ticks from lo to hi (multiples of a round step), and -1 if
    lo is -1 (the tick of the first copy)."""
    step = _int_ticks(hi - lo + 1, most)[1:2] or [1]
    ticks = [t for t in range(lo, hi + 1) if t % step[0] == 0]
    return [-1, *ticks] if lo == -1 and step[0] > 1 else ticks


# --- helpers ---------------------------------------------------------------------------------


class NotebookFigure(Figure):
    """A matplotlib `Figure` that shows itself as a PNG when it ends a notebook cell, with or
    without pyplot's inline backend.

    >>> fig = head_grouping_figure(4, 2)
    >>> isinstance(fig, NotebookFigure), fig._repr_png_() == figure_png(fig)
    (True, True)
    """

    def _repr_png_(self) -> bytes:
        return figure_png(self)


def _new_figure(width: float, height: float) -> Figure:
    """A figure with its own Agg canvas: no pyplot, no window, nothing left behind."""
    fig = NotebookFigure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _box(ax, x, y, width, height, face, hatch_pattern="", edge="white") -> Rectangle:
    """A rectangle whose left edge is x and whose vertical centre is y."""
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


def _label(ax, box: Rectangle, text: str, face, backed: bool | None = None):
    """Text centred in `box`, black or white, whichever reads better on `face`. On a hatched
    box (or with `backed=True`) the text gets a small background of its own."""
    x, y = box.get_x() + box.get_width() / 2, box.get_y() + box.get_height() / 2
    backed = bool(box.get_hatch()) if backed is None else backed
    bbox = dict(facecolor=face, edgecolor="none", pad=1.0) if backed else None
    label = ax.text(x, y, text, ha="center", va="center", fontsize=8, color=_ink(face), bbox=bbox)
    label.set_in_layout(False)  # it stays inside its box: the layout need not measure it
    return label


def _fit_labels(fig: Figure, labels, tick_axes=()) -> None:
    """Settle the layout, then make the text fit: shrink each label that overflows its box
    (down to 6 pt, then hide it), and blank tick labels that would overlap the previous one
    on `(ax, "x" or "y")` axes. Then freeze the layout, so saving does not move anything."""
    fig.get_layout_engine().execute(fig)  # places the axes, so the sizes below are final
    renderer = fig.canvas.get_renderer()
    pixels_per_point = renderer.points_to_pixels(1.0)
    for text, box in labels:
        room = box.get_window_extent(renderer)
        # Measuring text means drawing it; a rough estimate settles the clear cases (most of them).
        lines = text.get_text().split("\n")
        wide = max(len(line) for line in lines) * 0.65 * 8 * pixels_per_point
        tall = len(lines) * 1.25 * 8 * pixels_per_point
        if wide * 1.2 < room.width - 8 and tall * 1.1 < room.height - 4:
            continue  # fits at 8 pt
        if wide * 0.75 * 0.8 > room.width:
            text.set_visible(False)  # does not fit even at 6 pt
            continue
        margin = 8 if text.get_bbox_patch() else 2  # a background needs room around the text
        for size in (8, 7, 6):
            text.set_fontsize(size)
            extent = text.get_window_extent(renderer)
            if extent.width <= room.width - margin and extent.height <= room.height - margin / 2:
                break
        else:
            text.set_visible(False)
    for ax, which in tick_axes:
        axis = ax.xaxis if which == "x" else ax.yaxis
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
    fig.set_layout_engine("none")


def _ink(face: str) -> str:
    r, g, b = to_rgb(face)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.4 else "white"


def _tint(face: str, amount: float) -> tuple[float, float, float]:
    """`face` mixed with `amount` of white."""
    return tuple(c + (1 - c) * amount for c in to_rgb(face))


def _shade(face: str) -> tuple[float, float, float]:
    """`face` a little darker: hatching in it stays visible on white, even for yellow."""
    return tuple(0.8 * c for c in to_rgb(face))


def _darker(face: str) -> tuple[float, float, float]:
    """`face` darkened enough to read as text on white."""
    return tuple(0.6 * c for c in to_rgb(face))


def _line_handle(label: str):
    from matplotlib.lines import Line2D

    return Line2D([], [], color=OKABE_ITO["black"], linestyle="--", linewidth=1, label=label)


def _clean(ax) -> None:
    ax.tick_params(length=0)
    for side in ax.spines:
        ax.spines[side].set_visible(False)


# --- benchmark results -----------------------------------------------------------------------


def bench_times_figure(timings, title: str = "Ragged paged attention") -> Figure:
    """Three panels, first call / warm call / new-lengths call, log scale, one bar per
    implementation in each case.

    `timings` maps a case label to {implementation name: `minilib.perf.timing.Timing`}.

    >>> from minilib.perf.timing import Timing
    >>> t = Timing(2.0, 9, 1.5, 0.004, 5, 0.005, 0, 0.004)
    >>> fig = bench_times_figure({"mixed 8 seqs 32/8/128": {"jnp": t, "blockwise": t}})
    >>> [ax.get_title() for ax in fig.axes]
    ['first call, compile included', 'warm call (median)', 'new mix of lengths, same shapes']
    """
    cases = list(timings)
    impls = list(dict.fromkeys(name for by_impl in timings.values() for name in by_impl))
    panels = [
        ("first call, compile included", "seconds", lambda t: t.first_s),
        ("warm call (median)", "milliseconds", lambda t: t.warm_s * 1e3),
        ("new mix of lengths, same shapes", "milliseconds", lambda t: t.new_s * 1e3),
    ]
    fig = _new_figure(6 + 1.6 * len(cases) * 3, 4.8)
    axes = fig.subplots(1, 3, squeeze=False)[0]
    width = 0.8 / max(len(impls), 1)
    for ax, (panel_title, unit, value) in zip(axes, panels, strict=True):
        for k, impl in enumerate(impls):
            shift = (k - (len(impls) - 1) / 2) * width
            placed = [(i + shift, value(timings[c][impl])) for i, c in enumerate(cases)
                      if impl in timings[c]]  # fmt: skip
            xs, ys = zip(*placed, strict=True) if placed else ((), ())
            bars = ax.bar(xs, ys, width, label=impl, color=color(k), hatch=hatch(k))
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)), [c.replace(" seqs ", " seqs\n") for c in cases],
                      fontsize=8)  # fmt: skip
        ax.set_title(panel_title)
        ax.set_ylabel(unit + " (log scale)")
        ax.set_xlabel("workload, sequences, heads q/kv/dim")
    axes[0].legend(title="implementation")
    fig.suptitle(title)
    return fig


def working_memory_figure(temp_bytes, kv_cache_bytes) -> Figure:
    """XLA's working memory of one compiled call against max_kv_len, one line per
    implementation, with the KV cache's own size for scale.

    `temp_bytes` maps an implementation name to {max_kv_len: bytes}; `kv_cache_bytes` maps
    each max_kv_len to the bytes of the kv_pages argument.

    >>> fig = working_memory_figure({"jnp": {256: 2**22, 1024: 2**24}, "blockwise": {256: 2**20,
    ...                              1024: 2**20}}, {256: 2**23, 1024: 2**25})
    >>> fig.axes[0].get_title()
    'Working memory of one compiled call as max_kv_len grows'
    """
    fig = _new_figure(7, 4.8)
    ax = fig.subplots()
    for k, (impl, by_len) in enumerate(temp_bytes.items()):
        ax.plot(list(by_len), [b / 2**20 for b in by_len.values()], marker="o",
                color=color(k), label=f"{impl}: temp memory")  # fmt: skip
    cache_mib = [b / 2**20 for b in kv_cache_bytes.values()]
    ax.plot(list(kv_cache_bytes), cache_mib, "k--", label="the KV cache itself (argument)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(kv_cache_bytes), [str(n) for n in kv_cache_bytes])
    ax.set_yscale("symlog", linthresh=1.0)  # linear below 1 MiB, so that 0 can be shown
    ax.set_ylim(bottom=0)
    ax.set_xlabel("max_kv_len = pages_per_seq * page_size (log scale)")
    ax.set_ylabel("MiB (log scale above 1)")
    ax.set_title("Working memory of one compiled call as max_kv_len grows")
    ax.legend()
    return fig
