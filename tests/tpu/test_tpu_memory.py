"""minilib.tpu.memory: each chip's memories come from JAX's own table, never typed in."""

from __future__ import annotations

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

from minilib.tpu.chips import CHIPS
from minilib.tpu.memory import (
    chip_memories,
    chip_memories_here_or_recorded,
    recorded_chip_memories,
    why_unavailable,
)


def test_chip_memories_come_from_jaxs_table():
    rows = chip_memories()
    if not hasattr(pltpu, "get_tpu_info_for_chip"):
        assert rows is None and "get_tpu_info_for_chip" in why_unavailable()
        return
    assert [r.chip for r in rows] == list(CHIPS)
    v4, v5e = (pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(c), 1) for c in ("v4", "v5e"))
    assert rows[0].vmem_bytes == v4.vmem_capacity_bytes
    assert rows[1].vmem_bytes == v5e.vmem_capacity_bytes and rows[1].lanes == v5e.num_lanes


def test_the_recorded_table_is_jaxs_table():
    """The figures jax 0.7.2 shows (`minilib/tpu/recorded_chip_table.json`) are every field of
    every chip of this jax's table, where it has one: re-record with
    `python -m minilib.tpu.recorded --chips` when JAX's table moves."""
    recorded, record = recorded_chip_memories()
    live = chip_memories()
    if live is None:
        pytest.skip(f"jax {jax.__version__} has no table to check against")
    if record["jax"] != jax.__version__:
        pytest.skip(f"recorded with jax {record['jax']}; here jax {jax.__version__}")
    assert recorded == live, "run `python -m minilib.tpu.recorded --chips`"


def test_without_a_table_the_recorded_one_is_shown_and_labelled(monkeypatch):
    monkeypatch.delattr(pltpu, "get_tpu_info_for_chip", raising=False)
    rows, source = chip_memories_here_or_recorded(("v6e", "v5e"))
    recorded, record = recorded_chip_memories()
    assert rows == [recorded[3], recorded[1]]
    assert source.startswith(f"Recorded on {record['date']} with jax {record['jax']}")
    assert "python -m minilib.tpu.recorded --chips" in source
