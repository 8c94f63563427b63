"""What each speed lever buys, as the TPU compiler sees it: our kernel compiled with
`Levers.off()`, then with each lever added in turn. Static estimates from the compiled
programs (bundles per KV block, `COUNTING_RULE`), never timings.

The table (`lever_steps`, `lever_table`) has one row per kernel, compiled for v5e and v6e on
the comparison's workload (`COMPARISON_CASE`: bf16, 32 q / 8 KV heads, head_dim 128, page_size
16), KV blocks of 8 pages (128 tokens), q blocks of 8 rows; per chip two columns, the kernel
that serves 8 q per block and the one that serves decode:

* **rung 7**: the ladder's last rung (`minilib.ladder.ragged`), as notebook 08 compiles it;
* **Levers.off()**: our kernel with every lever off, the plain algorithm in one kernel;
* **+ lever**: each lever of `Levers.names()` added to the row above, in that order. A lever
  that does not apply to this workload (`kernel_config` drops it: `levers_that_apply`) gets
  no row; the table names it;
* **levers=None**: the levers chosen for the chip (`chosen_levers`), what ships;
* **v3**: vLLM's RPA v3 (`minilib.tpu.v3`), where it loads.

A kernel without a decode kernel serves a decode sequence with its 8 q per block kernel (one
live row of 8); its decode cell says so. Where libtpu is not installed, the table and the lever
sets of the explorer (`minilib.explore.levers`) are the recorded ones (`recorded_levers`,
written by `python -m minilib compile --levers --record`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from pathlib import Path

import jax

from minilib.kernel import Levers, kernel_config
from minilib.tpu.bundles import COUNTING_RULE
from minilib.tpu.comparison import cell_from_record, cell_record
from minilib.tpu.compile import compile_for_tpu
from minilib.tpu.kernel_costs import (
    COMPARISON_CASE,
    Cell,
    cell_of,
    compile_rpa,
    compile_v3,
    describe_case,
    rpa_specs,
)

__all__ = [
    "LEVER_CHIPS",
    "LeverStep",
    "applied_levers",
    "lever_set_cells",
    "lever_steps",
    "lever_table",
    "lever_table_cells",
    "record_levers",
    "recorded_levers",
]

LEVER_CHIPS = ("v5e", "v6e")
LEVER_BLOCKS = dict(num_kv_pages_per_block=8, num_queries_per_block=8)
CONFIGS = ("8 q per block", "decode")
RECORDED = Path(__file__).with_name("recorded_levers.json")
COMMAND = "python -m minilib compile --levers --record"


@dataclasses.dataclass(frozen=True)
class LeverStep:
    """One row of the levers table: its label, and the levers asked (ours), or None (rung 7,
    v3, and `levers=None`: those chosen for the chip).

    >>> LeverStep("+ open_blocks", Levers.only("decode_kernel", "open_blocks")).levers.on()
    ('decode_kernel', 'open_blocks')
    """

    label: str
    levers: Levers | None = None


def applied_levers(levers: Levers | None, case: dict = COMPARISON_CASE) -> tuple[tuple, tuple]:
    """(mixed kernel's, decode kernel's) levers that apply when our kernel is compiled with
    `levers` on `case` (8 pages per KV block, 8 q per block): `kernel_config`'s decision.

    >>> applied_levers(Levers.off())
    ((), ())
    >>> applied_levers(Levers.only("fixed_max"))   # no soft cap: no fixed max
    ((), ())
    """
    q, kv_pages, _, page_indices, _, _ = rpa_specs(**case)
    config = kernel_config(
        q, kv_pages, page_indices, levers=levers, interpret=False, sm_scale=1.0, **LEVER_BLOCKS
    )
    decode = () if config.decode_levers is None else config.decode_levers.on()
    return config.levers.on(), decode


def lever_steps(case: dict = COMPARISON_CASE) -> tuple[list[LeverStep], list[str]]:
    """(steps, skipped): `Levers.off()`, then each lever of `Levers.names()` added to the one
    before where it changes what applies (`applied_levers`); skipped, the names of those it
    does not change (they do not apply to this workload).

    >>> steps, skipped = lever_steps()
    >>> steps[0].label, steps[1].label, "fixed_max" in skipped   # no soft cap
    ('Levers.off()', '+ decode_kernel', True)
    """
    levers = Levers.off()
    steps = [LeverStep("Levers.off()", levers)]
    skipped = []
    for name in Levers.names():
        more = dataclasses.replace(levers, **{name: True})
        if applied_levers(more, case) == applied_levers(levers, case):
            skipped.append(name)
            continue
        levers = more
        steps.append(LeverStep(f"+ {name}", levers))
    return steps, skipped


def ours_cells(chip: str, levers: Levers | None, label: str) -> list[Cell]:
    """The two cells (8 q per block, decode) of our kernel compiled for `chip` with `levers`."""
    specs = rpa_specs(**COMPARISON_CASE)
    report = compile_rpa("ours", specs, chip=chip, levers=levers, **LEVER_BLOCKS)
    return both_cells(report, label, chip)


def both_cells(report, label: str, chip: str) -> list[Cell]:
    """The 8 q per block cell and the decode cell of one compiled program (`cell_of`)."""
    queries = LEVER_BLOCKS["num_queries_per_block"]
    return [
        cell_of(report, label, chip, CONFIGS[0]),
        cell_of(report, label, chip, CONFIGS[1], queries),
    ]


def rung_7_cells(chip: str) -> list[Cell]:
    """Rung 7 (`minilib.ladder.ragged`) compiled for `chip`, as notebook 08 compiles it."""
    from minilib.ladder import ragged

    sm_scale = COMPARISON_CASE["head_dim"] ** -0.5
    rung_7 = functools.partial(
        ragged.ragged_paged_attention_ladder, sm_scale=sm_scale, **LEVER_BLOCKS
    )
    report = compile_for_tpu(rung_7, *rpa_specs(**COMPARISON_CASE), chip=chip)
    return both_cells(report, "rung 7", chip)


def v3_cells(chip: str) -> list[Cell]:
    """v3 compiled for `chip` (its decode kernel serves decode), or cells saying why not."""
    from minilib.tpu.v3 import V3Unavailable

    try:
        report = compile_v3(chip, **LEVER_BLOCKS)
    except V3Unavailable as err:
        report = f"not available: {err}"
    return both_cells(report, "v3", chip)


def lever_table_cells(chips=LEVER_CHIPS) -> tuple[list[Cell], list[str]]:
    """(cells, skipped) of the levers table for `chips`: each cell's `kernel` is its row's
    label. Needs libtpu (about 30 compiles), so the example is not run:

    >>> cells, skipped = lever_table_cells()  # doctest: +SKIP
    >>> cells[0].kernel, cells[-1].kernel  # doctest: +SKIP
    ('rung 7', 'v3')
    """
    steps, skipped = lever_steps()
    cells = []
    for chip in chips:
        cells += rung_7_cells(chip)
        for step in [*steps, LeverStep("levers=None")]:
            cells += ours_cells(chip, step.levers, step.label)
        cells += v3_cells(chip)
    return cells, skipped


def lever_set_cells(levers: Levers, chips=LEVER_CHIPS) -> list[Cell]:
    """The cells of our kernel compiled with `levers` for each chip, cached per set of levers
    that apply (two sets that apply alike compile once). Needs libtpu:

    >>> cells = lever_set_cells(Levers.off())  # doctest: +SKIP
    >>> [c.config for c in cells]  # doctest: +SKIP
    ['8 q per block', 'decode', '8 q per block', 'decode']
    """
    cells = _compiled_set(applied_levers(levers), levers, tuple(chips))
    return [dataclasses.replace(cell, kernel=set_label(levers)) for cell in cells]


_COMPILED: dict[tuple, tuple[Cell, ...]] = {}


def _compiled_set(applied: tuple, levers: Levers, chips: tuple) -> tuple[Cell, ...]:
    key = (applied, chips)
    if key not in _COMPILED:
        label = set_label(levers)
        _COMPILED[key] = tuple(c for chip in chips for c in ours_cells(chip, levers, label))
    return _COMPILED[key]


def set_label(levers: Levers) -> str:
    """A set of levers as a label, and as its key in the record.

    >>> set_label(Levers.off()), set_label(Levers.only("open_blocks", "fixed_max"))
    ('Levers.off()', 'open_blocks, fixed_max')
    """
    return ", ".join(levers.on()) or "Levers.off()"


def recorded_sets(steps: list[LeverStep]) -> list[Levers]:
    """The sets of levers the record holds for the explorer: off, every one, each alone, and
    the table's cumulative ones."""
    sets = [Levers.off(), Levers.every(), *(Levers.only(name) for name in Levers.names())]
    sets += [step.levers for step in steps]
    return list(dict.fromkeys(sets))


