"""Solutions to notebook 01 (attention and head grouping)."""

import jax.numpy as jnp


def kv_head_for_q_head(q_head: int, num_q_heads: int, num_kv_heads: int) -> int:
    # Groups are consecutive: q heads [0, group) share KV head 0, [group, 2*group) KV head 1...
    group = num_q_heads // num_kv_heads
    return q_head // group


def repeat_kv(x, num_q_heads: int):
    # x: [num_tokens, num_kv_heads, head_dim]. jnp.repeat copies each head in place
    # (0, 0, 1, 1, ...); jnp.tile would copy the whole list (0, 1, 0, 1, ...).
    num_kv_heads = x.shape[1]
    return jnp.repeat(x, num_q_heads // num_kv_heads, axis=1)
