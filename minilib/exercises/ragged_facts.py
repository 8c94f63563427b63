"""Rung 7's cause rules, each checking the fact it names before naming it.

`RaggedFacts` holds what they check against: the case's tables (the rows a sequence has in a
q block, the KV blocks those rows see), the plan, and the run's copies with the grid step that
started each. Each rule of `FACT_RULES` looks at the first copy that differs from the plan
(`minilib.exercises.ragged_causes`) and returns its cause only where its fact holds, else None:
"past the diagonal" only for a block past the diagonal of the rows of the q block whose grid
step copied it, "no row in q block b" only where the sequence has none, "the very last work"
only after the plan's last copy. The first rule whose fact holds names the cause.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minilib.exercises.checking import Case
from minilib.exercises.ragged_mistakes import ragged
from minilib.kv_cache import pages_needed
from minilib.ladder.prefill_chunk import kv_block_pages

__all__ = ["FACT_RULES"]

DIAGONAL = (
    "KV blocks past the diagonal were copied: no live row of the q block sees a key past "
    "its last live row's position. That row is min(first_row + block_q, q_len) - 1 (rung 7: "
    "min(q_end, end_row) - 1, the sequence's last row *in this q block*), at position "
    "kv_len - q_len + row, and num_kv_blocks = cdiv(that position + 1, block_kv)."
)


TOO_FEW = (
    "KV blocks that a live row can see were never copied: num_kv_blocks must reach the "
    "position of the q block's *last* live row, cdiv(kv_len - q_len + last_row + 1, block_kv), "
    "not its first row's."
)


IDLE = (
    "a sequence with q_len 0 (idle: cu_q_lens[s + 1] == cu_q_lens[s]) has no rows and no "
    "work: skip it, in the walk and in next_work (`next_seq_with_rows(seq + 1, "
    "cu_q_lens[seq + 1], ...)` skips it)."
)


LAST_WORK = (
    "the very last work has no next: after the last KV block of the last sequence of the last "
    "q block, start nothing."
)


SPANNING = (
    "the q block ended mid-sequence: a sequence whose rows run past end_row is also the first "
    "sequence of the next q block, so its KV block 0 comes next. The next q block's first "
    "sequence is `next_seq_with_rows(seq, end_row, ...)`, from seq, not seq + 1."
)


@dataclasses.dataclass(frozen=True)
class RaggedFacts:
    """What rung 7's causes check their facts against: the case's tables, the plan, and the
    run's copies as (page, slot, place, Copy)."""

    run: object
    case: Case
    copies: list
    plan: list
    lens: list
    cu: list
    n: int
    block_q: int
    per_block: int
    page_size: int
    table: np.ndarray

    @property
    def block_kv(self) -> int:
        return self.per_block * self.page_size

    def rows(self, seq: int, blk: int) -> tuple[int, int] | None:
        """The rows (first, last) of sequence `seq` in q block `blk`, or None if it has none."""
        first = max(self.cu[seq], blk * self.block_q)
        last = min(self.cu[seq + 1], (blk + 1) * self.block_q) - 1
        return (first, last) if first <= last else None

    def blocks_needed(self, seq: int, blk: int, count=None) -> int:
        """The KV blocks sequence `seq`'s rows in q block `blk` see (0: no row there);
        `count(last_pos, block_kv)` may count them another way (a mistake)."""
        rows = self.rows(seq, blk)
        if rows is None:
            return 0
        q_len = self.cu[seq + 1] - self.cu[seq]
        last_pos = self.lens[seq] - q_len + rows[1] - self.cu[seq]
        return (count or _cdiv_plus_one)(last_pos, self.block_kv)

    def step(self, k: int) -> int | None:
        """The q block of the grid step that started copy k, if recorded."""
        copy = self.copies[k][3]
        grid = self.run.grid
        return grid[copy.step][0][0] if 0 <= copy.step < len(grid) else None

    def block_of(self, k: int):
        """Which (seq, KV block) the copies from k on, a block's worth, are, or None."""
        start = k - k % self.per_block
        pages = tuple(c[0] for c in self.copies[start : start + self.per_block])
        for s in range(len(self.lens)):  # a padding slot's kv_len may be huge: its row bounds it
            kv_len = min(self.lens[s], self.table.shape[1] * self.page_size)
            for b in range(pages_needed(kv_len, self.page_size)):
                block = kv_block_pages(self.table, s, kv_len, b, self.per_block, self.page_size)
                if pages and block[: len(pages)] == pages:  # a run may stop mid-block
                    return s, b
        return None


