"""Solutions to notebook 08 (the TPU kernel)."""


def kv_blocks_to_visit(first_q_pos, last_q_pos, kv_tokens_per_block, sliding_window):
    # Causal: the last row (position last_q_pos) sees keys up to its own position.
    end = last_q_pos // kv_tokens_per_block + 1  # exclusive: the block holding it is included
    if sliding_window is None:
        return 0, end
    # The first row (position first_q_pos) sees back to first_q_pos - sliding_window + 1.
    first_key = max(first_q_pos - sliding_window + 1, 0)
    return first_key // kv_tokens_per_block, end
