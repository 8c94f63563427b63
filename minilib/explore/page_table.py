"""The paged KV cache: its page pool, its page table, and the slots it wastes, as a figure and an
explorer.

    slot_usage(kv_lens, page_size)     slots a paged and a contiguous cache reserve
    page_table_figure(cache, seq_ids)  the pool, the page table, the slots reserved
    page_table_explorer()              sequences of your lengths in a real PagedKVCache

    >>> ex = page_table_explorer(kv_lens="37, 5, 120", page_size=16, total_num_pages=24)
    >>> print(ex.text.splitlines()[0])
    3 sequences: 162 tokens in 12 pages of 16 slots; the pool has 24 pages: 12 ours, 0 of
    other sequences, 12 free. Paged: 30 of 192 slots wasted; contiguous (each sequence sized to
    the longest): 198 of 360.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from minilib.errors import InputProblem, KVCacheError
from minilib.explore import style
from minilib.explore.explorer import (
    Explorer,
    check_at_least,
    check_at_most,
    dropdown,
    int_input,
    parse_ints,
    text_input,
)
from minilib.explore.text import and_join, array_rows, plural, pre, span, table
from minilib.kv_cache import FILL_ORDERS, cdiv, fill_cache, pool_pages_needed

__all__ = [
    "MAX_PAGES",
    "MAX_PAGE_SIZE",
    "MAX_SEQS",
    "MAX_SEQ_LEN",
    "SlotUsage",
    "page_table_explorer",
    "page_table_figure",
    "slot_usage",
]

# What the explorer draws at most. Drawing is the slow part (matplotlib, a box per page).
MAX_PAGES, MAX_PAGE_SIZE, MAX_SEQS, MAX_SEQ_LEN = 256, 4096, 16, 1_000_000
PAGE_SIZES_TO_TRY = (1, 2, 4, 8, 16, 32, 64)  # the explorer's suggestions pick from these


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


# --- the figure ------------------------------------------------------------------------------


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
    total = cache.total_num_pages
    cols = min(total, 16 if total <= 128 else 32)  # pages per row of the pool
    pool_rows = cdiv(total, cols)
    table_rows = max(len(seq_ids), 1)
    fig = style.new_figure(11, 2.2 + 0.42 * pool_rows + 0.42 * table_rows + 1.5)
    grid = fig.add_gridspec(
        3, 1, height_ratios=[0.9 + 0.42 * pool_rows, 0.5 + 0.42 * table_rows, 1.3]
    )
    pool_ax, table_ax, slots_ax = (fig.add_subplot(grid[i]) for i in range(3))

    labels = _draw_pool(pool_ax, cache, seq_ids, cols)
    labels += _draw_page_table(table_ax, cache, seq_ids)
    _draw_slots(slots_ax, [cache.seq_len(s) for s in seq_ids], cache.page_size)

    pool_ax.legend(
        handles=_pool_handles(cache, seq_ids),
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    fig.suptitle("Paged KV cache: where each sequence's tokens live")
    style.fit_labels(fig, labels, [(pool_ax, "x"), (table_ax, "x"), (slots_ax, "x")])
    return fig


def _draw_pool(ax, cache, seq_ids: list, cols: int) -> list:
    """Every page of the pool, page p in row p // cols and column p % cols: a page of one of
    `seq_ids` in its colour (its empty slots hatched), another sequence's page grey, a free
    page white."""
    page_size, total = cache.page_size, cache.total_num_pages
    rows = cdiv(total, cols)
    owner_of = {}  # page -> (index in seq_ids, slots used)
    for i, s in enumerate(seq_ids):
        n = cache.seq_len(s)
        for j, page in enumerate(cache.pages(s)):
            owner_of[page] = (i, min(page_size, n - j * page_size))
    labels = []
    for page, owner in enumerate(cache.allocator.owners):
        x, y = page % cols, -(page // cols)
        if page in owner_of:
            i, used = owner_of[page]
            box = _draw_page_of(ax, x, y, i, used / page_size)
            # On a partly empty page the number sits on the hatching: give it a background.
            text_face = style.color(i) if used == page_size else "white"
            backed = used < page_size
        elif owner is not None:
            box = style.rectangle(ax, x, y, 1, 0.8, style.LIGHT_GREY, "", edge="white")
            text_face, backed = style.LIGHT_GREY, False
        else:
            box = style.rectangle(ax, x, y, 1, 0.8, "white", "", edge=style.GREY)
            text_face, backed = "white", False
        labels.append((style.box_label(ax, box, str(page), text_face, backed), box))
    ax.set_xlim(-0.05, cols + 0.05)
    ax.set_ylim(-rows + 0.5, 0.5)
    ax.set_xticks([c + 0.5 for c in range(cols)], range(cols))
    ax.set_yticks(
        [-r for r in range(rows)],
        [span(range(r * cols, min(total, (r + 1) * cols))) for r in range(rows)],
    )
    ax.set_xlabel("column: page number = first page of the row + column")
    ax.set_ylabel("pages")
    ax.set_title(
        f"The page pool: {cache.allocator.num_used} of total_num_pages={total} pages in use "
        f"(page_size={plural(page_size, 'slot')} each)",
        fontsize=10,
    )
    style.clean(ax)
    return labels


def _draw_page_of(ax, x: float, y: float, i: int, used: float):
    """A page of sequence i, `used` (a fraction) of it filled, the rest hatched: reserved,
    wasted. Returns the page's outline."""
    face = style.color(i)
    outline = style.rectangle(ax, x, y, 1, 0.8, "white", "", edge=face)
    inner_edge = "white" if style.hatch(i) else "none"  # hatching is drawn in the edge colour
    style.rectangle(ax, x, y, used, 0.8, face, style.hatch(i), edge=inner_edge)
    if used < 1:
        style.rectangle(ax, x + used, y, 1 - used, 0.8, "white", "////", edge=style.shade(face))
    return outline


