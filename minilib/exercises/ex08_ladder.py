"""Notebook 08's kernel exercises: rungs 2 to 5 of the ladder, paged decode attention.

Every kernel checker runs the learner's `fn(q, kv_pages, kv_lens, page_indices, *, sm_scale,
interpret)` on two decode batches from `make_batch`, in strict TPU interpret mode, watched (see
`minilib.exercises.kernel_checking`), against plain jnp, then compiles it for v5e when libtpu
is installed. The batches hold the sequences where paging goes wrong:

  a sequence whose kv_len is a whole number of pages, not the last one   (the next page?)
  a sequence that uses every column of its page-table row                (no spare entry)
  a sequence of one token, and an empty slot (kv_len 0) between others   (no page at all)

In the first batch, every entry of `page_indices` past a sequence's last page holds garbage
past the end of `kv_pages`, so a copy or an index map that reads through one is an
out-of-bounds read; in the second they point at unused pages full of NaN (JAX's test
convention), so computing with one shows. A wrong output is placed (which sequences differ)
and matched against the usual mistakes.

`check_next_work` checks a plain Python function, event by event against the full kernel's
plan (`minilib.schedule.plan_schedule`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.batch import make_batch
from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, expected_vs_got
from minilib.exercises.kernel_checking import check_kernel
from minilib.exercises.kernel_failures import Names
from minilib.kv_cache import pages_needed
from minilib.ladder.prefetch import decode_schedule, planned_decode_schedule
from minilib.ladder.scalar_prefetch import paged_decode_reference

__all__ = [
    "check_double_buffered_decode",
    "check_next_work",
    "check_paged_decode_async_copy",
    "check_paged_decode_attention",
    "check_prefetching_decode",
]

GARBAGE_PAGE = 1000  # past-the-end garbage: total_num_pages + GARBAGE_PAGE + column


def _decode_cases(seed: int) -> list[Case]:
    """Two batches of the same shapes (so that one compile serves both), whose shapes change
    with the seed: 4 q heads on 2 KV heads and pages of 8 tokens for seed 0, one KV head (MQA)
    and pages of 16 for odd seeds, 8 q heads on 2 KV heads for the other even ones."""
    rng = np.random.default_rng(850 + seed)
    # page_size, pages_per_seq, num_q_heads, num_kv_heads, head_dim
    if seed == 0:
        shape = (8, 4, 4, 2, 128)
    elif seed % 2:
        shape = (16, 3, 4, 1, 64)
    else:
        shape = (8, 4, 8, 2, 128)
    page_size, pages_per_seq, num_q_heads, num_kv_heads, head_dim = shape
    full = page_size * pages_per_seq
    # 2 whole pages (not the last sequence), a partial page, an empty slot, every page slot,
    # one token, a partial page, an empty slot last
    edges = [2 * page_size, 5, 0, full, 1, page_size + 5, 0]
    random_lens = [int(n) for n in rng.integers(1, full + 1, size=len(edges) - 2)]
    random_lens.insert(int(rng.integers(0, len(random_lens))), page_size * int(rng.integers(1, 3)))
    random_lens.insert(0, 0)  # an empty slot first
    cases = []
    for i, (kv_lens, garbage) in enumerate(
        [(edges, "past the end of kv_pages"), (random_lens, "unused pages of NaN")]
    ):
        batch = make_batch(
            [(1, n) if n else (0, 0) for n in kv_lens],  # kv_len 0: an empty slot
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            pages_per_seq=pages_per_seq,
            total_num_pages=len(kv_lens) * pages_per_seq + 3,
            seed=seed * 10 + i,
        )
        q = _one_row_per_slot(batch, kv_lens)
        page_indices = np.asarray(batch.page_indices).copy()
        if garbage.startswith("past"):
            total = batch.kv_pages.shape[0]
            for seq, n in enumerate(kv_lens):
                used = pages_needed(n, page_size)
                page_indices[seq, used:] = total + GARBAGE_PAGE + np.arange(used, pages_per_seq)
        what = (
            f"kv_lens={kv_lens}, page_size={page_size}, pages_per_seq={pages_per_seq}, "
            f"num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}; "
            f"the page-table entries past each sequence's pages hold garbage ({garbage})"
        )
        args = (q, batch.kv_pages, batch.kv_lens, jnp.asarray(page_indices))
        cases.append(Case(what, args, dict(sm_scale=float(head_dim) ** -0.5)))
    return cases


def _one_row_per_slot(batch, kv_lens) -> jax.Array:
    """q with one row per sequence slot: an empty slot (no q row in the ragged batch) gets a
    random row too, which a kernel must not let leak into anything."""
    rows, live = [], np.asarray(batch.q, np.float32)
    rng = np.random.default_rng(len(kv_lens))
    k = 0
    for n in kv_lens:
        if n:
            rows.append(live[k])
            k += 1
        else:
            rows.append(rng.standard_normal(live.shape[1:]).astype(np.float32))
    return jnp.asarray(np.stack(rows), batch.q.dtype)


def _compile_case() -> Case:
    num_seqs, pages_per_seq, page_size, total_num_pages = 8, 8, 16, 64
    num_q_heads, num_kv_heads, head_dim = 8, 2, 128
    i32, bf16 = jnp.int32, jnp.bfloat16
    return Case(
        f"bf16, {num_seqs} sequences, page_size={page_size}, num_q_heads={num_q_heads}, "
        f"num_kv_heads={num_kv_heads}, head_dim={head_dim}",
        (
            jax.ShapeDtypeStruct((num_seqs, num_q_heads, head_dim), bf16),
            jax.ShapeDtypeStruct((total_num_pages, page_size, 2 * num_kv_heads, head_dim), bf16),
            jax.ShapeDtypeStruct((num_seqs,), i32),
            jax.ShapeDtypeStruct((num_seqs, pages_per_seq), i32),
        ),
        dict(sm_scale=head_dim**-0.5),
    )


# --- naming what went wrong --------------------------------------------------------------------


def _sequence_kind(seq: int, kv_len: int, page_size: int, pages_per_seq: int, last: bool):
    pages = pages_needed(kv_len, page_size)
    if kv_len == 0:
        return "kv_len=0, an empty slot: no page at all"
    if kv_len == 1:
        return "kv_len=1, one token"
    notes = []
    if kv_len % page_size == 0:
        notes.append(f"{pages} whole pages" + ("" if last else ", not the last sequence"))
    if pages == pages_per_seq:
        notes.append(f"uses all {pages_per_seq} page slots")
    return f"kv_len={kv_len}" + (f" ({'; '.join(notes)})" if notes else "")


def _describe_sequences(case: Case) -> list[str]:
    _, kv_pages, kv_lens, page_indices = case.args
    page_size, pages_per_seq = kv_pages.shape[1], page_indices.shape[1]
    lens = [int(n) for n in np.asarray(kv_lens)]
    return [
        _sequence_kind(s, n, page_size, pages_per_seq, s == len(lens) - 1)
        for s, n in enumerate(lens)
    ]


def _locate(expected, got, case: Case) -> str:
    """Which sequences differ, each with what is special about it."""
    want = np.asarray(expected, np.float64)
    try:
        have = np.asarray(got, np.float64).reshape(want.shape)
    except Exception:
        return ""
    bad = ~np.isclose(have, want, atol=1e-3, rtol=1e-3, equal_nan=True)
    wrong = [s for s in range(want.shape[0]) if bad[s].any()]
    if not wrong:
        return ""
    kinds = _describe_sequences(case)
    listed = "; ".join(f"{s} ({kinds[s]})" for s in wrong)
    right = len(kinds) - len(wrong)
    return f"sequences that differ: {listed}. The other {right} are right."


def _page_namer(case: Case) -> Callable[[int], str]:
    _, kv_pages, kv_lens, page_indices = case.args
    page_size, total = kv_pages.shape[1], kv_pages.shape[0]
    table, lens = np.asarray(page_indices), [int(n) for n in np.asarray(kv_lens)]

    def name(page: int) -> str:
        for seq, n in enumerate(lens):
            used = pages_needed(n, page_size)
            for i, p in enumerate(table[seq].tolist()):
                if p == page and i < used:
                    return f"page {i} of sequence {seq} (kv_pages[{page}])"
        for seq, n in enumerate(lens):
            for i, p in enumerate(table[seq].tolist()):
                if p == page:
                    return (
                        f"kv_pages[{page}], through page_indices[{seq}, {i}], which is past "
                        f"sequence {seq}'s pages ({_sequence_kind(seq, n, page_size, 0, False)}) "
                        "and holds garbage"
                    )
        if not 0 <= page < total:
            return f"kv_pages[{page}], which does not exist ({total} pages)"
        return f"kv_pages[{page}], a page no sequence owns"

    return name


def _names(buffer: str, semaphores: tuple[str, ...]) -> Callable[[Case], Names]:
    def names(case: Case) -> Names:
        return Names(buffer=buffer, semaphores=semaphores, page=_page_namer(case))

    return names


PAST_THE_LAST_PAGE = (
    "entries of page_indices past a sequence's last page hold garbage, and so does the whole "
    "row of an empty slot (kv_len 0)"
)


def _advice(rung: int) -> Callable[[str], str | None]:
    """The likely cause, in this rung's terms, of each kind of problem."""

    def advice(kind: str) -> str | None:
        if kind == "block":
            return (
                f"the index map read through an entry it must not: {PAST_THE_LAST_PAGE}. Clamp "
                "i to the sequence's last page, `jnp.minimum(i, cdiv(kv_len, page_size) - 1)`, "
                "and give a sequence with no page at all page 0 (`jnp.where`)."
            )
        if kind == "copy":
            start = {
                3: "copy page i only when the sequence has it (`i * page_size < kv_len`)",
                4: "start page 0 only when the sequence has a page, and page i + 1 only when "
                "i + 1 < cdiv(kv_len, page_size)",
                5: "next_work's next page must exist (`(page + 1) * page_size < kv_len`, not "
                "`<=`), and its next sequence must have pages (skip kv_len 0)",
            }.get(rung, "copy only the pages a sequence has")
            return f"a copy of a page the sequence does not have: {PAST_THE_LAST_PAGE}. {start}."
        if kind == "smem":
            return (
                "kv_lens or page_indices read past its end: a sequence index past the last "
                "sequence. A loop looking for the next sequence with pages must stop at "
                "num_seqs, and clamp the index it reads (`&` evaluates both sides)."
            )
        if kind == "deadlock" and rung == 5:
            return (
                "a wait for a copy no grid step started: the first copy (grid step 0, into slot "
                "0, of the first sequence that has pages); the first page of a sequence, which "
                "the step before must start; or the slot: a grid step starts from the slot that "
                "copy went to (`slot_ref[0]`), not from 0."
            )
        if kind == "deadlock" and rung == 4:
            return (
                "a wait for a copy that was never started (page 0, before the loop; page i + 1, "
                "in iteration i), or a wait on the other slot's semaphore: page i waits on "
                "`sems.at[i % 2]`, the one its copy signals."
            )
        if kind in ("never_waited", "overwrite") and rung == 5:
            return (
                "a copy started that no step waits for, or into a slot that holds a page still "
                "to be computed: the next work goes into the other slot (`1 - slot`); a grid "
                "step starts from the slot the step before left in `slot_ref[0]`, not from 0; "
                "only grid step 0 starts a copy of its own (not every step); a next page must "
                "exist (`<`, not `<=`); the very last work has no next."
            )
        if kind == "overwrite" and rung == 4:
            return (
                "the next page must go into the *other* slot (`1 - slot`), the one the page "
                "before has finished with; and page i must be waited for on its own slot's "
                "semaphore (`sems.at[i % 2]`) before its slot is reused: a wait on the other "
                "semaphore takes the other copy's signal instead."
            )
        return None

    return advice


