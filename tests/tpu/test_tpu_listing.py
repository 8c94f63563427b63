"""minilib.tpu.listing: the few raw lines of a bundle listing that notebook 09 shows.

The picking rule is checked on dump_reader's excerpt (no libtpu needed); the recorded lines
for v5e are checked against a fresh compile where libtpu is installed (marker `tpu_compile`).
"""

from __future__ import annotations

import pytest

from minilib.tpu.bundles import EXAMPLE_BUNDLES, EXAMPLE_TWO_LOOPS, kv_block_loop, parse_bundles
from minilib.tpu.compile import tpu_compile_available
from minilib.tpu.listing import (
    COMMAND,
    PICKED,
    RECORDED,
    kv_loop_listing,
    pick_listing_lines,
    recorded_listing,
)

AVAILABLE, REASON = tpu_compile_available()


def test_the_lines_are_the_first_of_each_kind_in_the_kv_block_loop():
    """On a listing whose KV-block loop has a copy before it, one after, and a loop of compute
    chunks inside: each line is the loop's first bundle holding its op, in listing order."""
    bundles = parse_bundles(EXAMPLE_TWO_LOOPS)
    start, end = kv_block_loop(bundles)
    body = bundles[start:end]
    lines = pick_listing_lines(EXAMPLE_TWO_LOOPS)
    addresses = [int(line.split()[0], 16) for line in lines]
    assert addresses[0] == body[0].address and lines[0].endswith("the KV-block loop starts")
    for what, pattern in PICKED:
        first = next((b for b in body if pattern.search(b.text)), None)
        shown = [line for line in lines if line.endswith(f"<- {what}")]
        if first is None:
            assert not shown, what
            continue
        assert len(shown) == 1 and shown[0].startswith(f"{first.address:#x} "), (what, shown)
        assert pattern.search(shown[0].split("<-")[0]), shown[0]  # the op it was picked for
    assert addresses == sorted(addresses)  # in the listing's order
    outside = {b.address for b in bundles} - {b.address for b in body}
    assert not outside & set(addresses)  # the copies before and after the loop are not shown


def test_a_listing_without_a_kv_block_loop_says_so():
    no_matmul = EXAMPLE_BUNDLES.replace("vmatmul", "vadd")
    with pytest.raises(ValueError, match="no KV-block loop"):
        pick_listing_lines(no_matmul)


def test_the_recorded_lines_say_how_they_were_made():
    header = [line for line in RECORDED.read_text().splitlines() if line.startswith("#")]
    assert any(COMMAND in line for line in header)
    lines = recorded_listing()
    whats = [line.rsplit("<- ", 1)[1] for line in lines]
    assert whats == ["the KV-block loop starts"] + [what for what, _ in PICKED]


@pytest.mark.tpu_compile
@pytest.mark.skipif(not AVAILABLE, reason=f"no TPU compile here: {REASON}")
def test_the_recorded_lines_are_what_a_compile_gives():
    assert kv_loop_listing("v5e") == recorded_listing(), (
        f"the recorded listing is out of date: {COMMAND}"
    )
