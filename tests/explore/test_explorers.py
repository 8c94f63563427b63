"""What every explorer of minilib.explore does, driven without a browser: a box of plain
widgets with named controls, everything it shows in widget state, number boxes that update as
you type, and an answer at once, with a message, to a huge or bad setting.

These tests run with ipywidgets 7 (Colab) and 8. Each explorer's own behaviour is tested in
its module's test file (test_explore_<module>.py).
"""

from __future__ import annotations

import time

import pytest

widgets = pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from conftest import one_case_per_path  # noqa: E402
from explorer_checks import IPYWIDGETS_7_COMMS, shows_figure  # noqa: E402
from ipywidgets.embed import embed_data  # noqa: E402

from minilib.explore import kernel_schedule  # noqa: E402
from minilib.explore.head_grouping import head_grouping_explorer  # noqa: E402
from minilib.explore.kernel_schedule import kernel_schedule_explorer  # noqa: E402
from minilib.explore.levers import levers_explorer  # noqa: E402
from minilib.explore.page_table import page_table_explorer  # noqa: E402
from minilib.explore.playground import validation_playground  # noqa: E402
from minilib.explore.ragged_batch import ragged_batch_explorer  # noqa: E402

pytestmark = pytest.mark.filterwarnings(IPYWIDGETS_7_COMMS)

EXPLORERS = [
    head_grouping_explorer,
    page_table_explorer,
    ragged_batch_explorer,
    validation_playground,
    kernel_schedule_explorer,
    levers_explorer,
]


@pytest.mark.parametrize("make", EXPLORERS, ids=lambda f: f.__name__)
def test_explorer_is_a_box_of_plain_widgets_with_named_controls(make):
    ex = make()
    assert isinstance(ex, widgets.VBox)
    assert ex.controls, "controls are exposed"
    for name, control in ex.controls.items():
        assert control.description == name, "each control is described by its name"
        assert control in ex.children[1].children, "and displayed"
    # All it shows lives in widget state: HTML text and PNG bytes, no Output widgets.
    assert isinstance(ex.views["message"], widgets.HTML)
    assert isinstance(ex.views["details"], widgets.HTML)
    assert isinstance(ex.views["figure"], widgets.Image)
    assert not any(isinstance(c, widgets.Output) for c in ex.children)
    assert ex.text.strip()
    # What a notebook front end receives (and what Colab saves): text and PNG, all in state.
    data = embed_data(views=[ex])
    states = [m["state"] for m in data["manager_state"]["state"].values()]
    assert ex.views["message"].value in [s.get("value") for s in states]
    if shows_figure(ex):  # the PNG travels as a binary buffer of the Image's `value`
        image = data["manager_state"]["state"][ex.views["figure"].model_id]
        assert image["buffers"][0]["path"] == ["value"]


def test_number_boxes_update_as_you_type():
    for make in EXPLORERS:
        for control in make().controls.values():
            if isinstance(control, widgets.IntText):
                assert control.continuous_update, (make.__name__, control.description)


# --- extremes: a huge or bad setting answers at once, with a message ---------------------------

EXTREMES = {
    "schedule, page_size 1, kv_len 8192, blocks of 1": (
        lambda: kernel_schedule_explorer(
            kv_lens="12, 8192, 30, 9",
            page_size=1,
            num_kv_pages_per_block="1",
            num_queries_per_block="1",
        ),
        "This explorer draws at most 400 KV blocks",
    ),
    "schedule, 4096 q rows in blocks of 1": (
        lambda: kernel_schedule_explorer(
            q_lens="4096", kv_lens="4096", num_queries_per_block="1", num_kv_pages_per_block="512"
        ),
        "grid steps",
    ),
    "schedule, 256 KV heads": (
        lambda: kernel_schedule_explorer(
            q_lens="4000, 1",
            kv_lens="8000, 8000",
            num_q_heads=256,
            num_kv_heads=256,
            num_queries_per_block="1",
        ),
        "This explorer draws at most",
    ),
    "schedule, kv_len 10**12": (
        lambda: kernel_schedule_explorer(kv_lens="12, 1000000000000, 30, 9"),
        "kv_lens[1]=1000000000000 is more than this explorer draws (at most 8192)",
    ),
    "schedule, page_size 10**9": (
        lambda: kernel_schedule_explorer(page_size=10**9),
        "page_size=1000000000 is more than this explorer draws (at most 4096)",
    ),
    "page table, 10**6 pages": (
        lambda: page_table_explorer(total_num_pages=10**6),
        "total_num_pages=1000000 is more than this explorer draws (at most 256)",
    ),
    "page table, pool far too small, after frees": (
        lambda: page_table_explorer(
            kv_lens="1000000", page_size=1, total_num_pages=256, order="after some frees"
        ),
        "Out of pages",
    ),
    "page table, page_size 10**9": (
        lambda: page_table_explorer(page_size=10**9),
        "page_size=1000000000 is more than this explorer draws (at most 4096)",
    ),
    "ragged batch, 4096 rows over 8192 keys": (
        lambda: ragged_batch_explorer(q_lens="4096", kv_lens="8192"),
        "sum of q_len * kv_len=33554432 is more than this explorer draws (at most 4194304)",
    ),
    "ragged batch, kv_len 10**12": (
        lambda: ragged_batch_explorer(q_lens="1", kv_lens="1000000000000"),
        "kv_lens[0]=1000000000000 is more than this explorer draws (at most 8192)",
    ),
    "head grouping, 10**9 heads": (
        lambda: head_grouping_explorer(num_q_heads=10**9, num_kv_heads=1),
        "num_q_heads=1000000000 is more than this explorer draws (at most 256)",
    ),
}


