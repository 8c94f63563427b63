"""The levers explorer: one checkbox per speed lever (`minilib.kernel.Levers`), and the bundles
per KV block of our kernel compiled with the levers checked, for v5e and v6e (8 q per block,
and decode), beside `Levers.off()`. Static estimates from the compiled programs, never timings.

Where libtpu is installed, each set is compiled here, once (`lever_costs.lever_set_cells`
keeps it); elsewhere the explorer shows the recorded sets (`lever_costs.recorded_levers`:
off, every lever, each alone, and the table's cumulative ones), and says so plainly for a
set that was not recorded.

    >>> ex = levers_explorer(on=())
    >>> "Levers.off()" in ex.text
    True
"""

from __future__ import annotations

import ipywidgets as widgets

from minilib.errors import InputProblem
from minilib.explore import style
from minilib.explore.explorer import Explorer
from minilib.explore.text import pre
from minilib.kernel import Levers
from minilib.tpu import lever_costs

__all__ = ["levers_explorer"]

NOTE = (
    "Check levers to compile our kernel with them (static estimates: bundles per KV block, not "
    "timings). A lever that does not apply to this workload changes nothing."
)


def levers_explorer(on: tuple[str, ...] = ()) -> Explorer:
    """One checkbox per lever, `on` checked: the bundles per KV block of our kernel with the
    checked levers, beside `Levers.off()`, on v5e and v6e.

    >>> ex = levers_explorer(on=("decode_kernel",))
    >>> list(ex.controls) == list(Levers.names()), ex.controls["decode_kernel"].value
    (True, True)
    """
    unknown = [name for name in on if name not in Levers.names()]
    if unknown:
        raise ValueError(f"{unknown=} are not levers: name some of {', '.join(Levers.names())}")
    controls = {name: checkbox(name, name in on) for name in Levers.names()}
    return Explorer("What the levers buy: bundles per KV block", controls, render_levers, NOTE)


def checkbox(name: str, value: bool) -> widgets.Checkbox:
    """A checkbox described by its lever's name."""
    return widgets.Checkbox(
        value=value,
        description=name,
        indent=False,
        layout=widgets.Layout(width="190px"),
    )


def render_levers(values: dict):
    """(status, figure, details) for the checked levers: compiled here, or recorded, or a
    problem saying the set was not recorded and nothing compiles here."""
    from minilib.tpu.compile import libtpu_version, tpu_compile_available

    asked = Levers.only(*[name for name, checked in values.items() if checked])
    ok, reason = tpu_compile_available()
    if ok:
        cells = lever_costs.lever_set_cells(Levers.off()) + lever_costs.lever_set_cells(asked)
        mixed, decode = lever_costs.applied_levers(asked)
        source = f"Compiled here (libtpu {libtpu_version()}); each set once, then kept."
        return shown(asked, cells, {"mixed": mixed, "decode": decode}, source, ())
    record = lever_costs.recorded_levers()
    found = lever_costs.recorded_set(asked, record)
    if found is None:
        return not_recorded(asked, record, reason), None, ""
    off = lever_costs.recorded_set(Levers.off(), record)
    source = lever_costs.recorded_label_here(record)
    return shown(asked, off.cells + found.cells, found.applied, source, found.dropped)


def shown(asked: Levers, cells, applied: dict, source: str, dropped: tuple):
    """The status line and the table of `Levers.off()` and the asked set (its cells are the
    last ones; looked up without `dropped`, they carry that set's label)."""
    label = cells[-1].kernel
    v5e = [c for c in cells if c.kernel == label and (c.chip, c.config) == ("v5e", "8 q per block")]
    figure = lever_costs.figure(v5e[0] if v5e else None)
    status = f"{label}: {figure} bundles per KV block on v5e at 8 q per block (static estimate)."
    lines = [
        f"Applies in the mixed kernel: {', '.join(applied['mixed']) or 'none'}; "
        f"in the decode kernel: {', '.join(applied['decode']) or 'no decode kernel'}.",
    ]
    if dropped:
        names = ", ".join(dropped)
        lines.append(f"Looked up without {names}: they apply nowhere on this workload.")
    table = lever_costs.lever_table(cells, [], source=source)
    return status, levers_figure(cells), pre("\n".join(lines) + "\n\n" + table)


def levers_figure(cells):
    """Bars of bundles per KV block: for each chip and config, one bar per row of `cells`
    (`Levers.off()`, then the checked set).

    >>> from minilib.tpu.lever_costs import recorded_levers, recorded_set
    >>> off = recorded_set(Levers.off(), recorded_levers()).cells
    >>> levers_figure(off).axes[0].get_ylabel()
    'bundles per KV block'
    """
    rows = list(dict.fromkeys(c.kernel for c in cells))
    columns = list(dict.fromkeys((c.chip, c.config) for c in cells))
    figures = {(c.kernel, c.chip, c.config): c.bundles_per_kv_block or 0 for c in cells}
    fig = style.new_figure(8, 3)
    ax = fig.add_subplot()
    width = 0.8 / len(rows)
    for r, row in enumerate(rows):
        xs = [i + r * width for i in range(len(columns))]
        heights = [figures.get((row, *column), 0) for column in columns]
        ax.bar(xs, heights, width, color=style.color(r), hatch=style.hatch(r), label=row)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(columns))])
    ax.set_xticklabels([lever_costs.column_name(*column) for column in columns])
    ax.set_ylabel("bundles per KV block")
    ax.set_title("Static estimates from the compiled programs, not timings", fontsize=10)
    ax.legend(fontsize=8)
    style.clean(ax)
    return fig


def not_recorded(asked: Levers, record: dict, reason: str) -> InputProblem:
    """The problem of a set that was not recorded, where nothing compiles."""
    why = reason.rstrip(".")
    return InputProblem(
        f"This set of levers ({lever_costs.set_label(asked)}) was not recorded, and nothing "
        f"compiles here ({why}). Recorded: Levers.off(), every lever, each lever alone, and "
        f"the cumulative sets of the levers table ({len(record['sets'])} sets). Check one of "
        "those, or install libtpu to compile any set.",
        title="Not recorded: no figure for this set",
    )
