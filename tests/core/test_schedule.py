"""The kernel's schedule: the Python plan, and proof that it is what the kernel does.

`plan_schedule` works the schedule out in Python; `record_schedule` runs the kernel (TPU
interpret mode) with its trace on. The first group checks they agree event for event. The
second checks properties of the plan that make the kernel correct and efficient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ONE_OF_EACH

from minilib.batch import make_batch, random_seq_lens
from minilib.errors import RPAInputError
from minilib.schedule import Event, Schedule, plan_schedule, record_schedule

BATCHES = {
    # name: (seq_lens, make_batch options, schedule options)
    "mixed, idle and padding slots, partial blocks": (
        ONE_OF_EACH,
        dict(page_size=8, max_num_batched_tokens=30, max_num_seqs=6, pages_per_seq=7),
        dict(num_kv_pages_per_block=3, num_queries_per_block=8),
    ),
    "two heads blocks and a sliding window": (
        [(6, 6), (1, 12), (9, 30)],
        dict(num_q_heads=16, num_kv_heads=8, head_dim=32, page_size=8),
        dict(sliding_window=10, num_kv_pages_per_block=1, num_queries_per_block=4),
    ),
    # The edges of the walk and of block skipping: sequence 0 ends where q block 1 starts;
    # q block 1 ends on a KV block's last key (a q block's last row taken one too far visits
    # the next KV block); sequence 2 starts mid-q-block under a window (its first row taken as
    # the q block's visits a KV block before its own).
    "edges: a sequence ending at a q block, a q block at a KV block, a window": (
        [(4, 4), (6, 42), (3, 30)],
        dict(page_size=4, max_num_seqs=4),
        dict(sliding_window=3, num_kv_pages_per_block=1, num_queries_per_block=4),
    ),
    "decode only, one q block": (
        [(1, 9), (1, 30), (1, 2)],
        dict(page_size=4, max_num_batched_tokens=8),
        dict(num_kv_pages_per_block=3, num_queries_per_block=8),
    ),
}


def schedule_args(name):
    seq_lens, batch_options, options = BATCHES[name]
    return make_batch(seq_lens, **batch_options).args(), options


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if "decode" in name else name
             for name in BATCHES]
)  # fmt: skip
def test_plan_is_what_the_kernel_records(name):
    args, options = schedule_args(name)
    plan = plan_schedule(*args, **options)
    recorded = record_schedule(*args, **options)
    assert recorded.events == plan.events, "\n".join(
        ["plan:", plan.describe(), "kernel:", recorded.describe()]
    )
    assert recorded == plan


# Seed 3 in the default run too: a walk that takes a sequence ending where the q block starts
# for its first (`<` for `<=` in first_seq_in_q_block) never ends on it; the hang limit
# (tests/time_limit.py) stops it.
@pytest.mark.parametrize(
    "seed", [0, 3] + [pytest.param(seed, marks=pytest.mark.slow) for seed in (1, 2, 4, 5)]
)
def test_plan_is_what_the_kernel_records_random(seed):
    rng = np.random.default_rng(seed)
    seq_lens = random_seq_lens(int(rng.integers(1, 7)), max_kv_len=50, max_q_len=20, seed=seed)
    seq_lens.insert(int(rng.integers(0, len(seq_lens) + 1)), (0, 3))  # an idle sequence
    batch = make_batch(seq_lens, page_size=4, max_num_seqs=len(seq_lens) + 1, pages_per_seq=13)
    options = dict(
        num_kv_pages_per_block=int(rng.integers(1, 14)),
        num_queries_per_block=int(rng.integers(1, 12)),
        sliding_window=[None, int(rng.integers(1, 20))][seed % 2],
    )
    assert record_schedule(*batch.args(), **options) == plan_schedule(*batch.args(), **options)


# ---------------------------------------------------------------------------------------------
# Properties of the plan (pure Python, fast).
# ---------------------------------------------------------------------------------------------


def random_plans(count=20):
    for seed in range(count):
        rng = np.random.default_rng(seed)
        seq_lens = random_seq_lens(int(rng.integers(1, 8)), max_kv_len=60, seed=seed)
        seq_lens.append((0, 4))
        batch = make_batch(
            seq_lens,
            page_size=int(rng.choice([4, 8])),
            max_num_batched_tokens=sum(q for q, _ in seq_lens) + int(rng.integers(0, 9)),
            max_num_seqs=len(seq_lens) + 2,
            pages_per_seq=15,
            seed=seed,
        )
        options = dict(
            num_kv_pages_per_block=int(rng.integers(1, 16)),
            num_queries_per_block=int(rng.integers(1, 20)),
            sliding_window=[None, int(rng.integers(1, 25))][seed % 2],
        )
        yield batch, options, plan_schedule(*batch.args(), **options)


def visible_keys(q_len, kv_len, sliding_window):
    """bool[q_len, kv_len]: may row i see key j? (NumPy; minilib.masking.causal_mask negated.)"""
    q_pos = kv_len - q_len + np.arange(q_len)[:, None]
    k_pos = np.arange(kv_len)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


def test_every_visible_key_is_computed_exactly_once_per_row():
    """Each (row, key) pair the causal (and window) mask lets through is in exactly one compute
    event, per heads block; so the online softmax sees every key, and none twice."""
    for batch, options, plan in random_plans():
        for heads_blk in range(plan.grid[0]):
            seen = {}
            for e in plan.computes():
                if e.heads_blk != heads_blk:
                    continue
                for row in range(*e.q_rows):
                    for key in range(*e.kv_tokens):
                        seen[row, key] = seen.get((row, key), 0) + 1
            assert max(seen.values()) == 1
            cu = np.asarray(batch.cu_q_lens)
            for seq, (q_len, kv_len) in enumerate(batch.seq_lens):
                visible = visible_keys(q_len, kv_len, options["sliding_window"])
                for i, key in zip(*np.nonzero(visible), strict=True):
                    assert seen.get((cu[seq] + i, key)) == 1, (seq, i, key)


def kernels_of(plan):
    """The two kernels' events apart: {kernel: events}, and the decode kernel's all first."""
    names = [e.kernel for e in plan.events]
    assert names == sorted(names), "the decode kernel runs first, then the mixed one"
    return {k: [e for e in plan.events if e.kernel == k] for k in ("decode", "mixed")}


def test_slots_alternate_and_each_copy_is_waited_for_once():
    """Within each kernel: its own chain of copies, in two slots."""
    for _, _, plan in random_plans():
        for events in kernels_of(plan).values():
            computes = [e for e in events if e.kind == "compute"]
            assert [e.slot for e in computes] == [i % 2 for i in range(len(computes))]
            pending = {}  # slot -> the block being copied into it
            for e in events:
                block = (e.heads_blk, e.seq, e.kv_blk)
                if e.kind == "start":
                    assert e.slot not in pending, "a slot was refilled before it was waited for"
                    pending[e.slot] = block
                elif e.kind == "wait":
                    assert pending.pop(e.slot) == block
            assert not pending


def test_each_compute_overlaps_the_next_copy():
    """Within each kernel, every compute but its last hides the copy of the next one."""
    for _, _, plan in random_plans():
        pairs = plan.in_flight()
        assert pairs, "every plan has a live sequence, so at least one compute"
        for kernel in ("decode", "mixed"):
            mine = [(c, r) for c, r in pairs if c.kernel == kernel]
            for (compute, running), (next_compute, _) in zip(mine, mine[1:], strict=False):
                assert running is not None and running.slot != compute.slot
                assert (running.heads_blk, running.seq, running.kv_blk) == (
                    next_compute.heads_blk,
                    next_compute.seq,
                    next_compute.kv_blk,
                )
            if mine:
                assert mine[-1][1] is None  # nothing left to fetch during the last compute


def test_one_token_sequences_go_to_the_decode_kernel():
    """A sequence with one q row is computed by the decode kernel, alone (its one row); every
    other live sequence by the mixed kernel."""
    for batch, _, plan in random_plans():
        for e in plan.computes():
            q_len = batch.seq_lens[e.seq][0]
            assert e.kernel == ("decode" if q_len == 1 else "mixed"), (e, q_len)
            if e.kernel == "decode":
                assert e.q_rows == (int(batch.cu_q_lens[e.seq]), int(batch.cu_q_lens[e.seq]) + 1)


def test_pages_are_the_sequences_own():
    for batch, _, plan in random_plans():
        table = np.asarray(batch.page_indices)
        for e in plan.events:
            kv_len = batch.seq_lens[e.seq][1]
            assert e.pages and set(e.pages) <= set(table[e.seq, : -(-kv_len // plan.page_size)])


# ---------------------------------------------------------------------------------------------
# The API.
# ---------------------------------------------------------------------------------------------


def test_plan_needs_only_shapes_of_q_and_kv_pages():
    batch = make_batch(ONE_OF_EACH, page_size=8)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (batch.q, batch.kv_pages)]
    plan = plan_schedule(*shapes, *batch.args()[2:], num_queries_per_block=8)
    assert plan == plan_schedule(*batch.args(), num_queries_per_block=8)


def test_describe_lists_every_grid_step():
    args, options = schedule_args("mixed, idle and padding slots, partial blocks")
    plan = plan_schedule(*args, **options)
    assert isinstance(plan, Schedule) and all(isinstance(e, Event) for e in plan.events)
    text = plan.describe()
    assert plan.grid == (1, 4)
    assert text.count("\ngrid step") == 4  # the mixed kernel's
    assert "no rows for this kernel" in text  # q block 3 holds only padding rows
    # The decode sequence (seq 1) is the decode kernel's, with a chain of copies of its own.
    assert "decode kernel, grid step (heads block 0, block 0): sequences [1]" in text
    assert "DMA start  slot 0 <- heads 0 seq 1 kv block 0" in text
    assert "DMA start  slot 1 <- heads 0 seq 3 kv block 0" in text
    assert list(plan.steps()) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert list(plan.steps("decode")) == [(0, 0)]


def test_bad_inputs_raise_minilib_errors():
    batch = make_batch(ONE_OF_EACH, page_size=8)
    with pytest.raises(RPAInputError, match="num_queries_per_block=0 must be positive"):
        plan_schedule(*batch.args(), num_queries_per_block=0)
    bad_kv_lens = jnp.asarray([5, 20, 7, 10], jnp.int32)  # q_len 12 > kv_len 10
    args = list(batch.args())
    args[2] = bad_kv_lens
    with pytest.raises(RPAInputError, match="q_len=12 must be less or equal to kv_len=10"):
        plan_schedule(*args)
