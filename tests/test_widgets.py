"""The explorers of minilib.widgets, driven without a browser.

Each test sets control values, as a learner would, and reads what the explorer shows: text in
its HTML views, the figure as PNG bytes in its Image view. Errors must show the validators' own
messages (compared with what the validator raises when called directly), and the explorer must
keep working after bad input. These tests run with ipywidgets 7 (Colab) and 8.
"""

from __future__ import annotations

import re
import time

import pytest

widgets = pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from ipywidgets.embed import embed_data  # noqa: E402

from minilib import widgets as w  # noqa: E402
from minilib.batch import make_batch  # noqa: E402
from minilib.errors import KVCacheError, RPAInputError  # noqa: E402
from minilib.heads import check_head_counts  # noqa: E402
from minilib.kv_cache import FILL_ORDERS, fill_cache  # noqa: E402
from minilib.mistakes import MISTAKES, base_batch  # noqa: E402
from minilib.validation import dynamic_validate_inputs  # noqa: E402

# ipywidgets 7 (Colab's) makes its comms with a class that ipykernel has deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:The `ipykernel.comm.Comm`:DeprecationWarning")

PNG = b"\x89PNG"


def shows_figure(ex: w.Explorer) -> bool:
    figure = ex.views["figure"]
    return bytes(figure.value).startswith(PNG) and figure.layout.display != "none"


def shows_error(ex: w.Explorer, err: Exception) -> bool:
    """The explorer shows exactly `str(err)`, and no figure."""
    return str(err) in ex.text and not shows_figure(ex)


def raised(fn, *args, **kwargs) -> Exception:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value


# --- what every explorer does ------------------------------------------------------------------

EXPLORERS = [
    w.head_grouping_explorer,
    w.page_table_explorer,
    w.ragged_batch_explorer,
    w.validation_playground,
    w.kernel_schedule_explorer,
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


# --- head grouping -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heads():
    return w.head_grouping_explorer()


def test_head_grouping_shows_the_groups(heads):
    heads.controls["num_q_heads"].value, heads.controls["num_kv_heads"].value = 12, 4
    assert shows_figure(heads)
    assert "GQA" in heads.text
    assert "each of the 4 KV heads serves 3 q heads" in heads.text
    cells = [c.split(">")[-1] for c in heads.views["details"].value.split("</td>")]
    assert cells[4:8] == ["KV head 1", "3..5", "2", "3"]  # its q heads, its K and V slots


def test_head_grouping_opens_on_a_valid_pair_one_keystroke_from_12_over_8():
    ex = w.head_grouping_explorer()
    assert shows_figure(ex) and ex.controls["num_q_heads"].value == 12
    ex.controls["num_kv_heads"].value = 8  # the notebook's famous pair: it shows the error
    assert "num_q_heads=12 must be divisible by num_kv_heads=8" in ex.text


def test_number_boxes_update_as_you_type():
    for make in EXPLORERS:
        for control in make().controls.values():
            if isinstance(control, widgets.IntText):
                assert control.continuous_update, (make.__name__, control.description)


def test_head_grouping_12_over_8_shows_the_validators_message(heads):
    heads.controls["num_q_heads"].value, heads.controls["num_kv_heads"].value = 12, 8
    err = raised(check_head_counts, 12, 8)
    assert err.message == "num_q_heads=12 must be divisible by num_kv_heads=8"
    assert shows_error(heads, err)
    # the fixes are in the hint: nearest valid counts, repeating KV heads, transposed q/k/v
    assert "(nearest to 8: 6)" in heads.text
    assert "jnp.repeat(k" in heads.text and "transposed" in heads.text
    heads.controls["num_kv_heads"].value = 6  # and it recovers
    assert shows_figure(heads) and "each of the 6 KV heads serves 2 q heads" in heads.text


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(0, 1), (8, 0), (8, -2), (4, 8)])
def test_head_grouping_bad_counts_show_a_message(heads, num_q_heads, num_kv_heads):
    heads.controls["num_q_heads"].value = num_q_heads
    heads.controls["num_kv_heads"].value = num_kv_heads
    assert not shows_figure(heads)
    assert "must be" in heads.text
    heads.controls["num_q_heads"].value, heads.controls["num_kv_heads"].value = 8, 1
    assert shows_figure(heads) and "MQA" in heads.text


