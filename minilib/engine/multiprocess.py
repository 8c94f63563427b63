"""One engine served by several processes, on JAX's own distributed runtime, on this machine.

A TPU slice of several hosts runs one process per host: each calls
`jax.distributed.initialize(...)`, after which `jax.devices()` lists every chip of every host,
and one mesh spans them all. `serve` does the same on one machine's CPU: it starts
`num_processes` Python processes, each with `devices_per_process` simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count`), joined by a coordinator on a free
localhost port, their collectives over gloo (TCP). Each process then

  1. builds `Mesh(np.array(jax.devices()), ("kv_heads",))`: every device of every process;
  2. builds the same `Engine` on it (the same seeded weights: `init_params(config, seed)`),
     each process placing its own share of the weights and of the KV cache;
  3. runs the same scheduler on the same requests, step by step: the scheduler is plain
     Python, deterministic, so every process packs the same batch and feeds the same numpy
     arrays to the same programs, which run as one program over all devices;
  4. writes its tokens to a file; `serve` reads them all and checks that they agree.

What the engine needed for it: its KV pool is made on the mesh (`sharding.nan_kv_pages`),
not made on one device and then placed (a placement checks that every process passes equal
values, and the pool's NaN equals nothing). The rest ran as it was: numpy inputs are the same
on every process, and the sampled tokens come out replicated, so each process reads them.

A process that dies (an error, a kill) leaves the others waiting in a collective for ever.
`serve` watches them all: when one exits with an error, or the timeout passes, it kills every
process it started and raises `MultiprocessError`, naming each process that had exited, its
exit code and the end of its stderr.

For tests, the environment variable MINILIB_MULTIPROCESS_EXIT="<process id>:<step>" makes
that process exit (code 3) right after that step, as a crash would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minilib.engine.model import ModelConfig, check_request
from minilib.errors import EngineError

__all__ = ["EXIT_VAR", "MultiprocessError", "MultiprocessRun", "serve"]

EXIT_VAR = "MINILIB_MULTIPROCESS_EXIT"  # "<process id>:<step>": that process exits then
EXIT_CODE = 3
STDERR_TAIL = 1500  # characters of a failed process's stderr in the error
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
ENGINE_ARGS = {
    "num_pages",
    "page_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "seed",
    "enable_prefix_caching",
}
# The default model: 2 x 2 devices hold one of its 4 KV heads each.
DEFAULT_CONFIG = ModelConfig(
    vocab_size=64, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=32
)
DEFAULT_ENGINE_ARGS = {
    "num_pages": 16,
    "page_size": 4,
    "max_num_batched_tokens": 8,
    "max_num_seqs": 3,
}


class MultiprocessError(RuntimeError):
    """A process of a multi-process run failed, or the run passed its timeout. Every process
    was stopped before it was raised; `pids` are their process ids.

    >>> try:
    ...     serve([[1, 2, 3]], max_new_tokens=2, timeout=0.01)  # far too short to start
    ... except MultiprocessError as err:
    ...     print(str(err).splitlines()[0])
    The multi-process run passed its timeout=0.01 s; every process was stopped.
    """

    def __init__(self, message: str, pids: list[int]):
        self.pids = pids
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class MultiprocessRun:
    """What a multi-process run produced, as process 0 saw it (every process saw the same
    tokens: `serve` checked).

    tokens: each prompt's generated tokens, in prompt order.
    num_processes, num_devices: processes, and devices of all processes (the mesh's size).
    local_devices: each process's own devices, as `str(device)`.
    kv_shard_shapes: each process's shards of layer 0's KV pool, their shapes.
    num_steps: engine steps; seconds: wall time of the whole run, start-up included.

    >>> run = MultiprocessRun(tokens=[[5, 9]], num_processes=2, num_devices=4,
    ...                       local_devices=[["cpu:0", "cpu:1"], ["cpu:2048", "cpu:2049"]],
    ...                       kv_shard_shapes=[[[16, 4, 2, 32]] * 2] * 2, num_steps=2,
    ...                       seconds=9.5)
    >>> run.num_devices == sum(len(d) for d in run.local_devices)  # the mesh spans them all
    True
    """

    tokens: list[list[int]]
    num_processes: int
    num_devices: int
    local_devices: list[list[str]]
    kv_shard_shapes: list[list[list[int]]]
    num_steps: int
    seconds: float


def serve(
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    config: ModelConfig | None = None,
    params_seed: int = 1,
    num_processes: int = 2,
    devices_per_process: int = 2,
    engine_args: dict | None = None,
    timeout: float = 300.0,
) -> MultiprocessRun:
    """Serve `prompts` (greedy, `max_new_tokens` each) with one engine spread over
    `num_processes` local processes of `devices_per_process` CPU devices each.

    `config`: the model (default: 8 q heads, 4 KV heads, 2 layers, so that 2 x 2 devices
    hold one KV head each); its weights are `init_params(config, params_seed)` in every
    process. `engine_args`: the `Engine`'s sizes (num_pages, page_size,
    max_num_batched_tokens, max_num_seqs; optional seed, enable_prefix_caching).
    Raises `MultiprocessError` when a process fails or `timeout` seconds pass, after stopping
    every process; `EngineError` (a ValueError) for bad arguments, before starting any.

    >>> from minilib.engine import dense_generate, init_params
    >>> prompts = [[1, 2, 3, 4, 5], [6, 7]]
    >>> run = serve(prompts, max_new_tokens=4)
    >>> dense = [dense_generate(init_params(DEFAULT_CONFIG, 1), DEFAULT_CONFIG, p, 4)
    ...          for p in prompts]
    >>> run.tokens == dense, len(run.tokens[0])
    (True, 4)
    """
    config = config or DEFAULT_CONFIG
    engine_args = engine_args or DEFAULT_ENGINE_ARGS
    check_arguments(num_processes, devices_per_process, engine_args, timeout)
    for i, prompt in enumerate(prompts):
        try:
            check_request(prompt, max_new_tokens, config)
        except EngineError as err:
            raise EngineError(f"serve: prompts[{i}]: {err.message}", err.hint) from None
    with tempfile.TemporaryDirectory(prefix="minilib-multiprocess-") as folder:
        job = {
            "prompts": [[int(t) for t in p] for p in prompts],
            "max_new_tokens": int(max_new_tokens),
            "config": dataclasses.asdict(config),
            "params_seed": int(params_seed),
            "engine_args": engine_args,
            "num_processes": num_processes,
            "port": free_port(),
            "folder": folder,
        }
        job_path = Path(folder) / "job.json"
        job_path.write_text(json.dumps(job))
        started = time.perf_counter()
        processes = start_processes(job_path, num_processes, devices_per_process)
        wait_for_all(processes, timeout)
        results = []
        for i in range(num_processes):
            results.append(json.loads((Path(folder) / f"result-{i}.json").read_text()))
    seconds = time.perf_counter() - started
    for result in results[1:]:
        if result["tokens"] != results[0]["tokens"]:
            raise MultiprocessError(
                f"process {result['process_id']} generated {result['tokens']}, process 0 "
                f"{results[0]['tokens']}: the processes did not run the same steps.",
                [p.pid for p, _ in processes],
            )
    return MultiprocessRun(
        tokens=results[0]["tokens"],
        num_processes=num_processes,
        num_devices=results[0]["num_devices"],
        local_devices=[r["local_devices"] for r in results],
        kv_shard_shapes=[r["kv_shard_shapes"] for r in results],
        num_steps=results[0]["num_steps"],
        seconds=seconds,
    )


def check_arguments(num_processes, devices_per_process, engine_args, timeout) -> None:
    """Raise `EngineError` for arguments `serve` cannot run with."""
    counts = {"num_processes": num_processes, "devices_per_process": devices_per_process}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EngineError(
                f"serve: {name}={value!r} must be a positive int.",
                "for example num_processes=2, devices_per_process=2.",
            )
    unknown = set(engine_args) - ENGINE_ARGS
    if unknown:
        raise EngineError(
            f"serve: engine_args has {sorted(unknown)}, which a process cannot be given.",
            f"give only these Engine arguments: {sorted(ENGINE_ARGS)}.",
        )
    if not isinstance(timeout, int | float) or not timeout > 0:
        raise EngineError(
            f"serve: timeout={timeout!r} must be a positive number of seconds.",
            "for example timeout=300.",
        )


def free_port() -> int:
    """A TCP port on localhost that no one listens on now (the coordinator takes it soon
    after: another program could take it first, which fails the run with a clear error)."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


