"""Solutions to notebook 05 (validation)."""

import numpy as np

from minilib import RPAInputError


def validate_q_lens(kv_lens, cu_q_lens, num_seqs) -> None:
    kv_lens, cu_q_lens = np.asarray(kv_lens), np.asarray(cu_q_lens)
    for i in range(int(num_seqs[0])):  # only the live sequences: the rest is padding
        q_len, kv_len = int(cu_q_lens[i + 1] - cu_q_lens[i]), int(kv_lens[i])
        if q_len > kv_len:
            raise RPAInputError(
                f"{q_len=} must be less or equal to {kv_len=} at sequence {i}.",
                "kv_len counts the new tokens too: write them to the cache first.",
            )
