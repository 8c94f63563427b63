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
