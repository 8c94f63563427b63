"""Solutions to notebook 07's kernel exercises, rung 1: the body of the flash-attention kernel,
and the `pallas_call` around it.

`flash_attention` is the library's `pallas_call` (`minilib.ladder.flash.flash_attention`)
around this body; `flash_attention_call` is the `pallas_call` written out, around the library's
body. The checkers call them.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.ladder import flash

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(MASK - m) is 0, never NaN


def flash_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, kv_len, q_len, sm_scale):
    # q_ref, o_ref: [block_q, head_dim]; k_ref, v_ref: [block_kv, head_dim]
    # m_ref, l_ref: f32[block_q, 1] and acc_ref: f32[block_q, head_dim], kept across KV steps.
    i, j = pl.program_id(1), pl.program_id(2)  # q block, KV block
    block_q, block_kv = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)  # the first KV block of this q block: nothing seen yet
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q_pos = kv_len - q_len + i * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    k_pos = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    q, k = q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32)
    v = jnp.where(k_pos.T < kv_len, v_ref[...].astype(jnp.float32), 0.0)  # NaN past kv_len
    s = jnp.dot(q, k.T) * sm_scale  # [block_q, block_kv]
    s = jnp.where((k_pos <= q_pos) & (k_pos < kv_len), s, MASK_VALUE)

    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_next)
    alpha = jnp.exp(m_prev - m_next)
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v)
    m_ref[...] = m_next

    @pl.when(j == pl.num_programs(2) - 1)  # the last KV block: normalise and write
    def _finish():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


flash_attention = functools.partial(flash.flash_attention, kernel=flash_kernel)


# --- Rung 1b: the pallas_call around the tested kernel body --------------------------------


def flash_attention_call(
    q, k, v, *, kv_len, sm_scale, block_q=8, block_kv=8, interpret=False, kernel=flash.flash_kernel
):
    # q: [num_heads, q_len, head_dim]; k, v: [num_heads, max_kv_len, head_dim]
    num_heads, q_len, head_dim = q.shape
    grid = (num_heads, q_len // block_q, pl.cdiv(kv_len, block_kv))  # no block past kv_len
    q_spec = pl.BlockSpec((None, block_q, head_dim), lambda h, i, j: (h, i, 0))  # block indices
    kv_spec = pl.BlockSpec((None, block_kv, head_dim), lambda h, i, j: (h, j, 0))
    return pl.pallas_call(
        functools.partial(kernel, kv_len=kv_len, q_len=q_len, sm_scale=sm_scale),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=grid,
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,  # one output block per (h, i), written on the last KV step
        scratch_shapes=[
            pltpu.VMEM((block_q, 1), jnp.float32),  # m
            pltpu.VMEM((block_q, 1), jnp.float32),  # l
            pltpu.VMEM((block_q, head_dim), jnp.float32),  # acc
        ],
        # The KV axis carries m, l and acc from step to step: "arbitrary". The others do not.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(q, k, v)
