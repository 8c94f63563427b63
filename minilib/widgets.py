"""Explorers: small ipywidgets tools to try one idea of the course with your own numbers.

    head_grouping_explorer()     which q heads share each KV head; the kv_pages head layout
    page_table_explorer()        a real PagedKVCache: pool, page table, wasted slots
    ragged_batch_explorer()      a mixed prefill/decode batch: cu_q_lens, kv_lens, masks
    validation_playground()      common mistakes, run through the real validators
    kernel_schedule_explorer()   the Pallas kernel's grid, KV blocks and DMAs

Each returns an `Explorer`, a `VBox` to display as the last line of a cell. Everything it
shows lives in widget state (text in `HTML` widgets, figures as PNG bytes in an `Image`), so
it works in Jupyter and Colab with ipywidgets 7 or 8 and no front-end extension, and can be
checked without a browser:

    >>> ex = head_grouping_explorer()
    >>> ex.controls["num_kv_heads"].value = 8
    >>> "num_q_heads=12 must be divisible by num_kv_heads=8" in ex.text
    True

Errors are shown inside the explorer, never raised: the validators' own messages (an
`RPAInputError` with its hint), or a note on the typed input that could not be read.
"""

from __future__ import annotations

import functools
import html
import inspect
import re
import textwrap
from collections.abc import Callable

import ipywidgets as widgets
import jax
import jax.numpy as jnp
import numpy as np

from minilib import viz
from minilib.batch import RaggedBatch, make_batch, seq_kind
from minilib.errors import InputProblem, KVCacheError, RPAInputError, ScheduleTooBig
from minilib.heads import (
    attention_kind,
    check_head_counts,
    combined_head_slots,
    head_groups,
    valid_num_kv_heads,
)
from minilib.kv_cache import FILL_ORDERS, fill_cache, pool_pages_needed
from minilib.mistakes import MISTAKES, SEQ_LENS, base_batch, run_mistake
from minilib.validation import dynamic_validate_inputs
from minilib.viz import plural, span

__all__ = [
    "Explorer",
    "head_grouping_explorer",
    "kernel_schedule_explorer",
    "page_table_explorer",
    "parse_ints",
    "parse_optional_int",
    "ragged_batch_explorer",
    "validation_playground",
]

# Colours of the message box (Okabe-Ito): problems in vermillion, all-clear in bluish green.
_PROBLEM, _OK = viz.OKABE_ITO["vermillion"], viz.OKABE_ITO["bluish green"]


