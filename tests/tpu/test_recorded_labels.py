"""Every recorded figure the course shows carries one label, made in one place
(`minilib.tpu.labels.recorded_label`): no module or notebook spells "Recorded on" itself, but
the recorded listing's header, which the label is read back from."""

from __future__ import annotations

import json
import pathlib
import re

from minilib.tpu.labels import recorded_label
from minilib.tpu.listing import HEADER, RECORDED, recorded_listing_label

ROOT = pathlib.Path(__file__).resolve().parents[2]
MADE_HERE = {"minilib/tpu/labels.py", "minilib/tpu/listing.py"}  # the label; the header


def code_that_spells_the_label():
    for path in sorted((ROOT / "minilib").rglob("*.py")):
        if str(path.relative_to(ROOT)) not in MADE_HERE and 'f"Recorded on' in path.read_text():
            yield str(path.relative_to(ROOT))
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code" and "Recorded on" in "".join(cell["source"]):
                yield f"{path.name} cell {cell['id']}"


def test_no_module_or_notebook_builds_its_own_label():
    assert list(code_that_spells_the_label()) == []


def test_the_label_says_when_with_what_by_which_command_and_why_not_here():
    record = {"date": "2026-12-05", "jax": "0.12.0.1", "libtpu": "0.0.50.1", "v3": "0.32.0"}
    label = recorded_label(record, "python -m minilib compile --record", not_here="no libtpu.")
    assert label == (
        "Recorded on 2026-12-05 with jax 0.12.0.1, libtpu 0.0.50.1 and v3 from tpu-inference "
        "0.32.0 by `python -m minilib compile --record`, not computed here: no libtpu."
    )


def test_the_listing_label_is_read_from_its_header():
    assert RECORDED.read_text().startswith("# Recorded on ")
    header = RECORDED.read_text().splitlines()[0]
    date, jax_version, libtpu = re.match(HEADER, header).groups()
    assert recorded_listing_label() == recorded_label(
        {"date": date, "jax": jax_version, "libtpu": libtpu},
        "python -m minilib.tpu.listing > minilib/tpu/recorded_listing_v5e.txt",
    )
