"""Colab's TPU runtime pairs jax 0.7.2 with libtpu 0.0.21.1, and two things stop that pair
compiling a Pallas kernel. minilib steps around both; these tests check that every kernel of
the course compiles with the pair, and that each of the two is still there, so still needed:

1. jax 0.7.2 serializes a kernel at Mosaic IR version 8 for any libtpu built after 2025-08-14,
   as this one is (2025-08-25), and its Mosaic reads up to version 7: "Unsupported version:
   expected <= 7 but got 8". minilib lowers kernels at version 7 with this pair
   (`minilib.jax_patches.mosaic_version`), on a real TPU as here.
2. Its compile-only devices crash jax (signal 11) after every compile, when jax asks them for
   an argument's default layout (`pxla.is_default_layout`). The compile is done and dumped by
   then; `minilib.tpu.compile` answers that question itself for this pair
   (`LAYOUT_QUERY_CRASHES`). A real TPU's devices are not compile-only.

Runs where such a pair is installed (`.venv-tpu-oldest`), and is skipped elsewhere. When a
libtpu reads version 8 or stops crashing, the test of that fix fails: take the pair out of
`mosaic_version.NEWEST_READ` or `LAYOUT_QUERY_CRASHES`.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from minilib.jax_patches import mosaic_version
from minilib.ladder import (
    aligned_blocks,
    async_copy,
    double_buffer,
    flash,
    prefetch,
    scalar_prefetch,
)
from minilib.pallas_basics import add_vectors
from minilib.tpu import compile as tpu_compile
from minilib.tpu.compile import LAYOUT_QUERY_CRASHES, compile_for_tpu
from minilib.tpu.kernel_costs import COMPARISON_CASE, compile_rpa, rpa_specs

PAIR = (jax.__version__, tpu_compile.libtpu_version())
pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(
        PAIR not in LAYOUT_QUERY_CRASHES and mosaic_version.ir_version_cap(*PAIR) is None,
        reason=f"jax {PAIR[0]} with libtpu {PAIR[1]} is not Colab's jax 0.7.2 with libtpu 0.0.21",
    ),
]

COLAB_CHIPS = ("v5e", "v6e")  # the chips of Colab's TPU runtimes


# --- With minilib's two fixes, every kernel of the course compiles --------------------------


def test_the_pair_is_available_and_kernels_are_lowered_at_the_version_libtpu_reads():
    ok, reason = tpu_compile.tpu_compile_available()
    assert ok, reason
    from jax._src import tpu_custom_call

    assert tpu_custom_call.get_ir_version.minilib_ir_version_cap == 7
    assert mosaic_version.apply() == 7  # applied when minilib was imported; again: unchanged


def assert_compiled(report):
    assert report.compiled, f"Mosaic/XLA rejected the kernel on {report.chip}:\n{report.error}"
    assert report.total_bundles and report.total_bundles > 0, f"no bundles read: {report}"


def decode_specs(dtype):
    s = jax.ShapeDtypeStruct
    return (s((8, 8, 128), dtype), s((64, 16, 4, 128), dtype), s((8,), jnp.int32),
            s((8, 4), jnp.int32))  # fmt: skip


def course_kernels():
    """name -> (function, argument specs): notebook 07's first kernel and every rung of the
    ladder (minilib's tested versions of what the learner writes)."""
    s = jax.ShapeDtypeStruct
    vector = s((4096,), jnp.float32)
    attention = (
        s((3, 16, 4, 128), jnp.float32),
        s((3, 128, 2, 128), jnp.float32),
        s((3, 128, 2, 128), jnp.float32),
        s((3,), jnp.int32),
        s((3,), jnp.int32),
    )
    dense = [s((2, n, 128), jnp.bfloat16) for n in (128, 256, 256)]
    decode = dict(sm_scale=0.1)
    return {
        "add_vectors": (functools.partial(add_vectors, block_size=1024, interpret=False),
                        (vector, vector)),
        "aligned_blocks": (functools.partial(aligned_blocks.attention_pallas_call_aligned,
                                             sm_scale=0.2, num_queries_per_block=8), attention),
        "flash": (functools.partial(flash.flash_attention, kv_len=200, sm_scale=0.1,
                                    block_q=32, block_kv=128), dense),
        "scalar_prefetch": (functools.partial(scalar_prefetch.paged_decode_attention, **decode),
                            decode_specs(jnp.bfloat16)),
        "async_copy": (functools.partial(async_copy.paged_decode_attention_async_copy,
                                         **decode), decode_specs(jnp.bfloat16)),
        "double_buffer": (functools.partial(
            double_buffer.paged_decode_attention_double_buffered, **decode),
            decode_specs(jnp.bfloat16)),
        "prefetch": (functools.partial(prefetch.paged_decode_attention_prefetch, **decode),
                     decode_specs(jnp.bfloat16)),
    }  # fmt: skip


@pytest.mark.parametrize("chip", COLAB_CHIPS)
@pytest.mark.parametrize("name", list(course_kernels()))
def test_every_ladder_kernel_compiles_on_colabs_pair(name, chip):
    fn, specs = course_kernels()[name]
    assert_compiled(compile_for_tpu(fn, *specs, chip=chip))


@pytest.mark.parametrize("chip", COLAB_CHIPS)
def test_the_course_kernel_compiles_on_colabs_pair_mixed_and_decode(chip):
    """The program of `minilib.kernel.ragged_paged_attention` holds its two kernels, mixed and
    decode, each with its bundle dump. (With jax 0.7.2 libtpu names both after the jit,
    `rpa_jit.2` and `rpa_jit.3`; the compiled HLO shows which is which by its output: all
    256 q rows for the mixed kernel, one row per sequence, 16, for the decode kernel.)"""
    report = compile_rpa(
        "ours", rpa_specs(**COMPARISON_CASE), chip=chip, num_kv_pages_per_block=8,
        num_queries_per_block=32,
    )  # fmt: skip
    assert_compiled(report)
    assert len(report.kernels) == 2, report
    assert all(k.bundles_per_kv_block and k.bundles_per_kv_block > 0 for k in report.kernels), (
        report
    )


# --- Without them, nothing would: each is still needed ----------------------------------------

# In a fresh process, as `minilib.tpu.compile` compiles but with one of its fixes undone.
# faulthandler prints the Python stack of a crash.
FRESH_PROCESS = """
import faulthandler, functools, sys
faulthandler.enable()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from minilib.pallas_basics import add_vectors
from minilib.tpu import compile as tpu_compile
from minilib.tpu.kernel_costs import COMPARISON_CASE, rpa_function, rpa_specs
from jax._src import tpu_custom_call
what = sys.argv[1]
if what == "jax's IR version":  # undo minilib.jax_patches.mosaic_version; keep the layout fix
    tpu_custom_call.get_ir_version = tpu_custom_call.get_ir_version.__wrapped__
    x = jax.ShapeDtypeStruct((4096,), jnp.float32)
    add = functools.partial(add_vectors, block_size=1024, interpret=False)
    report = tpu_compile.compile_for_tpu(add, x, x, chip="v5e")
    print("compiled" if report.compiled else f"compile failed: {report.error}")
    sys.exit()
device = tpu_compile.topology_device("v5e")  # jax's layout query, as lowered.compile() asks it
sharding = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
place = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
if what == "plain":
    fn, specs = (lambda a, b: jnp.sin(a) + b), [jax.ShapeDtypeStruct((4096,), jnp.float32)] * 2
else:  # the course kernel, mixed and decode
    fn = functools.partial(rpa_function("ours"), sm_scale=0.1)
    specs = rpa_specs(**COMPARISON_CASE)
with jax.sharding.use_abstract_mesh(tpu_compile.abstract_mesh(device)):
    lowered = jax.jit(fn).lower(*map(place, specs))
try:
    lowered.compile()
except Exception as err:
    print("compile failed:", err)
else:
    print("compiled")
"""


def run_fresh_process(what: str) -> subprocess.CompletedProcess:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, JAX_PLATFORMS="cpu", **tpu_compile.QUIET_LIBTPU_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-c", FRESH_PROCESS, what]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_cannot_compile_at_the_ir_version_jax_picks_for_this_libtpu():
    done = run_fresh_process("jax's IR version")
    assert "Unsupported version: expected <= 7 but got 8" in done.stdout, (
        f"Mosaic no longer rejects jax's IR version ({done.returncode=}): take {PAIR[1]} out of "
        f"mosaic_version.NEWEST_READ\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    )


@pytest.mark.parametrize("program", ["plain", "course kernel"])
def test_cannot_compile_on_compile_only_devices_if_jax_asks_them_for_a_layout(program):
    """Signal 11 in jax's layout query, after the compile: a plain XLA program, and the course
    kernel (lowered at IR version 7), which therefore Mosaic accepted."""
    done = run_fresh_process(program)
    crashed_in_the_layout_query = done.returncode == -11 and "in is_default_layout" in done.stderr
    assert crashed_in_the_layout_query and "compiled" not in done.stdout, (
        f"no longer the crash in the layout query ({done.returncode=}, {done.stdout=}): take "
        f"{PAIR} out of LAYOUT_QUERY_CRASHES, or update its reason\n{done.stderr[-3000:]}"
    )
    after_the_compile = "in from_hlo" in done.stderr and "_cached_compilation" not in done.stderr
    assert after_the_compile, done.stderr[-3000:]
