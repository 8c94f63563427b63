"""The serving benchmark of `python -m minilib bench --engine`: continuous against static
batching, on one workload of requests that arrive over time.

The workload: requests with prompts of mixed lengths and mixed numbers of new tokens,
arriving as a Poisson process. The arrival rate is set from this machine's own capacity: the
benchmark first serves all requests at once (that run also compiles every program), and
then lets them arrive at `load` times the rate it managed. So the load is about the same
fraction of capacity on any machine. The arrivals are in seconds, though: which step a
request arrives in depends on how long this machine took for each step, so the arriving
runs' step counts change from run to run (the all-at-once runs' do not).

The same arrivals go through two loops over the same `Engine` (same model, same pages, same
compiled programs); only the scheduling policy differs:

    continuous  a request joins the batch at the first step after it arrives, and leaves the
                step it finishes (iteration-level scheduling, as vLLM does);
    static      a batch is formed from the requests waiting when the engine is idle, and runs
                until its *last* request is done; requests arriving meanwhile wait for it.

Reported for each: throughput (generated tokens over the time from the first arrival to the
last finish), time to first token (TTFT) and time per output token (TPOT), median and p90,
in seconds and in engine steps. Both loops sample with the same seeded `SamplingParams`, so
by batch invariance they must produce the same tokens, and so must `dense_generate`.

What the seconds mean: they are timings of this machine (on a laptop, its CPU). What
transfers to a TPU is the shape of the result, measured in steps: with every request at
once, how many steps a request waits and takes comes from the scheduler alone; with
arrivals, it also depends on when, in steps, the requests arrived here. A TPU runs each
step far faster, which makes Python's per-step bookkeeping a larger share of a step; the
seconds, and the throughput in tokens per second, do not transfer.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from minilib.blockwise import ragged_paged_attention_blockwise
from minilib.engine.engine import Engine
from minilib.engine.model import ModelConfig, dense_generate, init_params
from minilib.engine.outputs import RequestOutput
from minilib.engine.sampling import SamplingParams

__all__ = [
    "BENCH_CONFIG",
    "LatencySummary",
    "ServingBench",
    "Workload",
    "engine_bench",
    "make_workload",
    "run_continuous",
    "run_static",
    "summarize",
]

BENCH_CONFIG = ModelConfig(
    vocab_size=1024,
    num_layers=2,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=64,
    embed_dim=512,
    mlp_dim=2048,
)
ENGINE_SIZES = dict(num_pages=96, page_size=16, max_num_batched_tokens=64, max_num_seqs=8)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests, and when each arrives: `arrivals[i]` seconds after the run starts.

    >>> w = make_workload(3, vocab_size=32, seed=0)
    >>> len(w.prompts), len(w.sampling_params), w.arrivals    # all at once until timed
    (3, 3, (0.0, 0.0, 0.0))
    """

    prompts: tuple[tuple[int, ...], ...]
    sampling_params: tuple[SamplingParams, ...]
    arrivals: tuple[float, ...]

    def arriving_at(self, rate: float, seed: int = 0) -> Workload:
        """The same requests, arriving as a Poisson process of `rate` requests per second.

        >>> w = make_workload(4, vocab_size=32).arriving_at(rate=2.0)
        >>> w.arrivals[0], all(a <= b for a, b in zip(w.arrivals, w.arrivals[1:]))
        (0.0, True)
        """
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(self.prompts) - 1)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
        return dataclasses.replace(self, arrivals=tuple(float(a) for a in arrivals))


def make_workload(
    num_requests: int,
    *,
    vocab_size: int,
    seed: int = 0,
    prompt_lens: tuple[int, int] = (4, 96),
    max_tokens: tuple[int, int] = (4, 48),
) -> Workload:
    """`num_requests` random requests: prompt lengths and numbers of new tokens each drawn
    log-uniformly from their ranges (many short ones, a few long ones), sampled at
    temperature 0.8 with a seed of their own. All arrive at 0 (see `Workload.arriving_at`).

    >>> w = make_workload(50, vocab_size=32)
    >>> lens = [len(p) for p in w.prompts]
    >>> 4 <= min(lens) < 12, 48 < max(lens) <= 96      # mixed lengths
    (True, True)
    """
    rng = np.random.default_rng(seed)

    def log_uniform(low, high):
        return int(np.exp(rng.uniform(np.log(low), np.log(high + 1))))

    prompts, params = [], []
    for i in range(num_requests):
        prompts.append(tuple(rng.integers(0, vocab_size, log_uniform(*prompt_lens)).tolist()))
        n = min(log_uniform(*max_tokens), max_tokens[1])
        params.append(SamplingParams(max_tokens=n, temperature=0.8, seed=seed * 10_000 + i))
    return Workload(tuple(prompts), tuple(params), (0.0,) * num_requests)


