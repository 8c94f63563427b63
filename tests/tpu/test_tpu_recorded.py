"""The results notebooks 07, 08 and 09 show where nothing compiles
(`minilib/tpu/recorded_results.json`, `minilib.tpu.recorded`) are what this stack compiles now.

Marker `tpu_compile`: runs where libtpu is installed (`.venv-tpu`), on the stack the results
were recorded with, and is skipped elsewhere with the reason. A kernel change that moves one
fails here until they are recorded again: `python -m minilib.tpu.recorded`. Static estimates
from the compiled programs, never timings.
"""

from __future__ import annotations

import jax
import pytest

from minilib.tpu.compile import libtpu_version, tpu_compile_available
from minilib.tpu.recorded import COMMAND, RESULTS, recorded_result, recorded_results

AVAILABLE, REASON = tpu_compile_available()


def test_every_result_is_recorded_and_labelled():
    record = recorded_results()
    assert sorted(record["results"]) == sorted(RESULTS)
    for name in RESULTS:
        _, label = recorded_result(name)
        assert label.startswith(f"Recorded on {record['date']} with jax {record['jax']}, "
                                f"libtpu {record['libtpu']} by `{COMMAND}`")  # fmt: skip
        if not AVAILABLE:  # why not here, and how to install libtpu
            assert "not computed here" in label and "pip install" in label


@pytest.mark.tpu_compile
@pytest.mark.skipif(not AVAILABLE, reason=f"no TPU compile here: {REASON}")
@pytest.mark.parametrize("name", sorted(RESULTS))
def test_recorded_result_is_what_compiles_here(name):
    record = recorded_results()
    here = (jax.__version__, libtpu_version())
    if (record["jax"], record["libtpu"]) != here:
        pytest.skip(f"recorded with jax {record['jax']}, libtpu {record['libtpu']}; here {here}")
    fresh = RESULTS[name]()
    assert fresh == record["results"][name], (
        f"{name}: recorded {record['results'][name]!r}, compiled {fresh!r}: run `{COMMAND}`"
    )


def test_rung_7_is_recorded_beside_the_comparisons_own_figures():
    """Notebook 08's rung 7 beside ours and v3's: ours and v3's figures are the three-way
    comparison's for the same workload and blocks (8 q per block, `minilib.tpu.comparison`),
    and the tested rung 7's KV-block loop is longer than both, as the notebook says."""
    from minilib.tpu.comparison import recorded_comparison

    rows, _ = recorded_result("rung_7_beside_ours_and_v3")
    cells, comparison = recorded_comparison()
    assert (comparison["jax"], comparison["libtpu"]) == (recorded_results()["jax"],
                                                         recorded_results()["libtpu"])  # fmt: skip
    figure = {(c.chip, c.kernel): c.bundles_per_kv_block for c in cells
              if c.config == "8 q per block"}  # fmt: skip
    assert [chip for chip, *_ in rows] == ["v5e", "v6e"]
    for chip, rung_7, ours, v3 in rows:
        assert (ours, v3) == (figure[chip, "ours"], figure[chip, "v3"]), chip
        assert ours < rung_7 and v3 < rung_7, (chip, rung_7, ours, v3)
