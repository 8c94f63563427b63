"""A ragged batch: its packed q rows and each sequence's causal mask, as a figure and an explorer.

ragged_batch_figure(batch, sliding_window)   the packed q rows, then a mask per sequence
mask_numpy(q_len, kv_len, sliding_window)    the causal mask, in NumPy, for the figure
ragged_batch_explorer()                      a batch of your (q_len, kv_len) pairs, checked
                                             by the real validator

>>> ex = ragged_batch_explorer(q_lens="6, 1", kv_lens="6, 20")
>>> print(ex.text.splitlines()[0])
Valid: 2 sequences (1 prefill, 1 decode), 7 q rows; no sliding window.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from minilib.batch import RaggedBatch, seq_kind
from minilib.explore import style
from minilib.explore.explorer import (
    Explorer,
    check_at_most,
    parse_optional_int,
    parse_q_and_kv_lens,
    text_input,
    typed_batch,
)
from minilib.explore.text import plural, pre, span, table
from minilib.kv_cache import cdiv
from minilib.masking import is_masked, q_position
from minilib.validation import dynamic_validate_inputs

__all__ = [
    "MAX_KV_LEN",
    "MAX_MASKS",
    "MAX_MASK_CELLS",
    "MAX_SEQS",
    "MAX_TOKENS",
    "mask_numpy",
    "ragged_batch_explorer",
    "ragged_batch_figure",
]

MAX_MASKS = 8  # sequences the figure draws with their mask
MASK_COLORS = {
    "may attend": style.OKABE_ITO["blue"],
    "masked: future key (causal)": style.FAINT,
    "masked: older than sliding_window": style.OKABE_ITO["vermillion"],
}
# What the explorer draws at most.
MAX_SEQS, MAX_TOKENS, MAX_KV_LEN = 16, 4096, 8192
MAX_MASK_CELLS = 2**22  # (q row, key) cells of all the masks drawn


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

    fig = style.new_figure(11, 2.0 + 2.7 * mask_rows)
    grid = fig.add_gridspec(1 + mask_rows, cols, height_ratios=[0.8] + [2.0] * mask_rows)
    rows_ax = fig.add_subplot(grid[0, :])
    labels = _draw_packed_rows(rows_ax, cu_q_lens, num_seqs, max_tokens)
    tick_axes = [(rows_ax, "x")]
    for i in range(shown):
        ax = fig.add_subplot(grid[1 + i // cols, i % cols])
        start = int(cu_q_lens[i])
        _draw_mask(ax, i, start, int(cu_q_lens[i + 1]) - start, int(kv_lens[i]), sliding_window)
        tick_axes += [(ax, "x"), (ax, "y")]

    window = "no sliding_window" if sliding_window is None else f"sliding_window={sliding_window}"
    more = f" (masks of the first {shown} of {num_seqs})" if shown < num_seqs else ""
    fig.suptitle(f"A ragged batch of {num_seqs} sequences and their causal masks, {window}{more}")
    if shown:
        kinds = list(MASK_COLORS.items())[: 2 if sliding_window is None else 3]
        handles = [Patch(facecolor=c, edgecolor=style.GREY, label=k) for k, c in kinds]
        dashed = "dashed: kv_len - q_len, where q row 0 sits"
        handles.append(
            Line2D(
                [], [], color=style.OKABE_ITO["black"], linestyle="--", linewidth=1, label=dashed
            )
        )
        fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8)
    style.fit_labels(fig, labels, tick_axes)
    return fig


def mask_numpy(q_len: int, kv_len: int, sliding_window: int | None = None) -> np.ndarray:
    """`minilib.masking.causal_mask` on NumPy positions (a test checks that they agree): the
    figure then needs no compiling for each new shape. True where q row i may NOT see key j.

    >>> mask_numpy(2, 4).astype(int).tolist()
    [[0, 0, 0, 1], [0, 0, 0, 0]]
    """
    q_pos = q_position(np.arange(q_len)[:, None], q_len, kv_len)  # [q_len, 1]
    return is_masked(q_pos, np.arange(kv_len)[None, :], sliding_window)


def _draw_mask(ax, i: int, start: int, q_len: int, kv_len: int, window: int | None) -> None:
    """Sequence i's mask: a row per q row (packed from row `start`), a column per key."""
    # 0: may attend, 1: a future key, 2: a past key outside the window.
    causal = mask_numpy(q_len, kv_len, None)
    windowed = mask_numpy(q_len, kv_len, window)
    image = np.where(causal, 1, np.where(windowed, 2, 0))
    if q_len and kv_len:
        ax.imshow(
            image,
            cmap=ListedColormap(list(MASK_COLORS.values())),
            vmin=-0.5,
            vmax=2.5,
            aspect="auto",
            interpolation="nearest",
            extent=(-0.5, kv_len - 0.5, q_len - 0.5, -0.5),
        )
        ax.axvline(
            kv_len - q_len - 0.5, color=style.OKABE_ITO["black"], linestyle="--", linewidth=1.2
        )
    ax.set_xlim(-0.5, max(kv_len, 1) - 0.5)
    ax.set_ylim(max(q_len, 1) - 0.5, -0.5)
    ax.set_xticks(style.int_ticks(kv_len, 6))
    ax.set_yticks(style.int_ticks(q_len, 5))
    ax.set_title(
        f"seq {i}: {seq_kind(q_len, kv_len)}\nq_len={q_len}, kv_len={kv_len}",
        fontsize=9,
        color=style.darker(style.color(i)),
    )
    ax.set_xlabel("key position", fontsize=8)
    ax.set_ylabel(f"q row r\n(packed row {start}+r)", fontsize=8)
    ax.tick_params(labelsize=8)


