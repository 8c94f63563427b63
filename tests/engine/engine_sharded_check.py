"""Run by tests/engine/test_engine_sharded.py in a fresh process with simulated CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/engine/engine_sharded_check.py

The device count is fixed when JAX starts, hence the separate process. Runs the engine with
its attention and KV cache sharded over meshes of 1, 2 and 4 devices (the interpreted kernel
and the reference on 4), for every attention implementation, next to the unsharded engine
and the dense model; a model with 2 KV heads on 4 devices (KV heads replicated); a serving
run on 4 devices with prefix caching, sampling, preemption and an abort, the pool's
accounting checked after every step; a model with attention sinks on 4 devices; and bad
meshes.
Prints one JSON line with what it saw; the test judges it.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.sharding import Mesh

import minilib
from minilib.engine import (
    Engine,
    EngineError,
    ModelConfig,
    SamplingParams,
    dense_generate,
    init_params,
)

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
# host-looping reference are slow, so they get a small run, on 4 devices only (one KV head a
# shard; jnp and blockwise also run two a shard, on 2 devices).
PLAN = [
    ("jnp", (1, 2, 4), 3, 5),
    ("blockwise", (2, 4), 3, 5),
    ("kernel", (4,), 2, 2),
    ("ref", (4,), 1, 2),
]


def mesh_of(size: int, axis: str = "kv_heads") -> Mesh:
    return Mesh(np.array(jax.devices()[:size]), (axis,))


def error_text(make) -> str:
    try:
        make()
    except EngineError as err:
        return str(err)
    return "no error"


def replicated_run() -> dict:
    """2 KV heads on 4 devices: each device holds a copy of one KV head."""
    config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32)
    params = init_params(config, seed=3)
    prompts = PROMPTS[:3]
    dense = [dense_generate(params, config, p, 5) for p in prompts]
    eng = Engine(params, config, attention=ATTENTION["jnp"], mesh=mesh_of(4), **SIZES)
    tokens = eng.generate(prompts, 5)
    return {
        "tokens": tokens,
        "dense": dense,
        "replicas": eng.kv_head_replicas,
        "shard_shapes": [list(s.data.shape) for s in eng.kv_pages[0].addressable_shards],
        "pages_free": eng.scheduler.allocator.num_free == SIZES["num_pages"],
    }


def sinks_run() -> dict:
    """A model with attention sinks on 4 devices: each device gets its q heads' sinks."""
    config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=32,
                         attention_sinks=True)  # fmt: skip
    params = init_params(config, seed=1)
    prompts = PROMPTS[:3]
    dense = [dense_generate(params, config, p, 5) for p in prompts]
    eng = Engine(params, config, attention=ATTENTION["jnp"], mesh=mesh_of(4), **SIZES)
    return {
        "tokens": eng.generate(prompts, 5),
        "dense": dense,
        "dense_without_sinks": [dense_generate(PARAMS, CONFIG, p, 5) for p in prompts],
    }


def serving_run() -> dict:
    """Prefix caching, sampling, preemption and aborts (of a waiting and of a running
    request) on 4 devices, against the dense model; the pool's books are checked after every
    step and every abort."""
    shared = rng.integers(0, 64, 9).tolist()
    prompts = [shared + rng.integers(0, 64, n).tolist() for n in (3, 6, 1, 4, 2)]
    params_of = [
        SamplingParams(max_tokens=6, temperature=0.9, top_k=16, seed=10 + i)
        for i in range(len(prompts))
    ]
    sizes = SIZES | {"num_pages": 8}
    eng = Engine(
        PARAMS, CONFIG, attention=ATTENTION["jnp"], mesh=mesh_of(4), enable_prefix_caching=True,
        **sizes,
    )  # fmt: skip
    ids = [eng.add_request(p, sampling_params=sp) for p, sp in zip(prompts, params_of, strict=True)]
    aborts = {1: ids[4], 3: ids[0]}  # after step 1: a waiting request; after 3: a running one
    problems, states = [], {}
    while eng.has_unfinished:
        stats = eng.step()
        problems += [f"step {stats.step}: {p}" for p in eng.scheduler.accounting_problems()]
        if stats.step in aborts:
            victim = eng.requests[aborts[stats.step]]
            states[stats.step] = "running" if victim in eng.scheduler.running else "waiting"
            eng.abort_request(victim.request_id)
            problems += [f"after abort: {p}" for p in eng.scheduler.accounting_problems()]
    outputs = [eng.request_output(i) for i in ids]
    dense = [
        dense_generate(PARAMS, CONFIG, p, sampling_params=sp)
        for p, sp in zip(prompts, params_of, strict=True)
    ]
    return {
        "tokens": [list(o.token_ids) for o in outputs[1:4]],
        "dense": dense[1:4],
        "aborted": [
            [o.finish_reason, list(o.token_ids), d]
            for o, d in ((outputs[4], dense[4]), (outputs[0], dense[0]))
        ],
        "aborted_states": [states[1], states[3]],
        "num_cached_tokens": [o.num_cached_tokens for o in outputs],
        "preempted": sum(s.num_preempted for s in eng.stats),
        "shared_pages_seen": any(s.shared_pages for s in eng.stats),
        "problems": problems,
        "pages_free": eng.scheduler.allocator.num_free == sizes["num_pages"],
    }


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
    six_q_heads = ModelConfig(
        vocab_size=64, num_layers=1, num_q_heads=6, num_kv_heads=2, head_dim=32
    )
    errors = {
        "kv heads not divisible": error_text(
            lambda: Engine(PARAMS, CONFIG, mesh=mesh_of(3), **SIZES)
        ),
        "q heads not divisible": error_text(
            lambda: Engine(init_params(six_q_heads), six_q_heads, mesh=mesh_of(4), **SIZES)
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
                "replicated": replicated_run(),
                "serving": serving_run(),
                "sinks": sinks_run(),
            }
        )
    )


if __name__ == "__main__":
    main()
