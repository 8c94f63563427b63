"""The TPU chips the course compiles for and reasons about: their published figures, the chip
being compiled for, and how many values of a dtype share one 32-bit word.

Facts only, so that every layer may read them, the kernel as much as the analysis tools. One
table, so that every module names a chip the same way and reads the same figures: the
compile-only topology `minilib.tpu.compile` asks JAX for, the device kinds JAX reports on a
real chip, the core clock the static cost model divides bundles by, and the two roofline
figures, HBM bandwidth and dense bf16 peak, per device.

Where the figures come from:

* v4, v5e, v5p, v6e: Google Cloud's TPU system architecture pages. The clocks follow from
  each chip's published peak (peak bf16 FLOP/s = 2 * MXUs * MXU size^2 * clock), except v6e's
  1.75 GHz, an assumption, and one that JAX's own table (`pltpu.get_tpu_info_for_chip`) does
  not support: by that formula 918 TFLOP/s at 1.75 GHz takes 4 MXUs of 256 x 256, and JAX's
  table gives v6e 2, which would take 3.5 GHz. So v6e's static issue times (bundles / clock)
  rest on an assumed clock; its bundle counts do not depend on it.
* TPU7x (Ironwood): https://docs.cloud.google.com/tpu/docs/tpu7x gives, per chip, 2307 TFLOP/s
  of dense bf16, 7380 GB/s of HBM bandwidth and two TensorCores. Each TensorCore is a device
  of its own (`tpu7x:1x1x1` has two devices, one core each), so a device gets half of each:
  1153.5 TFLOP/s and 3690 GB/s, as JAX's own table (`pltpu.get_tpu_info_for_chip`) also
  halves them. Google publishes no clock for TPU7x, and no MXU count from which the peak would
  give one: `clock_hz` is None, and what needs it (a static issue time) says it is unknown.

No code looks a chip up by anything but its key; `current_chip()` gives the key of the chip
being compiled for, without calling `jax.devices()`, so that lowering for a TPU on a TPU-less
machine works.

>>> CHIPS
('v4', 'v5e', 'v5p', 'v6e', 'tpu7x')
>>> FACTS["v5e"].clock_hz / 1e9, FACTS["v5e"].topology
(1.5, 'v5e:1x1')
>>> FACTS["tpu7x"].clock_hz is None, FACTS["tpu7x"].hbm_bytes_per_s / 1e9
(True, 3690.0)
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

import jax
import jax.numpy as jnp

__all__ = [
    "CHIPS",
    "DEFAULT_SCOPED_VMEM_BYTES",
    "DEVICE_KINDS",
    "FACTS",
    "ChipFacts",
    "current_chip",
    "installed_libtpu",
    "packing",
    "packing_of_size",
]


@dataclasses.dataclass(frozen=True)
class ChipFacts:
    """One chip's published figures, per device (one chip, or one core in split mode).

    >>> FACTS["v6e"].hbm_bytes_per_s / 1e9, FACTS["v6e"].peak_flops_per_s / 1e12  # GB/s, TFLOP/s
    (1640.0, 918.0)
    """

    name: str  # as people write it: "TPU v5e"
    topology: str  # jax.experimental.topologies' name of one chip
    clock_hz: float | None  # core clock: one VLIW bundle per cycle; None: not published
    hbm_bytes_per_s: float  # HBM bandwidth
    peak_flops_per_s: float  # dense bf16 matmul peak
    generation: int  # 4, 5, 6, 7: what code that branches on the TPU generation asks
    jax_chip_version: str  # its name in JAX's chip table: pltpu.ChipVersion("7x")
    tensor_cores: int = 1  # per chip: 2 on v4 and v5p (megacore: one device) and on TPU7x


FACTS: dict[str, ChipFacts] = {
    "v4": ChipFacts("TPU v4", "v4:1x1x1", 1.05e9, 1200e9, 275e12, 4, "v4", tensor_cores=2),
    "v5e": ChipFacts("TPU v5e", "v5e:1x1", 1.5e9, 819e9, 197e12, 5, "v5e"),
    "v5p": ChipFacts("TPU v5p", "v5p:1x1x1", 1.75e9, 2765e9, 459e12, 5, "v5p", tensor_cores=2),
    "v6e": ChipFacts("TPU v6e", "v6e:1x1", 1.75e9, 1640e9, 918e12, 6, "v6e"),
    "tpu7x": ChipFacts("TPU7x", "tpu7x:1x1x1", None, 3690e9, 1153.5e12, 7, "7x", tensor_cores=2),
}
CHIPS = tuple(FACTS)

# The VMEM a kernel may use unless it asks for more (`vmem_limit_bytes`): libtpu's default
# scoped limit, which JAX's table does not give. `tests/tpu/test_tpu_vmem_model.py` compiles
# a kernel just under it and one just over it for each chip (libtpu 0.0.50.1).
DEFAULT_SCOPED_VMEM_BYTES = {
    "v4": 16 << 20,
    "v5e": 16 << 20,
    "v5p": 16 << 20,
    "v6e": 32 << 20,
    "tpu7x": 32 << 20,
}

# `jax.devices()[0].device_kind` on a real chip -> its key in FACTS.
DEVICE_KINDS: dict[str, str] = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "tpu7x",
}


def current_chip() -> str | None:
    """The chip being compiled for: the abstract mesh's device kind (as `minilib.tpu.compile`
    sets it), else the device kind when JAX runs on a TPU, else None. Never `jax.devices()`
    off a TPU.

    >>> current_chip() is None or current_chip() in FACTS
    True
    """
    get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get_abstract_mesh() if get_abstract_mesh else None
    device = getattr(mesh, "abstract_device", None)
    if device is not None:
        return DEVICE_KINDS.get(device.device_kind)
    if jax.default_backend() == "tpu":
        return DEVICE_KINDS.get(jax.local_devices()[0].device_kind)
    return None


def installed_libtpu() -> str | None:
    """The version of libtpu pip installed, or None (none installed, or loaded from elsewhere
    through TPU_LIBRARY_PATH, as on some TPU VMs).

    >>> version = installed_libtpu()
    >>> version is None or version.startswith("0.")
    True
    """
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def packing_of_size(itemsize: int) -> int:
    """How many values of `itemsize` bytes share one 32-bit word.

    >>> packing_of_size(1), packing_of_size(4)
    (4, 1)
    """
    return 4 // itemsize


def packing(dtype) -> int:
    """How many values of `dtype` share one 32-bit word: a TPU tile is (8 * packing, 128).

    >>> packing(jnp.bfloat16), packing(jnp.float32)
    (2, 1)
    """
    return packing_of_size(jnp.dtype(dtype).itemsize)
