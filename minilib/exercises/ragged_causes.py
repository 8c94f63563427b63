"""Rungs 6 and 7: the learner's copies against the planned ones, and the likely causes.

`schedule_problem(rung)` compares the ledger of a run (`minilib.ladder.watch`) with the plan
(`minilib.ladder.prefill_chunk.prefill_copy_plan`, `minilib.ladder.ragged.ragged_copy_plan`):
page by page, the page copied, its slot and its place in the slot. The first difference is
named for what the extra, missing or different copy is: a KV block past the diagonal, the
block of an idle sequence (q_len 0), of a sequence with no row in the q block, of the next
sequence where the q block ended mid-sequence, a page not clamped, a slot not carried. Then
the overlap: each KV block's copy must start before the wait for the block before it, and in
rung 7 each q block's first KV block in the grid step before. `advice(rung)` words the
general DMA problems (`minilib.exercises.kernel_failures`) for these rungs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minilib.exercises.checking import Case
from minilib.exercises.kernel_failures import (
    NOTHING_IN_FLIGHT,
    OWN_STEP,
    smem_read_outside,
    start_before_wait,
)
from minilib.exercises.ragged_facts import (
    DIAGONAL,
    FACT_RULES,
    IDLE,
    LAST_WORK,
    NEXT_WORK,
    SPANNING,
    TOO_FEW,
    RaggedFacts,
    later_in_plan,
    no_row,
    pages_per_block,
    past_num_seqs,
    planned_copies,
)
from minilib.kv_cache import pages_needed
from minilib.ladder.prefill_chunk import prefill_copy_plan
from minilib.ladder.ragged import ragged_copy_plan

__all__ = ["advice", "schedule_problem"]


def schedule_problem(rung: int, partial: bool = False) -> Callable:
    """The rung's ledger check: `check(run, case)` returns a paragraph, or None. `partial`:
    the run stopped with an error, so only a copy that differs from the plan counts (not
    the copies missing after it stopped).

    >>> from minilib.exercises.kernel_run import KernelRun
    >>> print(schedule_problem(7)(KernelRun(out=None), Case("", ())))   # no ledger: nothing
    None
    """

    def check(run, case: Case) -> str | None:
        if run.watch is None:
            return None
        copies = [(c.page, c.slot, _place(c, case), c) for c in run.watch.copies]
        if rung == 6:
            return None if partial else _prefill_problem(run, copies, case)
        return _ragged_problem(run, copies, case, partial)

    return check


def _place(copy, case: Case) -> int | None:
    page_size = case.args[1].shape[1]
    where = copy.destination[1] if len(copy.destination) > 1 else None
    return where[0] // page_size if isinstance(where, tuple) else where


def _pages_cause(page, seq: int, case: Case, table, kv_len: int) -> str:
    page_size = case.args[1].shape[1]
    owned = [int(p) for p in table[seq, : pages_needed(kv_len, page_size)]]
    if page not in owned:
        return (
            f"a page past sequence {seq}'s last page (page {page}): the page-table entries "
            "past it are garbage. Clamp the page index to the last page, "
            "`jnp.minimum(b * pages_per_block + p, cdiv(kv_len, page_size) - 1)`."
        )
    return (
        f"the wrong page of sequence {seq}: place p of KV block b holds page "
        "`b * pages_per_block + p` of the sequence (clamped to its last page)."
    )


def _difference(want: list, have: list, case: Case, table, seq: int, kv_len: int,
                carried: bool) -> str | None:  # fmt: skip
    """The first difference between planned (page, slot, place) and copied, as a cause;
    `carried`: the slot carries over between grid steps (rung 7)."""
    for w, h in zip(want, have, strict=False):
        if w[0] != h[0]:
            return _pages_cause(h[0], seq, case, table, kv_len)
        if w[1] != h[1]:
            return (
                f"a KV block copied into slot {h[1]}, where slot {w[1]} was due: blocks take "
                "turns, the next into `1 - slot`"
                + (", and the slot carries over from one grid step to the next "
                   "(`slot_ref[0]`), so a grid step starts from it, not from 0." if carried
                   else ".")
            )  # fmt: skip
        if w[2] != h[2]:
            return (
                f"page {w[2]} of a KV block copied into place {h[2]} of its slot: page p goes "
                "to tokens p * page_size ... of the slot, `bufs.at[slot, pl.ds(p * page_size, "
                "page_size)]`."
            )
    return None


def _no_overlap(firsts: list) -> str | None:
    """The first KV block (but a grid step's first) whose copy started with no copy in
    flight. The ledger sees the copies and the waits, not the computes: it says that block
    b's copy was not on its way while the kernel waited for block b - 1, not whether a
    compute overlapped it."""
    for copy, what in firsts:
        if copy.in_flight == 0:
            return (
                f"{what} was copied only after every earlier copy had been waited for "
                f"({NOTHING_IN_FLIGHT}): the copy of block b + 1 was not on its way while the "
                "kernel waited for block b, so the two slots do not double-buffer the way the "
                "rung asks. " + start_before_wait("KV block b + 1", "block b")
            )
    return None


def _prefill_problem(run, copies, case: Case) -> str | None:
    q, kv_pages, kv_lens, page_indices, q_lens = case.args
    block_q, per_block = case.kwargs["block_q"], case.kwargs["num_kv_pages_per_block"]
    page_size, table = kv_pages.shape[1], np.asarray(page_indices)
    lens, qs = [int(n) for n in np.asarray(kv_lens)], [int(n) for n in np.asarray(q_lens)]
    plan = prefill_copy_plan(lens, qs, table, block_q=block_q, max_q_len=q.shape[1],
                             num_kv_pages_per_block=per_block, page_size=page_size)  # fmt: skip
    by_point: dict = {}
    for page, slot, place, copy in copies:
        point = run.grid[copy.step][0] if 0 <= copy.step < len(run.grid) else None
        by_point.setdefault(point, []).append((page, slot, place, copy))
    firsts = []
    for (seq, i), blocks in plan.items():
        want = [(pages[p], slot, p) for slot, pages in blocks for p in range(per_block)]
        mine = by_point.get((seq, i), [])
        have = [x[:3] for x in mine]
        where = (
            f"grid step ({seq}, {i}) (rows {i * block_q}..{(i + 1) * block_q - 1} of "
            f"sequence {seq}: q_len {qs[seq]}, kv_len {lens[seq]})"
        )
        cause = _difference(want, have, case, table, seq, lens[seq], carried=False)
        if cause is None and len(have) > len(want):
            cause = (
                "a q block with no live row (first_row >= q_len) has no KV block to visit: "
                "start nothing."
                if i * block_q >= qs[seq]
                else DIAGONAL
            )
        elif cause is None and len(have) < len(want):
            cause = TOO_FEW
        if cause is not None:
            return (f"{where} copied {len(have) // per_block or len(have)} KV block(s) "
                    f"(pages {[x[0] for x in have]}); the plan has {len(want) // per_block} "
                    f"(pages {[x[0] for x in want]}). Likely cause: {cause}")  # fmt: skip
        firsts += [(mine[b * per_block][3], f"KV block {b} of {where}")
                   for b in range(1, len(blocks))]  # fmt: skip
    return _no_overlap(firsts)


def _ragged_problem(run, copies, case: Case, partial: bool) -> str | None:
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = case.args
    block_q = case.kwargs["num_queries_per_block"]
    per_block = case.kwargs["num_kv_pages_per_block"]
    page_size, table = kv_pages.shape[1], np.asarray(page_indices)
    lens, cu = [int(n) for n in np.asarray(kv_lens)], [int(n) for n in np.asarray(cu_q_lens)]
    n = int(np.asarray(num_seqs)[0])
    plan = ragged_copy_plan(lens, table, cu, n, block_q=block_q,
                            num_q_blocks=q.shape[0] // block_q,
                            num_kv_pages_per_block=per_block, page_size=page_size)  # fmt: skip
    facts = RaggedFacts(run, case, copies, plan, lens, cu, n, block_q, per_block, page_size, table)
    k = _first_difference(facts)
    planned = len(plan) * per_block
    if k == planned == len(copies) and not partial:
        return _ragged_timing(run, copies, plan, per_block)
    if partial and k >= len(copies):  # the copies agree until the run stopped: on a read?
        read = smem_read_outside(run)
        if read is None or read[1] != table.shape:
            return None
        return _stopped_reading(facts, read[0], k)
    return _what_differs(facts, k) + "Likely cause: " + _ragged_cause(facts, k, partial)


def _first_difference(facts: RaggedFacts) -> int:
    """The first copy whose page, slot or place differs from the plan's, or, at the start of a
    block, whose grid step does (the work before it starts it, in its own grid step)."""
    want, have = planned_copies(facts), [c[:3] for c in facts.copies]
    for k, (w, h) in enumerate(zip(want, have, strict=False)):
        if w != h:
            return k
        if k % facts.per_block == 0 and not _right_step(facts, k):
            return k
    return min(len(want), len(have))


def _planned_step(facts: RaggedFacts, k: int) -> int:
    """The grid step that should start copy k: that of the work before it (0 for the first)."""
    w = k // facts.per_block
    return facts.plan[w - 1][0] if w > 0 else 0


def _right_step(facts: RaggedFacts, k: int) -> bool:
    step = facts.step(k)
    return step is None or step == _planned_step(facts, k)


def _due(facts: RaggedFacts, k: int) -> tuple:
    """(the planned work of copy k, the work before it, whether it is a q block's first)."""
    work = [tuple(x[:3]) for x in facts.plan]
    w = k // facts.per_block
    due = work[w] if w < len(work) else None
    prev = work[w - 1] if 0 < w <= len(work) else None
    first_of_blk = due is not None and due[0] > 0 and (prev is None or prev[0] < due[0])
    return due, prev, first_of_blk


def _what_differs(facts: RaggedFacts, k: int) -> str:
    """What copy k is against the plan: which of block, slot, place and grid step differ."""
    due, _, _ = _due(facts, k)
    got = facts.block_of(k) if k < len(facts.copies) else None
    head = f"copy {k} (of {len(facts.plan) * facts.per_block} planned) differs: the plan has "
    head += _planned(due)
    if due is not None:
        head += f", started in grid step {_planned_step(facts, k)}"
    if k >= len(facts.copies):
        return head + ", the kernel copied nothing more. "
    step = facts.step(k)
    in_step = f" in grid step {step}" if step is not None else ""
    if due is not None and got == (due[1], due[2]):
        w, h = planned_copies(facts)[k], facts.copies[k][:3]
        parts = [f"into slot {h[1]} (the plan: slot {w[1]})"] if w[1] != h[1] else []
        parts += [f"into place {h[2]} of its slot (the plan: {w[2]})"] if w[2] != h[2] else []
        parts += [f"in grid step {step}"] if not _right_step(facts, k) else []
        return head + f", the kernel copied that block, but {' and '.join(parts)}. "
    if got is None:
        pages = [c[0] for c in facts.copies[k : k + facts.per_block]]
        return head + f", the kernel copied pages {pages}{in_step}. "
    later = later_in_plan(facts, k, got)
    also = f", which the plan has later (copy {later})" if later is not None else ""
    return head + f", the kernel copied KV block {got[1]} of sequence {got[0]}{in_step}{also}. "


def _ragged_cause(facts: RaggedFacts, k: int, partial: bool) -> str:
    """The likely cause of copy k's difference from the plan: the first rule whose fact holds
    (each checks what it states), else what next_work's next is."""
    due, prev, first_of_blk = _due(facts, k)
    got = facts.block_of(k) if k < len(facts.copies) else None
    step = facts.step(k) if k < len(facts.copies) else None
    fewer_pages = pages_per_block(facts)
    if fewer_pages is not None:
        return fewer_pages
    if due is not None and got == (due[1], due[2]):
        return _same_block(facts, k, due, prev, first_of_blk, step)
    if got is None and k >= len(facts.copies):
        return TOO_FEW
    if got is None and due is None:
        return LAST_WORK
    if got is None:
        return _unknown_pages(facts, k, due, prev, first_of_blk)
    for rule in FACT_RULES:
        cause = rule(facts, k, due, prev, first_of_blk, got, step, partial)
        if cause is not None:
            return cause
    return NEXT_WORK


def _unknown_pages(facts: RaggedFacts, k: int, due, prev, first_of_blk: bool) -> str:
    """Copy k's pages are no KV block's: named by the row of page_indices that holds them."""
    page = facts.copies[k][0]
    rows = [s for s in range(facts.table.shape[0]) if page in facts.table[s]]
    spanning = first_of_blk and prev is not None and due[1] == prev[1]
    if spanning and any(r > due[1] for r in rows):  # a later sequence's row holds it too
        return SPANNING
    if due[1] in rows:
        return _pages_cause(page, due[1], facts.case, facts.table, facts.lens[due[1]])
    return NEXT_WORK


def _same_block(facts: RaggedFacts, k: int, due, prev, first_of_blk: bool, step) -> str:
    """Copy k is the planned block, in another slot or place, or started in another step."""
    if first_of_blk and step is not None and step >= due[0]:
        return _own_step(due[1], due[0])
    if facts.copies[k][:3] != planned_copies(facts)[k]:
        # the slot carries over between grid steps: a cause only for a grid step's first copy
        carried = k >= facts.per_block and facts.step(k - facts.per_block) != step
        cause = _difference(
            planned_copies(facts)[k:],
            [c[:3] for c in facts.copies[k:]],
            facts.case,
            facts.table,
            due[1],
            facts.lens[due[1]],
            carried=carried,
        )
        return cause or NEXT_WORK
    before = facts.plan[k // facts.per_block - 1]
    if step is not None and prev is not None and facts.rows(prev[1], step) is None:
        return (
            f"the work before it, KV block {prev[2]} of sequence {prev[1]} (the plan: for q "
            f"block {prev[0]}), ran in grid step {step}, and " + no_row(prev[1], step)
        )
    return (
        f"it was started by another grid step than the work before it (KV block {before[2]} "
        f"of sequence {before[1]} for q block {before[0]}): {NEXT_WORK}"
    )


def _stopped_reading(facts: RaggedFacts, index: tuple, k: int) -> str:
    """The run stopped reading page_indices at `index`, outside it, for the copy after the `k`
    that agree with the plan: jax 0.12.1 and later stop on a negative index (before, it wraps
    around, and the copy of a garbage page is what `_ragged_problem` names).

    >>> plan = [(0, 0, 0, 0, (0,)), (1, 0, 0, 1, (0,))]   # (q block, seq, KV block, slot, pages)
    >>> facts = RaggedFacts(None, None, [], plan, lens=[8], cu=[0, 8], n=1, block_q=4,
    ...                     per_block=1, page_size=8, table=np.zeros((1, 1), int))
    >>> print(_stopped_reading(facts, (-1, 0), 1))
    copy 1 (of 2 planned): the plan has KV block 0 of sequence 0 for q block 1, the kernel \
read page_indices[-1, 0] for its next copy, outside the table. Likely cause: sequence index -1 \
is below 0: the walk and next_work start at sequence 0, and clamp every index they read.
    """
    due, prev, first_of_blk = _due(facts, k)
    seq, page = index
    what = (
        f"copy {k} (of {len(facts.plan) * facts.per_block} planned): the plan has "
        f"{_planned(due)}, the kernel read page_indices[{seq}, {page}] for its next copy, "
        "outside the table. Likely cause: "
    )
    if seq < 0:  # before any rule that indexes cu_q_lens with it
        return what + (
            f"sequence index {seq} is below 0: the walk and next_work start at sequence 0, "
            "and clamp every index they read."
        )
    if due is None:
        return what + LAST_WORK
    if first_of_blk and prev is not None and due[1] == prev[1] and seq != due[1]:
        return what + SPANNING
    if seq >= facts.n:
        return what + past_num_seqs(seq, facts.n)
    if facts.cu[seq + 1] == facts.cu[seq]:
        return what + IDLE
    if seq != due[1] and facts.rows(seq, due[0]) is None:
        return what + no_row(seq, due[0])
    if seq != due[1]:
        return what + NEXT_WORK
    return what + (
        f"page {page} is outside sequence {seq}'s row: clamp the page index to its last page, "
        "`jnp.minimum(b * pages_per_block + p, cdiv(kv_len, page_size) - 1)`."
    )


def _planned(due) -> str:
    return (
        f"KV block {due[2]} of sequence {due[1]} for q block {due[0]}" if due else "no more copies"
    )


def _ragged_timing(run, copies, plan, per_block) -> str | None:
    """Each q block's first KV block copied in the grid step before it; copies overlapping."""
    firsts, seen = [], set()
    for k, (blk, seq, b, *_) in enumerate(plan):
        copy = copies[k * per_block][3]
        if blk not in seen and blk > 0:
            step = run.grid[copy.step][0][0] if 0 <= copy.step < len(run.grid) else None
            if step is not None and step >= blk:
                return _own_step(seq, blk)
        seen.add(blk)
        if k > 0:
            firsts.append((copy, f"KV block {b} of sequence {seq} (q block {blk})"))
    return _no_overlap(firsts)


def _own_step(seq: int, blk: int) -> str:
    return (
        f"KV block 0 of sequence {seq}, the first of q block {blk}, was copied in its own "
        f"grid step ({blk}): {OWN_STEP}. Prefetching across grid steps means "
        f"the last work of q block {blk - 1} starts it (next_work's last case: the first "
        "sequence of the next q block); only grid step 0 starts a copy of its own."
    )


def advice(rung: int) -> Callable[[str], str | None]:
    """The likely cause, in rung 6's or 7's terms, of each kind of DMA problem.

    >>> "slot_ref[0]" in advice(7)("deadlock"), advice(6)("shared")
    (True, None)
    """

    def words(kind: str) -> str | None:
        if kind == "copy":
            return (
                "a copy through a page-table entry past the sequence's last page (garbage): "
                "clamp place p of block b to the last page, `jnp.minimum(b * pages_per_block "
                "+ p, cdiv(kv_len, page_size) - 1)`"
                + (", and never follow next_work past the last work, nor into a sequence slot "
                   "past num_seqs." if rung == 7 else
                   "; start nothing for a q block with no live row.")
            )  # fmt: skip
        if kind == "smem":
            return (
                "kv_lens, page_indices or cu_q_lens read past their end: a sequence index "
                "past num_seqs. Loops over sequences stop at num_seqs, and clamp the index "
                "they read (`&` evaluates both sides)."
            )
        if kind == "deadlock":
            return (
                "a wait for a KV block whose copy was never started, or into the other slot: "
                + ("the first block, in each grid step, when it has a live row; block b + 1 "
                   "in iteration b, into `1 - slot`." if rung == 6 else
                   "grid step 0 starts the very first copy; every later one is started by the "
                   "work before it (next_work), into `1 - slot`; a grid step starts from the "
                   "slot that copy went to, `slot_ref[0]`, not from 0.")
            )  # fmt: skip
        if kind in ("never_waited", "overwrite"):
            return (
                "a copy started that no wait takes back, or into the slot still being read: "
                "the next KV block goes into the other slot (`1 - slot`), only when there is "
                "one (`b + 1 < num_kv_blocks`, not `<=`)"
                + ("; a grid step starts from the slot the step before left in `slot_ref[0]`, "
                   "not from 0; only grid step 0 starts a copy of its own; the very last work "
                   "has no next." if rung == 7 else "; a q block with no live row starts "
                   "nothing.")
            )  # fmt: skip
        return None

    return words