# --- the usual mistakes, as plain jnp/NumPy functions --------------------------------------------


@np.errstate(invalid="ignore", divide="ignore", over="ignore")  # NaN pages: NaN, silently
def _paged_softmax(q, kv_pages, kv_lens, page_indices, *, sm_scale, page_of=None,
                   first_pos=None, reset_each_page=False, reset_each_grid_step=False,
                   stop_after_first=False):  # fmt: skip
    """Decode attention page by page, as the kernels do it, in NumPy: the online softmax over
    the pages of each sequence. The keywords make the kernel's usual mistakes."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv_pages, np.float64)
    table, lens = np.asarray(page_indices), np.asarray(kv_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv.shape[1], kv.shape[2] // 2
    group = num_q_heads // num_kv_heads
    page_of = page_of or (lambda seq, i: table[seq, i])
    first_pos = first_pos or (lambda i: i * page_size)
    out = np.zeros_like(q)
    for seq in range(num_seqs):
        kv_len = int(lens[seq])
        m = np.full(num_q_heads, -np.inf)
        l, acc = np.zeros(num_q_heads), np.zeros((num_q_heads, head_dim))
        num_pages = pages_needed(kv_len, page_size)
        if reset_each_grid_step and num_pages < table.shape[1]:
            continue  # the last grid step, past the last page, reset it all: output 0
        for i in range(num_pages):
            if reset_each_page or reset_each_grid_step:
                m, l, acc = np.full(num_q_heads, -np.inf), l * 0, acc * 0
            page = kv[int(page_of(seq, i)) % kv.shape[0]]
            pos = first_pos(i) + np.arange(page_size)
            keys = np.repeat(page[:, 0::2], group, axis=1)  # [tokens, num_q_heads, head_dim]
            vals = np.where((pos < kv_len)[:, None, None], np.repeat(page[:, 1::2], group, 1), 0)
            s = np.einsum("hd,thd->ht", q[seq], keys) * sm_scale
            s = np.where(pos[None, :] < kv_len, s, -np.inf)
            m_next = np.maximum(m, s.max(axis=1))
            p = np.exp(s - m_next[:, None])
            alpha = np.exp(m - m_next)
            l = alpha * l + p.sum(axis=1)
            acc = alpha[:, None] * acc + np.einsum("ht,thd->hd", p, vals)
            m = m_next
            if stop_after_first:
                break
        out[seq] = acc / np.where(l == 0, 1, l)[:, None]  # l = 0: no key, acc = 0: output 0
    return out


def _decode_mistakes() -> dict[str, Callable]:
    def k_v_halves(q, kv_pages, kv_lens, page_indices, *, sm_scale):
        # K as the first half of the combined heads, V as the second: not interleaved.
        num_kv_heads = kv_pages.shape[2] // 2
        halves = jnp.concatenate([kv_pages[:, :, :num_kv_heads], kv_pages[:, :, num_kv_heads:]])
        interleaved = jnp.stack([halves[: len(kv_pages)], halves[len(kv_pages) :]], axis=3)
        kv = interleaved.reshape(kv_pages.shape)
        return paged_decode_reference(q, kv, kv_lens, page_indices, sm_scale=sm_scale)

    def pages_by_position(*args, sm_scale):
        return _paged_softmax(*args, sm_scale=sm_scale, page_of=lambda seq, i: i)

    def first_page_of_the_table(*args, sm_scale):
        table = np.asarray(args[3])
        return _paged_softmax(*args, sm_scale=sm_scale, page_of=lambda seq, i: table[0, i])

    def always_page_zero(*args, sm_scale):
        table = np.asarray(args[3])
        return _paged_softmax(*args, sm_scale=sm_scale, page_of=lambda seq, i: table[seq, 0])

    def positions_from_zero(*args, sm_scale):
        return _paged_softmax(*args, sm_scale=sm_scale, first_pos=lambda i: 0)

    def reset_each_page(*args, sm_scale):
        return _paged_softmax(*args, sm_scale=sm_scale, reset_each_page=True)

    def reset_each_grid_step(*args, sm_scale):  # rungs 2 and 3: one grid step per page slot
        return _paged_softmax(*args, sm_scale=sm_scale, reset_each_grid_step=True)

    def first_page_only(*args, sm_scale):
        return _paged_softmax(*args, sm_scale=sm_scale, stop_after_first=True)

    def no_sm_scale(*args, sm_scale):
        return _paged_softmax(*args, sm_scale=1.0)

    return {
        "K and V are interleaved on the combined head axis: K of KV head h is slot 2h, V is "
        "slot 2h + 1 (not the first and second halves).": k_v_halves,
        "the page table is not used: page i of sequence seq is kv_pages[page_indices[seq, i]], "
        "not kv_pages[i].": pages_by_position,
        "every sequence reads sequence 0's row of the page table: the row is "
        "page_indices[seq].": first_page_of_the_table,
        "every step reads the sequence's first page: page i is page_indices[seq, i], not "
        "page_indices[seq, 0].": always_page_zero,
        "the keys of page i sit at positions i * page_size ... (i + 1) * page_size - 1 "
        "(`first_pos`), not 0 ... page_size - 1.": positions_from_zero,
        "the softmax state is initialised on every page: only on the first (`i == 0`, or "
        "before the page loop); m, l and acc carry the earlier pages.": reset_each_page,
        "the softmax state is initialised on every grid step: only on the first page "
        "(`pl.when(i == 0)`); m, l and acc carry the earlier pages.": reset_each_grid_step,
        "only the first page counts: the output was written, or the loop stopped, after page "
        "0; write `acc / l` after the last page.": first_page_only,
        "sm_scale is not applied to the scores.": no_sm_scale,
    }


def _ledger_check(rung: int) -> Callable:
    """The rung's own checks of its copies, which hold whatever the output."""

    def check(run, case: Case) -> str | None:
        problem = _copy_through_garbage(run, case, rung)
        if problem is None and rung == 5:
            problem = _started_by_the_step_before(run, case)
        return problem

    return check


