"""The levers table (`minilib.tpu.lever_costs`): our kernel with `Levers.off()`, then each lever
added in turn, between rung 7 and v3, in bundles per KV block (static estimates from the
compiled programs, never timings), and its record (`minilib/tpu/recorded_levers.json`), which
notebook 09 and the levers explorer show where nothing compiles.

Marker `tpu_compile`: runs where libtpu is installed (`.venv-tpu`) and is skipped elsewhere with
the reason; the record's own tests run everywhere.
"""

from __future__ import annotations

import jax
import pytest

from minilib.kernel import Levers
from minilib.tpu.comparison import cell_from_record, cell_record, recorded_comparison
from minilib.tpu.compile import libtpu_version, tpu_compile_available
from minilib.tpu.lever_costs import (
    COMMAND,
    CONFIGS,
    LEVER_CHIPS,
    applied_levers,
    lever_set_cells,
    lever_steps,
    lever_table_cells,
    recorded_levers,
    recorded_set,
    recorded_table,
    set_label,
)
from minilib.tpu.recorded import recorded_result

AVAILABLE, REASON = tpu_compile_available()
needs_libtpu = pytest.mark.skipif(not AVAILABLE, reason=f"no TPU compile here: {REASON}")


def recorded_rows() -> list[str]:
    return list(dict.fromkeys(c["kernel"] for c in recorded_levers()["table"]))


def test_recorded_table_runs_from_rung_7_through_each_lever_to_v3():
    record = recorded_levers()
    rows = recorded_rows()
    added = [row.removeprefix("+ ") for row in rows if row.startswith("+ ")]
    assert rows == ["rung 7", "Levers.off()", *[f"+ {n}" for n in added], "levers=None", "v3"]
    # each lever once, in the order of Levers.names(): a row, or named as skipped
    assert sorted(added + record["skipped"], key=Levers.names().index) == list(Levers.names())
    assert added == sorted(added, key=Levers.names().index)
    for row in rows:  # every row has its four cells, each with a figure
        cells = [c for c in record["table"] if c["kernel"] == row]
        assert [(c["chip"], c["config"]) for c in cells] == [
            (chip, config) for chip in LEVER_CHIPS for config in CONFIGS
        ], row
        assert all(c["bundles_per_kv_block"] for c in cells), row


def test_recorded_table_is_labelled_with_its_stack_and_says_static():
    record = recorded_levers()
    first = recorded_table(record).splitlines()[0]
    assert "static estimates from the compiled programs, not timings" in first
    stack = f"with jax {record['jax']}, libtpu {record['libtpu']}"
    assert f"Recorded on {record['date']} {stack}" in first
    assert f"by `{COMMAND}`" in first
    if not AVAILABLE:
        assert "not computed here" in first


def test_recorded_ends_agree_with_the_other_records():
    """Rung 7 is notebook 08's record of it; v3 and levers=None are the three-way
    comparison's figures at 8 q per block (same workload, same blocks)."""
    table = {(c["kernel"], c["chip"], c["config"]): c["bundles_per_kv_block"]
             for c in recorded_levers()["table"]}  # fmt: skip
    rung_7_rows, _ = recorded_result("rung_7_beside_ours_and_v3")
    comparison, _ = recorded_comparison()
    compared = {(c.kernel, c.chip, c.config): c.bundles_per_kv_block for c in comparison}
    for chip, rung_7, ours, v3 in rung_7_rows:
        assert table["rung 7", chip, "8 q per block"] == rung_7
        assert table["levers=None", chip, "8 q per block"] == ours
        assert table["v3", chip, "8 q per block"] == v3
        for config in CONFIGS:
            assert table["v3", chip, config] == compared["v3", chip, config]
            assert table["levers=None", chip, config] == compared["ours", chip, config]


