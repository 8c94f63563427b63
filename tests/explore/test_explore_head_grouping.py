"""minilib.explore.head_grouping: the figure of which q heads share each KV head, and its
explorer, which shows the validator's own message for a pair it rejects."""

from __future__ import annotations

import pytest

widgets = pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from explorer_checks import IPYWIDGETS_7_COMMS, raised, shows_error, shows_figure  # noqa: E402
from figure_checks import assert_reads_well, draw  # noqa: E402

from minilib.errors import RPAInputError  # noqa: E402
from minilib.explore.head_grouping import (  # noqa: E402
    head_grouping_explorer,
    head_grouping_figure,
)
from minilib.heads import check_head_counts  # noqa: E402

pytestmark = pytest.mark.filterwarnings(IPYWIDGETS_7_COMMS)

# --- the figure ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(12, 4), (8, 8), (12, 1), (64, 16), (1, 1)])
def test_head_grouping_figure(num_q_heads, num_kv_heads):
    fig = draw(
        lambda: head_grouping_figure(num_q_heads, num_kv_heads),
        f"heads_{num_q_heads}_{num_kv_heads}",
    )
    assert_reads_well(fig)
    title = fig.axes[0].get_title()
    assert f"{num_q_heads} q head" in title and f"{num_kv_heads} KV head" in title


def test_head_grouping_figure_shows_the_layout():
    fig = head_grouping_figure(12, 4)
    shown = {t.get_text() for t in fig.axes[0].texts if t.get_visible()}
    assert {"q0", "q11", "KV 0", "KV 3", "K0\nslot 0", "V3\nslot 7"} <= shown


def test_head_grouping_figure_legend_counts_in_the_singular_too():
    legend = [t.get_text() for t in head_grouping_figure(8, 8).axes[0].get_legend().get_texts()]
    assert "KV head 0: q head 0" in legend
    legend = [t.get_text() for t in head_grouping_figure(12, 4).axes[0].get_legend().get_texts()]
    assert "KV head 1: q heads 3..5" in legend


def test_head_grouping_figure_rejects_an_invalid_pair_with_the_validators_message():
    with pytest.raises(RPAInputError, match="num_q_heads=12 must be divisible by num_kv_heads=8"):
        head_grouping_figure(12, 8)


# --- the explorer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heads():
    return head_grouping_explorer()


def test_head_grouping_shows_the_groups(heads):
    heads.controls["num_q_heads"].value, heads.controls["num_kv_heads"].value = 12, 4
    assert shows_figure(heads)
    assert "GQA" in heads.text
    assert "each of the 4 KV heads serves 3 q heads" in heads.text
    cells = [c.split(">")[-1] for c in heads.views["details"].value.split("</td>")]
    assert cells[4:8] == ["KV head 1", "3..5", "2", "3"]  # its q heads, its K and V slots


def test_head_grouping_opens_on_a_valid_pair_one_keystroke_from_12_over_8():
    ex = head_grouping_explorer()
    assert shows_figure(ex) and ex.controls["num_q_heads"].value == 12
    ex.controls["num_kv_heads"].value = 8  # the notebook's famous pair: it shows the error
    assert "num_q_heads=12 must be divisible by num_kv_heads=8" in ex.text


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


def test_head_grouping_counts_read_in_the_singular_too(heads):
    heads.controls["num_q_heads"].value, heads.controls["num_kv_heads"].value = 8, 1
    assert "MQA: the one KV head serves 8 q heads;" in heads.text
    heads.controls["num_q_heads"].value, heads.controls["num_kv_heads"].value = 4, 4
    assert "MHA: each of the 4 KV heads serves 1 q head;" in heads.text


def test_head_grouping_too_many_heads_to_draw(heads):
    heads.controls["num_q_heads"].value, heads.controls["num_kv_heads"].value = 512, 8
    assert "num_q_heads=512 is more than this explorer draws (at most 256)" in heads.text
    assert not shows_figure(heads)
    heads.controls["num_q_heads"].value = 10**9  # no hang, no huge list of divisors
    assert "num_q_heads=1000000000 is more than this explorer draws (at most 256)" in heads.text
