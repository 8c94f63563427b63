"""The kernel lowers for real TPUs (v5e, v6e) on this TPU-less machine.

`jax.export` with `platforms=["tpu"]` runs the Pallas-to-Mosaic lowering and checks the block
shapes against TPU tiling; the chip is described by an abstract mesh, so no TPU is needed.
This does not run Mosaic's own compiler passes (those live in libtpu, on the TPU host).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import pytest
from jax import export

from minilib.kernel import kernel_config, ragged_paged_attention

AbstractDevice = getattr(jax.sharding, "AbstractDevice", None)
AbstractMesh = getattr(jax.sharding, "AbstractMesh", None)
pytestmark = pytest.mark.skipif(
    AbstractDevice is None or not hasattr(jax.sharding, "use_abstract_mesh"),
    reason=f"jax {jax.__version__} has no jax.sharding.AbstractDevice/use_abstract_mesh, so "
    "a TPU cannot be described without one",
)

CHIPS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}

# (q dtype, kv dtype, num_q_heads, num_kv_heads, page_size): typical serving shapes, head_dim 128.
CONFIGS = {
    "bf16, GQA 32/8, page 16": (jnp.bfloat16, jnp.bfloat16, 32, 8, 16),
    "bf16 q, fp8 KV, page 128": (jnp.bfloat16, jnp.float8_e4m3fn, 32, 8, 128),
    "f32, two heads blocks, page 32": (jnp.float32, jnp.float32, 16, 8, 32),
}


def abstract_tpu_mesh(device_kind: str):
    """A one-device mesh of the given TPU kind (`platform=` exists only in newer JAX)."""
    kwargs = dict(device_kind=device_kind, num_cores=1)
    if "platform" in inspect.signature(AbstractDevice).parameters:
        kwargs["platform"] = "tpu"
    return AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(**kwargs))


def argument_shapes(q_dtype, kv_dtype, num_q_heads, num_kv_heads, page_size, head_dim=128):
    max_num_batched_tokens, max_num_seqs, pages_per_seq, total_num_pages = 256, 16, 16, 512
    return (
        jax.ShapeDtypeStruct((max_num_batched_tokens, num_q_heads, head_dim), q_dtype),
        jax.ShapeDtypeStruct((total_num_pages, page_size, 2 * num_kv_heads, head_dim), kv_dtype),
        jax.ShapeDtypeStruct((max_num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((max_num_seqs, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((max_num_seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("chip", list(CHIPS))
def test_lowers_to_a_mosaic_custom_call(chip, config, monkeypatch):
    q_dtype, kv_dtype, *_ = CONFIGS[config]
    args = argument_shapes(*CONFIGS[config])
    scales = dict(k_scale=0.5, v_scale=0.5) if jnp.dtype(kv_dtype).itemsize == 1 else {}
    f = functools.partial(
        ragged_paged_attention,
        sm_scale=0.088,
        sliding_window=128,
        soft_cap=50.0,
        interpret=False,
        **scales,
    )

    def no_devices(*_, **__):
        raise AssertionError("lowering must not look at jax.devices()")

    monkeypatch.setattr(jax, "devices", no_devices)
    with jax.sharding.use_abstract_mesh(abstract_tpu_mesh(CHIPS[chip])):
        exported = export.export(jax.jit(f), platforms=["tpu"])(*args)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text
    assert "minilib_ragged_paged_attention" in text
    assert "minilib_ragged_paged_attention_decode" in text  # the decode kernel, by name
    assert exported.out_avals[0].shape == args[0].shape


def test_heads_blocks_in_the_lowered_configs():
    """The f32 config really has two heads blocks; the bf16 ones keep all heads together."""
    blocks = {}
    for name, (q_dtype, kv_dtype, num_q_heads, num_kv_heads, page_size) in CONFIGS.items():
        q, kv_pages, _, page_indices, *_ = argument_shapes(
            q_dtype, kv_dtype, num_q_heads, num_kv_heads, page_size
        )
        blocks[name] = kernel_config(q, kv_pages, page_indices).num_heads_blocks
    assert blocks == {
        "bf16, GQA 32/8, page 16": 1,
        "bf16 q, fp8 KV, page 128": 1,
        "f32, two heads blocks, page 32": 2,
    }