@pytest.mark.parametrize("case", EXTREMES)
def test_extreme_settings_answer_at_once(case):
    make, message = EXTREMES[case]
    make()  # once first: imports and first compiles are not the explorer's own time
    kernel_schedule._planned.cache_clear()  # and the schedule is planned again, not recalled
    start = time.perf_counter()
    ex = make()
    elapsed = time.perf_counter() - start
    assert message in ex.text, ex.text
    assert ex.text.split("\n")[0] != "Cannot read this input", ex.text  # it reads well
    assert not shows_figure(ex)
    assert elapsed < 2.0, f"{case}: {elapsed:.1f} s"


# --- fuzz: no input, typed as a learner might, makes an explorer show "Unexpected" -------------

# What a learner may type into a text box: valid lists (kv_len 0, idle sequences, one value),
# typos, floats, signs, huge and empty values.
TEXT_INPUTS = [
    "1, 0", "5, 0", "0", "0, 0", "1", "3, 1, 0", "16, 8, 0, 33", "", " ", ",", "1,,2", "1 2 3",
    "a", "1.5", "-1", "-3, 4", "1e3", "0x10", "99999999999999999999", "1, 2, 3, 4, 5, 6, 7, 8, 9",
    "٣", "None", "[1, 2]", "(2, 3)", "1;2", "8192", "4096, 4096",
]  # fmt: skip
INT_INPUTS = [0, 1, 2, 3, 7, 8, 13, 16, 64, 128, 4096, -1, -8, 10**9, 10**20]
# Valid (q_lens, kv_lens) batches at the edges, typed into both boxes: empty slots (kv_len 0),
# idle sequences, one token, no sequence at all, the largest drawn.
BATCHES = [
    ("1, 0", "5, 0"), ("0", "0"), ("0, 1", "0, 7"), ("2, 0, 1", "2, 0, 9"), ("0, 0", "3, 0"),
    ("1", "1"), ("", ""), ("8", "8"), ("1, 1", "16, 17"), ("3", "8192"),
]  # fmt: skip


def fuzz_values(control, rng, n: int) -> list:
    options = getattr(control, "options", None)
    if options:
        pool = list(options)
    elif isinstance(control, widgets.Checkbox):
        pool = [False, True]
    elif isinstance(control, widgets.IntText):
        pool = INT_INPUTS
    else:
        pool = TEXT_INPUTS
    return [pool[i] for i in rng.choice(len(pool), size=min(n, len(pool)), replace=False)]


@pytest.mark.parametrize(
    "make, per_control, combos",
    [(make, 6, 6) for make in EXPLORERS]
    + [pytest.param(make, 40, 60, marks=pytest.mark.slow) for make in EXPLORERS],
    ids=[m.__name__ for m in EXPLORERS] + [f"{m.__name__}-sweep" for m in EXPLORERS],
)
def test_no_typed_input_shows_unexpected(make, per_control, combos):
    """Each control alone, then several at once, from the explorer's defaults and from the
    values before: valid, invalid and extreme. Every answer is a result or a plain message."""
    import numpy as np

    rng = np.random.default_rng(sum(map(ord, make.__name__)))
    ex = make()
    names = list(ex.controls)
    tried = []
    for name in names:
        for value in fuzz_values(ex.controls[name], rng, per_control):
            ex.controls[name].value = value
            tried.append((name, value))
            assert "Unexpected" not in ex.text, (tried[-3:], ex.text)
    if {"q_lens", "kv_lens"} <= set(names):
        for q_lens, kv_lens in BATCHES:
            ex.controls["q_lens"].value, ex.controls["kv_lens"].value = q_lens, kv_lens
            tried.append(("q_lens, kv_lens", (q_lens, kv_lens)))
            assert "Unexpected" not in ex.text, (tried[-3:], ex.text)
    for _ in range(combos):
        for name in rng.choice(names, size=min(3, len(names)), replace=False):
            control = ex.controls[name]
            value = fuzz_values(control, rng, 1)[0]
            control.value = value
            tried.append((name, value))
        assert "Unexpected" not in ex.text, (tried[-3:], ex.text)


