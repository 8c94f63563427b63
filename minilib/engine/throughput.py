"""The engine workload of `python -m minilib bench --engine`: tokens per second of the engine
against `dense_generate` run one request at a time, on the same requests.

Both are warmed up first on the same requests (every program they need is compiled), then
timed `reps` times each, keeping the fastest; the generated tokens of the two must be equal.

The engine wins by batching: one step reads each weight once for a token of every running
request, where the dense loop reads them once per token. It also pays for what batching
costs: rows padded to `max_num_batched_tokens`, and Python bookkeeping each step. With a very
small model, whose weights are cheap to read, those costs can win: the ratio depends on the
model's size, which is why the benchmark's model is larger than the tests'.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minilib.blockwise import ragged_paged_attention_blockwise
from minilib.engine.engine import Engine
from minilib.engine.model import ModelConfig, dense_generate, init_params
from minilib.perf.timing import timed_call

__all__ = ["BENCH_CONFIG", "EngineBench", "engine_bench"]

BENCH_CONFIG = ModelConfig(
    vocab_size=1024,
    num_layers=2,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=64,
    embed_dim=512,
    mlp_dim=2048,
)


@dataclasses.dataclass(frozen=True)
class EngineBench:
    """One timed run of each: generated tokens, seconds, and the two agree.

    The seconds below are made up, to show the fields (`engine_bench` measures them):

    >>> result = EngineBench(num_requests=4, max_new_tokens=8, generated_tokens=32,
    ...                      engine_seconds=0.5, dense_seconds=2.0, engine_steps=10,
    ...                      same_tokens=True)
    >>> result.engine_tokens_per_s, result.dense_tokens_per_s, result.speedup
    (64.0, 16.0, 4.0)
    """

    num_requests: int
    max_new_tokens: int
    generated_tokens: int
    engine_seconds: float
    dense_seconds: float
    engine_steps: int
    same_tokens: bool
    config: ModelConfig = BENCH_CONFIG

    @property
    def engine_tokens_per_s(self) -> float:
        return self.generated_tokens / self.engine_seconds

    @property
    def dense_tokens_per_s(self) -> float:
        return self.generated_tokens / self.dense_seconds

    @property
    def speedup(self) -> float:
        """Engine tokens/s over dense tokens/s."""
        return self.dense_seconds / self.engine_seconds

    def describe(self) -> str:
        config = self.config
        dense = "dense_generate, one request at a time"
        engine = f"engine, {self.engine_steps} steps"
        return (
            f"engine workload: {self.num_requests} requests, {self.max_new_tokens} new tokens "
            f"each ({self.generated_tokens} tokens); model: {config.num_layers} layers, "
            f"embed_dim {config.embed_dim}, heads {config.num_q_heads}/{config.num_kv_heads}/"
            f"{config.head_dim}\n"
            f"  {dense:40s} {self.dense_seconds:7.3f} s {self.dense_tokens_per_s:8.1f} tok/s\n"
            f"  {engine:40s} {self.engine_seconds:7.3f} s {self.engine_tokens_per_s:8.1f} tok/s\n"
            f"  engine / dense: {self.speedup:.2f}x   same tokens: {self.same_tokens}"
        )


def engine_bench(
    num_requests: int = 16,
    max_new_tokens: int = 16,
    *,
    seed: int = 0,
    attention=None,
    reps: int = 3,
    config: ModelConfig = BENCH_CONFIG,
) -> EngineBench:
    """Time the engine and the one-at-a-time dense loop on the same random requests
    (prompts of 4 to 47 tokens).

    >>> tiny = ModelConfig(vocab_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1,
    ...                    head_dim=8)
    >>> result = engine_bench(num_requests=2, max_new_tokens=2, reps=1, config=tiny)
    >>> result.generated_tokens, result.same_tokens
    (4, True)
    """
    params = init_params(config, seed)
    rng = np.random.default_rng(seed)
    prompts = [
        rng.integers(0, config.vocab_size, int(n)).tolist()
        for n in rng.integers(4, 48, num_requests)
    ]
    # Blockwise: it skips KV blocks past each kv_len (the jnp version reads all
    # pages_per_seq = num_pages pages of every sequence).
    attention = attention or ragged_paged_attention_blockwise

    def run_engine():
        engine = Engine(
            params,
            config,
            num_pages=64,
            page_size=16,
            max_num_batched_tokens=32,
            max_num_seqs=16,
            attention=attention,
        )
        return engine.generate(prompts, max_new_tokens), len(engine.stats)

    def run_dense():
        return [dense_generate(params, config, p, max_new_tokens) for p in prompts]

    engine_tokens, steps = run_engine()  # the first runs compile everything both need
    dense_tokens = run_dense()
    engine_seconds = min(timed_call(run_engine)[1] for _ in range(reps))
    dense_seconds = min(timed_call(run_dense)[1] for _ in range(reps))
    return EngineBench(
        num_requests=num_requests,
        max_new_tokens=max_new_tokens,
        generated_tokens=num_requests * max_new_tokens,
        engine_seconds=engine_seconds,
        dense_seconds=dense_seconds,
        engine_steps=steps,
        same_tokens=engine_tokens == dense_tokens,
        config=config,
    )
