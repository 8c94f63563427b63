"""A tiny continuous-batching serving engine on the paged KV cache: the course's capstone.

model.py       ModelConfig, init_params, dense_generate: a toy transformer and its yardstick
scheduler.py   admission, pages, chunked prefill, preemption: who runs in the next step
engine.py      Engine: pack one ragged batch, write K/V into pages, attend, sample, free
sharding.py    attention, its projections and the KV cache split by KV head (shard_map)
view.py        EngineView (import it from minilib.engine.view: it needs ipywidgets)
throughput.py  `python -m minilib bench --engine`: the engine against dense_generate

>>> from minilib.engine import Engine, ModelConfig, dense_generate, init_params
"""

from minilib.engine.engine import Engine, StepStats
from minilib.engine.model import ModelConfig, dense_generate, init_params
from minilib.errors import EngineError

__all__ = ["Engine", "EngineError", "ModelConfig", "StepStats", "dense_generate", "init_params"]
