"""Solutions to notebook 09 (performance)."""


def decode_kv_bytes(kv_lens, page_size, num_kv_heads, head_dim, itemsize) -> int:
    # Whole pages of each sequence, and per token slot: K and V of every KV head.
    slots = sum(-(-kv_len // page_size) * page_size for kv_len in kv_lens)
    return slots * 2 * num_kv_heads * head_dim * itemsize
