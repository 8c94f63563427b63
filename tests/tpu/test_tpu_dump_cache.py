"""libtpu's dumps kept on disk (`minilib.tpu.dump_cache`, `MINILIB_TPU_DUMP_CACHE`): a compile
kept by one process is read back by the next, which compiles nothing and reads what a fresh
compile gives; an entry that cannot be read is compiled again; without the variable nothing
is kept. Each run is a fresh process, as each test run is (libtpu starts once per process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from compile_checks import AVAILABLE, REASON

from minilib.tpu import dump_cache

ROOT = Path(__file__).resolve().parents[2]

# A kernel alone (`compile_for_tpu`, its figures) and a whole call (`compile_call`, every
# program libtpu dumped, and the compiled HLO); how many programs the backend compiled.
SCRIPT = """
import functools, json, jax, jax.numpy as jnp
from minilib.pallas_basics import add_vectors
from minilib.tpu import at_defaults, compile as tpu_compile
compiles = []
def count(event, duration, **kwargs):
    if event.endswith("backend_compile_duration"):
        compiles.append(event)
jax.monitoring.register_event_duration_secs_listener(count)
x = jax.ShapeDtypeStruct((4096,), jnp.float32)
add = functools.partial(add_vectors, block_size=1024, interpret=False)
report = tpu_compile.compile_for_tpu(add, x, x, chip="v5e")
assert report.compiled, report.error
hlo, programs = at_defaults.compile_call(lambda a, b: add(a, b) * 2, (x, x), "v6e")
print(json.dumps({"read": [repr(report.kernels), report.notes, hlo, repr(programs)],
                  "compiles": len(compiles)}))
"""


def run(cache: Path | None, root: Path = ROOT) -> dict:
    """SCRIPT in a fresh process, with the minilib of `root` and the cache folder `cache`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env.pop(dump_cache.CACHE_ENV, None)
    if cache is not None:
        env[dump_cache.CACHE_ENV] = str(cache)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, cwd=root)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.tpu_compile
@pytest.mark.skipif(not AVAILABLE, reason=f"no TPU compile here: {REASON}")
def test_a_kept_compile_is_read_back_as_a_fresh_compile_gives_it(tmp_path):
    fresh = run(None)
    assert fresh["compiles"] >= 2 and fresh["read"][3].count("Program(") >= 2, fresh
    assert not (tmp_path / "cache").exists()

    kept = run(tmp_path / "cache")  # compiles, and keeps each compile
    entries = sorted((tmp_path / "cache").glob("*.json.gz"))
    assert kept == fresh and len(entries) == fresh["compiles"], (len(entries), kept["compiles"])

    found = run(tmp_path / "cache")
    assert found["compiles"] == 0 and found["read"] == fresh["read"]

    for entry in entries:  # cut short, as a full disk might leave one
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    again = run(tmp_path / "cache")
    assert again == fresh
    assert run(tmp_path / "cache") == found  # kept anew, whole


def test_an_entry_is_found_only_by_the_same_compile(monkeypatch):
    """The key changes with the chip, the program and the flags of libtpu and XLA."""
    key = dump_cache.entry_key("v5e", "module @add {}")
    assert dump_cache.entry_key("v5e", "module @add {} ") != key
    assert dump_cache.entry_key("v6e", "module @add {}") != key
    for flags in ("LIBTPU_INIT_ARGS", "XLA_FLAGS"):
        with monkeypatch.context() as env:
            env.setenv(flags, os.environ.get(flags, "") + " --xla_dump_hlo_as_text")
            assert dump_cache.entry_key("v5e", "module @add {}") != key, flags
    assert dump_cache.entry_key("v5e", "module @add {}") == key


@pytest.mark.tpu_compile
@pytest.mark.skipif(not AVAILABLE, reason=f"no TPU compile here: {REASON}")
def test_a_checkout_elsewhere_reads_none_of_this_ones_compiles(tmp_path):
    """libtpu writes the source paths into its dumps (and the compiled program), so another
    checkout's compile, of the same code, is not this one's: it compiles afresh."""
    for checkout in ("a", "b"):
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / "minilib", tmp_path / checkout / "minilib", ignore=ignore)
    fresh = run(None, tmp_path / "b")
    assert str(tmp_path / "b") in fresh["read"][2]  # the compiled program's source paths
    run(tmp_path / "cache", tmp_path / "a")
    assert run(tmp_path / "cache", tmp_path / "b") == fresh


def test_a_cache_that_cannot_be_written_keeps_nothing_and_fails_nothing(tmp_path, monkeypatch):
    """A folder that cannot be made (here under a file): no entry, no error, no read back."""
    (tmp_path / "a file").write_text("")
    (tmp_path / "0001-add.1-00-final_bundles.txt").write_text("bundles")
    monkeypatch.setenv(dump_cache.CACHE_ENV, str(tmp_path / "a file" / "cache"))
    key = dump_cache.entry_key("v5e", "module @add {}")
    dump_cache.keep(key, "HloModule add", tmp_path, ["0001-add.1-00-final_bundles.txt"])
    assert dump_cache.read_back(key, tmp_path) is None
    monkeypatch.setenv(dump_cache.CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / f"{key}.json.gz").mkdir()  # the entry's name taken: not written
    dump_cache.keep(key, "HloModule add", tmp_path, ["0001-add.1-00-final_bundles.txt"])
    assert dump_cache.read_back(key, tmp_path) is None
