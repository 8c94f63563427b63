"""Solutions to notebook 02 (the paged KV cache)."""

import jax.numpy as jnp


def write_new_tokens(kv_pages, pages, kv_len: int, new_k, new_v):
    # kv_pages: [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    # new_k, new_v: [n, num_kv_heads, head_dim], the sequence's last n tokens: kv_len counts them.
    n, page_size = new_k.shape[0], kv_pages.shape[1]
    positions = kv_len - n + jnp.arange(n)
    page = jnp.asarray(pages)[positions // page_size]  # the page table turns column into page
    slot = positions % page_size
    kv_pages = kv_pages.at[page, slot, 0::2].set(new_k)  # K of KV head h in slot 2*h
    return kv_pages.at[page, slot, 1::2].set(new_v)  # V in slot 2*h + 1


def gather_kv(kv_pages, pages, kv_len: int):
    # kv_pages: [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    _, page_size, combined, head_dim = kv_pages.shape
    num_pages = -(-kv_len // page_size)
    seq_pages = kv_pages[pages[:num_pages]]  # [num_pages, page_size, combined, head_dim]
    tokens = seq_pages.reshape(num_pages * page_size, combined, head_dim)[:kv_len]
    return tokens[:, 0::2], tokens[:, 1::2]  # K in even slots, V in odd ones
