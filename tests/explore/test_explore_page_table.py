"""minilib.explore.page_table: slot_usage, the figure of a paged KV cache (pool, page table,
slots reserved), and its explorer, which fills a real PagedKVCache and shows the cache's own
message when the pool runs out, with a hint the explorer's controls can follow."""

from __future__ import annotations

import re

import pytest

widgets = pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from explorer_checks import IPYWIDGETS_7_COMMS, raised, shows_error, shows_figure  # noqa: E402
from figure_checks import assert_reads_well, draw  # noqa: E402

from minilib.errors import KVCacheError  # noqa: E402
from minilib.explore.page_table import (  # noqa: E402
    MAX_PAGES,
    page_table_explorer,
    page_table_figure,
    slot_usage,
)
from minilib.kv_cache import FILL_ORDERS, fill_cache, pool_pages_needed  # noqa: E402

pytestmark = pytest.mark.filterwarnings(IPYWIDGETS_7_COMMS)

# --- the figure ----------------------------------------------------------------------------


def test_slot_usage():
    usage = slot_usage([37, 5, 120], page_size=16)
    assert (usage.tokens, usage.paged_slots, usage.paged_wasted) == (162, 192, 30)
    assert (usage.contiguous_slots, usage.contiguous_wasted) == (360, 198)
    assert slot_usage([], page_size=16).paged_slots == 0


@pytest.mark.parametrize(
    "kv_lens, page_size, total, order",
    [
        ([37, 5, 120], 16, 24, "in order"),
        ([37, 5, 120, 64], 16, 30, "shuffled"),
        ([37, 5, 120], 16, 24, "after some frees"),
        ([90, 1, 17, 60, 50], 4, 64, "shuffled"),
        ([0, 3], 1, 4, "in order"),
    ],
)
def test_page_table_figure(kv_lens, page_size, total, order):
    cache, ids = fill_cache(kv_lens, page_size=page_size, total_num_pages=total, order=order)
    fig = draw(
        lambda: page_table_figure(cache, ids),
        f"pages_{order.replace(' ', '_')}_{len(kv_lens)}_{total}",
    )
    assert_reads_well(fig)
    assert f"total_num_pages={total}" in fig.axes[0].get_title()


# --- the explorer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pages():
    return page_table_explorer(kv_lens="37, 5, 120", page_size=16, total_num_pages=24)


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
        ("37, -5", "kv_lens[1]=-5 must be at least 0. A sequence holds 0 or more tokens."),
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
    [("37, 5, 120", 16, 24)]  # on every stack; the others once, in .venv
    + [
        pytest.param(*case, marks=pytest.mark.matrix)
        for case in [("37, 5, 120", 1, 24), ("1000, 3", 4, 100), ("5, 5, 5", 8, 3)]
    ],
)
def test_page_table_suggestions_do_what_they_say(kv_lens, page_size, total):
    """Every setting the note and the out-of-pages hint suggest does what they say it does."""
    ex = page_table_explorer(kv_lens=kv_lens, page_size=page_size, total_num_pages=total)
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


def test_page_table_note_follows_the_input():
    """The note's suggestions are for the lengths typed now, not those the explorer began with."""
    ex = page_table_explorer(kv_lens="37, 5, 120", page_size=16, total_num_pages=24)
    for kv_lens in ("37, 5, 120", "100, 3", "37, 5, 120"):
        ex.controls["kv_lens"].value = kv_lens
        need = pool_pages_needed([int(n) for n in kv_lens.split(",")], 1)
        assert f"page_size 1 needs {need} pages: set total_num_pages to {need} first" in (
            ex.header.value
        )
    ex.controls["total_num_pages"].value = 10**6  # more than is drawn: no suggestion
    assert "Try page_size" not in ex.header.value and "Sequence lengths" in ex.header.value


def test_page_table_counts_read_in_the_singular_too(pages):
    pages.controls["kv_lens"].value, pages.controls["page_size"].value = "1", 1
    assert "1 sequence: 1 token in 1 page of 1 slot;" in pages.text
    pages.controls["kv_lens"].value, pages.controls["page_size"].value = "37, 5, 120", 16
    assert "3 sequences: 162 tokens in 12 pages of 16 slots;" in pages.text


@pytest.mark.parametrize("page_size, total", [(0, 24), (-4, 24), (16, 0), (16, 5000)])
def test_page_table_bad_sizes(pages, page_size, total):
    pages.controls["page_size"].value = page_size
    pages.controls["total_num_pages"].value = total
    assert not shows_figure(pages)
    if total <= MAX_PAGES:
        err = raised(fill_cache, [37, 5, 120], page_size=page_size, total_num_pages=total)
        assert shows_error(pages, err) and "must be a positive int" in err.message
    else:
        limit = f"total_num_pages={total} is more than this explorer draws (at most {MAX_PAGES})"
        assert limit in pages.text
    pages.controls["page_size"].value, pages.controls["total_num_pages"].value = 16, 24
    assert shows_figure(pages)