def test_head_grouping_too_many_heads_to_draw(heads):
    heads.controls["num_q_heads"].value, heads.controls["num_kv_heads"].value = 512, 8
    assert "this explorer draws at most 256 heads" in heads.text and not shows_figure(heads)
    heads.controls["num_q_heads"].value = 10**9  # no hang, no huge list of divisors
    assert "this explorer draws at most 256 heads" in heads.text


# --- the paged KV cache ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pages():
    return w.page_table_explorer(kv_lens="37, 5, 120", page_size=16, total_num_pages=24)


def test_page_table_shows_the_real_cache(pages):
    assert shows_figure(pages)
    text = pages.text
    assert "kv_lens[:num_seqs]      = [37, 5, 120]" in text
    assert "[0, 1, 2, 0, 0, 0, 0, 0]" in text and "[4, 5, 6, 7, 8, 9, 10, 11]" in text
    assert "Paged: 30 of 192 slots wasted" in text
    assert "contiguous (each sequence sized to the longest): 198 of 360" in text


@pytest.mark.parametrize("order", FILL_ORDERS)
def test_page_table_orders_match_the_cache(pages, order):
    pages.controls["order"].value = order
    cache, ids = fill_cache([37, 5, 120], page_size=16, total_num_pages=24, order=order)
    for s in ids:
        assert str(list(cache.pages(s))) in pages.text
    assert shows_figure(pages)
    pages.controls["order"].value = "in order"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("37, abc, 5", "'abc' (entry 1) is not a whole number"),
        ("37, 5.5", "'5.5' (entry 1) is not a whole number"),
        ("37, -5", "kv_lens[1]=-5 is negative"),
        (",".join(["1"] * 17), "at most 16"),
    ],
)
def test_page_table_bad_lengths(pages, text, expected):
    pages.controls["kv_lens"].value = text
    assert expected in pages.text and not shows_figure(pages)
    pages.controls["kv_lens"].value = "37, 5, 120"
    assert shows_figure(pages)


def test_page_table_more_pages_than_the_pool_shows_the_caches_message(pages):
    pages.controls["kv_lens"].value = "370, 300, 5"
    err = raised(fill_cache, [370, 300, 5], page_size=16, total_num_pages=24)
    assert isinstance(err, KVCacheError) and err.message.startswith("Out of pages")
    assert err.message in pages.text and not shows_figure(pages)
    # The hint is one the explorer can follow: no free(seq_id), which it cannot do.
    assert "free(" not in pages.text
    assert "set total_num_pages to 44, or use page_size 32 (or bigger)" in pages.text
    pages.controls["total_num_pages"].value = 44  # the hint's first fix works ...
    assert shows_figure(pages) and "the pool has 44 pages" in pages.text
    pages.controls["total_num_pages"].value = 43  # ... and is the least that does
    assert err.message.split(":")[0] in pages.text and not shows_figure(pages)
    pages.controls["total_num_pages"].value, pages.controls["page_size"].value = 24, 32
    assert shows_figure(pages)  # and so does its second
    pages.controls["kv_lens"].value, pages.controls["page_size"].value = "37, 5, 120", 16


