"""Head grouping (MHA, GQA, MQA): which q heads share each KV head, as a figure and an explorer.

head_grouping_figure(num_q_heads, num_kv_heads)   the q heads, the KV heads, and the
                                                   combined head axis of kv_pages
head_grouping_explorer()                          the same for any pair you type, with
                                                   the validator's message for a bad one

>>> ex = head_grouping_explorer()
>>> ex.controls["num_kv_heads"].value = 8
>>> "num_q_heads=12 must be divisible by num_kv_heads=8" in ex.text
True
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from minilib.explore import style
from minilib.explore.explorer import Explorer, check_at_most, int_input
from minilib.explore.text import plural, span, table
from minilib.heads import (
    attention_kind,
    check_head_counts,
    combined_head_slots,
    head_groups,
    valid_num_kv_heads,
)

__all__ = ["MAX_HEADS", "head_grouping_explorer", "head_grouping_figure"]

MAX_HEADS = 256  # the explorer draws at most this many; more would be a smear of thin boxes
V_TINT = 0.55  # a V slot is its K slot's colour, this much lighter


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

    fig = style.new_figure(11, 3.9)
    ax = fig.add_subplot()
    labels = []  # (text, box) pairs, to shrink or hide where they do not fit
    height = 0.72
    for h, q_heads in enumerate(groups):
        face = style.color(h)
        for q in q_heads:  # row 2: the q heads
            box = style.rectangle(ax, q, 2, 1, height, face, style.hatch(h))
            labels.append((style.box_label(ax, box, f"q{q}", face), box))
        x0 = h * group  # row 1: the KV head, under its group
        box = style.rectangle(ax, x0, 1, group, height, face, style.hatch(h))
        labels.append((style.box_label(ax, box, f"KV {h}", face), box))
        for j, kv_kind in enumerate(("K", "V")):  # row 0: its K and V slots
            slot_face = face if kv_kind == "K" else style.tint(face, V_TINT)
            box = style.rectangle(
                ax, x0 + j * group / 2, 0, group / 2, height, slot_face, style.hatch(h)
            )
            text = f"{kv_kind}{h}\nslot {2 * h + j}"
            labels.append((style.box_label(ax, box, text, slot_face), box))

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
        Patch(facecolor=style.GREY, edgecolor="white", label="K of KV head h: slot 2*h"),
        Patch(
            facecolor=style.tint(style.GREY, V_TINT),
            edgecolor="white",
            label="V of KV head h: slot 2*h+1",
        ),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    style.fit_labels(fig, labels, [(ax, "x")])
    return fig


def _group_handles(groups: list[list[int]]) -> list[Patch]:
    """A legend entry per group, the first 6 of them when there are more than 8."""
    shown = groups if len(groups) <= 8 else groups[:6]
    handles = [
        style.legend_patch(
            h, f"KV head {h}: {plural(len(q_heads), 'q head', count=False)} {span(q_heads)}"
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


# --- the explorer ----------------------------------------------------------------------------


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
        "num_q_heads": int_input("num_q_heads", num_q_heads),
        "num_kv_heads": int_input("num_kv_heads", num_kv_heads),
    }
    return Explorer(
        "Head grouping: MHA, GQA, MQA",
        controls,
        _render_head_grouping,
        "Try 32/8 (Llama 3 8B), 8/1 (MQA), 8/8 (MHA), and 12/8, which is not allowed.",
    )


def _render_head_grouping(values: dict):
    num_q_heads, num_kv_heads = values["num_q_heads"], values["num_kv_heads"]
    check_at_most("num_q_heads", num_q_heads, MAX_HEADS, "Use fewer heads.")
    check_at_most("num_kv_heads", num_kv_heads, MAX_HEADS, "Use fewer heads.")
    valid = valid_num_kv_heads(num_q_heads)  # raises for num_q_heads < 1
    check_head_counts(num_q_heads, num_kv_heads)  # the validator: its message, its hint
    groups = head_groups(num_q_heads, num_kv_heads)
    group = num_q_heads // num_kv_heads
    kv_heads = "the one KV head" if num_kv_heads == 1 else f"each of the {num_kv_heads} KV heads"
    status = (
        f"<b>{attention_kind(num_q_heads, num_kv_heads)}</b>: {kv_heads} serves "
        f"{plural(group, 'q head')}; q head i uses KV head i // {group}. "
        f"Valid num_kv_heads for num_q_heads={num_q_heads}: {valid}."
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
    heads_table = table(("KV head", "q heads", "K slot in kv_pages", "V slot in kv_pages"), rows)
    shapes = (
        f"q: [max_num_batched_tokens, num_q_heads={num_q_heads}, head_dim]<br>"
        f"kv_pages: [total_num_pages, page_size, 2*num_kv_heads={2 * num_kv_heads}, head_dim]"
    )
    return status, head_grouping_figure(num_q_heads, num_kv_heads), shapes + heads_table
