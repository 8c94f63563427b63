"""The open KV blocks (`minilib.kernel.open_blocks`): the blocks a pass walks with no mask,
checked key by key against the causal mask, and the passes the static count gives each of
the mixed kernel's two KV-block loops. The kernel's answers with them are in
`test_kernel.py` ("open KV blocks" cases)."""

from __future__ import annotations

import numpy as np
import pytest

from minilib.masking import open_kv_blocks_end
from minilib.schedule import plan_schedule
from minilib.tpu.suite import SUITE, Workload, ours_trips


def sees_every_key(rows, seq_rows, kv_len, kv_blk, kv_tokens) -> bool:
    """Every row of the q block is the sequence's, and sees every key of the block."""
    q_start, q_end = seq_rows
    for row in range(*rows):
        if not q_start <= row < q_end:
            return False
        position = kv_len - q_end + row
        last_key = (kv_blk + 1) * kv_tokens - 1
        if last_key > position or last_key >= kv_len:
            return False
    return True


def test_the_open_blocks_are_those_whose_every_key_every_row_sees():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(400):
        bq, kv_tokens = int(rng.choice([1, 4, 8])), int(rng.choice([1, 3, 8, 16]))
        q_start = int(rng.integers(0, 20))
        q_len = int(rng.integers(1, 30))
        kv_len = q_len + int(rng.integers(0, 50))
        q_blk = int(rng.integers(0, (q_start + q_len) // bq + 2))
        rows, seq_rows = (q_blk * bq, (q_blk + 1) * bq), (q_start, q_start + q_len)
        end = int(open_kv_blocks_end(rows, seq_rows, kv_len, kv_tokens))
        for kv_blk in range(-(-kv_len // kv_tokens)):
            assert (kv_blk < end) == sees_every_key(rows, seq_rows, kv_len, kv_blk, kv_tokens)
            checked += kv_blk < end
    assert checked > 100  # the draw found open blocks, not only masked ones


def test_a_sliding_window_opens_no_block():
    assert open_kv_blocks_end((0, 8), (0, 8), 400, 16, sliding_window=300) == 0


@pytest.mark.parametrize("name", ["prefill", "mixed"])
def test_the_static_count_splits_the_passes_as_the_rule_does(name):
    """`ours_trips` gives the open loop the passes whose blocks every row sees whole, the
    masked loop the rest: together the plain kernel's passes."""
    workload, pages, queries = SUITE[name], 32, 128
    plain = ours_trips(workload, pages, queries)["mixed"]
    (opened, masked), *outer = ours_trips(workload, pages, queries, open_blocks=True)["mixed"]
    assert opened + masked == plain[0] and outer == plain[1:]
    q, kv_pages, *_ = workload.specs()
    s = plan_schedule(q, kv_pages, *workload.tables(), num_kv_pages_per_block=pages,
                      num_queries_per_block=queries)  # fmt: skip
    kv_lens = workload.tables()[0]
    expected = sum(
        sees_every_key(
            (e.step[1] * queries, (e.step[1] + 1) * queries),
            s.mixed_q_rows[e.seq],
            int(kv_lens[e.seq]),
            e.kv_blk,
            s.kv_tokens_per_block,
        )
        for e in s.computes()
        if e.kernel == "mixed"
    )
    assert opened == expected > 0 and masked > 0


def test_q_blocks_shared_by_two_sequences_open_nothing():
    # q blocks of 8 rows, KV blocks of 16 tokens. The first sequence has rows 0..9 (positions
    # 24..33), the second rows 10..31 (positions 18..39): no row is left for padding, so the q
    # block of rows 8..15 holds both and opens nothing (by position alone it would open 2 and
    # 1). Open: q block 0, block 0 (first position 24); q block 2, block 0 (24); q block 3,
    # blocks 0 and 1 (32).
    w = Workload("two chunks", ((10, 34), (22, 40)))
    (opened, masked), *_ = ours_trips(w, pages=1, queries=8, open_blocks=True)["mixed"]
    assert opened == 1 + 1 + 2
    assert opened + masked == ours_trips(w, pages=1, queries=8)["mixed"][0]