def _copy_through_garbage(run, case: Case, rung: int) -> str | None:
    """A copy through a page-table entry past a sequence's pages reads garbage, even when the
    garbage happens to be a page number that exists."""
    _, kv_pages, kv_lens, page_indices = case.args
    page_size = kv_pages.shape[1]
    table, lens = np.asarray(page_indices), [int(n) for n in np.asarray(kv_lens)]
    owned = {
        int(table[s, i]) for s, n in enumerate(lens) for i in range(pages_needed(n, page_size))
    }
    in_the_table = {int(p) for p in table.ravel()}
    for copy in run.watch.copies:
        if copy.page is None or copy.page in owned:
            continue
        if copy.page in in_the_table:
            cause = _advice(rung)("copy")
        else:
            cause = (
                "the page table is not used: page i of sequence seq is "
                "kv_pages[page_indices[seq, i]], not kv_pages[i]."
            )
        name = _page_namer(case)(copy.page)
        return f"a copy of a page no sequence has: {name}. Likely cause: {cause}"
    return None


def _started_by_the_step_before(run, case: Case) -> str | None:
    """Rung 5: the first page of every sequence but the first one with pages must be started by
    an earlier grid step (grid step s computes sequence s)."""
    _, kv_pages, kv_lens, page_indices = case.args
    lens, table = [int(n) for n in np.asarray(kv_lens)], np.asarray(page_indices)
    with_pages = [s for s, n in enumerate(lens) if n > 0]
    for seq in with_pages[1:]:
        first_page = int(table[seq, 0])
        mine = [c for c in run.watch.copies if c.page == first_page and c.step >= 0]
        if mine and min(c.step for c in mine) >= seq:
            return (
                f"page 0 of sequence {seq} was copied in its own grid step ({seq}): nothing "
                "overlaps that copy. Prefetching across grid steps means the step before "
                "starts it, when it computes its last page (next_work); a grid step starts no "
                "copy of its own, but grid step 0 the very first."
            )
    return None


