"""A TPU core's memories and compute units, per chip, as JAX itself describes them.

Newer JAX versions (0.10.2 does; 0.7.2 does not) carry a description of each TPU generation
(`pltpu.get_tpu_info_for_chip`, the figures Pallas itself plans with): HBM, VMEM and SMEM
capacity, the vector register shape (sublanes x lanes), and the MXU. `chip_memories` reads it
for the chips this course compiles for. Without that table (jax 0.7.2) then it returns None, and
`why_unavailable()` says so: the course never types these numbers in by hand.
"""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import tpu as pltpu

from minilib.tpu.chips import CHIPS, FACTS

__all__ = ["ChipMemories", "chip_memories", "why_unavailable"]


@dataclasses.dataclass(frozen=True)
class ChipMemories:
    """One TensorCore of a chip: memory capacities in bytes, and its compute units. On a chip
    with two TensorCores JAX's figures, HBM included, are one TensorCore's: on v4 and v5p
    (megacore: the two behind one device) as on TPU7x (each core a device of its own).

    >>> print(ChipMemories("v5e", hbm_bytes=16 << 30, vmem_bytes=128 << 20, smem_bytes=1 << 20,
    ...                    sublanes=8, lanes=128, num_mxus=4, mxu_size=128).row())
    v5e   HBM  16.0 GiB   VMEM  128 MiB   SMEM  1024 KiB
    vector register 8x128   4 MXU(s) of 128x128
    """

    chip: str
    hbm_bytes: int
    vmem_bytes: int
    smem_bytes: int
    sublanes: int  # a vector register is sublanes x lanes 32-bit values
    lanes: int
    num_mxus: int
    mxu_size: int  # the MXU is mxu_size x mxu_size
    tensor_cores: int = 1  # per chip (`minilib.tpu.chips`): where 2, each figure is one core's

    def row(self) -> str:
        gib, mib, kib = 2**30, 2**20, 2**10
        share = f" per TensorCore ({self.tensor_cores} per chip)" if self.tensor_cores > 1 else ""
        return (
            f"{self.chip:5s} HBM {self.hbm_bytes / gib:5.1f} GiB{share}   "
            f"VMEM {self.vmem_bytes / mib:4.0f} MiB   SMEM {self.smem_bytes / kib:5.0f} KiB   "
            "vector register "
            f"{self.sublanes}x{self.lanes}   {self.num_mxus} MXU(s) of "
            f"{self.mxu_size}x{self.mxu_size}"
        )


def chip_memories(chips=CHIPS) -> list[ChipMemories] | None:
    """Each chip's figures from JAX's own table, or None when this JAX has none (0.7.2).

    >>> rows = chip_memories(("v5e",))
    >>> rows is None or rows[0].vmem_bytes > 0
    True
    """
    get_info = getattr(pltpu, "get_tpu_info_for_chip", None)
    if get_info is None:
        return None
    rows = []
    for chip in chips:
        version = pltpu.ChipVersion(FACTS[chip].jax_chip_version)
        info = get_info(version, 1)  # one TensorCore's figures
        rows.append(
            ChipMemories(
                chip=chip,
                hbm_bytes=info.hbm_capacity_bytes,
                vmem_bytes=info.vmem_capacity_bytes,
                smem_bytes=info.smem_capacity_bytes,
                sublanes=info.num_sublanes,
                lanes=info.num_lanes,
                num_mxus=info.num_mxus,
                mxu_size=info.mxu_column_size,
                tensor_cores=FACTS[chip].tensor_cores,
            )
        )
    return rows


def why_unavailable() -> str:
    """Why `chip_memories()` returned None: this JAX has no table of TPU chips.

    >>> print(why_unavailable())
    jax ... has no table of TPU chips (pltpu.get_tpu_info_for_chip; jax 0.10.2 has it): ...
    """
    import jax

    return (
        f"jax {jax.__version__} has no table of TPU chips (pltpu.get_tpu_info_for_chip; jax "
        "0.10.2 has it): with a newer jax this prints HBM, VMEM and SMEM per chip."
    )
