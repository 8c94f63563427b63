"""Solutions to notebook 01 (attention and head grouping)."""

import jax
import jax.numpy as jnp


def grouped_query_attention(q, k, v, *, sm_scale):
    # q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    # Consecutive q heads share a KV head: KV head first, then the q heads of its group.
    q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("qhgd,khd->hgqk", q_grouped, k) * sm_scale  # no copy of K
    future = jnp.arange(num_tokens)[None, :] > jnp.arange(num_tokens)[:, None]
    scores = jnp.where(future, -jnp.inf, scores)  # every row sees its own key: no NaN
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hgqk,khd->qhgd", probs, v)  # [num_tokens, num_kv_heads, group, head_dim]
    return out.reshape(num_tokens, num_q_heads, head_dim)


def repeat_kv_pages(kv_pages, num_q_heads: int):
    # kv_pages: [total_num_pages, page_size, 2*num_kv_heads, head_dim], K in even slots.
    total_num_pages, page_size, combined, head_dim = kv_pages.shape
    group = num_q_heads // (combined // 2)
    k = jnp.repeat(kv_pages[:, :, 0::2], group, axis=2)  # each head in place: 0 0 1 1 ...
    v = jnp.repeat(kv_pages[:, :, 1::2], group, axis=2)
    both = jnp.stack([k, v], axis=3)  # [..., num_q_heads, 2, head_dim]: K0 V0 K1 V1 ...
    return both.reshape(total_num_pages, page_size, 2 * num_q_heads, head_dim)