@pytest.mark.parametrize(
    "kv_lens, page_size, total",
    [("37, 5, 120", 16, 24), ("37, 5, 120", 1, 24), ("1000, 3", 4, 100), ("5, 5, 5", 8, 3)],
)
def test_page_table_suggestions_do_what_they_say(kv_lens, page_size, total):
    """Every setting the note and the out-of-pages hint suggest does what they say it does."""
    ex = w.page_table_explorer(kv_lens=kv_lens, page_size=page_size, total_num_pages=total)
    note = ex.children[0].value
    tried = re.search(r"Try page_size ([\d, and]+):", note)
    for size in re.findall(r"\d+", tried.group(1)) if tried else []:  # "each fits the pool"
        ex.controls["page_size"].value = int(size)
        assert shows_figure(ex), (note, size)
    first = re.search(r"page_size (\d+) needs (\d+) pages: set total_num_pages to \2 first", note)
    if first:
        ex.controls["page_size"].value = int(first.group(1))
        assert not shows_figure(ex) and "Out of pages" in ex.text
        ex.controls["total_num_pages"].value = int(first.group(2))
        assert shows_figure(ex), note
        ex.controls["total_num_pages"].value = total
    runs_out = re.search(
        r"With page_size (\d+), see a pool of fewer than (\d+) pages run out", note
    )
    if runs_out:
        ex.controls["page_size"].value = int(runs_out.group(1))
        ex.controls["total_num_pages"].value = int(runs_out.group(2))
        assert shows_figure(ex), note
        ex.controls["total_num_pages"].value = int(runs_out.group(2)) - 1
        assert "Out of pages" in ex.text and not shows_figure(ex), note
        # Out of pages: each fix the hint names works.
        hint = ex.text.split("Hint: ")[1]
        assert "free(" not in hint
        for name, value in re.findall(
            r"(?:set|use) (total_num_pages|page_size) (?:to )?(\d+)", hint
        ):
            ex.controls["total_num_pages"].value = int(runs_out.group(2)) - 1
            ex.controls["page_size"].value = int(runs_out.group(1))
            ex.controls[name].value = int(value)
            assert shows_figure(ex), (hint, name, value)


def test_page_table_counts_read_in_the_singular_too(pages):
    pages.controls["kv_lens"].value, pages.controls["page_size"].value = "1", 1
    assert "1 sequence holds 1 token in 1 page of 1 slot;" in pages.text
    pages.controls["kv_lens"].value, pages.controls["page_size"].value = "37, 5, 120", 16
    assert "3 sequences hold 162 tokens in 12 pages of 16 slots;" in pages.text


@pytest.mark.parametrize("page_size, total", [(0, 24), (-4, 24), (16, 0), (16, 5000)])
def test_page_table_bad_sizes(pages, page_size, total):
    pages.controls["page_size"].value = page_size
    pages.controls["total_num_pages"].value = total
    assert not shows_figure(pages)
    if total <= w.MAX_PAGES:
        err = raised(fill_cache, [37, 5, 120], page_size=page_size, total_num_pages=total)
        assert shows_error(pages, err) and "must be a positive int" in err.message
    else:
        assert f"draws at most {w.MAX_PAGES} pages" in pages.text
    pages.controls["page_size"].value, pages.controls["total_num_pages"].value = 16, 24
    assert shows_figure(pages)


# --- the ragged batch --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ragged():
    return w.ragged_batch_explorer(q_lens="6, 1, 4, 1", kv_lens="6, 20, 12, 9")


def test_ragged_batch_shows_its_arrays(ragged):
    assert shows_figure(ragged)
    text = ragged.text
    assert "cu_q_lens = [0, 6, 7, 11, 12]" in text and "kv_lens   = [6, 20, 12, 9]" in text
    assert "1 prefill, 2 decode, 1 chunk" in text
    assert "[7, 11)" in text  # the packed q rows of the chunk


def test_ragged_batch_sliding_window(ragged):
    ragged.controls["sliding_window"].value = "4"
    assert shows_figure(ragged) and "sliding_window=4" in ragged.text
    assert "keys 16..19" in ragged.text  # the decode at position 19 sees its last 4 keys
    ragged.controls["sliding_window"].value = "0"
    batch = make_batch([(6, 6), (1, 20), (4, 12), (1, 9)])
    err = raised(dynamic_validate_inputs, *batch.args(), sliding_window=0)
    assert err.message == "sliding_window=0 must be positive."
    assert shows_error(ragged, err)
    ragged.controls["sliding_window"].value = "four"
    assert "'four' is not a whole number" in ragged.text
    ragged.controls["sliding_window"].value = ""
    assert shows_figure(ragged) and "no sliding window" in ragged.text