# --- every typed field: huge, negative, empty and non-numeric input --------------------------

BAD_INPUTS = {"huge": 10**30, "negative": -3, "zero": 0, "empty": "", "non-numeric": "abc"}
# Text fields where an empty box means None (the default), as each explorer's note says.
EMPTY_MEANS_NONE = {"sliding_window", "num_kv_pages_per_block", "num_queries_per_block"}
# Fields where 0 is valid: an idle sequence (q_len 0), an empty one (the page table's kv_len).
ZERO_IS_VALID = {
    (ragged_batch_explorer, "q_lens"),
    (kernel_schedule_explorer, "q_lens"),
    (page_table_explorer, "kv_lens"),
}
# (explorer, field) -> its box: a number box (IntText) or a text box (Text).
TYPED_FIELDS = {
    (make, name): type(control)
    for make in EXPLORERS
    for name, control in make().controls.items()
    if isinstance(control, widgets.IntText | widgets.Text)
}


def typed(ex, name: str, value) -> object:
    """`value` as a learner types it into the control: into the first entry of a list."""
    control = ex.controls[name]
    if isinstance(control, widgets.IntText) or value == "":
        return value
    if name in ("q_lens", "kv_lens"):  # the first entry bad, the others as they were
        return ", ".join([str(value), *control.value.split(",")[1:]])
    return str(value)


# On every stack, each explorer's first number box and first text box take every bad input;
# the other fields once, in .venv (`matrix`). Reversed, so that the first of each box wins.
FIRST_OF_EACH_BOX = {(make, box): name for (make, name), box in reversed(TYPED_FIELDS.items())}


def typed_case_id(make, name: str, kind: str) -> str:
    return f"{make.__name__}-{name}-{kind}"


TYPED_CASES = one_case_per_path(
    [
        pytest.param(make, name, kind, id=typed_case_id(make, name, kind))
        for make, name in TYPED_FIELDS
        for kind in BAD_INPUTS
    ],
    *(
        typed_case_id(make, name, kind)
        for (make, _), name in FIRST_OF_EACH_BOX.items()
        for kind in BAD_INPUTS
    ),
)


@pytest.mark.parametrize("make, name, kind", TYPED_CASES)
def test_every_typed_field_answers_bad_input_with_its_name(make, name, kind):
    """The answer names the field and the value typed, in a titled message: never
    "Unexpected", never a traceback. A number box refuses text itself (the browser does not
    let it be typed), and the explorer stays as it was. A number that reads well but is out
    of range (huge, negative, zero) is a validation problem, not text that cannot be read:
    its title says so."""
    from traitlets import TraitError

    from minilib.explore.explorer import OK_COLOUR, PROBLEM_COLOUR

    ex = make()
    before = ex.text
    value = typed(ex, name, BAD_INPUTS[kind])
    if isinstance(ex.controls[name], widgets.IntText) and kind in ("empty", "non-numeric"):
        with pytest.raises(TraitError):
            ex.controls[name].value = value
        assert ex.text == before
        return
    ex.controls[name].value = value
    message = ex.views["message"].value
    assert "Unexpected" not in ex.text and "Traceback" not in ex.text, ex.text
    if kind == "empty" and (name in EMPTY_MEANS_NONE or make is page_table_explorer):
        assert OK_COLOUR in message, ex.text  # None, or (page table) no sequence at all
        return
    if kind == "zero" and (make, name) in ZERO_IS_VALID:
        assert OK_COLOUR in message and shows_figure(ex), ex.text
        return
    assert PROBLEM_COLOUR in message and not shows_figure(ex), ex.text
    title, shown = ex.text.split("\n")[0], ex.text.split("Hint:")[0]  # before the hint
    assert name.removesuffix("s") in shown, shown  # q_lens: "q_lens[0]" or "q_len=-3"
    assert str(value).split(",")[0] in shown or f"len({name})=0" in shown, shown
    if kind in ("huge", "negative", "zero"):  # the title says what is wrong, not "Cannot read"
        assert title != "Cannot read this input", shown
    else:
        assert title == "Cannot read this input", shown