def run_continuous(engine: Engine, workload: Workload) -> tuple[list[RequestOutput], int]:
    """Serve `workload` with continuous batching: each request is added the moment it
    arrives, and the engine steps while anything is unfinished. Returns the outputs, in
    workload order, and the number of steps.

    >>> from minilib.engine import TINY_CONFIG, init_params
    >>> engine = Engine(init_params(TINY_CONFIG), TINY_CONFIG, **ENGINE_SIZES)
    >>> workload = make_workload(3, vocab_size=32, prompt_lens=(2, 6), max_tokens=(2, 4))
    >>> outputs, steps = run_continuous(engine, workload)
    >>> [o.finish_reason for o in outputs]
    ['length', 'length', 'length']
    """
    return _serve(engine, workload, static=False)


def run_static(engine: Engine, workload: Workload) -> tuple[list[RequestOutput], int]:
    """Serve `workload` with static batching: when the engine is idle, the requests that
    have arrived (up to `max_num_seqs`) form a batch, and no other joins until all of them
    have finished. Returns the outputs, in workload order, and the number of steps.

    >>> from minilib.engine import TINY_CONFIG, init_params
    >>> engine = Engine(init_params(TINY_CONFIG), TINY_CONFIG, num_pages=16, page_size=4,
    ...                 max_num_batched_tokens=16, max_num_seqs=2)          # two slots
    >>> workload = make_workload(3, vocab_size=32, prompt_lens=(2, 6), max_tokens=(2, 4))
    >>> outputs, steps = run_static(engine, workload)
    >>> outputs[2].metrics.first_scheduled_step > outputs[0].metrics.finished_step  # waited
    True
    """
    return _serve(engine, workload, static=True)


def _serve(engine: Engine, workload: Workload, *, static: bool):
    """The serving loop: add requests as they arrive (continuous), or only when the last
    batch is done (static); step while there is work; sleep until the next arrival."""
    start = time.perf_counter()
    order = sorted(range(len(workload.prompts)), key=lambda i: workload.arrivals[i])
    arrived: list[int] = []  # arrived, not yet given to the engine
    ids: dict[int, int] = {}  # workload index -> request id
    arrival_steps: dict[int, int] = {}  # workload index -> the step count when it arrived
    first_step = engine.num_steps
    while order or arrived or engine.has_unfinished:
        now = time.perf_counter()
        while order and start + workload.arrivals[order[0]] <= now:
            arrival_steps[order[0]] = engine.num_steps
            arrived.append(order.pop(0))
        if arrived and not (static and engine.has_unfinished):
            batch = arrived[: engine.max_num_seqs] if static else arrived
            for i in batch:
                ids[i] = engine.add_request(
                    list(workload.prompts[i]),
                    sampling_params=workload.sampling_params[i],
                    arrival_time=start + workload.arrivals[i],
                )
            arrived = arrived[len(batch) :]
        if engine.has_unfinished:
            engine.step()
        elif order and not arrived:  # idle: wait for the next request
            time.sleep(max(0.0, start + workload.arrivals[order[0]] - time.perf_counter()))
    outputs_by_id = {o.request_id: o for o in engine.pop_finished_outputs()}
    # A request the static loop held back arrived before the engine saw it: its latency in
    # steps counts from the step count when it arrived, as its seconds count from then.
    outputs = [
        dataclasses.replace(
            outputs_by_id[ids[i]],
            metrics=dataclasses.replace(
                outputs_by_id[ids[i]].metrics, arrival_step=arrival_steps[i]
            ),
        )
        for i in range(len(workload.prompts))
    ]
    return outputs, engine.num_steps - first_step


@dataclasses.dataclass(frozen=True)
class LatencySummary:
    """One policy's run: throughput, and TTFT and TPOT in seconds and in steps.

    >>> s = LatencySummary("continuous", generated_tokens=100, seconds=2.0, steps=40,
    ...                    ttft=(0.1, 0.3), tpot=(0.02, 0.04), ttft_steps=(2, 5),
    ...                    tpot_steps=(1.0, 1.5))
    >>> s.tokens_per_s, s.tokens_per_step
    (50.0, 2.5)
    """

    policy: str
    generated_tokens: int
    seconds: float  # from the first arrival to the last finish
    steps: int
    ttft: tuple[float, float]  # median, p90 (seconds)
    tpot: tuple[float, float]
    ttft_steps: tuple[float, float]
    tpot_steps: tuple[float, float]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def tokens_per_step(self) -> float:
        return self.generated_tokens / self.steps


