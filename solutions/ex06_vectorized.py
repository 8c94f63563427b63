"""Solutions to notebook 06, part 1 (vectorizing)."""

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def decode_attention(q, kv_pages, kv_lens, page_indices, *, sm_scale):
    # q: [num_seqs, num_q_heads, head_dim]; kv_lens: i32[num_seqs];
    # kv_pages: [total_num_pages, page_size, 2*num_kv_heads, head_dim];
    # page_indices: i32[num_seqs, pages_per_seq]
    num_seqs, num_q_heads, head_dim = q.shape
    combined = kv_pages.shape[2]
    num_kv_heads = combined // 2
    group = num_q_heads // num_kv_heads
    # Every page of every sequence: [num_seqs, pages_per_seq * page_size, combined, head_dim].
    slots = kv_pages[page_indices].reshape(num_seqs, -1, combined, head_dim)
    live = jnp.arange(slots.shape[1])[None, :] < kv_lens[:, None]  # lengths stay arrays
    slots = jnp.where(live[:, :, None, None], slots, 0.0)  # NaN past kv_len: 0 * NaN is NaN
    k, v = slots[:, :, 0::2], slots[:, :, 1::2]
    q_grouped = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = jnp.einsum("shgd,skhd->shgk", q_grouped, k) * sm_scale
    scores = jnp.where(live[:, None, None, :], scores, MASK_VALUE)
    out = jnp.einsum("shgk,skhd->shgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(num_seqs, num_q_heads, head_dim)