class Explorer(widgets.VBox):
    """An explorer: a row of controls, then what they show.

    Data flows one way: the control values go to `render(values)`, which returns what the
    views show, `(status, figure, details)`, and never writes a control. (A control whose
    choices depend on others, like the schedule's grid_step, is updated by an observer of
    those controls, before the render.)

    Attributes:
      controls: name -> input widget. Set `.value` and the explorer redraws.
      views: what is shown, all in widget state:
        "message": HTML, the status line (green), or the error with its hint (vermillion);
        "figure":  Image, the figure as PNG bytes (hidden, with empty bytes, on an error);
        "details": HTML, tables and the arrays.

    >>> def square(values):  # (status, figure, details)
    ...     return f"{values['n']} squared is {values['n'] ** 2}", None, ""
    >>> ex = Explorer("Squares", {"n": widgets.IntText(value=3)}, square)
    >>> ex.text
    '3 squared is 9\\n\\n'
    >>> ex.controls["n"].value = 4  # the explorer redraws
    >>> ex.text
    '4 squared is 16\\n\\n'
    """

    def __init__(self, title: str, controls: dict, render: Callable, note: str = ""):
        self.controls = controls
        self._render = render
        self._drawn: dict | None = None  # the control values the views show
        self.views = {
            "message": widgets.HTML(),
            "figure": widgets.Image(
                format="png", layout=widgets.Layout(max_width="100%", height="auto")
            ),
            "details": widgets.HTML(),
        }
        header = widgets.HTML(
            f"<div style='font-size:1.15em;font-weight:bold;margin:4px 0'>{html.escape(title)}"
            f"</div><div style='color:#555'>{note}</div>"
        )
        row = widgets.HBox(list(controls.values()), layout=widgets.Layout(flex_flow="row wrap"))
        super().__init__([header, row, *self.views.values()])
        for control in controls.values():
            control.observe(self._on_change, names="value")
        self.refresh()

    def refresh(self) -> None:
        """Redraw from the current control values. Never raises: problems are shown."""
        message, figure, details = self.views.values()
        self._drawn = self.values()
        try:
            status, fig, table = self._render(dict(self._drawn))
        except Exception as err:  # shown, so the explorer keeps working
            message.value = _error_html(err)
            figure.value, figure.layout.display = b"", "none"
            details.value = ""
            return
        # A render may report a problem it found (the playground's caught error) as its status.
        message.value = _error_html(status) if isinstance(status, Exception) else _box(status, _OK)
        if fig is None:
            figure.value, figure.layout.display = b"", "none"
        else:
            figure.value, figure.layout.display = viz.figure_png(fig), None
        details.value = table

    def values(self) -> dict:
        """name -> value of each control."""
        return {name: control.value for name, control in self.controls.items()}

    @property
    def text(self) -> str:
        """The text of every HTML view, without markup: what a reader sees."""
        parts = [self.views["message"].value, self.views["details"].value]
        text = re.sub(r"</t[dh]>", "\t", "\n".join(parts))  # table cells apart, rows on lines
        text = re.sub(r"<br>|</tr>|</div>|<pre[^>]*>|</pre>", "\n", text)
        return html.unescape(re.sub(r"<[^>]+>", "", text))

    def _on_change(self, change) -> None:
        # One change can reach here twice: a control whose options follow another control
        # (the schedule's grid_step) is updated by its own observer before this one runs,
        # and both report. The views are drawn once per new set of values.
        if self.values() != self._drawn:
            self.refresh()


# --- head grouping -------------------------------------------------------------------------

MAX_HEADS = 256  # drawn; more would be a smear of thin boxes


def head_grouping_explorer(num_q_heads: int = 12, num_kv_heads: int = 4) -> Explorer:
    """Pick `num_q_heads` and `num_kv_heads`; see which q heads share each KV head (one colour
    per group) and where each K and V head lives on the combined `kv_pages` head axis.

    An invalid pair shows `check_head_counts`'s own message and hint.

    >>> ex = head_grouping_explorer(32, 8)
    >>> print(ex.text.splitlines()[0])
    GQA: each of the 8 KV heads serves 4 q heads; q head i uses KV head i // 4.
    Valid num_kv_heads for num_q_heads=32: [1, 2, 4, 8, 16, 32].
    """
    controls = {
        "num_q_heads": _int_text("num_q_heads", num_q_heads),
        "num_kv_heads": _int_text("num_kv_heads", num_kv_heads),
    }
    return Explorer(
        "Head grouping: MHA, GQA, MQA",
        controls,
        _render_head_grouping,
        "Try 32/8 (Llama 3 8B), 8/1 (MQA), 8/8 (MHA), and 12/8, which is not allowed.",
    )


