"""minilib.engine sharded over 1, 2 and 4 simulated CPU devices, in a fresh process
(tests/engine/engine_sharded_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_sharded_check(num_devices: int = 4) -> dict:
    """tests/engine/engine_sharded_check.py in a fresh process with `num_devices` CPU devices."""
    env = dict(os.environ)
    # The device count, after any flags of the test run's own (tasks.py's unoptimised compiles).
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_devices}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = ROOT / "tests" / "engine" / "engine_sharded_check.py"
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded():
    return run_sharded_check(4)


def test_sharded_runs_equal_the_unsharded_run_and_the_dense_model(sharded):
    assert sharded["num_devices"] == 4
    for run in sharded["runs"]:
        assert run["tokens"] == run["unsharded"] == run["dense"], run
        assert run["pages_free"], run
    seen = {(run["attention"], run["mesh_size"]) for run in sharded["runs"]}
    want = {("jnp", 1), ("jnp", 2), ("jnp", 4), ("blockwise", 2), ("blockwise", 4)}
    assert want | {("kernel", 4), ("ref", 4)} <= seen, seen


def test_sharded_kv_pages_are_split_by_kv_head(sharded):
    # Each device holds 2*num_kv_heads/D of the combined head axis: its KV heads' K and V.
    assert sharded["shard_shapes"]["4"] == [[16, 4, 2, 32]] * 4


def test_sharded_projections_are_split_by_head(sharded):
    specs = sharded["weight_specs"]
    for name in ("wq", "wk", "wv", "wo"):
        assert "kv_heads" in specs[name], specs
    assert "kv_heads" not in specs["w_in"] + specs["w_out"], specs


def test_more_devices_than_kv_heads_replicate_them(sharded):
    run = sharded["replicated"]
    assert run["tokens"] == run["dense"] and run["pages_free"], run
    assert run["replicas"] == 2
    # each of the 4 devices holds K and V of one KV head: a copy of one of the 2
    assert run["shard_shapes"] == [[16, 4, 2, 32]] * 4


def test_sharded_attention_sinks_match_dense(sharded):
    run = sharded["sinks"]
    assert run["tokens"] == run["dense"] != run["dense_without_sinks"], run


def test_sharded_serving_with_prefix_caching_sampling_and_abort(sharded):
    run = sharded["serving"]
    assert run["problems"] == [], run["problems"]
    assert run["tokens"] == run["dense"], run
    assert run["aborted_states"] == ["waiting", "running"]
    for reason, tokens, dense in run["aborted"]:
        assert reason == "abort" and tokens == dense[: len(tokens)] and len(tokens) < len(dense)
    assert any(tokens for _, tokens, _ in run["aborted"]), "the running one had tokens"
    assert run["num_cached_tokens"][1:4] == [8, 8, 8], run["num_cached_tokens"]
    assert run["preempted"] > 0 and run["shared_pages_seen"] and run["pages_free"], run


def test_bad_meshes_get_clear_errors(sharded):
    assert "num_kv_heads=4 is not divisible" in sharded["errors"]["kv heads not divisible"]
    assert "num_q_heads=6 is not divisible" in sharded["errors"]["q heads not divisible"]
    assert "'model'" in sharded["errors"]["unknown axis"]
    assert "Hint:" in sharded["errors"]["unknown axis"]
    assert "not a jax.sharding.Mesh" in sharded["errors"]["not a mesh"]
