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
and matched against the usual mistakes (`minilib.exercises.decode_mistakes`). Whatever the
output, each copy must read a page its sequence has, and in rung 5 the first page of a
sequence must be started by the grid step before its own.

Notebook 08's `check_next_work`, for rung 5's plan in plain Python, is in
`minilib.exercises.ex08_next_work`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.batch import make_batch
from minilib.exercises.checking import Case, CheckResult
from minilib.exercises.decode_mistakes import decode_mistakes
from minilib.exercises.kernel_checking import check_kernel
from minilib.exercises.kernel_failures import Names
from minilib.kv_cache import pages_needed
from minilib.ladder.scalar_prefetch import paged_decode_reference
from minilib.tpu.numerics import BF16_PASS_TOLERANCE, one_bf16_pass

__all__ = [
    "check_double_buffered_decode",
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
    tol = BF16_PASS_TOLERANCE if one_bf16_pass() else 1e-3  # a TPU's matmuls: one bf16 pass
    bad = ~np.isclose(have, want, atol=tol, rtol=tol, equal_nan=True)
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


# --- the rung's own checks of its copies -------------------------------------------------------


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


# --- the checkers ------------------------------------------------------------------------------


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
        mistakes=decode_mistakes(),
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