def _check_decode_kernel(
    name: str, fn: Callable, seed: int, verbose: bool, details: bool, *, rung: int,
    buffer: str = "buf", semaphores: tuple[str, ...] = ("sem",),
) -> CheckResult:  # fmt: skip
    prefetching = rung == 5
    return check_kernel(
        name,
        fn,
        paged_decode_reference,
        _decode_cases(seed),
        compile_case=_compile_case(),
        mistakes=_decode_mistakes(),
        atol=2e-5,
        verbose=verbose,
        details=details,
        names=_names(buffer, semaphores),
        locate=_locate,
        advice=_advice(rung),
        record_grid=prefetching,
        ledger_check=_ledger_check(rung),
    )


def check_paged_decode_attention(
    fn: Callable, *, seed: int = 0, verbose: bool = True, details: bool = False
) -> CheckResult:
    """Rung 2: `fn(q, kv_pages, kv_lens, page_indices, *, sm_scale, interpret)`, paged decode
    attention whose index map reads `page_indices` (scalar prefetch).

    q: [num_seqs, num_q_heads, head_dim]; kv_pages: [total_num_pages, page_size,
    2*num_kv_heads, head_dim]; kv_lens: i32[num_seqs]; page_indices: i32[num_seqs,
    pages_per_seq]. Returns [num_seqs, num_q_heads, head_dim]; 0 for an empty slot (kv_len 0).
    `details=True` adds JAX's own output (race detector, interpreter) to a failure.

    >>> from minilib.ladder.scalar_prefetch import paged_decode_attention
    >>> check_paged_decode_attention(paged_decode_attention).status
    Passed: paged_decode_attention matches the reference on all 2 cases...
    'passed'
    """
    return _check_decode_kernel("paged_decode_attention", fn, seed, verbose, details, rung=2)


