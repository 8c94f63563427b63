"""Each cause rule of rung 7 (`minilib.exercises.ragged_causes`) names its cause only where
its fact holds: fed a ledger where the fact is false, it stays silent.

The ledgers are built by hand from the plan (`ragged_copy_plan`), one copy per page, as the
watch records them; no kernel runs, so these are fast.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from minilib.batch import make_batch
from minilib.exercises import ragged_causes as rc
from minilib.exercises import ragged_facts as rf
from minilib.exercises.checking import Case
from minilib.exercises.kernel_run import KernelRun
from minilib.ladder.prefill_chunk import kv_block_pages
from minilib.ladder.ragged import ragged_copy_plan
from minilib.ladder.watch import Copy

# q blocks of 8 rows: sequence 0 has rows 0-4, 1 is idle, 2 has row 5, 3 rows 6-15 (q blocks
# 0 and 1), 4 is empty, 5 rows 16-18 (q block 2).
LENS = [(5, 13), (0, 9), (1, 16), (10, 24), (0, 0), (3, 40)]
PAGE_SIZE, PER_BLOCK, BLOCK_Q = 8, 2, 8


@pytest.fixture(scope="module")
def case():
    b = make_batch(
        LENS,
        page_size=PAGE_SIZE,
        pages_per_seq=5,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        seed=0,
    )
    args = (b.q, b.kv_pages, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs)
    kwargs = dict(sm_scale=0.1, num_queries_per_block=BLOCK_Q, num_kv_pages_per_block=PER_BLOCK)
    return Case("rung 7's first case", args, kwargs)


def plan_of(case):
    q, _, kv_lens, table, cu, n = case.args
    return ragged_copy_plan(
        np.asarray(kv_lens),
        np.asarray(table),
        np.asarray(cu),
        int(n[0]),
        block_q=BLOCK_Q,
        num_q_blocks=q.shape[0] // BLOCK_Q,
        num_kv_pages_per_block=PER_BLOCK,
        page_size=PAGE_SIZE,
    )


def ledger(case, blocks):
    """A run whose copies are `blocks` [(seq, KV block, slot, grid step)], page by page."""
    table, kv_lens = np.asarray(case.args[3]), np.asarray(case.args[2])
    copies = []
    for seq, b, slot, step in blocks:
        pages = kv_block_pages(table, seq, int(kv_lens[seq]), b, PER_BLOCK, PAGE_SIZE)
        for p, page in enumerate(pages):
            place = (p * PAGE_SIZE, (p + 1) * PAGE_SIZE)
            copies.append(
                Copy(
                    len(copies),
                    source=(int(page), ":", ":", ":"),
                    destination=(slot, place, ":", ":"),
                    buffer=1,
                    semaphore=slot,
                    core=0,
                    nbytes=1,
                    waited=1,
                    step=step,
                    in_flight=int(bool(copies)),
                )
            )
    watch = type("Ledger", (), {"copies": copies, "deadlock": None})()
    return KernelRun(out=None, watch=watch, grid=tuple(((s,), 0) for s in range(3)))


def planned(case):
    """The plan's blocks, each started in the grid step of the work before it."""
    plan = plan_of(case)
    return [
        (seq, b, slot, plan[w - 1][0] if w else 0) for w, (_, seq, b, slot, _) in enumerate(plan)
    ]


def problem(case, blocks, partial=False):
    return rc.schedule_problem(7, partial=partial)(ledger(case, blocks), case)


def test_the_plan_itself_has_no_problem(case):
    assert problem(case, planned(case)) is None


def test_no_row_is_named_only_for_a_sequence_without_rows_there(case):
    blocks = planned(case)
    # copy of KV block 0 of sequence 2 (rows in q block 0 only) while q block 1 is walked
    wrong = blocks[:4] + [(2, 0, blocks[4][2], 1)] + blocks[5:]
    assert "sequence 2 has no row in q block 1" in problem(case, wrong)
    # sequence 3 has rows 6-7 in q block 0: never "no row in q block 0"
    wrong = blocks[:1] + [(3, 0, blocks[1][2], 0)] + blocks[2:]
    assert "has no row in q block 0" not in problem(case, wrong)


def test_no_row_is_not_named_for_a_sequence_with_rows_in_the_step_that_copied_it(case):
    """Only the no-row rule's fact decides here: no other rule's fact holds, so the cause is
    the general one, and a no-row rule that did not check the rows would name it."""
    blocks = planned(case)  # works: (0,0,0) (0,2,0) (0,3,0) (1,3,0) (1,3,1) (2,5,0..2)
    # KV block 0 of sequence 3 copied by grid step 1 (where it has rows 8-15) where the plan
    # has KV block 0 of sequence 5 for q block 2 (where sequence 3 has none)
    wrong = blocks[:5] + [(3, 0, blocks[5][2], 1)] + blocks[6:]
    text = problem(case, wrong)
    assert "the kernel copied KV block 0 of sequence 3 in grid step 1" in text, text
    assert "has no row" not in text, text
    assert text.endswith("Likely cause: " + rf.NEXT_WORK), text