def summarize(policy: str, outputs: list[RequestOutput], steps: int) -> LatencySummary:
    """The summary of one run's outputs (TPOT over requests with two tokens or more).

    >>> from minilib.engine.outputs import RequestMetrics
    >>> m = RequestMetrics(arrival_time=0.0, arrival_step=0, first_token_time=0.5,
    ...                    first_token_step=1, last_token_time=1.5, last_token_step=3,
    ...                    finished_time=1.5, finished_step=3)
    >>> out = RequestOutput(0, (1,), (4, 5, 6), "length", 0, m)
    >>> s = summarize("static", [out], steps=4)
    >>> s.ttft, s.tpot, s.ttft_steps, s.tpot_steps
    ((0.5, 0.5), (0.5, 0.5), (2.0, 2.0), (1.0, 1.0))
    """

    def median_p90(values):
        values = np.asarray([v for v in values if v is not None], np.float64)
        if values.size == 0:
            return (float("nan"), float("nan"))
        return (float(np.median(values)), float(np.percentile(values, 90)))

    metrics = [(o.metrics, len(o.token_ids)) for o in outputs]
    first = min(m.arrival_time for m, _ in metrics)
    last = max(m.finished_time for m, _ in metrics)
    return LatencySummary(
        policy=policy,
        generated_tokens=sum(n for _, n in metrics),
        seconds=last - first,
        steps=steps,
        ttft=median_p90(m.time_to_first_token for m, _ in metrics),
        tpot=median_p90(m.time_per_output_token(n) for m, n in metrics),
        ttft_steps=median_p90(m.steps_to_first_token for m, _ in metrics),
        tpot_steps=median_p90(m.steps_per_output_token(n) for m, n in metrics),
    )


@dataclasses.dataclass(frozen=True)
class ServingBench:
    """The benchmark's result: each policy with every request at once (its capacity) and
    with Poisson arrivals, and whether the tokens agree (continuous, static and
    `dense_generate`).

    The numbers below are made up, to show the fields (`engine_bench` measures them):

    >>> run = lambda p, s, t: LatencySummary(p, 400, s, t, (0.1, 0.2), (0.01, 0.02),
    ...                                      (3.0, 6.0), (1.0, 1.2))
    >>> bench = ServingBench(
    ...     num_requests=8, request_rate=4.0, load=0.9,
    ...     at_once={"continuous": run("continuous", 2.0, 100), "static": run("static", 3.0, 150)},
    ...     arriving={"continuous": run("continuous", 2.5, 110), "static": run("static", 3.5, 160)},
    ...     same_tokens=True)
    >>> bench.capacity_ratio, bench.step_ratio
    (1.5, 1.5)
    """

    num_requests: int
    request_rate: float  # requests per second
    load: float  # the arrival rate over continuous batching's all-at-once rate
    at_once: dict[str, LatencySummary]  # "continuous", "static": every request at time 0
    arriving: dict[str, LatencySummary]  # the same requests, arriving at request_rate
    same_tokens: bool
    config: ModelConfig = BENCH_CONFIG

    @property
    def capacity_ratio(self) -> float:
        """Continuous tokens/s over static tokens/s, every request at once."""
        return self.at_once["continuous"].tokens_per_s / self.at_once["static"].tokens_per_s

    @property
    def step_ratio(self) -> float:
        """Static steps over continuous steps for the same tokens, every request at once:
        the part of the capacity ratio that comes from the scheduler alone."""
        return self.at_once["static"].steps / self.at_once["continuous"].steps

    @property
    def ttft_p90_ratio(self) -> float:
        """Static TTFT p90 over continuous TTFT p90, with arrivals."""
        return self.arriving["static"].ttft[1] / self.arriving["continuous"].ttft[1]

    def describe(self) -> str:
        c = self.config
        head = (
            f"  {'':11s} {'tok/s':>8s} {'steps':>6s} {'tok/step':>8s}   "
            f"{'TTFT median / p90':>19s} {'(steps)':>13s}   {'TPOT median / p90':>19s} "
            f"{'(steps)':>11s}"
        )

        def row(s: LatencySummary) -> str:
            return (
                f"  {s.policy:11s} {s.tokens_per_s:8.1f} {s.steps:6d} {s.tokens_per_step:8.2f}   "
                f"{s.ttft[0]:8.3f} / {s.ttft[1]:6.3f} s {s.ttft_steps[0]:5.1f} / "
                f"{s.ttft_steps[1]:5.1f}   {s.tpot[0]:8.4f} / {s.tpot[1]:6.4f} s "
                f"{s.tpot_steps[0]:4.2f} / {s.tpot_steps[1]:4.2f}"
            )

        return "\n".join(
            [
                f"serving workload: {self.num_requests} requests (prompts and outputs of mixed "
                f"lengths); model: {c.num_layers} layers, embed_dim {c.embed_dim}, heads "
                f"{c.num_q_heads}/{c.num_kv_heads}/{c.head_dim}",
                "seconds and tok/s are timings of this machine (on a laptop, its CPU; not a "
                "TPU); steps of the all-at-once runs come from the scheduler alone and "
                "transfer to any machine; with arrivals in seconds, the step a request arrives "
                "in, and so its steps, depend on this machine's speed",
                "every request at once (capacity):",
                head,
                row(self.at_once["continuous"]),
                row(self.at_once["static"]),
                f"Poisson arrivals at {self.request_rate:.1f} requests/s ({self.load:.0%} of "
                "continuous batching's capacity above; tok/s counts the drain after the last "
                "arrival too):",
                head,
                row(self.arriving["continuous"]),
                row(self.arriving["static"]),
                f"  continuous / static: {self.capacity_ratio:.2f}x the capacity in tok/s "
                f"({self.step_ratio:.2f}x fewer steps); static's TTFT p90 "
                f"{self.ttft_p90_ratio:.1f}x continuous's",
                f"  same tokens (continuous, static, dense_generate): {self.same_tokens}",
            ]
        )


