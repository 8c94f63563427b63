"""What runs only under `slow`: every test family, as collected before `-m` deselects any.

The default run (CI's) skips the tests marked `slow`, the larger sweeps. A behaviour held by
`slow` tests alone is one CI never checks, so each family that has slow cases keeps a fast
case in the default run: tests/test_markers.py holds it, from what this plugin records.

A family is a test function (its parametrized cases together), with the `_sweep` of a slow
sweep dropped: `property_tests` (tests/conftest.py) makes `test_x` (a few examples) and
`test_x_sweep` (many, slow) of one check.
"""

from __future__ import annotations

import pytest

FAMILIES = pytest.StashKey[dict[str, set[bool]]]()


def family(item) -> str:
    name = getattr(item, "originalname", item.name).removesuffix("_sweep")
    return f"{item.path.name}::{name}"


@pytest.hookimpl(tryfirst=True)  # before the `-m` filter deselects the slow tests
def pytest_collection_modifyitems(config, items):
    families: dict[str, set[bool]] = {}
    for item in items:
        families.setdefault(family(item), set()).add(item.get_closest_marker("slow") is not None)
    config.stash[FAMILIES] = families


def slow_only(config) -> list[str]:
    """The families collected in this run whose every case is marked `slow`."""
    return sorted(name for name, kinds in config.stash[FAMILIES].items() if kinds == {True})
