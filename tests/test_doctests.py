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

import minilib

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(minilib.__path__, prefix="minilib.")
    if info.name != "minilib.__main__"
)

# The modules whose `__all__` is checked: every public name has an example. A module joins
# this list, one line, once it declares `__all__` and each name there has an example; once
# every module has joined, the list is MODULES.
PUBLIC_API_MODULES = [
    "minilib.batch",
    "minilib.bench",
    "minilib.block_sizes",
    "minilib.blockwise",
    "minilib.doctor",
    "minilib.engine",
    "minilib.engine.engine",
    "minilib.engine.model",
    "minilib.engine.scheduler",
    "minilib.engine.sharding",
    "minilib.engine.throughput",
    "minilib.engine.view",
    "minilib.errors",
    "minilib.exercises",
    "minilib.exercises.checking",
    "minilib.exercises.ex00_tour",
    "minilib.exercises.ex01_heads",
    "minilib.exercises.ex02_paged_cache",
    "minilib.exercises.ex03_ragged",
    "minilib.exercises.ex04_reference",
    "minilib.exercises.ex05_validation",
    "minilib.exercises.ex06_online_softmax",
    "minilib.exercises.ex06_vectorized",
    "minilib.exercises.ex07_flash",
    "minilib.exercises.ex07_pallas",
    "minilib.exercises.ex08_kernel",
    "minilib.exercises.ex08_ladder",
    "minilib.exercises.ex09_performance",
    "minilib.exercises.ex10_engine",
    "minilib.exercises.kernel_checking",
    "minilib.heads",
    "minilib.kernel_costs",
    "minilib.kernel_trace",
    "minilib.kv_cache",
    "minilib.ladder",
    "minilib.ladder.aligned_blocks",
    "minilib.ladder.async_copy",
    "minilib.ladder.double_buffer",
    "minilib.ladder.flash",
    "minilib.ladder.interpret",
    "minilib.ladder.prefetch",
    "minilib.ladder.scalar_prefetch",
    "minilib.masking",
    "minilib.mistakes",
    "minilib.options",
    "minilib.reference",
    "minilib.roofline",
    "minilib.schedule",
    "minilib.timing",
    "minilib.tpu_compile",
    "minilib.tpu_memory",
    "minilib.validation",
    "minilib.vectorized",
    "minilib.viz",
    "minilib.widgets",
    "minilib.workloads",
]


@pytest.mark.parametrize("name", MODULES)
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


@pytest.mark.parametrize("name", PUBLIC_API_MODULES)
def test_every_public_name_has_an_example(name):
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} declares no __all__: list its public names"
    unknown = [n for n in module.__all__ if not hasattr(module, n)]
    assert not unknown, f"{name}.__all__ names what the module does not define: {unknown}"
    missing = names_without_example(module)
    assert not missing, f"{name}: public names without a `>>>` example: {missing}"
