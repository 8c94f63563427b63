"""`Explorer`: what every explorer of the course is made of, and how it reads typed input.

    Explorer(title, controls, render, note, choices)   controls, then what they show
    int_input, text_input, dropdown                     the controls, all alike
    parse_ints, parse_optional_int, parse_q_and_kv_lens typed text to numbers, or a clear
                                                        `InputProblem`
    typed_batch                                         a batch of the typed lengths, for
                                                        the validator to judge
    check_at_most                                       a number more than the explorer draws
    check_at_least                                      a number out of range: too small
    error_html                                          a problem as the explorer shows it

Everything an explorer shows lives in widget state (text in `HTML` widgets, figures as PNG
bytes in an `Image`), so it works in Jupyter and Colab with ipywidgets 7 or 8 and no
front-end extension, and can be checked without a browser. Errors are shown inside the
explorer, never raised: the validators' own messages (an `RPAInputError` with its hint), or a
note on the typed input that could not be read.
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Callable

import ipywidgets as widgets
import numpy as np

from minilib.batch import RaggedBatch, make_batch
from minilib.errors import InputProblem, RPAInputError
from minilib.explore.style import OKABE_ITO, figure_png
from minilib.explore.text import message_box, pre

__all__ = [
    "OK_COLOUR",
    "PROBLEM_COLOUR",
    "Explorer",
    "check_at_least",
    "check_at_most",
    "dropdown",
    "error_html",
    "int_input",
    "parse_ints",
    "parse_optional_int",
    "parse_q_and_kv_lens",
    "text_input",
    "typed_batch",
]

# The bar of the message box (Okabe-Ito): all clear in bluish green, problems in vermillion.
OK_COLOUR, PROBLEM_COLOUR = OKABE_ITO["bluish green"], OKABE_ITO["vermillion"]


class Explorer(widgets.VBox):
    """An explorer: a row of controls, then what they show.

    Data flows one way: the control values go to `render(values)`, which returns what the
    views show, `(status, figure, details)`, and never writes a control.

    A control whose options depend on the other controls (the schedule's grid_step offers
    the steps of the planned grid) gets them from `choices(values)`, which returns
    {control name: options}. On each change the explorer first sets those options, keeping
    the control's choice if it is still offered (else the first option), then renders once,
    with values and options that agree. The explorer has one observer, so nothing depends on
    the order in which observers run.

    `note`, the line under the title, is a string, or `note(values)` for a note that follows
    the controls (the page table's suggestions); it is drawn again on each change.

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

    A derived control: `digit` offers the digits below `n`, and keeps its choice while it can.

    >>> controls = {"n": widgets.IntText(value=5), "digit": widgets.Dropdown(options=["0"])}
    >>> ex = Explorer("Digits", controls, lambda v: (f"digit {v['digit']}", None, ""),
    ...               choices=lambda v: {"digit": [str(d) for d in range(v["n"])]})
    >>> controls["digit"].value = "3"
    >>> controls["n"].value = 8  # 3 is still offered
    >>> controls["digit"].options[-1], ex.text
    ('7', 'digit 3\\n\\n')
    >>> controls["n"].value = 2  # 3 is not
    >>> ex.text
    'digit 0\\n\\n'
    """

    def __init__(
        self,
        title: str,
        controls: dict,
        render: Callable,
        note: str | Callable = "",
        choices: Callable | None = None,
    ):
        self.controls = controls
        self._render = render
        self._choices = choices
        self._title, self._note = title, note
        self._offering = False  # True while the explorer sets the options of derived controls
        self.views = {
            "message": widgets.HTML(),
            "figure": widgets.Image(
                format="png", layout=widgets.Layout(max_width="100%", height="auto")
            ),
            "details": widgets.HTML(),
        }
        self.header = widgets.HTML()
        row = widgets.HBox(list(controls.values()), layout=widgets.Layout(flex_flow="row wrap"))
        super().__init__([self.header, row, *self.views.values()])
        for control in controls.values():
            control.observe(self._on_change, names="value")
        self.refresh()

    def refresh(self) -> None:
        """Offer the derived controls their options, then redraw from the control values.
        Never raises: problems are shown."""
        message, figure, details = self.views.values()
        note = self._note(self.values()) if callable(self._note) else self._note
        self.header.value = (
            f"<div style='font-size:1.15em;font-weight:bold;margin:4px 0'>"
            f"{html.escape(self._title)}</div><div style='color:#555'>{note}</div>"
        )
        try:
            self._offer_choices()
            status, fig, table = self._render(self.values())
        except Exception as err:  # shown, so the explorer keeps working
            message.value = error_html(err)
            figure.value, figure.layout.display = b"", "none"
            details.value = ""
            return
        # A render may report a problem it found (the playground's caught error) as its status.
        if isinstance(status, Exception):
            message.value = error_html(status)
        else:
            message.value = message_box(status, OK_COLOUR)
        if fig is None:
            figure.value, figure.layout.display = b"", "none"
        else:
            figure.value, figure.layout.display = figure_png(fig), None
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
        if not self._offering:  # a change the explorer makes itself is drawn by its refresh
            self.refresh()

    def _offer_choices(self) -> None:
        """Set each derived control's options from `choices`, keeping a choice still offered."""
        offered = self._choices(self.values()) if self._choices else {}
        self._offering = True
        try:
            for name, options in offered.items():
                control, options = self.controls[name], tuple(options)
                if tuple(control.options) != options:
                    chosen = control.value if control.value in options else options[0]
                    control.options = options  # may reset the value (a change event) ...
                    control.value = chosen  # ... so it is set back
        finally:
            self._offering = False


# --- the controls ----------------------------------------------------------------------------

_STYLE = {"description_width": "initial"}  # the whole name shows, however long


def int_input(description: str, value: int) -> widgets.IntText:
    """A box for a whole number. It updates as you type: each change of a number redraws the
    explorer. (Text boxes, which take lists, update on Enter or on leaving the box, not at
    each comma.)

    >>> box = int_input("num_q_heads", 12)
    >>> box.description, box.value, box.continuous_update
    ('num_q_heads', 12, True)
    """
    return widgets.IntText(
        value=value,
        description=description,
        style=_STYLE,
        continuous_update=True,
        layout=widgets.Layout(width="210px"),
    )


def text_input(description: str, value: str, placeholder: str) -> widgets.Text:
    """A box for typed text (a list of numbers, or an optional one), read on Enter.

    >>> box = text_input("kv_lens", "37, 5, 120", "e.g. 37, 5, 120")
    >>> box.description, box.value, box.continuous_update
    ('kv_lens', '37, 5, 120', False)
    """
    return widgets.Text(
        value=value,
        description=description,
        placeholder=placeholder,
        style=_STYLE,
        continuous_update=False,
        layout=widgets.Layout(width="260px"),
    )


def dropdown(description: str, options, value, width: str | None = None) -> widgets.Dropdown:
    """A menu of `options`, `value` chosen.

    >>> menu = dropdown("order", ["in order", "shuffled"], "shuffled")
    >>> menu.description, menu.options, menu.value
    ('order', ('in order', 'shuffled'), 'shuffled')
    """
    layout = widgets.Layout() if width is None else widgets.Layout(width=width)
    return widgets.Dropdown(
        options=list(options), value=value, description=description, style=_STYLE, layout=layout
    )


# --- reading typed input ---------------------------------------------------------------------


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


def parse_q_and_kv_lens(q_text: str, kv_text: str) -> tuple[list[int], list[int]]:
    """The typed q_lens and kv_lens: one of each per sequence, or an `InputProblem`.

    >>> parse_q_and_kv_lens("6, 1", "6, 20")
    ([6, 1], [6, 20])
    >>> parse_q_and_kv_lens("6, 1", "6")
    Traceback (most recent call last):
    ...
    minilib.errors.InputProblem: len(q_lens)=2 but len(kv_lens)=1: give one q_len and one kv_len
    per sequence.
    """
    q_lens, kv_lens = parse_ints(q_text, "q_lens"), parse_ints(kv_text, "kv_lens")
    if len(q_lens) != len(kv_lens):
        raise InputProblem(
            f"{len(q_lens)=} but {len(kv_lens)=}: give one q_len and one kv_len per sequence."
        )
    return q_lens, kv_lens


def typed_batch(q_lens: list[int], kv_lens: list[int], **sizes) -> RaggedBatch:
    """`make_batch` of the typed (q_len, kv_len) pairs, with the typed kv_lens as they are, so
    that `dynamic_validate_inputs` judges them and the explorer shows the message the kernel
    would give. (`make_batch` refuses a kv_len shorter than its q_len, or negative, with a
    message of its own: such a sequence is built with kv_len = q_len, and the typed kv_lens go
    in after. A negative q_len stays: make_batch names it.) `sizes` go to `make_batch`.

    >>> from minilib.validation import dynamic_validate_inputs
    >>> dynamic_validate_inputs(*typed_batch([3, 1], [2, 9]).args())
    Traceback (most recent call last):
    ...
    minilib.errors.RPAInputError: q_len=3 must be less or equal to kv_len=2 at sequence 0.
    Hint: ...
    """
    pairs = list(zip(q_lens, kv_lens, strict=True))
    batch = make_batch([(q, q if kv < q else kv) for q, kv in pairs], **sizes)
    typed = batch.kv_lens.at[: len(kv_lens)].set(np.asarray(kv_lens, np.int32))
    return dataclasses.replace(batch, kv_lens=typed)


def check_at_most(name: str, value: int, limit: int, fix: str) -> None:
    """Raise an `InputProblem` titled "<name> is too large" if `value` is more than the
    explorer draws (`limit`): the message names the value and the limit, then `fix`.

    >>> check_at_most("total_num_pages", 10**6, 256, "Use a smaller pool.")
    Traceback (most recent call last):
    ...
    minilib.errors.InputProblem: total_num_pages=1000000 is more than this explorer draws
    (at most 256). Use a smaller pool.
    """
    if value > limit:
        raise InputProblem(
            f"{name}={value} is more than this explorer draws (at most {limit}). {fix}",
            title=f"{name} is too large: this explorer draws at most {limit}",
        )


def check_at_least(name: str, value: int, minimum: int, fix: str) -> None:
    """Raise an `InputProblem` titled "<name> is out of range" if `value` is less than
    `minimum`: a number that reads well but means nothing (a page of -3 tokens). The message
    names the value and the minimum, then `fix`.

    >>> check_at_least("page_size", 0, 1, "A page holds at least one token: try 16.")
    Traceback (most recent call last):
    ...
    minilib.errors.InputProblem: page_size=0 must be at least 1. A page holds at least one
    token: try 16.
    """
    if value < minimum:
        raise InputProblem(
            f"{name}={value} must be at least {minimum}. {fix}",
            title=f"{name} is out of range: it must be at least {minimum}",
        )


# --- problems, as shown ----------------------------------------------------------------------


def error_html(err: Exception) -> str:
    """`err` as the explorer shows it: a title saying what kind of problem it is, then its
    message, word for word, in the problem colour.

    >>> shown = error_html(InputProblem("kv_lens: 'x' (entry 0) is not a whole number."))
    >>> PROBLEM_COLOUR in shown, "<b>Cannot read this input</b>" in shown
    (True, True)
    """
    if isinstance(err, RPAInputError):
        title = type(err).__name__
    elif isinstance(err, InputProblem):
        title = err.title
    elif isinstance(err, ValueError):
        title = type(err).__name__
    else:
        title = f"Unexpected {type(err).__name__} (a bug in the explorer? please report it)"
    return message_box(f"<b>{html.escape(title)}</b>{pre(str(err))}", PROBLEM_COLOUR)