def test_a_block_copied_twice_blames_an_idle_sequence_only_when_one_precedes_it(case):
    blocks = planned(case)
    # KV block 0 of sequence 2 copied again: sequence 1, just before it, is idle
    twice = blocks[:2] + [(2, 0, blocks[2][2], 0)] + blocks[2:]
    text = problem(case, twice)
    assert "KV block 0 of sequence 2 was copied twice in a row" in text, text
    assert "sequence 1 just before it is idle" in text and "q_len 0" in text, text
    # KV block 1 of sequence 3 copied again: no idle sequence's work starts a KV block 1
    twice = blocks[:5] + [(3, 1, blocks[5][2], 1)] + blocks[5:]
    text = problem(case, twice)
    assert "twice in a row" not in text and "q_len 0" not in text, text
    assert text.endswith("Likely cause: " + rf.NEXT_WORK), text


def stopped(case, blocks, index):
    """A run whose copies are `blocks` and that stopped reading page_indices at `index`."""
    shape = np.asarray(case.args[3]).shape
    error = (
        f"IndexError: Out-of-bounds read of (0 0 smem 104): reading [{index}] but buffer has "
        f"shape {shape}."
    )
    run = dataclasses.replace(ledger(case, blocks), error=error)
    return rc.schedule_problem(7, partial=True)(run, case)


def test_a_stopped_read_names_no_row_only_for_a_sequence_without_rows_there(case):
    blocks = planned(case)[:1]  # then the plan has KV block 0 of sequence 2, for q block 0
    text = stopped(case, blocks, (5, 0))  # sequence 5: rows in q block 2 only
    assert "read page_indices[5, 0]" in text, text
    assert "sequence 5 has no row in q block 0" in text, text
    text = stopped(case, blocks, (3, 0))  # sequence 3: rows 6-7 in q block 0
    assert "read page_indices[3, 0]" in text, text
    assert "has no row" not in text, text
    assert text.endswith("Likely cause: " + rf.NEXT_WORK), text


def test_past_the_diagonal_only_for_a_block_past_it(case):
    blocks = planned(case)  # works: (0,0,0) (0,2,0) (0,3,0) (1,3,0) (1,3,1) (2,5,0..2)
    # KV block 1 of sequence 3 copied in grid step 0: past q block 0's diagonal (1 block)
    wrong = blocks[:3] + [(3, 1, blocks[3][2], 0)] + blocks[4:]
    assert "past the diagonal" in problem(case, wrong)
    # the same block copied in grid step 1, where sequence 3 sees 2 blocks: inside it
    wrong = blocks[:3] + [(3, 1, blocks[3][2], 1)] + blocks[4:]
    assert "past the diagonal" not in problem(case, wrong)


def test_the_very_last_work_only_after_the_last_work(case):
    blocks = planned(case)
    extra = blocks + [(5, 0, 1 - blocks[-1][2], 2)]  # one more, from the last grid step
    assert "the very last work has no next" in problem(case, extra)
    early = blocks + [(5, 0, 1 - blocks[-1][2], 1)]  # one more, from an earlier grid step
    assert "the very last work has no next" not in problem(case, early)


def test_a_skipped_first_block_is_not_started_only_with_a_deadlock(case):
    blocks = planned(case)
    skipped = blocks[:3] + blocks[4:]  # q block 1's first block (3, 0) never copied
    text = problem(case, skipped, partial=True)
    assert "was never started" not in text  # no deadlock in this ledger
    run = ledger(case, skipped)
    run.watch.deadlock = {"semaphore": 1}
    text = rc.schedule_problem(7, partial=True)(run, case)
    assert "KV block 0 of sequence 3, the first of q block 1, was never started" in text


def test_which_of_block_slot_and_step_differs(case):
    blocks = planned(case)
    seq, b, slot, step = blocks[4]
    text = problem(case, blocks[:4] + [(seq, b, 1 - slot, step)] + blocks[5:])
    assert f"the kernel copied that block, but into slot {1 - slot} (the plan: slot {slot})" in text
    text = problem(case, blocks[:3] + [(3, 0, blocks[3][2], 1)] + blocks[4:])
    assert "the kernel copied that block, but in grid step 1" in text
    assert "in its own grid step" in text


def test_the_learners_line_not_generated_code():
    """An error raised in code Python generated (a frozen dataclass's __setattr__, whose file
    is "<string>") is reported at the learner's own line, whose source is shown."""
    import dataclasses
    import traceback

    from minilib.exercises.checking import _where_it_raised

    @dataclasses.dataclass(frozen=True)
    class Block:
        pages: int

    def learners_kernel():
        block = Block(2)
        block.pages = 16  # the learner's line: a frozen field set

    try:
        learners_kernel()
    except dataclasses.FrozenInstanceError as err:
        files = [f.filename for f in traceback.extract_tb(err.__traceback__)]
        assert files[-1] == "<string>", files  # raised in the generated code
        where = _where_it_raised(err)
    assert "test_ragged_causes.py" in where and "block.pages = 16" in where, where
