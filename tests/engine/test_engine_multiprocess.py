"""One engine served by 2 local processes of 2 CPU devices each, on JAX's distributed runtime
(`minilib.engine.multiprocess`): the tokens of the one-process engine and of the dense model;
a process that exits mid-run, or a timeout, stops every process and says which did what."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minilib.engine import Engine, EngineError, dense_generate, init_params
from minilib.engine.multiprocess import (
    DEFAULT_CONFIG,
    DEFAULT_ENGINE_ARGS,
    EXIT_VAR,
    MultiprocessError,
    serve,
)

PARAMS_SEED = 1
rng = np.random.default_rng(2)
PROMPTS = [rng.integers(0, 64, n).tolist() for n in (5, 11, 2, 7)]  # 11: a chunked prefill
MAX_NEW = 5
# A run takes about 25 s on a loaded 2-core machine; a hang fails in three minutes, not at
# the ten-minute watchdog.
TIMEOUT = 180


def assert_all_gone(pids):
    """Every process was reaped: Linux keeps /proc/<pid> until then."""
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not alive, f"processes {alive} are still there"


def test_two_processes_serve_the_tokens_of_one_process_and_of_the_dense_model():
    run = serve(
        PROMPTS,
        MAX_NEW,
        params_seed=PARAMS_SEED,
        num_processes=2,
        devices_per_process=2,
        timeout=TIMEOUT,
    )
    params = init_params(DEFAULT_CONFIG, PARAMS_SEED)
    one_process = Engine(params, DEFAULT_CONFIG, **DEFAULT_ENGINE_ARGS).generate(PROMPTS, MAX_NEW)
    dense = [dense_generate(params, DEFAULT_CONFIG, p, MAX_NEW) for p in PROMPTS]
    assert run.tokens == one_process == dense
    # One mesh of 4 devices over both processes; each process holds 2 of the 4 KV heads.
    assert run.num_processes == 2 and run.num_devices == 4
    assert [len(devices) for devices in run.local_devices] == [2, 2]
    assert run.local_devices[0] != run.local_devices[1]
    assert run.kv_shard_shapes == [[[16, 4, 2, 32]] * 2] * 2
    assert run.num_steps > len(PROMPTS)  # batched over several steps, prefill chunked


def test_a_process_that_exits_mid_run_stops_them_all_and_is_named(monkeypatch):
    monkeypatch.setenv(EXIT_VAR, "1:2")
    with pytest.raises(MultiprocessError) as caught:
        serve(PROMPTS, MAX_NEW, params_seed=PARAMS_SEED, timeout=TIMEOUT)
    message = str(caught.value)
    assert message.startswith("A process of the multi-process run failed"), message
    assert "process 1: exited with code 3" in message, message
    assert "exiting after step 2" in message, message  # its stderr's tail
    # Process 0 waits in a collective for process 1: killed, unless it failed on its own.
    assert "process 0: was still running, and was killed" in message or (
        "process 0: exited with code" in message
    ), message
    assert len(caught.value.pids) == 2
    assert_all_gone(caught.value.pids)


def test_a_run_past_its_timeout_stops_every_process():
    with pytest.raises(MultiprocessError) as caught:
        serve(PROMPTS, MAX_NEW, timeout=0.5)  # too short for JAX to start
    message = str(caught.value)
    assert "passed its timeout=0.5 s" in message, message
    assert "process 0: was still running, and was killed" in message, message
    assert "process 1: was still running, and was killed" in message, message
    assert_all_gone(caught.value.pids)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_processes": 0}, "num_processes=0 must be a positive int"),
        ({"devices_per_process": True}, "devices_per_process=True must be a positive int"),
        ({"engine_args": {"num_pages": 8, "mesh": None}}, "engine_args has ['mesh']"),
        ({"timeout": 0}, "timeout=0 must be a positive number"),
        ({"prompts": [[1, 2], [1, 99]]}, "prompts[1]: prompt=[1, 99] holds token ids [99]"),
    ],
)
def test_bad_arguments_are_refused_before_any_process_starts(kwargs, words):
    arguments = {"prompts": PROMPTS, "max_new_tokens": MAX_NEW} | kwargs
    with pytest.raises(EngineError) as caught:
        serve(**arguments)
    assert words in str(caught.value)
    assert "Hint:" in str(caught.value)
