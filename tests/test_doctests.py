"""Every example in a minilib docstring runs and prints what it says, and every public name
has one.

"Public" is checkable: a module's public names are its `__all__`. Every function and class
there has a docstring with a runnable `>>>` example (run by `test_docstring_examples`).
Kernel-body helpers (the inner steps of a Pallas kernel, which only run inside one) stay out of
`__all__`; their docstrings and comments document them.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
from conftest import one_case_per_path

import minilib

MODULES = ["minilib"] + sorted(
    info.name
    for info in pkgutil.walk_packages(minilib.__path__, prefix="minilib.")
    if info.name != "minilib.__main__"
)


# Modules whose examples run a Pallas kernel in interpret mode, the engine's model, a
# benchmark or a sweep (each 15 s or more of one core): their examples run once, in .venv.
# On the other stacks the notebooks run the same functions.
HEAVY_EXAMPLES = {
    "minilib.blockwise",
    "minilib.engine.engine",
    "minilib.engine.model",
    "minilib.engine.multiprocess",
    "minilib.engine.sampling",
    "minilib.engine.sharding",
    "minilib.engine.throughput",
    "minilib.engine.view",
    "minilib.exercises.ex01_heads",
    "minilib.exercises.ex02_paged_cache",
    "minilib.exercises.ex04_reference",
    "minilib.exercises.ex06_online_softmax",
    "minilib.exercises.ex07_flash",
    "minilib.exercises.ex07_flash_call",
    "minilib.exercises.ex07_pallas",
    "minilib.exercises.ex08_ladder",
    "minilib.exercises.ex08_ragged",
    "minilib.exercises.ex10_engine",
    "minilib.exercises.ex10_rejection",
    "minilib.exercises.engine_runs",
    "minilib.kernel",
    "minilib.kernel.call",
    "minilib.kv_cache",
    "minilib.ladder.prefill_chunk",
    "minilib.ladder.ragged",
    "minilib.ladder.scalar_prefetch",
    "minilib.pallas_basics",
    "minilib.perf.bench",
    "minilib.perf.memory_sweep",
    "minilib.perf.timing",
    "minilib.schedule",
    "minilib.tpu.sinks",
    "minilib.vectorized",
}
EXAMPLES = one_case_per_path(MODULES, *(name for name in MODULES if name not in HEAVY_EXAMPLES))


def test_the_heavy_examples_are_modules():
    assert HEAVY_EXAMPLES <= set(MODULES), HEAVY_EXAMPLES - set(MODULES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def names_without_example(module) -> list[str]:
    """The functions and classes of `module.__all__` whose docstring has no `>>>` example."""
    missing = []
    for public_name in module.__all__:
        obj = getattr(module, public_name)
        if callable(obj):  # functions, classes, and jitted functions (which keep __doc__)
            if ">>>" not in (obj.__doc__ or ""):  # its own docstring, not an inherited one
                missing.append(public_name)
    return missing


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_has_an_example(name):
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} declares no __all__: list its public names"
    unknown = [n for n in module.__all__ if not hasattr(module, n)]
    assert not unknown, f"{name}.__all__ names what the module does not define: {unknown}"
    missing = names_without_example(module)
    assert not missing, f"{name}: public names without a `>>>` example: {missing}"
