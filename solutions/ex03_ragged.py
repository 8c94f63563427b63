"""Solutions to notebook 03 (ragged batches)."""

import jax.numpy as jnp


def causal_mask(q_len: int, kv_len: int):
    # The q rows are the sequence's last q_len tokens: row i is at kv_len - q_len + i.
    q_pos = (kv_len - q_len) + jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(kv_len)[None, :]
    return k_pos > q_pos  # True = masked: the key comes after the row


def seq_for_row(cu_q_lens, num_seqs, row: int) -> int:
    # Sequence i owns rows [cu_q_lens[i], cu_q_lens[i+1]); an idle sequence owns none.
    for i in range(int(num_seqs[0])):
        if cu_q_lens[i] <= row < cu_q_lens[i + 1]:
            return i
    raise ValueError(f"row={row} is padding: past cu_q_lens[num_seqs]")
