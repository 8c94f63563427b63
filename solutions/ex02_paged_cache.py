"""Solutions to notebook 02 (the paged KV cache)."""


def token_location(t: int, pages, page_size: int) -> tuple[int, int]:
    # The sequence's page *column* is t // page_size; the page table turns it into a page.
    return int(pages[t // page_size]), t % page_size


def gather_kv(kv_pages, pages, kv_len: int):
    # kv_pages: [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    _, page_size, combined, head_dim = kv_pages.shape
    num_pages = -(-kv_len // page_size)
    seq_pages = kv_pages[pages[:num_pages]]  # [num_pages, page_size, combined, head_dim]
    tokens = seq_pages.reshape(num_pages * page_size, combined, head_dim)[:kv_len]
    return tokens[:, 0::2], tokens[:, 1::2]  # K in even slots, V in odd ones
