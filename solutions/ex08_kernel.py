"""Solutions to notebook 08 (the TPU kernel)."""


def kv_blocks_to_visit(first_q_pos, last_q_pos, kv_len, block_len, sliding_window):
    # Causal: the last row (position last_q_pos) sees keys up to last_q_pos, never past kv_len.
    last_key = min(last_q_pos, kv_len - 1)
    end = last_key // block_len + 1  # exclusive: the block holding last_key is included
    if sliding_window is None:
        return 0, end
    # The first row (position first_q_pos) sees back to first_q_pos - sliding_window + 1.
    first_key = max(first_q_pos - sliding_window + 1, 0)
    return first_key // block_len, end