# JAX's persistent compilation cache, as the test runs set it. A worker that read the step's
# program from it while the other compiled its own hung in their first collective (jax 0.12.1,
# gloo, both processes waiting for ever): the workers compile afresh.
COMPILATION_CACHE_VARS = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)


def worker_env(devices_per_process: int) -> dict[str, str]:
    """This process's environment, for a worker: CPU only, `devices_per_process` devices, no
    persistent compilation cache (`COMPILATION_CACHE_VARS`), and this minilib importable
    first."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for name in COMPILATION_CACHE_VARS:
        env.pop(name, None)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={devices_per_process}"])
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    return env


def start_processes(job_path: Path, num_processes: int, devices_per_process: int) -> list:
    """Start the workers, each in a session of its own (so that a kill reaches anything it
    started), stderr to a file. Returns [(Popen, stderr path)]."""
    env = worker_env(devices_per_process)
    processes = []
    for i in range(num_processes):
        stderr_path = job_path.parent / f"stderr-{i}.txt"
        with open(stderr_path, "w") as stderr:
            command = [sys.executable, "-m", "minilib.engine.multiprocess", str(job_path), str(i)]
            process = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        processes.append((process, stderr_path))
    return processes


def wait_for_all(processes: list, timeout: float) -> None:
    """Return when every process has exited with code 0. When one exits with another code,
    or `timeout` seconds pass first, kill them all and raise `MultiprocessError`."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [process.poll() for process, _ in processes]
        failed = any(code not in (None, 0) for code in codes)
        if not failed and all(code == 0 for code in codes):
            return
        if failed or time.monotonic() > deadline:
            stop_all(processes)
            report = failure_report(processes, codes, timeout, failed)
            raise MultiprocessError(report, [p.pid for p, _ in processes])
        time.sleep(0.05)