def inert_levers(case: dict = COMPARISON_CASE) -> list[str]:
    """The levers that apply nowhere on `case`: on their own, and on top of every other, they
    change nothing `kernel_config` decides (`applied_levers`).

    >>> "fixed_max" in inert_levers(), "decode_kernel" in inert_levers()   # no soft cap
    (True, False)
    """
    off, every = applied_levers(Levers.off(), case), applied_levers(Levers.every(), case)
    inert = []
    for name in Levers.names():
        alone = applied_levers(Levers.only(name), case)
        others = applied_levers(dataclasses.replace(Levers.every(), **{name: False}), case)
        if alone == off and others == every:
            inert.append(name)
    return inert


def lever_table(cells: list[Cell], skipped: list[str], *, source: str) -> str:
    """The levers table: per row (`Cell.kernel`), bundles per KV block for each chip and
    config, then the levers skipped, the notes, and what is missing; `source` says where the
    figures come from (compiled here, or the recorded label).

    >>> from minilib.tpu.dump_reader import KernelStats
    >>> def cell(row, chip, config, bundles, note=""):
    ...     return Cell(row, chip, config, KernelStats("k.1", 5000, bundles, 0, 0, ()), note=note)
    >>> cells = [cell("Levers.off()", "v5e", "8 q per block", 2008),
    ...          cell("Levers.off()", "v5e", "decode", 2008, note="no decode kernel: ..."),
    ...          cell("+ decode_kernel", "v5e", "8 q per block", 1900),
    ...          Cell("v3", "v5e", "decode", missing="not available: no wheel")]
    >>> print(lever_table(cells, ["fixed_max"], source="Compiled here."))  # doctest: +ELLIPSIS
    Bundles per KV block: static estimates from the compiled programs, not timings. Compiled here.
    Rule: ...
    Workload: bf16 (cache bf16), 32 q / 8 KV heads, head_dim 128, ...; 8 q per block.
    <BLANKLINE>
                              v5e 8 q   v5e decode
    Levers.off()                2,008       2,008*
    + decode_kernel             1,900            -
    v3                              -            -
    <BLANKLINE>
    No row (they do not apply to this workload, kernel_config drops them): fixed_max.
    * no decode kernel: ...
    v3 (v5e, decode): not available: no wheel
    """
    columns = list(dict.fromkeys((c.chip, c.config) for c in cells))
    width = max(22, *(len(c.kernel) + 2 for c in cells))
    by_place = {(c.kernel, c.chip, c.config): c for c in cells}
    workload = describe_case(COMPARISON_CASE, LEVER_BLOCKS["num_kv_pages_per_block"])
    lines = [
        f"Bundles per KV block: static estimates from the compiled programs, not timings. {source}",
        f"Rule: {COUNTING_RULE}.",
        f"Workload: {workload}; {LEVER_BLOCKS['num_queries_per_block']} q per block.",
        "",
        " " * width + "".join(f"{column_name(chip, config):>13}" for chip, config in columns),
    ]
    for row in dict.fromkeys(c.kernel for c in cells):
        figures = [figure(by_place.get((row, *column))) for column in columns]
        lines.append(f"{row:{width}}" + "".join(f"{f:>13}" for f in figures))
    lines.append("")
    if skipped:
        dropped = ", ".join(skipped)
        lines.append(
            f"No row (they do not apply to this workload, kernel_config drops them): {dropped}."
        )
    lines += list(dict.fromkeys(f"* {c.note}" for c in cells if c.note))
    lines += [f"{c.kernel} ({c.chip}, {c.config}): {c.missing}" for c in cells if c.missing]
    return "\n".join(lines).rstrip()