def engine_bench(
    num_requests: int = 32,
    *,
    load: float = 0.9,
    seed: int = 0,
    attention=None,
    reps: int = 1,
    config: ModelConfig = BENCH_CONFIG,
    sizes: dict | None = None,
    workload: Workload | None = None,
) -> ServingBench:
    """Serve one workload with continuous and with static batching, first with every
    request at once, then arriving at `load` times continuous batching's all-at-once rate;
    check every run's tokens against `dense_generate`. Each run is repeated `reps` times
    (policies alternating) and the fastest kept; a first untimed run compiles everything.

    >>> from minilib.engine import TINY_CONFIG
    >>> w = make_workload(4, vocab_size=32, prompt_lens=(2, 8), max_tokens=(2, 6))
    >>> bench = engine_bench(config=TINY_CONFIG, workload=w,
    ...                      sizes=dict(num_pages=16, page_size=4, max_num_batched_tokens=16,
    ...                                 max_num_seqs=2))
    >>> bench.same_tokens, bench.at_once["static"].steps >= bench.at_once["continuous"].steps
    (True, True)
    """
    params = init_params(config, seed)
    workload = workload or make_workload(num_requests, vocab_size=config.vocab_size, seed=seed)
    # Blockwise: it skips KV blocks past each kv_len (the jnp version reads all
    # pages_per_seq = num_pages pages of every sequence).
    attention = attention or ragged_paged_attention_blockwise
    loops = {"continuous": run_continuous, "static": run_static}

    def new_engine():
        return Engine(params, config, attention=attention, **(sizes or ENGINE_SIZES))

    def best_of(work: Workload) -> tuple[dict[str, LatencySummary], list]:
        runs = {policy: [] for policy in loops}
        for _ in range(reps):
            for policy, loop in loops.items():
                runs[policy].append(loop(new_engine(), work))
        best = {
            policy: min((summarize(policy, *run) for run in policy_runs), key=_seconds)
            for policy, policy_runs in runs.items()
        }
        return best, [outputs for policy_runs in runs.values() for outputs, _ in policy_runs]

    run_continuous(new_engine(), workload)  # compiles every program both loops need
    at_once, outputs = best_of(workload)
    rate = load * len(workload.prompts) / at_once["continuous"].seconds  # requests per second
    arriving, more_outputs = best_of(workload.arriving_at(rate, seed))
    dense = [
        dense_generate(params, config, list(p), sampling_params=sp)
        for p, sp in zip(workload.prompts, workload.sampling_params, strict=True)
    ]
    same = all([list(o.token_ids) for o in run] == dense for run in outputs + more_outputs)
    return ServingBench(
        num_requests=len(workload.prompts),
        request_rate=rate,
        load=load,
        at_once=at_once,
        arriving=arriving,
        same_tokens=same,
        config=config,
    )


def _seconds(summary: LatencySummary) -> float:
    return summary.seconds