def _cdiv_plus_one(last_pos: int, block_kv: int) -> int:
    return -(-(last_pos + 1) // block_kv)


def planned_copies(facts: RaggedFacts) -> list:
    return [(pages[p], slot, p) for *_, slot, pages in facts.plan for p in range(facts.per_block)]


def later_in_plan(facts: RaggedFacts, k: int, got) -> int | None:
    """The first copy after k that the plan has for block `got`, or None."""
    w = k // facts.per_block
    for v, (_, seq, b, *_) in enumerate(facts.plan[w + 1 :], start=w + 1):
        if (seq, b) == got:
            return v * facts.per_block
    return None


NEXT_WORK = (
    "the walk or next_work chose another KV block than the plan's next. Each work starts the "
    "copy of the next: the next KV block of this sequence (`b + 1 < num_kv_blocks`), else KV "
    "block 0 of the next sequence with rows in this q block, else KV block 0 of the next q "
    "block's first sequence; a grid step walks the sequences with rows in its q block."
)


def _fact_idle(facts, k, due, prev, first_of_blk, got, step, partial):
    seq = got[0]
    if seq < facts.n and facts.cu[seq + 1] == facts.cu[seq]:
        return IDLE
    return None


def _fact_past_num_seqs(facts, k, due, prev, first_of_blk, got, step, partial):
    return past_num_seqs(got[0], facts.n) if got[0] >= facts.n else None


def _fact_twice(facts, k, due, prev, first_of_blk, got, step, partial):
    """KV block 0 of a sequence copied twice in a row, the sequence just before it idle: the
    idle sequence was walked, and its work started the next sequence's KV block 0 again."""
    if prev is None or got != (prev[1], prev[2]) or k < facts.per_block:
        return None
    if facts.block_of(k - facts.per_block) != got:  # the copy before: the same block?
        return None
    seq, before = got[0], got[0] - 1
    if got[1] != 0 or before < 0 or facts.cu[before + 1] != facts.cu[before]:
        return None
    return (
        f"KV block 0 of sequence {seq} was copied twice in a row, and sequence {before} just "
        "before it is idle: " + IDLE
    )


def _fact_diagonal(facts, k, due, prev, first_of_blk, got, step, partial):
    """A block past the diagonal of its sequence's rows in the q block that copied it."""
    if prev is None or step is None or got[0] != prev[1] or got[1] <= prev[2]:
        return None
    needed = facts.blocks_needed(got[0], step)
    return DIAGONAL if needed > 0 and got[1] >= needed else None


def _fact_order(facts, k, due, prev, first_of_blk, got, step, partial):
    """The next q block's first sequence chosen before this q block's next sequence."""
    if prev is None or due is None or due[0] != prev[0] or due[1] == prev[1] or got[1] != 0:
        return None
    end_row = (prev[0] + 1) * facts.block_q
    first_next = next((s for s in range(prev[1], facts.n) if facts.cu[s + 1] > end_row), None)
    if got[0] != first_next:
        return None
    return (
        f"next_work's cases in the wrong order: after the last KV block of sequence {prev[1]}, "
        f"sequence {due[1]} still has rows in q block {due[0]}, so its KV block 0 comes next; "
        "the next q block's first sequence comes only after the last sequence of this q block "
        "(`jnp.where(more_blocks, seq, jnp.where(later_here, later, next_blk_first))`)."
    )


def _fact_spanning(facts, k, due, prev, first_of_blk, got, step, partial):
    """The sequence running on into the next q block skipped for the one after it."""
    if not (first_of_blk and prev is not None and due[1] == prev[1]) or got[1] != 0:
        return None
    end_row = prev[0] * facts.block_q + facts.block_q
    after = next((s for s in range(due[1] + 1, facts.n) if facts.cu[s + 1] > end_row), None)
    return SPANNING if got[0] == after else None


def _fact_not_started(facts, k, due, prev, first_of_blk, got, step, partial):
    """A q block's first KV block never started: the run then waited for it for ever."""
    deadlock = facts.run.watch.deadlock if facts.run.watch is not None else None
    if not (first_of_blk and partial and deadlock is not None):
        return None
    if later_in_plan(facts, k, got) != k + facts.per_block:  # the kernel went on with the next
        return None
    return (
        f"KV block {due[2]} of sequence {due[1]}, the first of q block {due[0]}, was never "
        f"started, and grid step {due[0]} then waited for it: the last work of q block "
        f"{due[0] - 1} starts it (next_work's last case: KV block 0 of "
        "`next_seq_with_rows(seq, end_row, ...)`, the next q block's first sequence, when "
        "`q_blk + 1 < num_q_blks`)."
    )


def _fact_count(facts, k, due, prev, first_of_blk, got, step, partial):
    """The KV blocks of a sequence counted as a usual mistake does: the kernel's copies are
    those of the plan made with that count (but the very first, which grid step 0 starts
    whatever the count)."""
    have = [c[0] for c in facts.copies[facts.per_block :]]
    for count, words in COUNT_MISTAKES:
        plan = _plan_counted(facts, count)
        want = [pages[p] for *_, pages in plan[1:] for p in range(facts.per_block)]
        if have and (want[: len(have)] == have if partial else want == have):
            return words
    return None


def _floor_count(last_pos: int, block_kv: int) -> int:
    return (last_pos + 1) // block_kv


def _cdiv_no_plus_one(last_pos: int, block_kv: int) -> int:
    return -(-last_pos // block_kv)


COUNT_MISTAKES = (
    (
        _floor_count,
        "the KV blocks were counted with a floor: a sequence's rows in a q block "
        "see the keys at positions 0 ... last_pos, last_pos + 1 of them, which take "
        "`pl.cdiv(last_pos + 1, block_kv)` KV blocks; `(last_pos + 1) // block_kv` loses the "
        "last, partial one.",
    ),
    (
        _cdiv_no_plus_one,
        "the KV blocks were counted as `cdiv(last_pos, block_kv)`: the keys "
        "at positions 0 ... last_pos are last_pos + 1 of them, so the count is "
        "`pl.cdiv(last_pos + 1, block_kv)` (last_pos = kv_len - q_len + last_row - q_start).",
    ),
)


def _plan_counted(facts: RaggedFacts, count) -> list:
    """The plan's (q block, seq, KV block, slot, pages), each sequence's KV blocks in a q
    block counted by `count(last_pos, block_kv)`."""
    work = []
    for blk in range(facts.case.args[0].shape[0] // facts.block_q):
        for seq in range(facts.n):
            work += [(blk, seq, b) for b in range(facts.blocks_needed(seq, blk, count))]
    return [
        (
            blk,
            seq,
            b,
            k % 2,
            kv_block_pages(facts.table, seq, facts.lens[seq], b, facts.per_block, facts.page_size),
        )
        for k, (blk, seq, b) in enumerate(work)
    ]


def _fact_skipped_rows(facts, k, due, prev, first_of_blk, got, step, partial):
    """A spanning sequence's rows not walked in the q block where it starts: the KV block 0
    copied for them served the next q block, whose own first copy is then not made."""
    if partial or not (first_of_blk and prev is not None and due[1] == prev[1]):
        return None
    if later_in_plan(facts, k, got) != k + facts.per_block or facts.run.out is None:
        return None
    rows = facts.rows(prev[1], prev[0])
    expected = ragged()(*facts.case.args, **facts.case.kwargs)
    got_rows = np.asarray(facts.run.out, np.float64)[rows[0] : rows[1] + 1]
    if np.allclose(got_rows, expected[rows[0] : rows[1] + 1], atol=1e-3, equal_nan=False):
        return None  # its rows are right: they were computed
    return (
        f"sequence {prev[1]}'s rows in q block {prev[0]} (rows {rows[0]}..{rows[1]}, where it "
        "starts) were not walked: its KV block 0, copied for them, served the next q block "
        "instead. A grid step walks every sequence with a row in its q block, "
        "while `cu_q_lens[seq] < end_row`, also one whose rows run on past end_row."
    )


def _fact_last_work(facts, k, due, prev, first_of_blk, got, step, partial):
    """An extra copy after the plan's last, started by the very last work's grid step."""
    if due is not None or not facts.plan:
        return None
    last_blk = facts.plan[-1][0]
    return LAST_WORK if step is None or step == last_blk else None


def _fact_no_row(facts, k, due, prev, first_of_blk, got, step, partial):
    """A sequence copied for a q block where it has no row (nor in the step that copied it)."""
    if due is None or got[0] == due[1]:
        return None
    blk = step if step is not None else due[0]
    if facts.rows(got[0], due[0]) is not None or facts.rows(got[0], blk) is not None:
        return None
    return no_row(got[0], blk)


def pages_per_block(facts: RaggedFacts) -> str | None:
    """Every KV block copied as fewer pages than num_kv_pages_per_block: the kernel's copies,
    p at a time into places 0 ... p - 1, are the plan's KV blocks, in the plan's order, as
    p pages each (`kv_block_pages` with p), not per_block."""
    places = [c[2] for c in facts.copies]
    p = max(places, default=-1) + 1
    if not 0 < p < facts.per_block or len(places) < 2 * p:  # two blocks' worth at least
        return None
    if places != [i % p for i in range(len(places))] or len(places) > len(facts.plan) * p:
        return None
    for i in range(0, len(places), p):
        _, seq, b, *_ = facts.plan[i // p]
        pages = kv_block_pages(facts.table, seq, facts.lens[seq], b, p, facts.page_size)
        if tuple(c[0] for c in facts.copies[i : i + p]) != tuple(pages)[: len(places) - i]:
            return None
    return (
        f"every KV block was copied as {p} page(s), into places 0..{p - 1} of its slot: the "
        f"copies are the plan's KV blocks made of {p} pages each, but this case has "
        f"num_kv_pages_per_block={facts.per_block}. A KV block's page count is not a number "
        "written in the kernel: it is `bufs.shape[1] // page_size` (the slot's tokens over "
        "a page's)."
    )


def past_num_seqs(seq: int, n: int) -> str:
    return (
        f"sequence slot {seq} is past num_seqs ({n}): the walk and next_work stop at "
        "num_seqs = num_seqs_ref[0], not the tables' length."
    )


def no_row(seq: int, blk: int) -> str:
    return (
        f"sequence {seq} has no row in q block {blk}: a grid step walks only the sequences "
        "with rows in its q block, from `next_seq_with_rows(0, first_row, ...)` while "
        "cu_q_lens[seq] < end_row, and next_work chooses among those."
    )


# In the order they are tried: the first whose fact holds names the cause.
FACT_RULES = (
    _fact_idle,
    _fact_past_num_seqs,
    _fact_twice,
    _fact_count,
    _fact_diagonal,
    _fact_order,
    _fact_spanning,
    _fact_not_started,
    _fact_skipped_rows,
    _fact_last_work,
    _fact_no_row,
)
