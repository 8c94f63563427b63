"""minilib.explore.explorer: the Explorer's one-way flow, its hook for derived controls, and how
it reads typed input and shows problems."""

from __future__ import annotations

import re

import pytest

widgets = pytest.importorskip("ipywidgets")

from explorer_checks import IPYWIDGETS_7_COMMS  # noqa: E402

from minilib.errors import InputProblem, RPAInputError  # noqa: E402
from minilib.explore.explorer import (  # noqa: E402
    OK_COLOUR,
    PROBLEM_COLOUR,
    Explorer,
    parse_ints,
    parse_optional_int,
    parse_q_and_kv_lens,
)

pytestmark = pytest.mark.filterwarnings(IPYWIDGETS_7_COMMS)

# --- the derived controls: one observer, one render per change ---------------------------------


def digits(values: dict) -> dict:
    """The `digit` menu offers the digits below `n` (none below 1: just "-")."""
    return {"digit": [str(d) for d in range(values["n"])] or ["-"]}


def digit_explorer(derived_first: bool):
    """An explorer whose `digit` control is derived from `n`; `derived_first` puts it first in
    the controls, so that its observer would run before n's."""
    n = widgets.IntText(value=5, description="n")
    digit = widgets.Dropdown(options=["0"], value="0", description="digit")
    controls = {"digit": digit, "n": n} if derived_first else {"n": n, "digit": digit}
    rendered = []

    def render(values):
        rendered.append(dict(values))
        assert values["digit"] in digits(values)["digit"], "values and options agree"
        return f"n={values['n']} digit={values['digit']}", None, ""

    return Explorer("Digits", controls, render, choices=digits), rendered


@pytest.mark.parametrize("derived_first", [False, True])
def test_a_derived_control_keeps_a_valid_choice_and_renders_once(derived_first):
    ex, rendered = digit_explorer(derived_first)
    assert ex.controls["digit"].options == ("0", "1", "2", "3", "4")  # set before the render
    assert rendered == [{"n": 5, "digit": "0"}] and "n=5 digit=0" in ex.text
    ex.controls["digit"].value = "3"
    assert rendered[-1] == {"n": 5, "digit": "3"} and len(rendered) == 2
    ex.controls["n"].value = 8  # 3 is still offered: kept
    assert ex.controls["digit"].options[-1] == "7" and ex.controls["digit"].value == "3"
    assert rendered[-1] == {"n": 8, "digit": "3"} and len(rendered) == 3
    ex.controls["n"].value = 2  # 3 is gone: the first option, and still one render
    assert ex.controls["digit"].options == ("0", "1") and ex.controls["digit"].value == "0"
    assert rendered[-1] == {"n": 2, "digit": "0"} and len(rendered) == 4
    ex.controls["n"].value = 3  # 0 is still offered: the options change, the choice does not
    assert rendered[-1] == {"n": 3, "digit": "0"} and len(rendered) == 5
    assert "n=3 digit=0" in ex.text


def test_an_unchanged_menu_is_left_alone():
    ex, rendered = digit_explorer(derived_first=False)
    changes = []
    ex.controls["digit"].observe(changes.append, names=["options", "value"])
    ex.refresh()  # same values, same options: nothing is set, and it draws once
    assert changes == [] and len(rendered) == 2


def test_a_choices_problem_is_shown_not_raised():
    def broken(values):
        raise ValueError(f"n={values['n']} has no digits")

    controls = {"n": widgets.IntText(value=1), "digit": widgets.Dropdown(options=["0"])}
    ex = Explorer("Broken", controls, lambda v: ("drawn", None, ""), choices=broken)
    assert "n=1 has no digits" in ex.text and PROBLEM_COLOUR in ex.views["message"].value
    ex.controls["n"].value = 2  # and the explorer keeps working
    assert "n=2 has no digits" in ex.text


def test_a_render_problem_is_shown_in_the_problem_colour_and_the_explorer_recovers():
    def render(values):
        if values["n"] < 0:
            raise InputProblem(f"n={values['n']} is negative.")
        return f"n={values['n']}", None, ""

    ex = Explorer("Signs", {"n": widgets.IntText(value=1)}, render)
    assert OK_COLOUR in ex.views["message"].value
    ex.controls["n"].value = -1
    message = ex.views["message"].value
    assert "Cannot read this input" in ex.text and "n=-1 is negative." in ex.text
    assert PROBLEM_COLOUR in message and OK_COLOUR not in message
    ex.controls["n"].value = 1
    assert ex.text.startswith("n=1") and OK_COLOUR in ex.views["message"].value


def test_an_unexpected_error_says_it_is_a_bug():
    def render(values):
        raise KeyError("oops")

    ex = Explorer("Bug", {"n": widgets.IntText(value=1)}, render)
    assert "Unexpected KeyError (a bug in the explorer? please report it)" in ex.text


def test_error_text_wraps_between_words_not_inside_them():
    """Front ends give output <pre> blocks `word-break: break-all`; ours override it."""
    from minilib.explore.head_grouping import head_grouping_explorer

    pytest.importorskip("matplotlib")
    ex = head_grouping_explorer()
    ex.controls["num_kv_heads"].value = 8
    html_text = ex.views["message"].value
    pres = re.findall(r"<pre style='([^']*)'", html_text)
    assert pres and all("word-break:normal" in p and "overflow-wrap" in p for p in pres)
    assert "<b>RPAInputError</b>" in html_text


# --- reading typed input -------------------------------------------------------------------


def test_parse_ints_reads_commas_spaces_and_brackets():
    assert parse_ints("37, 5 120", "kv_lens") == [37, 5, 120]
    assert parse_ints("[1,2,3]", "kv_lens") == [1, 2, 3]
    assert parse_ints("  ", "kv_lens") == []


@pytest.mark.parametrize("text, bad", [("3, x", "'x' (entry 1)"), ("1.5", "'1.5' (entry 0)")])
def test_parse_ints_names_the_bad_entry(text, bad):
    with pytest.raises(InputProblem, match=re.escape(f"kv_lens: {bad} is not a whole number")):
        parse_ints(text, "kv_lens")


def test_parse_optional_int():
    assert [parse_optional_int(t, "w") for t in ("", " None ", "none", " 7 ")] == [
        None,
        None,
        None,
        7,
    ]
    with pytest.raises(InputProblem, match="sliding_window: 'seven' is not a whole number"):
        parse_optional_int("seven", "sliding_window")


def test_q_and_kv_lens_need_one_of_each_per_sequence():
    assert parse_q_and_kv_lens("6, 1", "6 20") == ([6, 1], [6, 20])
    with pytest.raises(InputProblem, match=re.escape("len(q_lens)=1 but len(kv_lens)=2")):
        parse_q_and_kv_lens("6", "6, 20")
    assert not issubclass(InputProblem, RPAInputError)  # titled apart from validator errors