def _render_head_grouping(values: dict):
    num_q_heads, num_kv_heads = values["num_q_heads"], values["num_kv_heads"]
    if max(num_q_heads, num_kv_heads) > MAX_HEADS:
        raise InputProblem(
            f"num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}: this explorer draws at "
            f"most {MAX_HEADS} heads."
        )
    valid = valid_num_kv_heads(num_q_heads)  # raises for num_q_heads < 1
    check_head_counts(num_q_heads, num_kv_heads)  # the validator: its message, its hint
    groups = head_groups(num_q_heads, num_kv_heads)
    group = num_q_heads // num_kv_heads
    status = (
        f"<b>{attention_kind(num_q_heads, num_kv_heads)}</b>: each of the {num_kv_heads} KV "
        f"heads serves {group} q head{'s' if group > 1 else ''}; q head i uses KV head "
        f"i // {group}. Valid num_kv_heads for num_q_heads={num_q_heads}: {valid}."
    )
    slots = combined_head_slots(num_kv_heads)
    rows = [
        (
            f"KV head {h}",
            span(q_heads),
            f"{slots.index(('K', h))}",
            f"{slots.index(('V', h))}",
        )
        for h, q_heads in enumerate(groups)
    ]
    table = _table(("KV head", "q heads", "K slot in kv_pages", "V slot in kv_pages"), rows)
    shapes = (
        f"q: [max_num_batched_tokens, num_q_heads={num_q_heads}, head_dim]<br>"
        f"kv_pages: [total_num_pages, page_size, 2*num_kv_heads={2 * num_kv_heads}, head_dim]"
    )
    return status, viz.head_grouping_figure(num_q_heads, num_kv_heads), shapes + table


# --- the paged KV cache ---------------------------------------------------------------------

# Drawing is the slow part (matplotlib, a box per page): these bound the boxes a figure draws.
MAX_PAGES, MAX_PAGE_SIZE, MAX_SEQS, MAX_SEQ_LEN = 256, 4096, 16, 1_000_000


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
        "kv_lens": _text("kv_lens", kv_lens, "e.g. 37, 5, 120"),
        "page_size": _int_text("page_size", page_size),
        "total_num_pages": _int_text("total_num_pages", total_num_pages),
        "order": widgets.Dropdown(
            options=list(FILL_ORDERS), value=order, description="order", style=_STYLE
        ),
    }
    return Explorer(
        "The paged KV cache",
        controls,
        _render_page_table,
        "Sequence lengths in tokens, separated by commas. "
        + _page_size_suggestions(parse_ints(kv_lens, "kv_lens"), page_size, total_num_pages),
    )


PAGE_SIZES_TO_TRY = (1, 2, 4, 8, 16, 32, 64)


def _page_size_suggestions(kv_lens, page_size: int, total_num_pages: int) -> str:
    """What to try, computed so that each suggestion does what it says."""
    fits = [p for p in PAGE_SIZES_TO_TRY if pool_pages_needed(kv_lens, p) <= total_num_pages]
    if not fits:
        return ""
    sizes = list(dict.fromkeys([fits[0], *([page_size] if page_size in fits else []), fits[-1]]))
    text = f"Try page_size {_and(sizes)}: the pool of {total_num_pages} pages holds them. "
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


