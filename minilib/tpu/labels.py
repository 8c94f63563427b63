"""How a recorded figure says where it comes from, wherever it is shown.

A figure compiled on another machine is shown with one label: when it was recorded, with which
jax (and libtpu, and v3), by which command, and why it was not computed here.
"""

from __future__ import annotations

__all__ = ["recorded_label"]

STACK = ("jax", "libtpu")


def recorded_label(record: dict, command: str, *, not_here: str = "") -> str:
    """ "Recorded on <date> with jax X, libtpu Y[ and v3 from tpu-inference Z] by `command`[, not computed here:
    <not_here>]." from a record's `date`, `jax`, `libtpu` and `v3` (those it has).

    >>> record = {"date": "2026-12-05", "jax": "0.12.0.1", "libtpu": "0.0.50.1"}
    >>> print(recorded_label(record, "python -m minilib compile --record", not_here="no libtpu."))
    Recorded on 2026-12-05 with jax 0.12.0.1, libtpu 0.0.50.1 by `python -m minilib compile --record`, not computed here: no libtpu.
    >>> print(recorded_label({"date": "2026-12-05", "jax": "0.12.0.1"}, "python -m x"))
    Recorded on 2026-12-05 with jax 0.12.0.1 by `python -m x`.
    """  # noqa: E501
    stack = ", ".join(f"{name} {record[name]}" for name in STACK if name in record)
    if "v3" in record:
        stack += f" and v3 from tpu-inference {record['v3'].removeprefix('tpu-inference ')}"
    why = f", not computed here: {not_here.rstrip('.')}" if not_here else ""
    return f"Recorded on {record['date']} with {stack} by `{command}`{why}."
