"""A kernel whose copies move fewer bytes than its wait takes back fails in seconds, naming the
semaphore and the wait, under the guard every kernel test runs in (tests/conftest.py,
`minilib.ladder.deadlock`): without it the wait waits for ever, as it would on the chip, and
the test runs to the ten-minute watchdog.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# The kernel's compile included, on a loaded machine: far below the watchdog's ten minutes,
# far above the guard's five seconds of patience.
SECONDS = 120


def copies_rows(rows_copied: int):
    """A kernel that copies `rows_copied` of x's 8 rows into VMEM, then waits for all 8."""

    def kernel(x_hbm_ref, o_ref, buf, sem):
        copied = pl.ds(0, rows_copied)
        pltpu.make_async_copy(x_hbm_ref.at[copied], buf.at[copied], sem).start()
        pltpu.make_async_copy(x_hbm_ref, buf, sem).wait()
        o_ref[...] = buf[...]

    return kernel


def call(kernel, interpret):
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=interpret,
    )(jnp.ones((8, 128), jnp.float32))


EAGER = pltpu.InterpretParams(dma_execution_mode="eager")


@pytest.mark.parametrize("interpret", [INTERPRET, EAGER], ids=["on_wait", "eager"])
@pytest.mark.parametrize("rows_copied", [0, 4])
def test_a_short_copy_fails_in_seconds_naming_its_wait(interpret, rows_copied):
    start = time.monotonic()
    with pytest.raises(Exception, match="deadlock") as raised:
        jax.block_until_ready(call(copies_rows(rows_copied), interpret))
    assert time.monotonic() - start < SECONDS
    message = str(raised.value)
    assert f"for 4096 bytes, and it holds {512 * rows_copied}" in message
    assert "a wait on DMA semaphore" in message


def test_a_whole_copy_passes_under_the_guard():
    """The guard calls no wait stuck that ends: the copy of all 8 rows, in both modes."""
    for interpret in (INTERPRET, EAGER):
        out = call(copies_rows(8), interpret)
        np.testing.assert_array_equal(np.asarray(out), 1.0)
