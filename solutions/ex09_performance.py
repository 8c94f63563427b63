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


LANES = 128  # m and l take one 128-lane row of a vector register per q row


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
):
    rows = num_queries_per_block * group
    # What does not depend on the KV block: q and out blocks, double-buffered, and the state.
    q_and_out = 2 * 2 * num_queries_per_block * num_kv_heads_per_block * group * head_dim
    state = num_kv_heads_per_block * rows * (2 * LANES + head_dim) * 4  # float32
    fixed = q_and_out * itemsize + state
    # Each page of the KV block costs its bytes twice: two slots, for double buffering.
    per_page = 2 * page_size * 2 * num_kv_heads_per_block * head_dim * itemsize
    if vmem_budget_bytes < fixed + per_page:
        return 0
    return min((vmem_budget_bytes - fixed) // per_page, pages_per_seq)