def test_ragged_batch_bad_lengths(ragged):
    ragged.controls["q_lens"].value = "6, 21, 4, 1"  # q_len > kv_len: make_batch says so
    err = raised(make_batch, [(6, 6), (21, 20), (4, 12), (1, 9)])
    assert isinstance(err, RPAInputError) and shows_error(ragged, err)
    ragged.controls["q_lens"].value = "6, 1, 4"
    assert "q_lens has 3 entries but kv_lens has 4" in ragged.text
    ragged.controls["q_lens"].value = "6, x, 4, 1"
    assert "'x' (entry 1) is not a whole number" in ragged.text
    ragged.controls["q_lens"].value = "6, 1, 4, 1"
    assert shows_figure(ragged)


# --- the validation playground -----------------------------------------------------------------


def test_playground_offers_every_mistake_of_the_catalogue():
    # What each mistake makes the validators say is tested in test_validation.py.
    ex = w.validation_playground()
    assert list(ex.controls["mistake"].options) == list(MISTAKES)


VALID = "correct: a valid mixed batch"


def test_playground_shows_each_validators_message_and_the_code():
    ex = w.validation_playground()
    for name in MISTAKES:
        ex.controls["mistake"].value = name
        args, options = MISTAKES[name](base_batch())
        err = raised(dynamic_validate_inputs, *args, **options) if name != VALID else None
        message = ex.views["message"].value
        if err is None:
            assert "Valid: dynamic_validate_inputs accepts these inputs." in ex.text
            assert w._OK in message and w._PROBLEM not in message
        else:
            assert str(err) in ex.text, name  # the message and its hint, word for word
            assert "Hint: " in ex.text
            # the error is the status, in the problem colour: no green "all clear" above it
            assert w._PROBLEM in message and w._OK not in message, name
        assert f"def {MISTAKES[name].__name__}(b):" in ex.text  # the code that ran


# --- the kernel schedule -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def schedule():
    return w.kernel_schedule_explorer()


def _plan(**overrides):
    from minilib.schedule import plan_schedule

    batch = make_batch(
        [(12, 12), (1, 40), (6, 30), (1, 9)],
        num_q_heads=16,
        num_kv_heads=8,
        head_dim=128,
        page_size=8,
    )
    options = dict(num_kv_pages_per_block=2, num_queries_per_block=8) | overrides
    return batch, plan_schedule(*batch.args(), **options)


def test_schedule_shows_the_grid_and_steps(schedule):
    _, plan = _plan()
    assert shows_figure(schedule)
    assert "grid = (2 heads blocks, 3 q blocks) = 6 grid steps" in schedule.text
    assert f"{len(plan.computes())} KV blocks computed" in schedule.text
    steps = schedule.controls["grid_step"].options
    assert list(steps) == [w.ALL_STEPS] + [str(s) for s in plan.steps()]
    schedule.controls["grid_step"].value = "(0, 1)"
    assert shows_figure(schedule) and "grid step (0, 1):" in schedule.text
    n = sum(e.kind == "compute" for e in plan.steps()[(0, 1)])
    assert schedule.text.count("compute    slot") == n


def test_schedule_block_sizes(schedule):
    schedule.controls["grid_step"].value = "(0, 2)"
    schedule.controls["num_queries_per_block"].value = "16"  # 2 q blocks: step (0, 2) is gone
    assert "= 4 grid steps" in schedule.text
    assert schedule.controls["grid_step"].value == w.ALL_STEPS
    schedule.controls["num_kv_pages_per_block"].value = "9"  # more than pages_per_seq=5
    batch, _ = _plan()
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
    ex = w.kernel_schedule_explorer()
    ex.controls["grid_step"].value = "(0, 1)"
    ex.controls["num_queries_per_block"].value = "16"  # a smaller grid that still has (0, 1)
    _, plan = _plan(num_queries_per_block=16)
    assert list(ex.controls["grid_step"].options) == [w.ALL_STEPS] + [str(s) for s in plan.steps()]
    assert ex.controls["grid_step"].value == "(0, 1)" and "grid step (0, 1):" in ex.text
    ex.controls["num_kv_heads"].value = 6  # no plan: the menu offers all steps, the view why
    assert list(ex.controls["grid_step"].options) == [w.ALL_STEPS]
    assert shows_error(ex, raised(check_head_counts, 16, 6))