def _render_page_table(values: dict):
    kv_lens = parse_ints(values["kv_lens"], "kv_lens")
    page_size, total = values["page_size"], values["total_num_pages"]
    for i, n in enumerate(kv_lens):
        if n < 0:
            raise InputProblem(f"kv_lens[{i}]={n} is negative: a sequence holds 0 or more tokens.")
        if n > MAX_SEQ_LEN:
            raise InputProblem(
                f"kv_lens[{i}]={n} is longer than this explorer handles ({MAX_SEQ_LEN})."
            )
    if len(kv_lens) > MAX_SEQS:
        raise InputProblem(f"{len(kv_lens)} sequences: this explorer draws at most {MAX_SEQS}.")
    if total > MAX_PAGES or page_size > MAX_PAGE_SIZE:
        raise InputProblem(
            f"total_num_pages={total}, page_size={page_size}: this explorer draws at most "
            f"{MAX_PAGES} pages of at most {MAX_PAGE_SIZE} slots."
        )
    try:
        cache, ids = fill_cache(
            kv_lens, page_size=page_size, total_num_pages=total, order=values["order"]
        )
    except KVCacheError as err:  # the cache's message; a hint that works in the explorer
        if not err.message.startswith("Out of pages"):
            raise
        raise KVCacheError(err.message, _pool_hint(kv_lens, page_size, total)) from None
    cache_kv_lens, page_indices, _, num_seqs = cache.batch_metadata([(s, 0) for s in ids])
    n = int(num_seqs[0])
    usage = viz.slot_usage(kv_lens, page_size)
    ours = sum(len(cache.pages(s)) for s in ids)
    status = (
        f"{plural(len(ids), 'sequence')} hold{'s' if len(ids) == 1 else ''} "
        f"{plural(usage.tokens, 'token')} in {plural(ours, 'page')} of "
        f"{plural(page_size, 'slot')}; "
        f"the pool has {total} pages: {ours} ours, {cache.allocator.num_used - ours} of other "
        f"sequences, {cache.allocator.num_free} free. Paged: {usage.paged_wasted} of "
        f"{usage.paged_slots} slots wasted; contiguous (each sequence sized to the longest): "
        f"{usage.contiguous_wasted} of {usage.contiguous_slots}."
    )
    rows = []
    for s, length in zip(ids, kv_lens, strict=True):
        pages = cache.pages(s)
        rows.append(
            (
                f"seq {s}",
                length,
                len(pages),
                str(list(pages)),
                len(pages) * page_size,
                len(pages) * page_size - length,
            )
        )
    table = _table(
        (
            "sequence",
            "kv_len",
            "pages of the pool",
            "which, in token order",
            "slots reserved",
            "empty slots of its last page",
        ),
        rows,
    )
    cache_kv_lens, page_indices = np.asarray(cache_kv_lens), np.asarray(page_indices)
    max_num_seqs, pages_per_seq = page_indices.shape
    arrays = (
        f"kv_lens[:num_seqs]      = {cache_kv_lens[:n].tolist()}\n"
        f"page_indices[:num_seqs] = {_rows(page_indices[:n])}\n"
        f"num_seqs                = {np.asarray(num_seqs).tolist()}\n\n"
        f"(from cache.batch_metadata: kv_lens is i32[max_num_seqs={max_num_seqs}] and "
        f"page_indices i32[max_num_seqs, pages_per_seq={pages_per_seq}];\n"
        f" columns past a sequence's pages, and rows past num_seqs, are padding (0), "
        f"never read.)"
    )
    return status, viz.page_table_figure(cache, ids), table + _pre(arrays)


# --- the ragged batch -----------------------------------------------------------------------

MAX_TOKENS, MAX_KV_LEN = 4096, 8192
MAX_MASK_CELLS = 2**22  # (q row, key) cells of all the masks drawn


def ragged_batch_explorer(
    q_lens: str = "6, 1, 4, 1", kv_lens: str = "6, 20, 12, 9", sliding_window: str = ""
) -> Explorer:
    """A mixed prefill/decode batch of your (q_len, kv_len) pairs, built with `make_batch`
    and checked with `dynamic_validate_inputs`: its `cu_q_lens` and `kv_lens`, the packed q
    rows of each sequence, and each sequence's causal mask (offset by kv_len - q_len), with
    an optional `sliding_window` (empty for None).

    >>> ex = ragged_batch_explorer(q_lens="6, 1", kv_lens="6, 20")
    >>> print(ex.text.splitlines()[0])
    Valid: 2 sequences (1 prefill, 1 decode), 7 q rows; no sliding window.
    >>> ex.controls["q_lens"].value = "3, 1"
    >>> ex.controls["kv_lens"].value = "2, 9"  # q_len > kv_len: the validator's message
    >>> print(ex.text.splitlines()[1])
    sequence 0: (q_len=3, kv_len=2) needs 0 <= q_len <= kv_len.
    """
    controls = {
        "q_lens": _text("q_lens", q_lens, "e.g. 6, 1, 4"),
        "kv_lens": _text("kv_lens", kv_lens, "e.g. 6, 20, 12"),
        "sliding_window": _text("sliding_window", sliding_window, "empty: None"),
    }
    return Explorer(
        "A ragged batch: prefill, chunks and decodes together",
        controls,
        _render_ragged_batch,
        "One q_len and one kv_len per sequence (kv_len counts the new tokens too). "
        "Leave sliding_window empty for None.",
    )


