"""A pytest worker empties JAX's caches past half the system's limit on memory maps
(tests/conftest.py): the compiled programs' maps are given back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import memory_maps, release_compiled_programs


@pytest.mark.skipif(memory_maps() is None, reason="no /proc/self/maps here")
def test_past_half_the_limit_the_compiled_programs_are_unmapped():
    for i in range(60):
        jax.jit(lambda x, i=i: jnp.sin(x) * i)(jnp.ones((i + 1,))).block_until_ready()
    held = memory_maps()
    assert not release_compiled_programs(limit=4 * held)  # under half: kept
    assert release_compiled_programs(limit=held)
    assert memory_maps() < held - 60  # about three maps a program
