"""The strictest TPU interpret mode this JAX offers, and the race detector's verdict.

`strict_interpret_params()` turns on what catches kernel bugs on a CPU:

  detect_races=True            a buffer access that no wait orders with a DMA's write into
                               that buffer is recorded as a race: a read of a buffer before
                               the wait for the copy into it, a read of a slot while a copy
                               into it has started. (Two copies into one slot, neither waited
                               for, may go unreported: the checkers' ledger,
                               `minilib.ladder.watch`, catches those.)
  uninitialized_memory="nan"   scratch and output buffers start as NaN (integers at their
                               largest value), so a state the kernel forgot to initialise shows
                               up in the answer; interpret mode itself reports nothing;
  dma_execution_mode="eager"   a copy lands the moment it starts. A read before the wait then
                               still sees the right data (only the race detector catches it),
                               but a read after a *later* copy into the same buffer started
                               sees the later data: a wrong answer.

`num_cores=2` simulates two TensorCores behind one device (megacore: v4, v5p), which split the
"parallel" grid axes between them, each with its own scratch. The interpreter always visits a
"parallel" axis in a shuffled order (`random_seed` picks the shuffle); "arbitrary" axes run in
order.

Options this JAX's `pltpu.InterpretParams` lacks are left out, and named in
`MISSING_OPTIONS`, so that a report can say what was not checked.

A race is reported, not raised (`on_race="warn"`, where this JAX has the option; from jax 0.12
its default raises inside the copy's callback, which ends the run with a bare "CpuCallback
error"): the kernel runs to its end, so a checker sees both its answer and the verdict.
"""

from __future__ import annotations

import dataclasses
import importlib

from jax.experimental.pallas import tpu as pltpu

__all__ = [
    "MISSING_OPTIONS",
    "STRICT_OPTIONS",
    "detecting_races",
    "races_found",
    "strict_interpret_params",
]

STRICT_OPTIONS = {
    "detect_races": True,
    "uninitialized_memory": "nan",
    "dma_execution_mode": "eager",
}
_FIELDS = {f.name for f in dataclasses.fields(pltpu.InterpretParams)}
MISSING_OPTIONS = tuple(name for name in STRICT_OPTIONS if name not in _FIELDS)
REPORT_RACES = {"on_race": "warn"} if "on_race" in _FIELDS else {}


def strict_interpret_params(
    *,
    num_cores: int = 1,
    random_seed: int | None = None,
    grid_point_recorder=None,
    uninitialized_memory: str = "nan",
) -> pltpu.InterpretParams:
    """`pltpu.InterpretParams` with every option of `STRICT_OPTIONS` this JAX has.

    `num_cores`: TensorCores per device (2: megacore). `random_seed`: the shuffle of the
    "parallel" grid axes. `grid_point_recorder`: called with each grid point the interpreter
    runs and its core (and, from jax 0.8, a token first, which it must return).
    `uninitialized_memory="zero"`: scratch and output buffers start as 0, not NaN (a checker
    runs a wrong kernel so to see whether its NaN came from memory it never wrote).

    >>> strict_interpret_params().detect_races
    True
    """
    strict = STRICT_OPTIONS | {"uninitialized_memory": uninitialized_memory}
    options = {k: v for k, v in strict.items() if k in _FIELDS}
    cores = "num_cores_or_threads" if "num_cores_or_threads" in _FIELDS else "num_cores_per_device"
    options[cores] = num_cores
    if random_seed is not None:
        options["random_seed"] = random_seed
    if grid_point_recorder is not None:
        options["grid_point_recorder"] = grid_point_recorder
    return detecting_races(pltpu.InterpretParams(**options))


def detecting_races(params: pltpu.InterpretParams | None = None) -> pltpu.InterpretParams:
    """`params` (default: the plain interpret mode) with the race detector on, reporting races
    rather than raising them (`strict_interpret_params` is made so too).

    >>> detecting_races().detect_races
    True
    """
    params = pltpu.InterpretParams() if params is None else params
    return dataclasses.replace(params, detect_races=True, **REPORT_RACES)


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
