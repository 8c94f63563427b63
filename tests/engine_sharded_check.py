"""Run by tests/test_engine.py in a fresh process with simulated CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/engine_sharded_check.py

The device count is fixed when JAX starts, hence the separate process. Runs the engine with
its attention and KV cache sharded over meshes of 1, 2 and 4 devices, for every attention
implementation, next to the unsharded engine and the dense model, and tries bad meshes.
Prints one JSON line with what it saw; the test judges it.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.sharding import Mesh

import minilib
from minilib.engine import Engine, EngineError, ModelConfig, dense_generate, init_params

CONFIG = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=32)
PARAMS = init_params(CONFIG, seed=1)
SIZES = {"num_pages": 16, "page_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 3}
rng = np.random.default_rng(2)
PROMPTS = [rng.integers(0, 64, n).tolist() for n in (5, 11, 2, 7)]
ATTENTION = {
    "jnp": minilib.ragged_paged_attention_jnp,
    "blockwise": minilib.ragged_paged_attention_blockwise,
    "kernel": minilib.ragged_paged_attention,
    "ref": minilib.ref_ragged_paged_attention,
}
# (attention, mesh sizes, how many prompts, max_new_tokens): the interpreted kernel and the
# host-looping reference are slow, so they get a small run.
PLAN = [
    ("jnp", (1, 2, 4), 3, 5),
    ("blockwise", (2, 4), 3, 5),
    ("kernel", (2, 4), 2, 2),
    ("ref", (2, 4), 1, 2),
]


def mesh_of(size: int, axis: str = "kv_heads") -> Mesh:
    return Mesh(np.array(jax.devices()[:size]), (axis,))


def error_text(make) -> str:
    try:
        make()
    except EngineError as err:
        return str(err)
    return "no error"


def main() -> None:
    runs = []
    for name, sizes, num_prompts, max_new in PLAN:
        prompts = PROMPTS[:num_prompts]
        dense = [dense_generate(PARAMS, CONFIG, p, max_new) for p in prompts]
        plain = Engine(PARAMS, CONFIG, attention=ATTENTION[name], **SIZES)
        unsharded = plain.generate(prompts, max_new)
        for size in sizes:
            eng = Engine(PARAMS, CONFIG, attention=ATTENTION[name], mesh=mesh_of(size), **SIZES)
            tokens = eng.generate(prompts, max_new)
            free = eng.scheduler.allocator.num_free == SIZES["num_pages"]
            runs.append(
                {
                    "attention": name,
                    "mesh_size": size,
                    "tokens": tokens,
                    "unsharded": unsharded,
                    "dense": dense,
                    "pages_free": free,
                }
            )
    eng = Engine(PARAMS, CONFIG, attention=ATTENTION["jnp"], mesh=mesh_of(4), **SIZES)
    shard_shapes = [list(s.data.shape) for s in eng.kv_pages[0].addressable_shards]
    weight_specs = {name: str(w.sharding.spec) for name, w in eng.params["layers"][0].items()}
    two_kv_heads = ModelConfig(
        vocab_size=64, num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=32
    )
    errors = {
        "kv heads not divisible": error_text(
            lambda: Engine(init_params(two_kv_heads), two_kv_heads, mesh=mesh_of(4), **SIZES)
        ),
        "unknown axis": error_text(
            lambda: Engine(PARAMS, CONFIG, mesh=mesh_of(2, "model"), **SIZES)
        ),
        "not a mesh": error_text(lambda: Engine(PARAMS, CONFIG, mesh=jax.devices(), **SIZES)),
    }
    print(
        json.dumps(
            {
                "num_devices": jax.device_count(),
                "runs": runs,
                "shard_shapes": {"4": shard_shapes},
                "weight_specs": weight_specs,
                "errors": errors,
            }
        )
    )


if __name__ == "__main__":
    main()