def stop_all(processes: list) -> None:
    """Kill each process's session (it and anything it started), then reap it."""
    for process, _ in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it exited in between
                pass
    for process, _ in processes:
        process.wait()


def failure_report(processes: list, codes: list, timeout: float, failed: bool) -> str:
    """Which processes had exited, how, and the end of their stderr; which were stopped."""
    if failed:
        lines = ["A process of the multi-process run failed; every process was stopped."]
    else:
        lines = [f"The multi-process run passed its {timeout=} s; every process was stopped."]
    for i, ((_, stderr_path), code) in enumerate(zip(processes, codes, strict=True)):
        if code is None:
            lines.append(f"process {i}: was still running, and was killed.")
            continue
        if code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        tail = stderr_path.read_text(errors="replace")[-STDERR_TAIL:]
        lines.append(f"process {i}: {how}. The end of its stderr:\n{tail}")
    return "\n".join(lines)


def exit_step(process_id: int) -> int | None:
    """The step after which this process must exit (EXIT_VAR), or None."""
    value = os.environ.get(EXIT_VAR, "")
    if not value:
        return None
    who, _, step = value.partition(":")
    if not (who.isdigit() and step.isdigit()):
        raise EngineError(
            f"{EXIT_VAR}={value!r} is not '<process id>:<step>'.",
            f"for example {EXIT_VAR}=1:2 makes process 1 exit after step 2.",
        )
    return int(step) if int(who) == process_id else None


def run_worker(job_path: str, process_id: int) -> None:
    """One process of `serve`: join the others, build the engine on the mesh of all their
    devices, serve the requests, write what it saw to result-<process_id>.json."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from minilib.engine.engine import Engine
    from minilib.engine.model import init_params

    job = json.loads(Path(job_path).read_text())
    exit_after = exit_step(process_id)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # before initialize
    jax.config.update("jax_enable_compilation_cache", False)  # see COMPILATION_CACHE_VARS
    jax.distributed.initialize(
        coordinator_address=f"localhost:{job['port']}",
        num_processes=job["num_processes"],
        process_id=process_id,
    )
    mesh = Mesh(np.array(jax.devices()), ("kv_heads",))  # every device of every process
    config = ModelConfig(**job["config"])
    params = init_params(config, job["params_seed"])
    engine = Engine(params, config, mesh=mesh, **job["engine_args"])
    ids = [engine.add_request(p, job["max_new_tokens"]) for p in job["prompts"]]
    while engine.has_unfinished:
        stats = engine.step()
        if stats.step == exit_after:
            message = f"process {process_id}: exiting after step {stats.step} ({EXIT_VAR})"
            print(message, file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)
    result = {
        "process_id": process_id,
        "tokens": [engine.output(i) for i in ids],
        "num_devices": jax.device_count(),
        "local_devices": [str(d) for d in jax.local_devices()],
        "kv_shard_shapes": [list(s.data.shape) for s in engine.kv_pages[0].addressable_shards],
        "num_steps": engine.num_steps,
    }
    path = Path(job["folder"]) / f"result-{process_id}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").rename(path)  # whole, or not there
    jax.distributed.shutdown()


if __name__ == "__main__":
    run_worker(sys.argv[1], int(sys.argv[2]))