def _draw_packed_rows(ax, cu_q_lens: np.ndarray, num_seqs: int, max_tokens: int) -> list:
    """The rows of q, one coloured run per sequence, then the padding rows."""
    labels = []
    for i in range(num_seqs):
        start, end = int(cu_q_lens[i]), int(cu_q_lens[i + 1])
        if end > start:
            box = style.rectangle(ax, start, 0, end - start, 0.8, style.color(i), style.hatch(i))
            labels.append((style.box_label(ax, box, f"seq {i}", style.color(i)), box))
    used = int(cu_q_lens[num_seqs])
    if used < max_tokens:
        style.rectangle(ax, used, 0, max_tokens - used, 0.8, "white", "xx", edge=style.LIGHT_GREY)
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
    handles = [style.legend_patch(i, f"seq {i}") for i in range(min(num_seqs, 12))]
    if num_seqs > 12:
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"... {num_seqs - 12} more"))
    if used < max_tokens:
        handles.append(
            Patch(facecolor="white", hatch="xx", edgecolor=style.LIGHT_GREY, label="padding rows")
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


# --- the explorer ----------------------------------------------------------------------------


def ragged_batch_explorer(
    q_lens: str = "6, 1, 4, 1", kv_lens: str = "6, 20, 12, 9", sliding_window: str = ""
) -> Explorer:
    """A mixed prefill/decode batch of your (q_len, kv_len) pairs, built with `make_batch`
    and checked with `dynamic_validate_inputs`: its `cu_q_lens` and `kv_lens`, the packed q
    rows of each sequence, and each sequence's causal mask (offset by kv_len - q_len), with
    an optional `sliding_window` (empty for None).

    >>> ex = ragged_batch_explorer(q_lens="6, 1", kv_lens="6, 20")
    >>> ex.controls["q_lens"].value = "3, 1"
    >>> ex.controls["kv_lens"].value = "2, 9"  # q_len > kv_len: the validator's message
    >>> print(ex.text.splitlines()[1])
    q_len=3 must be less or equal to kv_len=2 at sequence 0.
    """
    controls = {
        "q_lens": text_input("q_lens", q_lens, "e.g. 6, 1, 4"),
        "kv_lens": text_input("kv_lens", kv_lens, "e.g. 6, 20, 12"),
        "sliding_window": text_input("sliding_window", sliding_window, "empty: None"),
    }
    return Explorer(
        "A ragged batch: prefill, chunks and decodes together",
        controls,
        _render_ragged_batch,
        "One q_len and one kv_len per sequence (kv_len counts the new tokens too). "
        "Leave sliding_window empty for None.",
    )


def _check_limits(q_lens: list[int], kv_lens: list[int]) -> None:
    """What this explorer draws at most, checked before the batch is built."""
    check_at_most("len(q_lens)", len(q_lens), MAX_SEQS, "Type fewer sequences.")
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        check_at_most(f"q_lens[{i}]", q_len, MAX_TOKENS, "Type a shorter q_len.")
        check_at_most(f"kv_lens[{i}]", kv_len, MAX_KV_LEN, "Type a shorter kv_len.")
    check_at_most("sum(q_lens)", sum(q_lens), MAX_TOKENS, "Type shorter q_lens: q rows in all.")
    cells = sum(q * kv for q, kv in zip(q_lens, kv_lens, strict=True))
    fix = "Try shorter sequences: the masks have a (q row, key) cell for each."
    check_at_most("sum of q_len * kv_len", cells, MAX_MASK_CELLS, fix)


def _render_ragged_batch(values: dict):
    q_lens, kv_lens = parse_q_and_kv_lens(values["q_lens"], values["kv_lens"])
    window = parse_optional_int(values["sliding_window"], "sliding_window")
    _check_limits(q_lens, kv_lens)
    batch = typed_batch(q_lens, kv_lens, num_q_heads=2, num_kv_heads=1, head_dim=8)
    dynamic_validate_inputs(*batch.args(), sliding_window=window)
    kinds = [seq_kind(q, kv) for q, kv in batch.seq_lens]
    status = (
        f"Valid: {plural(len(kinds), 'sequence')} ("
        + ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
        + f"), {plural(batch.num_tokens, 'q row')}; "
        + ("no sliding window." if window is None else f"sliding_window={window}.")
    )
    return status, ragged_batch_figure(batch, window), _ragged_details(batch, window)


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
    seqs_table = table(
        ("sequence", "kind", "q_len", "kv_len", "packed q rows", "kv_len - q_len")
        + ("first q row sees", "last q row sees"),
        rows,
    )
    arrays = (
        f"cu_q_lens = {cu.tolist()}\nkv_lens   = {np.asarray(batch.kv_lens).tolist()}\n"
        f"num_seqs  = {np.asarray(batch.num_seqs).tolist()}\n\n{batch.describe()}"
    )
    return seqs_table + pre(arrays)


def _keys_seen(position: int, window: int | None) -> str:
    first = 0 if window is None else max(0, position - window + 1)
    return f"keys {span(range(first, position + 1))}"