def check_paged_decode_async_copy(
    fn: Callable, *, seed: int = 0, verbose: bool = True, details: bool = False
) -> CheckResult:
    """Rung 3: like `check_paged_decode_attention`, for the kernel that copies each page itself
    (`kv_pages` in `pl.ANY`, one buffer, `make_async_copy(...).start()` then `.wait()`).

    >>> from minilib.ladder.async_copy import paged_decode_attention_async_copy as fn
    >>> check_paged_decode_async_copy(fn).status
    Passed: paged_decode_async_copy matches the reference on all 2 cases...
    'passed'
    """
    return _check_decode_kernel("paged_decode_async_copy", fn, seed, verbose, details, rung=3)


def check_double_buffered_decode(
    fn: Callable, *, seed: int = 0, verbose: bool = True, details: bool = False
) -> CheckResult:
    """Rung 4: like `check_paged_decode_attention`, for the kernel that double-buffers the pages
    of one sequence (two slots, two semaphores). No race, every copy waited for, one
    semaphore per slot, no copy into a slot still being filled.

    >>> from minilib.ladder.double_buffer import paged_decode_attention_double_buffered as fn
    >>> check_double_buffered_decode(fn).status
    Passed: double_buffered_decode matches the reference on all 2 cases...
    'passed'
    """
    return _check_decode_kernel(
        "double_buffered_decode", fn, seed, verbose, details, rung=4, buffer="bufs",
        semaphores=("sems[0]", "sems[1]"),
    )  # fmt: skip


