"""Solutions to notebook 04 (the naive reference)."""

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attend_soft_cap(q, k, v, *, sm_scale, soft_cap):
    # q: [q_len, num_q_heads, head_dim]; k, v: [kv_len, num_kv_heads, head_dim]
    q_len, num_q_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:  # cap first: masking after keeps masked keys at ~-inf
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    q_pos = (kv_len - q_len) + jnp.arange(q_len)[:, None]
    scores = jnp.where(jnp.arange(kv_len)[None, :] > q_pos, MASK_VALUE, scores)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("hqk,khd->qhd", probs, v).astype(q.dtype)


def sliding_window_mask(q_len: int, kv_len: int, sliding_window: int):
    q_pos = (kv_len - q_len) + jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(kv_len)[None, :]
    # Causal, and at most sliding_window keys: q_pos - sliding_window + 1 .. q_pos.
    return (k_pos > q_pos) | (k_pos <= q_pos - sliding_window)