def _draw_page_table(ax, cache, seq_ids: list) -> list:
    """`page_indices[:num_seqs]`: a row per sequence, its physical page in each logical page."""
    page_size, pages_per_seq = cache.page_size, cache.pages_per_seq
    labels = []
    for i, s in enumerate(seq_ids):
        pages = cache.pages(s)
        for j in range(pages_per_seq):
            if j < len(pages):
                box = style.rectangle(ax, j, -i, 1, 0.8, style.color(i), style.hatch(i))
                labels.append((style.box_label(ax, box, str(pages[j]), style.color(i)), box))
            else:
                style.rectangle(ax, j, -i, 1, 0.8, style.FAINT, "", edge="white")
    ax.set_xlim(-0.05, pages_per_seq + 0.05)
    ax.set_ylim(-max(len(seq_ids), 1) + 0.5, 0.5)
    step = max(1, math.ceil(pages_per_seq / 32))
    ax.set_xticks([j + 0.5 for j in range(0, pages_per_seq, step)], range(0, pages_per_seq, step))
    ax.set_yticks(
        [-i for i in range(len(seq_ids))],
        [f"seq {s}: kv_len={cache.seq_len(s)}" for s in seq_ids],
    )
    ax.set_xlabel(f"logical page j: tokens j*{page_size} to (j+1)*{page_size}-1")
    ax.set_title(
        f"The page table page_indices[:num_seqs]: physical page of each logical page "
        f"(pages_per_seq={pages_per_seq}; empty cells are padding, never read)",
        fontsize=10,
    )
    style.clean(ax)
    return labels


