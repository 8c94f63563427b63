"""Solutions to notebook 00 (setup and tour)."""


def live_seq_lens(kv_lens, cu_q_lens, num_seqs) -> list[tuple[int, int]]:
    # Only the first num_seqs[0] slots are live: the rest is padding, and holds garbage.
    # Sequence i owns rows [cu_q_lens[i], cu_q_lens[i+1]) of q, and kv_lens[i] tokens in the
    # cache, its new ones included.
    return [
        (int(cu_q_lens[i + 1] - cu_q_lens[i]), int(kv_lens[i])) for i in range(int(num_seqs[0]))
    ]
