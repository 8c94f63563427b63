"""The strictest TPU interpret mode this JAX offers, and the race detector's verdict.

`strict_interpret_params()` turns on what catches kernel bugs on a CPU:

  detect_races=True            a DMA that writes a buffer while the kernel reads it, or two
                               copies into one buffer at once, is recorded as a race;
  uninitialized_memory="nan"   scratch and output buffers start as NaN, so a state the kernel
                               forgot to initialise shows up in the answer;
  dma_execution_mode="eager"   a copy lands as soon as it starts, so reading a buffer that a
                               copy is about to overwrite gives a wrong answer, not a lucky one.

Options this JAX's `pltpu.InterpretParams` lacks are left out, and named in
`MISSING_OPTIONS`, so that a report can say what was not checked.
"""

from __future__ import annotations

import dataclasses
import importlib

from jax.experimental.pallas import tpu as pltpu

__all__ = ["MISSING_OPTIONS", "STRICT_OPTIONS", "races_found", "strict_interpret_params"]

STRICT_OPTIONS = {
    "detect_races": True,
    "uninitialized_memory": "nan",
    "dma_execution_mode": "eager",
}
_FIELDS = {f.name for f in dataclasses.fields(pltpu.InterpretParams)}
MISSING_OPTIONS = tuple(name for name in STRICT_OPTIONS if name not in _FIELDS)


def strict_interpret_params() -> pltpu.InterpretParams:
    """`pltpu.InterpretParams` with every option of `STRICT_OPTIONS` this JAX has.

    >>> strict_interpret_params().detect_races
    True
    """
    options = {k: v for k, v in STRICT_OPTIONS.items() if k in _FIELDS}
    return pltpu.InterpretParams(**options)


def races_found() -> bool:
    """Whether the last kernel run with `detect_races=True` found a race.

    The race detector keeps its verdict in a module global, whose module moved between JAX
    versions. Raises RuntimeError if this JAX has no race detector.

    >>> import jax.numpy as jnp
    >>> from minilib.pallas_basics import add_vectors
    >>> x = jnp.arange(8.0)
    >>> add_vectors(x, x, block_size=8, interpret=strict_interpret_params()).tolist()
    [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    >>> races_found()   # no DMA in that kernel, so no race
    False
    """
    for name in (
        "jax._src.pallas.mosaic.interpret.interpret_pallas_call",  # jax 0.8 and later
        "jax._src.pallas.mosaic.interpret",  # jax 0.7
    ):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "races"):
            return module.races is not None and bool(module.races.races_found)
    raise RuntimeError("cannot find the Pallas interpret race detector in this JAX")