def test_recorded_sets_hold_off_every_each_alone_and_the_cumulative_ones():
    record = recorded_levers()
    steps = [row for row in recorded_rows() if row == "Levers.off()" or row.startswith("+ ")]
    assert len(steps) > 2
    for levers in [Levers.off(), Levers.every(), *(Levers.only(n) for n in Levers.names())]:
        assert set_label(levers) in record["sets"], set_label(levers)
    table = {(c["kernel"], c["chip"], c["config"]): c for c in record["table"]}
    cumulative = Levers.off()
    for row in steps[1:]:  # each cumulative set, recorded with the table's figures
        cumulative = Levers.only(*cumulative.on(), row.removeprefix("+ "))
        found = recorded_set(cumulative, record)
        for cell in found.cells:
            recorded = table[row, cell.chip, cell.config]
            assert cell.bundles_per_kv_block == recorded["bundles_per_kv_block"]


def test_recorded_set_drops_only_levers_that_apply_nowhere():
    record = recorded_levers()
    assert record["inert"], "this workload has levers that do not apply"
    inert = record["inert"][0]
    found = recorded_set(Levers.only("decode_kernel", inert), record)
    assert found.dropped == (inert,)
    assert found.cells == recorded_set(Levers.only("decode_kernel"), record).cells
    # a lever that applies is never dropped: such a set is not recorded, and says so (None)
    assert recorded_set(Levers.only("open_blocks", "heads_in_flight"), record) is None


@pytest.mark.tpu_compile
@needs_libtpu
def test_levers_pass_through_compile_rpa():
    from minilib.tpu.kernel_costs import COMPARISON_CASE, compile_rpa, rpa_specs

    specs = rpa_specs(**COMPARISON_CASE)
    blocks = dict(num_kv_pages_per_block=8, num_queries_per_block=8)
    off = compile_rpa("ours", specs, chip="v5e", levers=Levers.off(), **blocks)
    every = compile_rpa("ours", specs, chip="v5e", levers=Levers.every(), **blocks)
    assert [k.name for k in off.kernels] == ["minilib_ragged_paged_attention.1"]
    assert any("decode" in k.name for k in every.kernels)
    assert every.kernel.bundles_per_kv_block < off.kernel.bundles_per_kv_block


@pytest.mark.tpu_compile
@needs_libtpu
def test_skipped_levers_change_nothing_and_each_row_changes_what_applies():
    steps, skipped = lever_steps()
    applied = [applied_levers(step.levers) for step in steps]
    assert len(set(applied)) == len(applied), "each row's lever applies"
    for name in skipped:
        more = Levers.only(*steps[-1].levers.on(), name)
        assert applied_levers(more) == applied[-1], name


@pytest.mark.tpu_compile
@needs_libtpu
def test_a_set_that_applies_alike_compiles_once():
    off = lever_set_cells(Levers.off())
    inert = lever_set_cells(Levers.only(*recorded_levers()["inert"]))
    assert [c.stats for c in inert] == [c.stats for c in off]
    assert {c.kernel for c in off} == {"Levers.off()"}
    assert {c.kernel for c in inert} == {set_label(Levers.only(*recorded_levers()["inert"]))}


@pytest.mark.tpu_compile
@needs_libtpu
def test_recorded_levers_are_what_compiles_here():
    record = recorded_levers()
    here = (jax.__version__, libtpu_version())
    if (record["jax"], record["libtpu"]) != here:
        pytest.skip(f"recorded with jax {record['jax']}, libtpu {record['libtpu']}; here {here}")
    cells, skipped = lever_table_cells()
    assert skipped == record["skipped"]
    fresh = [cell_record(c) for c in cells]
    assert [c["bundles_per_kv_block"] for c in fresh] == [
        c["bundles_per_kv_block"] for c in record["table"]
    ], f"run `{COMMAND}`"
    assert [cell_from_record(c) for c in record["table"]] == [cell_from_record(c) for c in fresh]
    for label, recorded in record["sets"].items():
        levers = Levers.only(*[] if label == "Levers.off()" else label.split(", "))
        figures = [c.bundles_per_kv_block for c in lever_set_cells(levers)]
        assert figures == [c["bundles_per_kv_block"] for c in recorded["cells"]], label