def _render_ragged_batch(values: dict):
    q_lens, kv_lens = _q_and_kv_lens(values["q_lens"], values["kv_lens"])
    window = parse_optional_int(values["sliding_window"], "sliding_window")
    if len(q_lens) > MAX_SEQS or sum(q_lens) > MAX_TOKENS or max(kv_lens, default=0) > MAX_KV_LEN:
        raise InputProblem(
            f"this explorer draws at most {MAX_SEQS} sequences, {MAX_TOKENS} q rows in all, "
            f"and kv_len up to {MAX_KV_LEN}."
        )
    cells = sum(q * kv for q, kv in zip(q_lens, kv_lens, strict=True))
    if cells > MAX_MASK_CELLS:
        raise InputProblem(
            f"the masks have {cells} (q row, key) cells in all, sum of q_len * kv_len: this "
            f"explorer draws at most {MAX_MASK_CELLS}. Try shorter sequences."
        )
    batch = make_batch(
        list(zip(q_lens, kv_lens, strict=True)), num_q_heads=2, num_kv_heads=1, head_dim=8
    )
    dynamic_validate_inputs(*batch.args(), sliding_window=window)
    kinds = [seq_kind(q, kv) for q, kv in batch.seq_lens]
    status = (
        f"Valid: {len(kinds)} sequences ("
        + ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
        + f"), {batch.num_tokens} q rows; "
        + ("no sliding window." if window is None else f"sliding_window={window}.")
    )
    return status, viz.ragged_batch_figure(batch, window), _ragged_details(batch, window)


def _ragged_details(batch: RaggedBatch, window: int | None) -> str:
    cu = np.asarray(batch.cu_q_lens)
    rows = []
    for i, (q_len, kv_len) in enumerate(batch.seq_lens):
        offset = kv_len - q_len
        if q_len == 0:  # idle, kv_len 0 included: no row, so no key seen
            sees = ["(no q rows)", "(no q rows)"]
        else:
            sees = [_keys_seen(position, window) for position in (offset, kv_len - 1)]
        rows.append(
            (
                f"seq {i}",
                seq_kind(q_len, kv_len),
                q_len,
                kv_len,
                f"[{cu[i]}, {cu[i + 1]})",
                offset,
                *sees,
            )
        )
    table = _table(
        ("sequence", "kind", "q_len", "kv_len", "packed q rows", "kv_len - q_len")
        + ("first q row sees", "last q row sees"),
        rows,
    )
    arrays = (
        f"cu_q_lens = {cu.tolist()}\nkv_lens   = {np.asarray(batch.kv_lens).tolist()}\n"
        f"num_seqs  = {np.asarray(batch.num_seqs).tolist()}\n\n{batch.describe()}"
    )
    return table + _pre(arrays)


def _keys_seen(position: int, window: int | None) -> str:
    first = 0 if window is None else max(0, position - window + 1)
    return f"keys {span(range(first, position + 1))}"


# --- the validation playground --------------------------------------------------------------


def validation_playground(mistake: str = "12 q heads with 8 KV heads") -> Explorer:
    """Pick a common mistake: the playground builds a real batch with `make_batch`, breaks it
    as the mistake does, runs the real `dynamic_validate_inputs`, and shows the exact error
    with its hint, or that the inputs are valid.

    >>> ex = validation_playground("12 q heads with 8 KV heads")
    >>> print(*ex.text.splitlines()[:2], sep="\\n")
    RPAInputError
    num_q_heads=12 must be divisible by num_kv_heads=8
    """
    controls = {
        "mistake": widgets.Dropdown(
            options=list(MISTAKES),
            value=mistake,
            description="mistake",
            style=_STYLE,
            layout=widgets.Layout(width="520px"),
        )
    }
    return Explorer(
        "Validation playground: what the validators say",
        controls,
        _render_mistake,
        "Each choice runs the code shown through dynamic_validate_inputs.",
    )