def column_name(chip: str, config: str) -> str:
    """'v5e 8 q', 'v5e decode'."""
    return f"{chip} {config.removesuffix(' per block')}"


def figure(cell: Cell | None) -> str:
    """A cell's bundles per KV block, '*' when it has a note, '-' when it has none."""
    if cell is None or cell.bundles_per_kv_block is None:
        return "-"
    return f"{cell.bundles_per_kv_block:,}" + ("*" if cell.note else "")


def record_levers(path: Path = RECORDED) -> dict:
    """Compile the levers table and every set of `recorded_sets` for `LEVER_CHIPS`, and write
    them, with the date and the versions, to `path`. Needs libtpu and v3 (about 60 compiles),
    so the example is not run:

    >>> record_levers()["libtpu"]  # doctest: +SKIP
    '0.0.50.1'
    """
    from minilib.tpu.compile import libtpu_version, require_libtpu
    from minilib.tpu.v3 import V3_VERSION, load_v3

    require_libtpu()
    load_v3()  # raises V3Unavailable, with the fix
    cells, skipped = lever_table_cells()
    steps, _ = lever_steps()
    sets = {}
    for levers in recorded_sets(steps):
        mixed, decode = applied_levers(levers)
        sets[set_label(levers)] = {
            "applied": {"mixed": list(mixed), "decode": list(decode)},
            "cells": [cell_record(c) for c in lever_set_cells(levers)],
        }
    record = {
        "what": "bundles per KV block of our kernel with each set of levers: static "
        f"estimates from the compiled programs, not timings; written by `{COMMAND}`",
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "libtpu": libtpu_version(),
        "v3": f"tpu-inference {V3_VERSION}",
        "rule": COUNTING_RULE,
        "workload": describe_case(COMPARISON_CASE, LEVER_BLOCKS["num_kv_pages_per_block"]),
        "skipped": skipped,
        "inert": inert_levers(),
        "table": [cell_record(c) for c in cells],
        "sets": sets,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def recorded_levers(path: Path = RECORDED) -> dict:
    """The record `record_levers` wrote: date, versions, the table's cells, the levers it
    skipped, and each recorded set's cells.

    >>> record = recorded_levers()
    >>> record["table"][0]["kernel"], record["table"][-1]["kernel"], "Levers.off()" in record["sets"]
    ('rung 7', 'v3', True)
    """  # noqa: E501
    return json.loads(path.read_text())


def recorded_label_here(record: dict) -> str:
    """The record's label (`recorded_label`), saying why nothing is compiled here."""
    from minilib.tpu.compile import tpu_compile_available
    from minilib.tpu.labels import recorded_label

    ok, reason = tpu_compile_available()
    return recorded_label(record, COMMAND, not_here="" if ok else reason)


def lever_table_here_or_recorded() -> str:
    """The levers table: compiled here where libtpu is installed, else the recorded one with
    its label. With libtpu it compiles about 30 kernels, so the example is not run here:

    >>> print(lever_table_here_or_recorded())  # doctest: +SKIP
    Bundles per KV block: static estimates from the compiled programs, not timings. ...
    """
    from minilib.tpu.compile import libtpu_version, tpu_compile_available

    if tpu_compile_available()[0]:
        cells, skipped = lever_table_cells()
        here = f"Compiled here, now (libtpu {libtpu_version()}, jax {jax.__version__})."
        return lever_table(cells, skipped, source=here)
    return recorded_table(recorded_levers())


def recorded_table(record: dict) -> str:
    """The levers table of a record (`record_levers`), labelled with when and with what.

    >>> print(recorded_table(recorded_levers()).splitlines()[0])  # doctest: +ELLIPSIS
    Bundles per KV block: static estimates ..., not timings. Recorded on ... libtpu ...
    """
    cells = [cell_from_record(c) for c in record["table"]]
    return lever_table(cells, record["skipped"], source=recorded_label_here(record))


def run(args) -> int:
    """`python -m minilib compile --levers [--record]`: print the levers table, or record it
    and the explorer's sets. 0, or 1 when this host cannot compile for a TPU."""
    from minilib.tpu.compile import tpu_compile_available

    ok, reason = tpu_compile_available()
    if not ok:
        print(f"Cannot compile for a TPU here: {reason}")
        return 1
    if args.record:
        record = record_levers()
        print(f"Recorded the levers table and {len(record['sets'])} sets in {RECORDED}")
        print(recorded_table(record))
        return 0
    print(lever_table_here_or_recorded())
    return 0


@dataclasses.dataclass(frozen=True)
class RecordedSet:
    """A recorded set of levers (`record_levers`): its cells, the levers that applied to each
    kernel, and the levers asked that the lookup dropped (they apply nowhere on this workload)."""

    cells: list[Cell]
    applied: dict
    dropped: tuple[str, ...]


def recorded_set(levers: Levers, record: dict) -> RecordedSet | None:
    """The record's figures for `levers`, or None if it holds none: looked up as asked, else
    without the levers that apply nowhere on this workload (`inert_levers`, as recorded).

    >>> record = recorded_levers()
    >>> found = recorded_set(Levers.only("decode_kernel", "fixed_max"), record)
    >>> found.dropped, found.applied["mixed"], len(found.cells)
    (('fixed_max',), ['decode_kernel'], 4)
    >>> recorded_set(Levers.only("open_blocks", "heads_in_flight"), record) is None
    True
    """
    dropped = tuple(name for name in levers.on() if name in record["inert"])
    for label, gone in ((set_label(levers), ()), (without(levers, dropped), dropped)):
        if label in record["sets"]:
            found = record["sets"][label]
            cells = [cell_from_record(c) for c in found["cells"]]
            return RecordedSet(cells, found["applied"], gone)
    return None


def without(levers: Levers, names: tuple[str, ...]) -> str:
    """The label of `levers` with `names` off."""
    return set_label(dataclasses.replace(levers, **{name: False for name in names}))
