"""minilib.tpu.memory: each chip's memories come from JAX's own table, never typed in."""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu

from minilib.tpu.chips import CHIPS
from minilib.tpu.memory import chip_memories, why_unavailable


def test_chip_memories_come_from_jaxs_table():
    rows = chip_memories()
    if not hasattr(pltpu, "get_tpu_info_for_chip"):
        assert rows is None and "get_tpu_info_for_chip" in why_unavailable()
        return
    assert [r.chip for r in rows] == list(CHIPS)
    v4, v5e = (pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(c), 1) for c in ("v4", "v5e"))
    assert rows[0].vmem_bytes == v4.vmem_capacity_bytes
    assert rows[1].vmem_bytes == v5e.vmem_capacity_bytes and rows[1].lanes == v5e.num_lanes
