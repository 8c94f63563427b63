"""The plain kernel (`minilib.kernel.plain`): what runs with every speed lever off.

It stays two modules a learner reads in a sitting each (the kernel, its walk), importing no
lever; and with every lever off (the plain slot, the plain load, one KV head at a time, one
kernel for every sequence) it matches JAX's reference in TPU interpret mode, on batches whose
unused slots and pages are NaN.
"""

from __future__ import annotations

import ast
import pathlib

import jax.numpy as jnp
import pytest
from conftest import INTERPRET, ONE_OF_EACH, assert_output_matches_jax

import minilib.kernel
from minilib.batch import make_batch
from minilib.kernel import (
    Levers,
    Points,
    choose_points,
    kernel_config,
    rpa_pallas_call,
    split_configs,
)

KERNEL = pathlib.Path(minilib.kernel.__file__).parent
PLAIN_MODULES = ("plain", "walk")
LEVERS = (
    "strided",
    "strided_fold",
    "padded_slot",
    "fp8",
    "lane_blocks",
    "narrow_rows",
    "heads_in_flight",
    "reciprocal",
    "fixed_max",
    "decode",
    "mixed_layout",
    "open_blocks",
    "levers",
)
MAX_PLAIN_LINES = 400


def kernel_imports(module: str) -> set[str]:
    """The `minilib.kernel` modules that `module` imports, by name."""
    found = set()
    for node in ast.walk(ast.parse((KERNEL / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "minilib.kernel":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minilib.kernel."):
            found.add(node.module.removeprefix("minilib.kernel."))
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
            found |= {
                name.removeprefix("minilib.kernel.")
                for name in names
                if name.startswith("minilib.kernel.")
            }
    return found


def test_the_plain_kernel_imports_no_lever():
    for module in PLAIN_MODULES:
        assert not kernel_imports(module) & set(LEVERS), (module, kernel_imports(module))


def test_a_lever_imports_no_other_lever():
    """Levers meet only in `levers` (the switchboard), which hands each the pieces it needs."""
    for lever in LEVERS[:-1]:
        assert not kernel_imports(lever) & set(LEVERS), (lever, kernel_imports(lever))


@pytest.mark.parametrize("module", PLAIN_MODULES)
def test_each_plain_module_is_read_in_one_sitting(module):
    """Its lines of code, docstrings and comments: what a reader reads. Blank lines are not
    counted: they are the formatter's (two between top-level definitions, one between methods).
    One statement a line: the kernel in `plain`, its walk in scalar code in `walk`."""
    text = (KERNEL / f"{module}.py").read_text()
    lines = sum(1 for line in text.splitlines() if line.strip())
    assert lines <= MAX_PLAIN_LINES, f"{module} has {lines} lines"


def every_lever_off(batch, **options):
    """The config of one kernel for every sequence, with every lever off (`Levers.off()`):
    the points are the plain kernel's own."""
    config = kernel_config(
        batch.q, batch.kv_pages, batch.page_indices, levers=Levers.off(), **options
    )
    assert split_configs(config) == (config, None)
    assert not config.decode and not config.leaves_decode and config.lane_blocks == 1
    assert choose_points(config) == Points()
    return config


@pytest.mark.parametrize(
    "batch_options, options",
    [
        pytest.param(dict(num_q_heads=8, num_kv_heads=2, dtype=jnp.float32), {}, id="f32 GQA"),
        pytest.param(
            dict(num_q_heads=4, num_kv_heads=4, dtype=jnp.bfloat16, head_dim=128),
            dict(sliding_window=6, soft_cap=20.0),
            id="bf16 MHA, sliding window, soft cap",
        ),
    ],
)
def test_the_plain_kernel_matches_jax_reference(batch_options, options):
    """Every lever off, in TPU interpret mode (NaN in uninitialized memory), on a batch with a
    prefill, a decode, an idle sequence and a chunk, NaN in its unused slots and pages."""
    batch = make_batch(ONE_OF_EACH, page_size=8, max_num_batched_tokens=24, max_num_seqs=6,
                       pages_per_seq=7, **batch_options)  # fmt: skip
    options = dict(sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=8, **options)
    config = every_lever_off(batch, **options)
    call = rpa_pallas_call(batch.q, batch.kv_pages, config=config, interpret=INTERPRET)
    (out,) = call(*batch.args()[2:], batch.q, batch.kv_pages)
    assert_output_matches_jax(out, batch, **options)
