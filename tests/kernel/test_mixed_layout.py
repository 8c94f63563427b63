"""The mixed kernel's own q layout (`kernel.mixed_layout`): one-token sequences take no rows,
the others start on a q block while the padding fits; the output comes back in the batch's
rows. Parity against the reference on NaN-padded batches (TPU interpret mode; under a TPU's
matmul numerics on .venv-oldest, tasks.py's KERNEL_PARITY_TESTS), the layout's invariants, and
the (q block, sequence) passes it saves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, assert_close, assert_matches_jax

from minilib.batch import make_batch, random_seq_lens
from minilib.kernel import kernel_config, mixed_layout, ragged_paged_attention
from minilib.reference import ref_ragged_paged_attention
from minilib.schedule import plan_schedule

# Decodes first, then chunks of 13, 7, 9 and 3 rows (none a multiple of the q block of 8), an
# idle sequence, padding rows (35 live of 40) and padding slots (8 live of 10). 8 rows are
# free: the chunks of 13 and 7 start on q blocks (3 + 1 rows of padding), the one of 9 starts
# on one by chance, the one of 3 mid-block (the padding would not fit).
SEQ_LENS = [(1, 20), (1, 9), (13, 30), (0, 5), (7, 7), (1, 33), (9, 40), (3, 12)]
BATCH_OPTIONS = dict(page_size=8, max_num_batched_tokens=40, max_num_seqs=10)
BLOCKS = dict(num_kv_pages_per_block=2, num_queries_per_block=8)
SM_SCALE = 0.125


def layout_of(batch, **options):
    config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, **options)
    return mixed_layout(batch.cu_q_lens, batch.num_seqs, config), config


def test_the_batch_lays_out_as_its_comment_says():
    batch = make_batch(SEQ_LENS, **BATCH_OPTIONS)
    layout, _ = layout_of(batch, **BLOCKS)
    starts = np.asarray(layout.cu_q_lens)
    assert starts[:9].tolist() == [0, 0, 0, 16, 16, 24, 24, 33, 36]


@pytest.mark.parametrize("options", [{}, dict(sliding_window=6, soft_cap=20.0)],
                         ids=["causal", "sliding window and soft cap"])  # fmt: skip
def test_matches_jax_reference(options):
    batch = make_batch(SEQ_LENS, **BATCH_OPTIONS)
    run = lambda *args, **kw: ragged_paged_attention(*args, interpret=INTERPRET, **kw)  # noqa: E731
    assert_matches_jax(run, batch, sm_scale=SM_SCALE, **BLOCKS, **options)


def test_sinks_match_the_reference():
    """With attention sinks (JAX's reference has none: minilib's, checked against the dense
    formula in tests/core/test_attention_sink.py)."""
    batch = make_batch(SEQ_LENS, num_q_heads=8, **BATCH_OPTIONS)
    sink = jnp.asarray(2.0 * np.random.default_rng(1).standard_normal(8), jnp.float32)
    out = ragged_paged_attention(*batch.args(), sm_scale=SM_SCALE, attention_sink=sink,
                                 interpret=INTERPRET, **BLOCKS)  # fmt: skip
    want = ref_ragged_paged_attention(*batch.args(), sm_scale=SM_SCALE, attention_sink=sink)
    n = batch.num_tokens
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out)[n:], 0.0)
    assert_close(np.asarray(out)[:n], np.asarray(want)[:n], jnp.float32)


@pytest.mark.parametrize("seed", range(6))
def test_layout_invariants(seed):
    """Every row of a mixed sequence goes to the mixed q and back; the sequences there are in
    order and apart, each with its padding or none before its rows; those padded start and
    end on a q block; every other output row reads the last row, which no sequence owns when
    there are such rows or padding."""
    rng = np.random.default_rng(seed)
    seq_lens = random_seq_lens(int(rng.integers(1, 9)), max_kv_len=40, max_q_len=20, seed=seed)
    seq_lens += [(1, 5)] * int(rng.integers(0, 4)) + [(0, 3)]
    rng.shuffle(seq_lens)
    tokens = sum(q for q, _ in seq_lens)
    batch = make_batch([tuple(s) for s in seq_lens], max_num_seqs=len(seq_lens) + 2,
                       max_num_batched_tokens=tokens + int(rng.integers(0, 12)))  # fmt: skip
    bq = int(rng.integers(2, 12))
    layout, config = layout_of(batch, num_queries_per_block=bq)
    cu, mixed_cu = np.asarray(batch.cu_q_lens), np.asarray(layout.cu_q_lens)
    q_rows, out_rows = np.asarray(layout.q_rows), np.asarray(layout.out_rows)
    mixed_rows = len(q_rows)
    assert mixed_rows == -(-config.max_num_batched_tokens // bq) * bq
    assert np.all(np.diff(mixed_cu) >= 0) and mixed_cu[-1] <= mixed_rows
    owned = np.zeros(len(out_rows), bool)
    for seq, (q_len, _) in enumerate(batch.seq_lens):
        start, end = mixed_cu[seq], mixed_cu[seq + 1]
        if q_len < 2:
            assert start == end
            continue
        padding = (end - start) - q_len
        assert padding in (0, -q_len % bq), (seq, padding)
        if padding:
            assert start % bq == 0 and end % bq == 0
        rows = np.arange(cu[seq], cu[seq + 1])
        np.testing.assert_array_equal(out_rows[rows], np.arange(start + padding, end))
        np.testing.assert_array_equal(q_rows[out_rows[rows]], rows)
        owned[rows] = True
    padded = mixed_cu[-1] > sum(q for q, _ in batch.seq_lens if q > 1)
    if padded or not owned.all():  # then the last row is no sequence's: the kernel zeroes it
        assert mixed_cu[-1] <= mixed_rows - 1
    assert np.all(out_rows[~owned] == mixed_rows - 1)


def test_chunks_after_decodes_take_their_own_q_blocks():
    """4 decodes, then 2 chunks of 16 rows, in q blocks of 8: each chunk takes 2 q blocks (4
    (q block, sequence) passes in all), not 3 each as packed after the decode rows."""
    batch = make_batch([(1, 20)] * 4 + [(16, 40)] * 2, page_size=8)
    plan = plan_schedule(*batch.args(), num_kv_pages_per_block=2, num_queries_per_block=8)
    mixed = {(e.step, e.seq) for e in plan.computes() if e.kernel == "mixed"}
    assert sorted(mixed) == [((0, 0), 4), ((0, 1), 4), ((0, 2), 5), ((0, 3), 5)]
    assert plan.mixed_q_rows[4:6] == ((0, 16), (16, 32))


def padded_starts(q_lens, num_seqs: int, bq: int, max_num_batched_tokens: int) -> list[int]:
    """The mixed q's cu_q_lens by the rule `mixed_layout`'s docstring states, sequence by
    sequence: the one-token and idle sequences (and the slots past num_seqs) take no rows; the
    others take their rows, padded to a multiple of bq while their padding and that of all
    before them fit in the rows left free, less the last row."""
    mixed_rows = -(-max_num_batched_tokens // bq) * bq
    mixed = [s < num_seqs and q > 1 for s, q in enumerate(q_lens)]
    free = mixed_rows - sum(q for q, m in zip(q_lens, mixed, strict=True) if m)
    starts, padding_so_far = [0], 0
    for q, m in zip(q_lens, mixed, strict=True):
        rows = 0
        if m:
            padding = -q % bq
            padding_so_far += padding
            rows = q + (padding if padding_so_far <= free - 1 else 0)
        starts.append(starts[-1] + rows)
    return starts


@functools.cache
def jitted_mixed_starts(bq: int, max_num_batched_tokens: int, max_num_seqs: int):
    q = jax.ShapeDtypeStruct((max_num_batched_tokens, 4, 64), jnp.float32)
    kv_pages = jax.ShapeDtypeStruct((8, 8, 4, 64), jnp.float32)
    page_indices = jax.ShapeDtypeStruct((max_num_seqs, 4), jnp.int32)
    config = kernel_config(q, kv_pages, page_indices, num_queries_per_block=bq)
    return jax.jit(lambda cu_q_lens, num_seqs: mixed_layout(cu_q_lens, num_seqs, config).cu_q_lens)


def test_the_padding_stops_where_it_would_take_the_last_row():
    """The edge: 3 + 8 rows of 12 in q blocks of 4 leave one row free, the last, which no
    sequence may take: the chunk of 3 is not padded. 3 + 7 leave two: it is."""
    for q_lens, want in (([3, 8], [0, 3, 11]), ([3, 7], [0, 4, 11])):
        cu_q_lens = jnp.asarray(np.cumsum([0, *q_lens]), jnp.int32)
        starts = jitted_mixed_starts(4, 12, 2)(cu_q_lens, jnp.asarray([2], jnp.int32))
        assert np.asarray(starts).tolist() == want == padded_starts(q_lens, 2, 4, 12)


@pytest.mark.parametrize(
    "bq, max_num_batched_tokens, max_num_seqs", [(4, 12, 4), (3, 10, 5), (8, 16, 4)]
)
def test_the_layout_is_the_stated_rule_on_small_random_batches(
    bq, max_num_batched_tokens, max_num_seqs
):
    """Against the rule written out, on 200 random batches per shape (one compile each):
    every edge of `padding <= free - 1` is met many times at these sizes."""
    rng = np.random.default_rng(bq)
    mixed_starts = jitted_mixed_starts(bq, max_num_batched_tokens, max_num_seqs)
    at_the_edge = 0
    for _ in range(200):
        num_seqs = int(rng.integers(1, max_num_seqs + 1))
        q_lens = rng.multinomial(
            int(rng.integers(0, max_num_batched_tokens + 1)), [1 / num_seqs] * num_seqs
        )
        cu = np.cumsum([0, *q_lens])
        garbage = rng.integers(-50, 50, max_num_seqs - num_seqs)  # slots past num_seqs
        cu_q_lens = jnp.asarray(np.concatenate([cu, garbage]), jnp.int32)
        got = np.asarray(mixed_starts(cu_q_lens, jnp.asarray([num_seqs], jnp.int32)))
        want = padded_starts(
            list(q_lens) + [0] * (max_num_seqs - num_seqs), num_seqs, bq, max_num_batched_tokens
        )
        assert got.tolist() == want, (q_lens.tolist(), num_seqs)
        mixed_rows = -(-max_num_batched_tokens // bq) * bq
        free = mixed_rows - sum(q for q in q_lens if q > 1)
        at_the_edge += any(np.cumsum([-q % bq for q in q_lens if q > 1]) == free)
    assert at_the_edge >= 5  # the draw reaches the edge, where `<` and `<=` part
