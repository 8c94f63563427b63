"""What async scheduling hides: the host's planning of step n + 1 while the device runs step n.

    JAX_PLATFORMS=cpu python benchmarks/async_scheduling.py [num_requests]   # default 8

The same requests on the same model, synchronous then async, alternating run by run so that
both see the same machine load; medians of `REPS` runs, after a run of each to compile. Each
run's wall time splits into the host's time blocked on the device's tokens
(`Engine.seconds_waiting`) and the rest, the host's own work: planning, packing, launching,
recording. Synchronous, the two add up: the device idles while the host works. Async, the
host works while the device runs the step before: the wall time shrinks by the work hidden
(on a CPU, the "device" shares the cores with the host, so less is hidden than on a TPU).
`num_overlapped` counts the steps still running when the host had launched their successor.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from minilib.engine import Engine, ModelConfig, init_params

REPS = 3
CONFIG = ModelConfig(vocab_size=256, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)
MAX_NEW = 16


def timed_run(eng: Engine, prompts: list[list[int]]) -> dict:
    """Serve `prompts` to the end; the run's wall seconds, the host's waiting seconds, its
    own seconds, its steps and (async) the steps overlapped."""
    waited, steps = eng.seconds_waiting, eng.num_steps
    overlapped = eng.async_loop.num_overlapped if eng.async_loop else 0
    start = time.perf_counter()
    eng.generate(prompts, MAX_NEW)
    wall = time.perf_counter() - start
    wait = eng.seconds_waiting - waited
    return {
        "wall": wall,
        "wait": wait,
        "host": wall - wait,
        "steps": eng.num_steps - steps,
        "overlapped": (eng.async_loop.num_overlapped if eng.async_loop else 0) - overlapped,
    }


def main(num_requests: int = 8) -> None:
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, CONFIG.vocab_size, n).tolist() for n in rng.integers(4, 24, num_requests)
    ]
    params = init_params(CONFIG, seed=0)
    sizes = dict(num_pages=64, page_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    engines = {
        mode: Engine(params, CONFIG, async_scheduling=mode == "async", **sizes)
        for mode in ("sync", "async")
    }
    assert engines["sync"].generate(prompts, MAX_NEW) == engines["async"].generate(prompts, MAX_NEW)
    runs = {mode: [] for mode in engines}
    for _ in range(REPS):
        for mode, eng in engines.items():
            runs[mode].append(timed_run(eng, prompts))
    median = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    for mode, m in median.items():
        print(
            f"{mode:5s}  wall {1e3 * m['wall']:8.1f} ms   host work {1e3 * m['host']:8.1f} ms   "
            f"waiting for the device {1e3 * m['wait']:8.1f} ms   "
            f"{m['steps']:.0f} steps, {m['overlapped']:.0f} overlapped"
        )
    sync, async_ = median["sync"], median["async"]
    hidden = sync["wall"] - async_["wall"]
    print(
        f"async / sync wall time: {async_['wall'] / sync['wall']:.2f}; hidden: "
        f"{1e3 * hidden:.1f} ms, {hidden / sync['host']:.0%} of sync's host work"
    )


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:]])