def test_schedule_caption_names_a_tile_it_draws():
    from minilib.viz import kernel_schedule_figure

    for overrides in [{}, {"num_kv_pages_per_block": 1}, {"num_queries_per_block": 32}]:
        _, plan = _plan(**overrides)
        fig = kernel_schedule_figure(plan)
        caption = fig.axes[0].get_xlabel()
        named = re.search(r"tile (s(\d+) b(\d+)): sequence \2, KV block \3", caption)
        drawn = {t.get_text() for t in fig.axes[0].texts}
        assert named and named.group(1) in drawn, (caption, sorted(drawn))


def test_error_text_wraps_between_words_not_inside_them():
    """Front ends give output <pre> blocks `word-break: break-all`; ours override it."""
    ex = w.head_grouping_explorer()
    ex.controls["num_kv_heads"].value = 8
    html_text = ex.views["message"].value
    pres = re.findall(r"<pre style='([^']*)'", html_text)
    assert pres and all("word-break:normal" in p and "overflow-wrap" in p for p in pres)


def test_schedule_bad_heads(schedule):
    schedule.controls["num_kv_heads"].value = 6
    assert shows_error(schedule, raised(check_head_counts, 16, 6))
    schedule.controls["num_kv_heads"].value = 8
    assert shows_figure(schedule)


# --- extremes: a huge or bad setting answers at once, with a message ---------------------------

EXTREMES = {
    "schedule, page_size 1, kv_len 8192, blocks of 1": (
        lambda: w.kernel_schedule_explorer(
            kv_lens="12, 8192, 30, 9",
            page_size=1,
            num_kv_pages_per_block="1",
            num_queries_per_block="1",
        ),
        "This explorer draws at most 400 KV blocks",
    ),
    "schedule, 4096 q rows in blocks of 1": (
        lambda: w.kernel_schedule_explorer(
            q_lens="4096", kv_lens="4096", num_queries_per_block="1", num_kv_pages_per_block="512"
        ),
        "grid steps",
    ),
    "schedule, 256 KV heads": (
        lambda: w.kernel_schedule_explorer(
            q_lens="4000, 1",
            kv_lens="8000, 8000",
            num_q_heads=256,
            num_kv_heads=256,
            num_queries_per_block="1",
        ),
        "This explorer draws at most",
    ),
    "schedule, kv_len 10**12": (
        lambda: w.kernel_schedule_explorer(kv_lens="12, 1000000000000, 30, 9"),
        "kv_len up to 8192",
    ),
    "schedule, page_size 10**9": (
        lambda: w.kernel_schedule_explorer(page_size=10**9),
        "page_size up to 4096",
    ),
    "page table, 10**6 pages": (
        lambda: w.page_table_explorer(total_num_pages=10**6),
        "draws at most 256 pages",
    ),
    "page table, pool far too small, after frees": (
        lambda: w.page_table_explorer(
            kv_lens="1000000", page_size=1, total_num_pages=256, order="after some frees"
        ),
        "Out of pages",
    ),
    "page table, page_size 10**9": (
        lambda: w.page_table_explorer(page_size=10**9),
        "pages of at most 4096 slots",
    ),
    "ragged batch, 4096 rows over 8192 keys": (
        lambda: w.ragged_batch_explorer(q_lens="4096", kv_lens="8192"),
        "explorer draws at most 4194304",
    ),
    "ragged batch, kv_len 10**12": (
        lambda: w.ragged_batch_explorer(q_lens="1", kv_lens="1000000000000"),
        "kv_len up to 8192",
    ),
    "head grouping, 10**9 heads": (
        lambda: w.head_grouping_explorer(num_q_heads=10**9, num_kv_heads=1),
        "draws at most 256 heads",
    ),
}


@pytest.mark.parametrize("case", EXTREMES)
def test_extreme_settings_answer_at_once(case):
    make, message = EXTREMES[case]
    make()  # once first: imports and first compiles are not the explorer's own time
    start = time.perf_counter()
    ex = make()
    elapsed = time.perf_counter() - start
    assert message in ex.text, ex.text
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