def _render_mistake(values: dict):
    fn = MISTAKES[values["mistake"]]
    args, options = fn(base_batch())
    code = textwrap.dedent(inspect.getsource(fn))
    shapes = "\n".join(
        f"{name:13s}: {_describe_array(a)}"
        for name, a in zip(
            ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"), args, strict=True
        )
    )
    if options:
        shapes += "\noptions      : " + ", ".join(f"{k}={v!r}" for k, v in options.items())
    details = (
        "<b>The mistake</b> (b is a correct batch: make_batch(SEQ_LENS, num_q_heads=4, "
        f"num_kv_heads=2, head_dim=8, page_size=8), SEQ_LENS = {SEQ_LENS}):"
        + _pre(code)
        + "<b>What reaches dynamic_validate_inputs(*args, **options)</b>:"
        + _pre(shapes)
    )
    err = run_mistake(values["mistake"])  # the real validator on the same inputs
    if err is not None:
        return err, None, details
    return "Valid: dynamic_validate_inputs accepts these inputs.", None, details


def _describe_array(a) -> str:
    shape = getattr(a, "shape", None)
    if shape is None:
        return repr(a)
    value = f" = {np.asarray(a).tolist()}" if a.ndim <= 2 and a.size <= 16 else ""
    return f"{a.dtype}{list(shape)}{value}"


# --- the kernel schedule --------------------------------------------------------------------