def _draw_slots(ax, kv_lens: list[int], page_size: int) -> None:
    """Two bars, the slots a contiguous and a paged cache reserve, the wasted part hatched."""
    usage = slot_usage(kv_lens, page_size)
    bars = [
        (
            f"contiguous\n{len(kv_lens)} x longest ({max(kv_lens, default=0)})",
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
        ax.barh(
            y,
            reserved - wasted,
            color=style.OKABE_ITO["blue"],
            height=0.6,
            label="used slots (tokens)" if y == 0 else None,
        )
        ax.barh(
            y,
            wasted,
            left=reserved - wasted,
            color="white",
            hatch="////",
            edgecolor=style.OKABE_ITO["vermillion"],
            height=0.6,
            label="reserved but empty (wasted)" if y == 0 else None,
        )
        pct = 100 * wasted / reserved if reserved else 0.0
        ax.text(
            reserved, y, f"  {wasted} wasted of {reserved} ({pct:.0f}%)", va="center", fontsize=9
        )
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.set_xlim(0, max(usage.contiguous_slots, usage.paged_slots, 1) * 1.4)
    ax.set_ylim(-0.6, len(bars) - 0.4)
    ax.set_xlabel("KV slots (one slot holds one token's K and V)")
    ax.set_title(
        "Memory reserved: paged cache against one contiguous buffer per sequence", fontsize=10
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _pool_handles(cache, seq_ids: list) -> list[Patch]:
    """The pool's legend: each sequence, then the kinds of page the pool shows."""
    handles = [style.legend_patch(i, f"seq {s}") for i, s in enumerate(seq_ids)]
    handles.append(
        Patch(
            facecolor="white",
            edgecolor=style.GREY,
            hatch="////",
            label="empty slots of a last page",
        )
    )
    if cache.allocator.num_used > sum(len(cache.pages(s)) for s in seq_ids):
        handles.append(
            Patch(facecolor=style.LIGHT_GREY, edgecolor="white", label="page of another sequence")
        )
    if cache.allocator.num_free:
        handles.append(Patch(facecolor="white", edgecolor=style.GREY, label="free page"))
    return handles


# --- the explorer ----------------------------------------------------------------------------


def page_table_explorer(
    kv_lens: str = "37, 5, 120",
    page_size: int = 16,
    total_num_pages: int = 24,
    order: str = "in order",
) -> Explorer:
    """Sequences of your lengths in a real `PagedKVCache`: the page pool (owner of each page),
    the page table, the slots wasted against a contiguous cache sized to the longest
    sequence, and the `kv_lens` and `page_indices` arrays that attention reads.

    A pool too small shows the cache's own `KVCacheError`:

    >>> ex = page_table_explorer(kv_lens="37, 5, 120", total_num_pages=4)
    >>> print(ex.text.splitlines()[1])
    Out of pages: appending n_new=120 tokens to seq_id=2 (seq_len=0) needs 8 new pages,
    but only num_free=0 of total_num_pages=4 are free.
    """
    controls = {
        "kv_lens": text_input("kv_lens", kv_lens, "e.g. 37, 5, 120"),
        "page_size": int_input("page_size", page_size),
        "total_num_pages": int_input("total_num_pages", total_num_pages),
        "order": dropdown("order", FILL_ORDERS, order),
    }
    return Explorer(
        "The paged KV cache",
        controls,
        _render_page_table,
        _note,
    )


def _note(values: dict) -> str:
    """The line under the title: what to try with the typed input, once it can be drawn."""
    note = "Sequence lengths in tokens, separated by commas. "
    page_size, total = values["page_size"], values["total_num_pages"]
    try:
        kv_lens = parse_ints(values["kv_lens"], "kv_lens")
        _check_limits(kv_lens, page_size, total)
    except InputProblem:  # the message under the controls says what is wrong
        return note
    if page_size < 1 or total < 1:  # and so does the cache's
        return note
    return note + _page_size_suggestions(kv_lens, page_size, total)


def _page_size_suggestions(kv_lens, page_size: int, total_num_pages: int) -> str:
    """What to try, computed so that each suggestion does what it says."""
    fits = [p for p in PAGE_SIZES_TO_TRY if pool_pages_needed(kv_lens, p) <= total_num_pages]
    if not fits:
        return ""
    sizes = list(dict.fromkeys([fits[0], *([page_size] if page_size in fits else []), fits[-1]]))
    text = f"Try page_size {and_join(sizes)}: the pool of {total_num_pages} pages holds them. "
    smaller = [p for p in PAGE_SIZES_TO_TRY if p < fits[0]]
    if smaller and pool_pages_needed(kv_lens, smaller[0]) <= MAX_PAGES:
        need = pool_pages_needed(kv_lens, smaller[0])
        text += f"page_size {smaller[0]} needs {need} pages: set total_num_pages to {need} first. "
    need = pool_pages_needed(kv_lens, page_size)
    if need > 1:
        text += f"With page_size {page_size}, see a pool of fewer than {need} pages run out."
    return text


def _pool_hint(kv_lens, page_size: int, total_num_pages: int) -> str:
    """How to make these sequences fit, with the explorer's own controls."""
    need = pool_pages_needed(kv_lens, page_size)
    fixes = []
    if need <= MAX_PAGES:
        fixes.append(f"set total_num_pages to {need}")
    bigger = [
        p
        for p in (*PAGE_SIZES_TO_TRY, 128, 256, 512, 1024, 2048, MAX_PAGE_SIZE)
        if p > page_size and pool_pages_needed(kv_lens, p) <= total_num_pages
    ]
    if bigger:
        fixes.append(f"use page_size {bigger[0]} (or bigger)")
    if not fixes:
        return "these sequences need more pages than this explorer draws: use fewer tokens."
    return (
        f"these sequences need {need} pages of {plural(page_size, 'slot')}; the pool has "
        f"{total_num_pages}. In this explorer, {', or '.join(fixes)}."
    )


def _check_limits(kv_lens: list[int], page_size: int, total: int) -> None:
    """What this explorer draws at most, checked before the cache is built."""
    for i, n in enumerate(kv_lens):
        check_at_least(f"kv_lens[{i}]", n, 0, "A sequence holds 0 or more tokens.")
        check_at_most(f"kv_lens[{i}]", n, MAX_SEQ_LEN, "Type a shorter sequence.")
    check_at_most("len(kv_lens)", len(kv_lens), MAX_SEQS, "Type fewer sequences.")
    check_at_most("total_num_pages", total, MAX_PAGES, "Use a smaller pool.")
    check_at_most("page_size", page_size, MAX_PAGE_SIZE, "Use smaller pages.")


def _render_page_table(values: dict):
    kv_lens = parse_ints(values["kv_lens"], "kv_lens")
    page_size, total = values["page_size"], values["total_num_pages"]
    _check_limits(kv_lens, page_size, total)
    try:
        cache, ids = fill_cache(
            kv_lens, page_size=page_size, total_num_pages=total, order=values["order"]
        )
    except KVCacheError as err:  # the cache's message; a hint that works in the explorer
        if not err.message.startswith("Out of pages"):
            raise
        raise KVCacheError(err.message, _pool_hint(kv_lens, page_size, total)) from None
    return _pool_status(cache, ids, kv_lens), page_table_figure(cache, ids), _details(cache, ids)


def _pool_status(cache, ids: list, kv_lens: list[int]) -> str:
    usage = slot_usage(kv_lens, cache.page_size)
    ours = sum(len(cache.pages(s)) for s in ids)
    return (
        f"{plural(len(ids), 'sequence')}: {plural(usage.tokens, 'token')} in "
        f"{plural(ours, 'page')} of {plural(cache.page_size, 'slot')}; "
        f"the pool has {cache.total_num_pages} pages: {ours} ours, "
        f"{cache.allocator.num_used - ours} of other sequences, {cache.allocator.num_free} "
        f"free. Paged: {usage.paged_wasted} of {usage.paged_slots} slots wasted; contiguous "
        f"(each sequence sized to the longest): {usage.contiguous_wasted} of "
        f"{usage.contiguous_slots}."
    )


def _details(cache, ids: list) -> str:
    """A row per sequence, then the arrays attention reads, from `cache.batch_metadata`."""
    page_size = cache.page_size
    rows = []
    for s in ids:
        pages, length = cache.pages(s), cache.seq_len(s)
        reserved = len(pages) * page_size
        rows.append((f"seq {s}", length, len(pages), str(list(pages)), reserved, reserved - length))
    header = (
        "sequence",
        "kv_len",
        "pages of the pool",
        "which, in token order",
        "slots reserved",
        "empty slots of its last page",
    )
    kv_lens, page_indices, _, num_seqs = cache.batch_metadata([(s, 0) for s in ids])
    kv_lens, page_indices, n = np.asarray(kv_lens), np.asarray(page_indices), int(num_seqs[0])
    max_num_seqs, pages_per_seq = page_indices.shape
    first = "page_indices[:num_seqs] = "
    arrays = (
        f"kv_lens[:num_seqs]      = {kv_lens[:n].tolist()}\n"
        f"{first}{array_rows(page_indices[:n], indent=len(first))}\n"
        f"num_seqs                = {np.asarray(num_seqs).tolist()}\n\n"
        f"(from cache.batch_metadata: kv_lens is i32[max_num_seqs={max_num_seqs}] and "
        f"page_indices i32[max_num_seqs, pages_per_seq={pages_per_seq}];\n"
        f" columns past a sequence's pages, and rows past num_seqs, are padding (0), "
        f"never read.)"
    )
    return table(header, rows) + pre(arrays)
