"""A jax and libtpu pair that `minilib.tpu.compile` refuses (`CANNOT_COMPILE`) is refused with
the reason and the fix, and the reason still holds. Runs where such a pair is installed
(`.venv-tpu-oldest`: Colab's jax 0.7.2 with libtpu 0.0.21.1), and is skipped elsewhere.

The reason is checked in fresh processes, past the refusal: a plain XLA program still crashes
the process after its compile, and a Pallas kernel's Mosaic module is still rejected. When a
libtpu fixes either, these fail: take the pair out of `CANNOT_COMPILE`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from minilib.tpu import compile as tpu_compile
from minilib.tpu.compile import CANNOT_COMPILE, TPUCompileUnavailable, compile_for_tpu

PAIR = (jax.__version__, tpu_compile.libtpu_version())
pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(
        PAIR not in CANNOT_COMPILE,
        reason=f"jax {PAIR[0]} with libtpu {PAIR[1]} is not a pair in CANNOT_COMPILE",
    ),
]

# Compile for a v5e compile-only device as tpu_compile does, without its refusal or its dumps.
COMPILE_SCRIPT = """
import functools, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from minilib.tpu import compile as tpu_compile
from minilib.pallas_basics import add_vectors
device = tpu_compile.topology_device("v5e")
sharding = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
x = jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=sharding)
fn = {"plain": lambda a, b: jnp.sin(a) + b,
      "pallas": functools.partial(add_vectors, block_size=1024, interpret=False)}[sys.argv[1]]
with jax.sharding.use_abstract_mesh(tpu_compile.abstract_mesh(device)):
    lowered = jax.jit(fn).lower(x, x)
try:
    lowered.compile()
except Exception as err:
    print("compile failed:", err)
else:
    print("compiled")
"""


def compile_in_fresh_process(kind: str) -> subprocess.CompletedProcess:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, JAX_PLATFORMS="cpu", **tpu_compile.QUIET_LIBTPU_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-c", COMPILE_SCRIPT, kind]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_cannot_compile_pair_is_refused_with_the_reason_and_the_fix():
    ok, reason = tpu_compile.tpu_compile_available()
    assert not ok
    assert f"libtpu {PAIR[1]} with jax {PAIR[0]} cannot compile here" in reason, reason
    assert CANNOT_COMPILE[PAIR] in reason and "pip install" in reason, reason
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    with pytest.raises(TPUCompileUnavailable, match="cannot compile here"):
        compile_for_tpu(lambda a: a + 1, x, chip="v5e")


def test_cannot_compile_pair_still_crashes_a_plain_compile():
    done = compile_in_fresh_process("plain")
    assert done.returncode < 0 and "compiled" not in done.stdout, (
        f"the compile no longer crashes ({done.returncode=}, {done.stdout=}): take {PAIR} out "
        f"of CANNOT_COMPILE, or update its reason\n{done.stderr[-2000:]}"
    )


def test_cannot_compile_pair_still_rejects_a_pallas_kernel():
    done = compile_in_fresh_process("pallas")
    assert "Unsupported version: expected <= 7 but got 8" in done.stdout, (
        f"Mosaic no longer rejects the kernel's IR version ({done.returncode=}): take {PAIR} "
        f"out of CANNOT_COMPILE, or update its reason\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    )