def check_prefetching_decode(
    fn: Callable, *, seed: int = 0, verbose: bool = True, details: bool = False
) -> CheckResult:
    """Rung 5: like `check_double_buffered_decode`, for the kernel whose grid steps prefetch
    the next sequence's first page (`next_work` in the kernel, the slot kept in SMEM).

    >>> from minilib.ladder.prefetch import paged_decode_attention_prefetch as fn
    >>> check_prefetching_decode(fn).status
    Passed: prefetching_decode matches the reference on all 2 cases...
    'passed'
    """
    return _check_decode_kernel(
        "prefetching_decode", fn, seed, verbose, details, rung=5, buffer="bufs",
        semaphores=("sems[0]", "sems[1]"),
    )  # fmt: skip


# --- next_work, in plain Python ---------------------------------------------------------------


def _schedule_of(next_work_fn: Callable) -> Callable:
    def run(kv_lens, page_size, num_seqs):
        return decode_schedule(_plain_work(next_work_fn), kv_lens, page_size, num_seqs)

    return run


def _plain_work(next_work_fn: Callable) -> Callable:
    """`next_work_fn` with its answer as Python ints: NumPy and JAX integers, 0-d arrays and
    a 2-element array are as good as a tuple of ints; anything else is kept as it is, for the
    events to show."""

    def plain(*args):
        nxt = next_work_fn(*args)
        if nxt is None or isinstance(nxt, str | bytes) or np.ndim(nxt) != 1:
            return nxt
        try:
            return tuple(_int_or_same(x) for x in nxt)
        except TypeError:
            return nxt

    return plain


def _int_or_same(x):
    if isinstance(x, bool | np.bool_) or np.ndim(x) != 0:
        return x
    try:
        return operator.index(np.asarray(x).item() if np.ndim(x) == 0 else x)
    except TypeError:
        return x


