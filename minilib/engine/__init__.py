"""A tiny continuous-batching serving engine on the paged KV cache: the course's capstone.

model.py         ModelConfig, init_params, dense_generate: a toy transformer and its yardstick
sampling.py      SamplingParams, and seeded sampling that batching cannot change
scheduler.py     admission, pages, chunked prefill, preemption: who runs in the next step
prefix_cache.py  BlockPool: reference-counted pages named by chained hashes, an LRU of free ones
spec_decode.py   speculative decoding: vLLM's n-gram proposer and its rejection sampler
packing.py       pack_batch: one step's sequences in the fixed-size arrays attention reads
buckets.py       the sizes a step is padded to, compiled once at warm-up; CompileCounter
engine.py        Engine: pack one ragged batch, write K/V into pages, attend, sample, free
outputs.py       RequestOutput and RequestMetrics: tokens, finish reason, latency; StepStats
sharding.py      attention, its projections and the KV cache split by KV head (shard_map)
multiprocess.py  serve: one engine over several local processes, JAX's distributed runtime
view.py          EngineView (import it from minilib.engine.view: it needs ipywidgets)
throughput.py    `python -m minilib bench --engine`: continuous against static batching

>>> from minilib.engine import Engine, ModelConfig, SamplingParams, dense_generate, init_params
"""

from minilib.engine.engine import Engine
from minilib.engine.model import TINY_CONFIG, ModelConfig, dense_generate, init_params
from minilib.engine.outputs import RequestMetrics, RequestOutput, StepStats
from minilib.engine.sampling import SamplingParams
from minilib.errors import EngineError

__all__ = [
    "TINY_CONFIG",
    "Engine",
    "EngineError",
    "ModelConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
    "dense_generate",
    "init_params",
]
