"""minilib.explore.levers: one checkbox per lever; the bundles per KV block of the checked set
beside Levers.off(), recorded where nothing compiles, and a plain "not recorded" for a set the
record does not hold (never a guess)."""

from __future__ import annotations

import pytest

widgets = pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from explorer_checks import IPYWIDGETS_7_COMMS, shows_figure  # noqa: E402

from minilib.explore.explorer import OK_COLOUR, PROBLEM_COLOUR  # noqa: E402
from minilib.explore.levers import levers_explorer  # noqa: E402
from minilib.kernel import Levers  # noqa: E402
from minilib.tpu.compile import tpu_compile_available  # noqa: E402
from minilib.tpu.lever_costs import recorded_levers, recorded_set, set_label  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings(IPYWIDGETS_7_COMMS),
    pytest.mark.skipif(tpu_compile_available()[0], reason="libtpu here: the explorer compiles"),
]


def check(ex, names) -> None:
    for name, control in ex.controls.items():
        control.value = name in names


def test_one_checkbox_per_lever_named_by_it():
    ex = levers_explorer(on=("open_blocks",))
    assert list(ex.controls) == list(Levers.names())
    assert all(isinstance(c, widgets.Checkbox) for c in ex.controls.values())
    assert [n for n, c in ex.controls.items() if c.value] == ["open_blocks"]


def test_a_recorded_set_shows_its_recorded_figures_beside_off():
    record = recorded_levers()
    ex = levers_explorer()
    for levers in (Levers.only("decode_kernel", "open_blocks", "strided_kv_loads"), Levers.every()):
        check(ex, levers.on())
        found = recorded_set(levers, record)
        assert found is not None, set_label(levers)
        v5e = found.cells[0]  # v5e, 8 q per block
        assert f"{v5e.bundles_per_kv_block:,} bundles per KV block on v5e" in ex.text
        assert "Recorded on" in ex.text and "not computed here" in ex.text
        assert "not timings" in ex.text
        off = recorded_set(Levers.off(), record).cells[0].bundles_per_kv_block
        off_row = [line for line in ex.text.splitlines() if line.startswith("Levers.off()")]
        assert len(off_row) == 1 and f"{off:,}" in off_row[0], "off's row is shown"
        assert OK_COLOUR in ex.views["message"].value
        assert shows_figure(ex)


def test_a_set_not_recorded_says_so_plainly():
    ex = levers_explorer()
    check(ex, ("open_blocks", "heads_in_flight"))
    assert recorded_set(Levers.only("open_blocks", "heads_in_flight"), recorded_levers()) is None
    assert "Not recorded: no figure for this set" in ex.text
    assert "open_blocks, heads_in_flight" in ex.text
    assert "bundles per KV block on v5e" not in ex.text  # no figure guessed
    assert not shows_figure(ex)
    assert PROBLEM_COLOUR in ex.views["message"].value


def test_a_lever_that_applies_nowhere_is_looked_up_without_it():
    inert = recorded_levers()["inert"][0]
    ex = levers_explorer(on=("decode_kernel", inert))
    assert f"Looked up without {inert}" in ex.text
    assert "decode_kernel:" in ex.text  # the figures of the set without it


def test_an_unknown_lever_is_a_clear_value_error():
    with pytest.raises(ValueError, match="unknown=\\['fast'\\] are not levers"):
        levers_explorer(on=("fast",))
