"""Solutions to notebook 06 (vectorizing, then the online softmax)."""

import jax.numpy as jnp


def online_softmax_update(m, l, acc, scores, v):
    # m, l: [rows]; acc: [rows, head_dim]; scores: [rows, kv_tokens_per_block];
    # v: [kv_tokens_per_block, head_dim]
    m_new = jnp.maximum(m, scores.max(axis=-1))
    alpha = jnp.exp(m - m_new)  # rescales the old sums; 0 on the first block (m = -inf)
    p = jnp.exp(scores - m_new[:, None])  # <= 1: never overflows
    l_new = alpha * l + p.sum(axis=-1)
    acc_new = alpha[:, None] * acc + p @ v.astype(jnp.float32)
    return m_new, l_new, acc_new