def _compare_events(expected, got, case: Case) -> None:
    if got == expected:
        return
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            raise Mismatch(
                f"event {i} (as (kind, seq, page, slot)) differs:\n"
                + expected_vs_got("  event", want, have)
            )
    shorter = "fewer" if len(got) < len(expected) else "more"
    raise Mismatch(
        f"{len(got)} events, {shorter} than the plan's {len(expected)}; the first "
        f"{min(len(got), len(expected))} agree. "
        + (
            f"Next planned: {expected[len(got)]}"
            if len(got) < len(expected)
            else f"Extra: {got[len(expected)]}"
        )  # fmt: skip
    )


def check_next_work(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(seq, page, kv_lens, num_seqs, page_size) -> (seq, page) or None`: the work after
    page `page` of sequence `seq` in a decode batch (a sequence with kv_len 0 has no page, so
    no work), None after the very last.

    The schedule it gives (`minilib.ladder.prefetch.decode_schedule`: start the first copy, then
    for each work start the next one into the other slot, wait, compute) must be, event by
    event, the full kernel's plan (`plan_schedule`, one page per KV block). kv_lens come as a
    list, a NumPy array or a JAX array.

    >>> from minilib.ladder.prefetch import next_work
    >>> check_next_work(next_work)
    Passed: next_work matches the reference on all 8 cases.
    CheckResult('next_work', status='passed')
    """
    rng = np.random.default_rng(880 + seed)
    # (kv_lens, page_size, num_seqs): the slots past num_seqs are padding, with garbage
    specs = [
        ([20, 5], 8, 2),
        ([8, 8, 8], 8, 3),  # whole pages, every sequence
        ([1], 16, 1),
        ([3, 17, 1, 9], 4, 4),
        ([16, 0, 0, 7, 0], 8, 5),  # empty slots after a whole-page sequence, and at the end
        ([0, 4, 0], 4, 3),  # an empty slot first
        ([9, 3, 77, 5], 8, 2),  # two padding slots past num_seqs
    ]
    random_lens = [int(n) for n in rng.integers(0, 30, size=4)]
    specs.append((random_lens, int(rng.choice([4, 8])), 4))
    as_given = [list, np.asarray, jnp.asarray]
    cases = [
        Case(
            f"kv_lens={kv_lens} (as {('a list', 'a NumPy array', 'a JAX array')[i % 3]}), "
            f"num_seqs={num_seqs}, page_size={page_size}",
            (as_given[i % 3](kv_lens), page_size, num_seqs),
        )
        for i, (kv_lens, page_size, num_seqs) in enumerate(specs)
    ]

    def no_next_sequence(seq, page, kv_lens, num_seqs, page_size):
        return (seq, page + 1) if (page + 1) * page_size < kv_lens[seq] else None

    def page_count_off_by_one(seq, page, kv_lens, num_seqs, page_size):
        if page + 1 <= kv_lens[seq] // page_size:
            return seq, page + 1
        return (seq + 1, 0) if seq + 1 < num_seqs else None

    def into_empty_slots(seq, page, kv_lens, num_seqs, page_size):
        if (page + 1) * page_size < kv_lens[seq]:
            return seq, page + 1
        return (seq + 1, 0) if seq + 1 < num_seqs else None

    def past_num_seqs(seq, page, kv_lens, num_seqs, page_size):
        if (page + 1) * page_size < kv_lens[seq]:
            return seq, page + 1
        return (seq + 1, 0) if seq + 1 < len(kv_lens) else None

    mistakes = {
        "after a sequence's last page comes page 0 of the next sequence: prefetching across "
        "grid steps means the last page of one sequence starts the copy of the next one's "
        "first page.": _schedule_of(no_next_sequence),
        "the number of pages is ceil(kv_len / page_size): a sequence of kv_len=16 and "
        "page_size=8 has pages 0 and 1, kv_len=17 has pages 0, 1 and 2.": _schedule_of(
            page_count_off_by_one
        ),
        "a sequence with kv_len 0 (an empty slot) has no page 0: skip it, to the next "
        "sequence that has pages (its page-table row is garbage).": _schedule_of(into_empty_slots),
        "only the first num_seqs sequences are live: the slots past them are padding, with "
        "garbage in them (use num_seqs, not len(kv_lens)).": _schedule_of(past_num_seqs),
    }
    return run_check(
        "next_work",
        _schedule_of(fn),
        planned_decode_schedule,
        cases,
        diagnose(_compare_events, mistakes),
        verbose=verbose,
    )