MAX_COMPUTES = 400  # KV blocks drawn
MAX_GRID_STEPS = 256  # grid steps listed (one entry each in the grid_step menu)


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
    >>> ex.text.split(";")[0]
    'grid = (2 heads blocks, 3 q blocks) = 6 grid steps'
    >>> ex.controls["grid_step"].options  # the steps of that grid, to zoom in on
    ('all grid steps', '(0, 0)', '(0, 1)', '(0, 2)', '(1, 0)', '(1, 1)', '(1, 2)')
    """
    controls = {
        "q_lens": _text("q_lens", q_lens, "e.g. 12, 1, 6"),
        "kv_lens": _text("kv_lens", kv_lens, "e.g. 12, 40, 30"),
        "num_q_heads": _int_text("num_q_heads", num_q_heads),
        "num_kv_heads": _int_text("num_kv_heads", num_kv_heads),
        "page_size": _int_text("page_size", page_size),
        "num_kv_pages_per_block": _text(
            "num_kv_pages_per_block", num_kv_pages_per_block, "default"
        ),
        "num_queries_per_block": _text("num_queries_per_block", num_queries_per_block, "default"),
        "sliding_window": _text("sliding_window", sliding_window, "empty: None"),
        "grid_step": widgets.Dropdown(
            options=[ALL_STEPS], value=ALL_STEPS, description="grid_step", style=_STYLE
        ),
    }
    plan = functools.lru_cache(maxsize=1)(_plan)  # the menu and the view need the same plan

    def list_grid_steps(change=None) -> None:
        """The grid_step menu offers the steps of the planned grid, keeping the choice if the
        step still exists. It runs before the view is drawn, as the first observer of the
        controls the plan is made from."""
        try:
            schedule = plan(*(controls[name].value for name in PLAN_INPUTS))
            steps = [ALL_STEPS] + [str(step) for step in schedule.steps()]
        except Exception:  # no plan: the view shows why
            steps = [ALL_STEPS]
        menu = controls["grid_step"]
        if list(menu.options) != steps:
            chosen = menu.value if menu.value in steps else ALL_STEPS
            menu.options = steps  # resets the choice to the first option ...
            menu.value = chosen  # ... so it is set back

    list_grid_steps()
    for name in PLAN_INPUTS:
        controls[name].observe(list_grid_steps, names="value")

    def render(values: dict):
        schedule = plan(*(values[name] for name in PLAN_INPUTS))
        chosen = values["grid_step"]
        step = None if chosen == ALL_STEPS else tuple(int(x) for x in chosen.strip("()").split(","))
        return (
            _schedule_status(schedule),
            viz.kernel_schedule_figure(schedule, step),
            _schedule_details(schedule, step),
        )

    return Explorer(
        "The kernel's schedule: grid, KV blocks, double buffering",
        controls,
        render,
        "Change the block sizes and watch the grid and the copies change. head_dim=128, "
        "float32; empty block sizes use the kernel's defaults.",
    )


ALL_STEPS = "all grid steps"
HEAD_DIM = 128
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
    """The schedule of the typed batch and block sizes. The limits are checked first, so that
    nothing big is built, planned or drawn."""
    from minilib.schedule import plan_schedule  # imports the Pallas kernel

    q_lens, kv_lens = _q_and_kv_lens(q_lens, kv_lens)
    if len(q_lens) > MAX_SEQS or sum(q_lens) > MAX_TOKENS or num_q_heads > MAX_HEADS:
        raise InputProblem(
            f"this explorer draws at most {MAX_SEQS} sequences, {MAX_TOKENS} q rows in all and "
            f"{MAX_HEADS} q heads."
        )
    valid_num_kv_heads(num_q_heads)  # raises for num_q_heads < 1
    if page_size < 1:
        raise InputProblem(
            f"page_size={page_size} must be positive: a page holds at least one token."
        )
    if page_size > MAX_PAGE_SIZE or max(kv_lens, default=0) > MAX_KV_LEN:
        raise InputProblem(
            f"this explorer draws page_size up to {MAX_PAGE_SIZE} and kv_len up to {MAX_KV_LEN}."
        )
    # Only the shapes and dtypes of q and kv_pages matter to the schedule: the index arrays
    # come from a real batch, q and kv_pages are shapes, so big head counts cost no memory.
    batch = make_batch(
        list(zip(q_lens, kv_lens, strict=True)),
        num_q_heads=1,
        num_kv_heads=1,
        head_dim=1,
        page_size=page_size,
    )
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
        raise InputProblem(f"{err} This explorer draws at most {MAX_COMPUTES} KV blocks "
                           f"and {MAX_GRID_STEPS} grid steps.") from None  # fmt: skip


def _schedule_status(schedule) -> str:
    computes = schedule.computes()
    starts = [e for e in schedule.events if e.kind == "start"]
    fetched = [(e.heads_blk, e.seq, e.kv_blk) for e in starts]
    again = len(fetched) - len(set(fetched))
    heads, q_blocks = schedule.grid
    return (
        f"grid = ({plural(heads, 'heads block')}, {plural(q_blocks, 'q block')}) = "
        f"{plural(heads * q_blocks, 'grid step')}; "
        f"{len(computes)} KV blocks computed, {len(starts)} DMAs. {again} DMAs copy a KV block "
        f"already copied for another q block of the same sequence. "
        f"num_queries_per_block={schedule.num_queries_per_block}, "
        f"num_kv_pages_per_block={schedule.num_kv_pages_per_block} "
        f"({schedule.kv_tokens_per_block} tokens per KV block)."
    )


def _schedule_details(schedule, step) -> str:
    from minilib.schedule import describe_event

    bq = schedule.num_queries_per_block
    rows = []
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
    table = _table(
        ("grid step", "q rows", "sequences", "KV blocks computed", "pages copied (DMAs started)"),
        rows,
    )
    if step is None:
        listing = schedule.describe()
    else:
        listing = f"grid step {step}:\n" + "\n".join(
            "  " + describe_event(e) for e in schedule.steps()[step]
        )
    return table + _pre(listing)


# --- reading typed input --------------------------------------------------------------------


def parse_ints(text: str, name: str) -> list[int]:
    """Whole numbers separated by commas or spaces. Raises `InputProblem` naming the bad one.

    >>> parse_ints("37, 5 120", "seq_lens")
    [37, 5, 120]
    """
    items = [t for t in re.split(r"[,\s]+", text.strip().strip("[]()")) if t]
    numbers = []
    for i, item in enumerate(items):
        try:
            numbers.append(int(item))
        except ValueError:
            raise InputProblem(
                f"{name}: {item!r} (entry {i}) is not a whole number. Type whole numbers "
                f"separated by commas, e.g. 37, 5, 120."
            ) from None
    return numbers


def _q_and_kv_lens(q_text: str, kv_text: str) -> tuple[list[int], list[int]]:
    """The typed q_lens and kv_lens: one of each per sequence."""
    q_lens, kv_lens = parse_ints(q_text, "q_lens"), parse_ints(kv_text, "kv_lens")
    if len(q_lens) != len(kv_lens):
        raise InputProblem(
            f"q_lens has {len(q_lens)} entries but kv_lens has {len(kv_lens)}: give one q_len "
            "and one kv_len per sequence."
        )
    return q_lens, kv_lens


def parse_optional_int(text: str, name: str) -> int | None:
    """A whole number, or None for an empty field (or "None"). Raises `InputProblem` naming
    the field otherwise.

    >>> parse_optional_int(" 4 ", "sliding_window"), parse_optional_int("", "sliding_window")
    (4, None)
    >>> parse_optional_int("four", "sliding_window")
    Traceback (most recent call last):
    ...
    minilib.errors.InputProblem: sliding_window: 'four' is not a whole number. Type a number,
    or leave it empty for None.
    """
    text = text.strip()
    if text in ("", "None", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise InputProblem(
            f"{name}: {text!r} is not a whole number. Type a number, or leave it empty for None."
        ) from None


# --- small helpers --------------------------------------------------------------------------

_STYLE = {"description_width": "initial"}


def _int_text(description: str, value: int) -> widgets.IntText:
    # Updates as you type: each change of a number redraws the explorer. Text boxes,
    # which take lists, update on Enter (or leaving the box), not at each comma.
    return widgets.IntText(
        value=value,
        description=description,
        style=_STYLE,
        continuous_update=True,
        layout=widgets.Layout(width="210px"),
    )


def _text(description: str, value: str, placeholder: str) -> widgets.Text:
    return widgets.Text(
        value=value,
        description=description,
        placeholder=placeholder,
        style=_STYLE,
        continuous_update=False,
        layout=widgets.Layout(width="260px"),
    )


def _box(inner_html: str, colour: str) -> str:
    return (
        f"<div style='border-left:4px solid {colour};padding:4px 10px;margin:6px 0'>"
        f"{inner_html}</div>"
    )


def _error_html(err: Exception) -> str:
    if isinstance(err, RPAInputError):
        title = type(err).__name__
    elif isinstance(err, InputProblem):
        title = "Cannot read this input"
    elif isinstance(err, ValueError):
        title = type(err).__name__
    else:
        title = f"Unexpected {type(err).__name__} (a bug in the explorer? please report it)"
    return _box(f"<b>{html.escape(title)}</b>{_pre(str(err))}", _PROBLEM)


def _pre(text: str) -> str:
    # Wrap long lines between words. (Notebook front ends give output <pre> blocks
    # `word-break: break-all`, which splits words and numbers anywhere.)
    style = "white-space:pre-wrap;word-break:normal;overflow-wrap:break-word;margin:4px 0"
    return f"<pre style='{style}'>{html.escape(text)}</pre>"


def _table(header, rows) -> str:
    cell = "style='padding:2px 10px;text-align:left;border-bottom:1px solid #ddd'"
    head = "".join(f"<th {cell}>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td {cell}>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in rows
    )
    return f"<table style='border-collapse:collapse;margin:6px 0'><tr>{head}</tr>{body}</table>"


def _rows(array: np.ndarray) -> str:
    return "[" + ",\n                           ".join(str(r) for r in array.tolist()) + "]"


def _and(items) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
