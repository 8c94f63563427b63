"""Attention split over devices by KV head: `shard_map` over `Mesh(devices, ("kv_heads",))`.

Attention never mixes heads: q head h reads only KV head h // group. So a mesh of D devices
can split the KV heads into D contiguous blocks, each device holding its block's K/V pages
and the q heads that read them:

    kv_pages [total_num_pages, page_size, 2*num_kv_heads, head_dim]   axis 2 split D ways
    q        [max_num_batched_tokens, num_q_heads, head_dim]          axis 1 split D ways

The combined layout K0 V0 K1 V1 ... keeps each head's K and V side by side, so a contiguous
block of axis 2 holds whole KV heads; and q heads d*nq/D .. (d+1)*nq/D - 1 use exactly KV
heads d*nkv/D .. (d+1)*nkv/D - 1. Each device runs the unchanged attention function on its
heads, with no communication; the index arrays (`kv_lens`, `page_indices`, `cu_q_lens`,
`num_seqs`) are the same on every device. The pages are a pool shared by all heads, so the
scheduler and page table do not change at all.

The projections around attention are split the same way (`shard_params`): each device makes
q, k and v for its own heads only, and the output projection ends with one sum over devices.
The MLP, norms and embeddings stay replicated.

More devices than KV heads (say 2 KV heads on 4 chips) cannot split the KV heads; vLLM then
*replicates* them, and so does `replicate_kv_heads`: each KV head is copied to D/num_kv_heads
devices (its K and V projections repeated), so every device holds exactly one KV head and the
num_q_heads/D q heads that read it. Each copy costs a device's share of the pool, and each
device still computes only its own q heads.

On a CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=4` (set before JAX starts) makes
four simulated devices. On a TPU slice the devices are chips, and the same code runs.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

try:  # jax >= 0.7 has it at the top level; older versions in jax.experimental
    from jax import shard_map
except ImportError:  # pragma: no cover - depends on the installed jax
    from jax.experimental.shard_map import shard_map

from minilib.engine.model import ModelConfig
from minilib.errors import EngineError

__all__ = [
    "check_mesh",
    "kv_head_replicas",
    "nan_kv_pages",
    "replicate_kv_heads",
    "shard_attention",
    "shard_kv_pages",
    "shard_params",
]

AXIS = "kv_heads"
Q_SPEC = PartitionSpec(None, AXIS, None)  # q and the output: q heads split
KV_SPEC = PartitionSpec(None, None, AXIS, None)  # kv_pages: combined K/V heads split
SAME = PartitionSpec()  # the index arrays: a full copy on every device
SINK_SPEC = PartitionSpec(AXIS)  # attention_sink [num_q_heads]: split as q's heads are
KV_HEAD_AXIS_1 = PartitionSpec(None, AXIS, None)  # wq, wk, wv [embed_dim, heads, head_dim]

# Errors that mean "this implementation reads the lengths on the host" (both references loop
# over sequences in Python): it cannot run with traced lengths.
_NEEDS_HOST_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def check_mesh(mesh, config: ModelConfig) -> int:
    """Raise `EngineError` unless `mesh` can split `config`'s KV heads. Returns its size.

    >>> config = ModelConfig(vocab_size=8, num_layers=1, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=8)
    >>> check_mesh(Mesh(np.array(jax.devices()[:1]), ("kv_heads",)), config)
    1
    """
    if not isinstance(mesh, Mesh):
        raise EngineError(
            f"mesh={mesh!r} is not a jax.sharding.Mesh.",
            f"build one with Mesh(np.array(jax.devices()), ({AXIS!r},)).",
        )
    if tuple(mesh.axis_names) != (AXIS,):
        raise EngineError(
            f"mesh.axis_names={tuple(mesh.axis_names)} are not the engine's: it knows one "
            f"axis, {AXIS!r}.",
            f"name the mesh axis {AXIS!r}: Mesh(devices, ({AXIS!r},)).",
        )
    size = mesh.shape[AXIS]
    nq, nkv = config.num_q_heads, config.num_kv_heads
    fits = [d for d in range(1, nq + 1) if nq % d == 0 and (nkv % d == 0 or d % nkv == 0)]
    if nkv % size and size % nkv:
        raise EngineError(
            f"num_kv_heads={nkv} is not divisible by the mesh axis {AXIS!r} of size {size}, "
            f"nor is {size} a multiple of it: the devices can neither split the KV heads "
            "evenly nor hold equal numbers of copies of them.",
            f"use a mesh of one of these sizes: {fits}.",
        )
    if nq % size:
        raise EngineError(
            f"num_q_heads={nq} is not divisible by the mesh axis {AXIS!r} of size {size}: "
            "the devices cannot hold equal shares of the q heads.",
            f"use a mesh of one of these sizes: {fits}.",
        )
    return size


def kv_head_replicas(mesh, config: ModelConfig) -> int:
    """How many copies of each KV head the mesh needs: 1 when the devices split the KV
    heads, D / num_kv_heads when there are more devices than KV heads.

    >>> config = ModelConfig(vocab_size=8, num_layers=1, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=8)
    >>> kv_head_replicas(Mesh(np.array(jax.devices()[:1]), ("kv_heads",)), config)
    1
    """
    return max(check_mesh(mesh, config) // config.num_kv_heads, 1)


def replicate_kv_heads(params: dict, replicas: int) -> dict:
    """`params` with every KV head's K and V projections repeated `replicas` times, in place:
    KV head k becomes heads k*replicas .. k*replicas + replicas - 1. q head h then reads head
    h * (num_kv_heads * replicas) // num_q_heads, a copy of the KV head it read before, so
    attention computes exactly what it did.

    >>> from minilib.engine.model import init_params
    >>> config = ModelConfig(vocab_size=8, num_layers=1, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=8)
    >>> layer = replicate_kv_heads(init_params(config), 2)["layers"][0]
    >>> layer["wk"].shape, bool((layer["wk"][:, 2] == layer["wk"][:, 3]).all())
    ((64, 4, 8), True)
    """
    if replicas == 1:
        return params

    def repeat(layer):
        return layer | {name: jnp.repeat(layer[name], replicas, axis=1) for name in ("wk", "wv")}

    return params | {"layers": [repeat(layer) for layer in params["layers"]]}


def nan_kv_pages(shape: tuple, dtype, mesh: Mesh | None) -> jax.Array:
    """A KV pool of `shape` full of NaN (a stale read shows on a page's first use). With a
    mesh, made on it already split as `shard_kv_pages` splits it: each device fills its own
    share, and no device holds the whole pool first. Without one, on the default device.

    With several processes (`minilib.engine.multiprocess`) a pool made on one device could
    not be placed at all: `device_put` checks that every process passes equal values, and
    NaN equals nothing.

    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("kv_heads",))
    >>> pages = nan_kv_pages((2, 4, 4, 8), jnp.float32, mesh)
    >>> pages.sharding.spec == KV_SPEC, bool(jnp.isnan(pages).all())
    (True, True)
    >>> nan_kv_pages((2, 4, 4, 8), jnp.float32, None).shape
    (2, 4, 4, 8)
    """
    if mesh is None:
        return jnp.full(shape, jnp.nan, dtype)
    fill = jax.jit(
        lambda: jnp.full(shape, jnp.nan, dtype), out_shardings=NamedSharding(mesh, KV_SPEC)
    )
    return fill()


def shard_kv_pages(kv_pages: jax.Array, mesh: Mesh) -> jax.Array:
    """Place `kv_pages` on the mesh, each device holding its KV heads' K and V.

    >>> import jax.numpy as jnp
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("kv_heads",))
    >>> shard_kv_pages(jnp.zeros((2, 4, 4, 8)), mesh).sharding.spec == KV_SPEC  # axis 2 split
    True
    """
    return jax.device_put(kv_pages, NamedSharding(mesh, KV_SPEC))


def shard_params(params: dict, mesh: Mesh) -> dict:
    """Place the head-parallel weights by head, like the KV cache: wq, wk and wv split on
    their head axis, wo on its head axis; everything else replicated.

    Then the jitted layers run split too (XLA partitions them from the weights' placement):
    each device computes q, k and v of its own heads only, which are exactly the heads its
    attention reads, and the output projection ends with one sum over devices.

    >>> from minilib.engine.model import init_params
    >>> config = ModelConfig(vocab_size=8, num_layers=1, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=8)
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("kv_heads",))
    >>> params = shard_params(init_params(config), mesh)
    >>> [params["layers"][0][name].sharding.spec == KV_HEAD_AXIS_1 for name in ("wq", "wk")]
    [True, True]
    >>> params["embed"].sharding.spec == SAME
    True
    """
    by_head = {
        "wq": KV_HEAD_AXIS_1,
        "wk": KV_HEAD_AXIS_1,
        "wv": KV_HEAD_AXIS_1,
        "wo": PartitionSpec(AXIS, None, None),  # [num_q_heads, head_dim, embed_dim]
    }

    def place(layer):
        return {
            name: jax.device_put(w, NamedSharding(mesh, by_head.get(name, SAME)))
            for name, w in layer.items()
        }

    everywhere = NamedSharding(mesh, SAME)
    replicated = {k: jax.device_put(v, everywhere) for k, v in params.items() if k != "layers"}
    return replicated | {"layers": [place(layer) for layer in params["layers"]]}


def shard_attention(attention, mesh: Mesh, config: ModelConfig):
    """`attention`, run on every device of `mesh` over that device's heads.

    The result has `attention`'s signature. Jittable implementations are traced once per
    set of options (the index arrays are arguments). An `attention_sink` (f32[num_q_heads])
    is an array, not an option: it is split over the devices as q's heads are. The
    references read the lengths on the host; for them the index arrays are baked in as
    constants, which runs the sharded call op by op, and compiles anew each step: right, but
    slow.

    >>> import jax.numpy as jnp
    >>> def scale_q(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale):
    ...     return q * sm_scale                       # a stand-in with attention's signature
    >>> config = ModelConfig(vocab_size=8, num_layers=1, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=8)
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("kv_heads",))
    >>> sharded = shard_attention(scale_q, mesh, config)
    >>> lengths = (jnp.zeros(2, jnp.int32), jnp.zeros((2, 1), jnp.int32),
    ...            jnp.zeros(3, jnp.int32), jnp.zeros(1, jnp.int32))
    >>> out = sharded(jnp.ones((4, 4, 8)), jnp.zeros((2, 4, 4, 8)), *lengths, sm_scale=0.5)
    >>> out.shape, float(out[0, 0, 0])
    ((4, 4, 8), 0.5)
    """
    check_mesh(mesh, config)
    compiled = {}  # options -> the jitted sharded function
    host_lengths = False

    def local_heads(options):
        def attend(q, kv_pages, *metadata, sink=()):  # q [T, num_q_heads / D, head_dim]
            sinks = {"attention_sink": sink[0]} if sink else {}
            return attention(q, kv_pages, *metadata, **options, **sinks)

        return attend

    def sharded(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        nonlocal host_lengths
        metadata = (kv_lens, page_indices, cu_q_lens, num_seqs)
        sink = options.pop("attention_sink", None)
        sink = () if sink is None else (sink,)
        sink_specs = (SINK_SPEC,) * len(sink)
        if not host_lengths:
            key = (tuple(sorted(options.items())), len(sink))
            if key not in compiled:
                attend = local_heads(options)
                specs = (Q_SPEC, KV_SPEC, SAME, SAME, SAME, SAME, *sink_specs)
                compiled[key] = jax.jit(_shard_map(
                    lambda q, kv, *m: attend(q, kv, *m[:4], sink=m[4:]), mesh, specs, Q_SPEC
                ))  # fmt: skip
            try:
                return compiled[key](q, kv_pages, *metadata, *sink)
            except _NEEDS_HOST_VALUES:
                host_lengths = True
        host = [np.asarray(a) for a in metadata]
        attend = local_heads(options)
        run = _shard_map(
            lambda q, kv, *s: attend(q, kv, *host, sink=s), mesh, (Q_SPEC, KV_SPEC, *sink_specs),
            Q_SPEC,
        )  # fmt: skip
        return run(q, kv_pages, *sink)

    return sharded


def _shard_map(f, mesh, in_specs, out_specs):
    """`shard_map` without the replication check (a Pallas kernel or the references' host
    loop has no replication rule), under the keyword this jax version names it with."""
    check = "check_vma" if "check_vma" in inspect.signature(shard_map).parameters else "check_rep"
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{check: False})
