"""Solutions to notebook 09 (performance)."""


def arithmetic_intensity(seq_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, itemsize):
    live = [(q_len, kv_len) for q_len, kv_len in seq_lens if q_len > 0]  # idle: no work
    # Row i of a sequence sits at position kv_len - q_len + i and sees keys 0..that position.
    pairs = sum(kv_len - q_len + i + 1 for q_len, kv_len in live for i in range(q_len))
    flops = 4 * head_dim * num_q_heads * pairs  # q.k and probs.v: a multiply-add each
    rows = sum(q_len for q_len, _ in live)
    q_and_out = 2 * rows * num_q_heads * head_dim * itemsize
    slots = sum(-(-kv_len // page_size) * page_size for _, kv_len in live)  # whole pages
    kv = slots * 2 * num_kv_heads * head_dim * itemsize  # K and V of every KV head, once
    return flops / (q_and_out + kv)


LANES = 128  # a vector register row: m and l take one per q row, a score row whole ones


def kernel_vmem_bytes(pages, *, page_size, num_kv_heads_per_block, group, head_dim, itemsize,
                      num_queries_per_block, padded_slot):  # fmt: skip
    kvh, rows = num_kv_heads_per_block, num_queries_per_block * group
    tokens = pages * page_size
    heads_per_token = 2 * kvh + (2 if padded_slot else 0)  # padded: a spare row per token
    kv_slots = 2 * tokens * heads_per_token * head_dim * itemsize  # double-buffered
    q_and_out = 2 * 2 * kvh * rows * head_dim * itemsize  # q and out blocks, 2 buffers each
    folded_q = kvh * rows * head_dim * itemsize
    state = kvh * rows * (2 * LANES + head_dim) * 4  # m, l, acc in float32
    spills = kvh * rows * (-(-tokens // LANES) * LANES) * 4  # one f32 score matrix per KV head
    return kv_slots + q_and_out + folded_q + state + spills


def num_kv_pages_per_block(
    vmem_budget_bytes,
    *,
    page_size,
    pages_per_seq,
    num_kv_heads_per_block,
    group,
    head_dim,
    itemsize,
    num_queries_per_block,
    padded_slot,
):
    shapes = dict(page_size=page_size, num_kv_heads_per_block=num_kv_heads_per_block,
                  group=group, head_dim=head_dim, itemsize=itemsize,
                  num_queries_per_block=num_queries_per_block, padded_slot=padded_slot)  # fmt: skip
    # Count up: a page does not always cost the same (the spills grow by 128 tokens at a time).
    pages = 0
    while pages < pages_per_seq and kernel_vmem_bytes(pages + 1, **shapes) <= vmem_budget_bytes:
        pages += 1
    return pages
