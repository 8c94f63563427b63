"""Notebook 08's kernel exercises: rungs 2 to 5 of the ladder, paged decode attention.

Every kernel checker runs the learner's `fn(q, kv_pages, kv_lens, page_indices, *, sm_scale,
interpret)` on six decode batches from `make_batch`, of two shapes in which every size differs
(one compile each), in strict TPU interpret mode, watched (see
`minilib.exercises.kernel_checking`), against plain jnp, then compiles it for v5e when libtpu
is installed. The batches hold the sequences where paging goes wrong:

  a sequence whose kv_len is a whole number of pages, not the last one   (the next page?)
  a sequence that uses every column of its page-table row                (no spare entry)
  a sequence of one token, and an empty slot (kv_len 0) between others   (no page at all)
  no live sequence at all; one live sequence; every slot live and full   (degenerate batches)

In some batches, every entry of `page_indices` past a sequence's last page holds garbage past
the end of `kv_pages`, so a copy or an index map that reads through one is an out-of-bounds
read; in the others they point at unused pages full of NaN (JAX's test convention), so
computing with one shows. A wrong output is placed (which sequences differ) and matched
against the usual mistakes (`minilib.exercises.decode_mistakes`), else read for what its wrong
rows say (never written? only some q heads? only the sequences of several pages?).
An out-of-bounds block is matched against the index maps' usual mistakes (`_block_cause`).
Whatever the output, each copy must read a page its sequence has, and in rung 5 the first
page of a sequence must be started by the grid step before its own.

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
from minilib.exercises.decode_mistakes import _locate, _page_namer, _pattern, decode_mistakes
from minilib.exercises.kernel_checking import TableRead, check_kernel, index_map_read_outside
from minilib.exercises.kernel_failures import (
    Names,
    copies_never_overlap,
    first_page_not_prefetched,
    smem_read_outside,
)
from minilib.kv_cache import pages_needed
from minilib.ladder.scalar_prefetch import paged_decode_reference

__all__ = [
    "check_double_buffered_decode",
    "check_paged_decode_async_copy",
    "check_paged_decode_attention",
    "check_prefetching_decode",
]

GARBAGE_PAGE = 1000  # past-the-end garbage: total_num_pages + GARBAGE_PAGE + column
# sm_scale by head_dim: never head_dim ** -0.5 (0.088 for 128, 0.125 for 64), so a kernel that
# scales by 1/sqrt(head_dim) instead of its sm_scale shows; one per shape, one compile each.
SM_SCALES = {128: 0.05, 64: 0.2}


# page_size, pages_per_seq, num_q_heads, num_kv_heads, head_dim, num_seqs: two shapes per
# seed, each dimension different in the second (and num_seqs != pages_per_seq in each), so that
# a kernel that confuses two of them, or hard-codes one, shows.
SHAPES = {  # by seed % 3
    0: [(8, 4, 4, 2, 128, 8), (16, 3, 8, 1, 64, 5)],
    1: [(16, 3, 4, 1, 64, 8), (8, 5, 6, 3, 128, 3)],
    2: [(8, 4, 8, 2, 128, 8), (16, 2, 4, 4, 64, 3)],
}


def _decode_cases(seed: int) -> list[Case]:
    """Batches of two shapes (`SHAPES`; the batches of a shape share one compile), chosen by
    the seed. Of the first shape: the edge cases, with garbage past the end of kv_pages;
    random lengths, with NaN pages; no live sequence; one live sequence. Of the second: every
    page slot used, an empty slot, a whole page, one token (garbage past the end); every
    sequence slot live, each using every page slot (NaN pages)."""
    rng = np.random.default_rng(850 + seed)
    first, second = SHAPES[seed % 3]
    batches = []
    for shape in (first, second):
        page_size, pages_per_seq, *_, num_seqs = shape
        full = page_size * pages_per_seq
        lens = [int(n) for n in rng.integers(1, full + 1, size=num_seqs)]
        if shape == first:
            # 2 whole pages (not the last sequence), a partial page, an empty slot, every
            # page slot, one token, a partial page, an empty slot last
            edges = [2 * page_size, 5, 0, full, 1, page_size + 5, 0, *lens][:num_seqs]
            lens[int(rng.integers(0, num_seqs))] = page_size * int(rng.integers(1, pages_per_seq))
            lens[int(rng.integers(1, num_seqs))] = 0  # an empty slot in the middle
            lens[0] = 0  # an empty slot first
            one = [0] * num_seqs
            one[int(rng.integers(1, num_seqs))] = lens[-1] or full  # one live sequence
            batches += [(shape, edges, "past"), (shape, lens, "nan"),
                        (shape, [0] * num_seqs, "past"), (shape, one, "past")]  # fmt: skip
        else:
            edges = [full, 0, page_size, 1, *lens][:num_seqs]  # every page, none, one, 1 token
            # every sequence slot live, every page slot used
            every = [int(n) for n in rng.integers(full - page_size + 1, full + 1, num_seqs)]
            batches += [(shape, edges, "past"), (shape, every, "nan")]
    return [_decode_case(shape, lens, garbage, seed * 10 + k)
            for k, (shape, lens, garbage) in enumerate(batches)]  # fmt: skip


def _decode_case(shape: tuple, kv_lens: list[int], garbage: str, seed: int) -> Case:
    """One decode batch. garbage "past": every entry of page_indices past a sequence's last
    page holds a page number past the end of kv_pages; "nan": they point at unused pages full
    of NaN (make_batch's)."""
    page_size, pages_per_seq, num_q_heads, num_kv_heads, head_dim, num_seqs = shape
    batch = make_batch(
        [(1, n) if n else (0, 0) for n in kv_lens],  # kv_len 0: an empty slot
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        total_num_pages=num_seqs * pages_per_seq + 3,
        seed=seed,
    )
    q = _one_row_per_slot(batch, kv_lens)
    page_indices = np.asarray(batch.page_indices).copy()
    if garbage == "past":
        total = batch.kv_pages.shape[0]
        for seq, n in enumerate(kv_lens):
            used = pages_needed(n, page_size)
            page_indices[seq, used:] = total + GARBAGE_PAGE + np.arange(used, pages_per_seq)
    held = "past the end of kv_pages" if garbage == "past" else "unused pages of NaN"
    what = (
        f"kv_lens={kv_lens}, page_size={page_size}, pages_per_seq={pages_per_seq}, "
        f"num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}; "
        f"the page-table entries past each sequence's pages hold garbage ({held})"
    )
    args = (q, batch.kv_pages, batch.kv_lens, jnp.asarray(page_indices))
    return Case(what + f"; sm_scale={SM_SCALES[head_dim]}", args,
                dict(sm_scale=SM_SCALES[head_dim]))  # fmt: skip


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


def _names(buffer: str, semaphores: tuple[str, ...]) -> Callable[[Case], Names]:
    def names(case: Case) -> Names:
        return Names(buffer=buffer, semaphores=semaphores, page=_page_namer(case))

    return names


def _table_read_problem(read: TableRead, case: Case, stopped: bool = False) -> str:
    """An index map's read outside kv_lens or page_indices, with its likely cause. `stopped`:
    the interpreter stopped on it; otherwise the run went on (a negative index wraps around
    in interpret mode before jax 0.12.1)."""
    _, _, kv_lens, _ = case.args
    lens = [int(n) for n in np.asarray(kv_lens)]
    name = ("kv_lens", "page_indices")[read.table] if read.table < 2 else "a table"
    step = ", ".join(map(str, read.step))
    went_on = "" if stopped else "This jax's interpret mode wraps it around, and the run goes on. "
    what = (
        f"an index map read {name}[{', '.join(map(str, read.index))}] at grid step ({step}), "
        f"outside the table (shape {read.shape}). {went_on}A TPU reads SMEM unchecked: another "
        "sequence's entry, or whatever lies next to the table."
    )
    seq, *rest = read.index
    if read.table == 1 and rest and rest[0] < 0 and 0 <= seq < len(lens) and lens[seq] == 0:
        cause = (
            f"sequence {seq} has kv_len 0, no page at all: num_pages - 1 is -1, and "
            "`jnp.minimum(i, num_pages - 1)` reads column -1, before its row. Clamp to 0 as "
            "well, `jnp.minimum(i, jnp.maximum(num_pages - 1, 0))`, and give a sequence with "
            "no page page 0 of the pool (`jnp.where(num_pages > 0, page, 0)`)."
        )
    elif read.table == 1 and rest and rest[0] >= read.shape[1]:
        cause = (
            "a page index past pages_per_seq: clamp i to the sequence's last page, "
            "num_pages - 1 (not num_pages)."
        )
    elif not 0 <= seq < read.shape[0]:
        cause = (
            "a sequence index past the last sequence: the sequence is `pl.program_id(0)` "
            "(`seq`); i = pl.program_id(1) is the page."
        )
    else:
        cause = "an index into kv_lens or page_indices that is not clamped to the table."
    return f"{what} Likely cause: {cause}"


def _read_that_stopped(fn: Callable) -> Callable:
    """When the interpreter stopped on a read outside a table (jax 0.12.1 and later stop on a
    negative index too): the index map's read outside it, named with its likely cause."""

    def check(run, case: Case) -> str | None:
        if smem_read_outside(run) is None:
            return None
        read = index_map_read_outside(fn, case)
        return None if read is None else _table_read_problem(read, case, stopped=True)

    return check


def _block_cause_of(fn: Callable) -> Callable:
    """`_block_cause`, after the index maps' reads of the tables: an out-of-bounds block that
    comes from a read outside page_indices is named for that read."""

    def block_cause(step: tuple, index: tuple, case: Case) -> str | None:
        read = index_map_read_outside(fn, case)
        if read is not None:
            return _table_read_problem(read, case).split("Likely cause: ", 1)[1]
        return _block_cause(step, index, case)

    return block_cause


def _block_cause(step: tuple, index: tuple, case: Case) -> str | None:
    """Rung 2: why the index map of `kv_pages` chose a block past its end at grid step
    (seq, i). Each usual mistake is an index map; the one that first goes out of bounds at
    the same step, with the same block, is the likely cause (the grid runs seq by seq, page
    by page, and stops at the first block out of bounds)."""
    if len(step) != 2 or len(index) != 4:
        return None
    _, kv_pages, kv_lens, page_indices = case.args
    total, page_size = kv_pages.shape[0], kv_pages.shape[1]
    table, lens = np.asarray(page_indices), [int(n) for n in np.asarray(kv_lens)]
    num_seqs, pages_per_seq = table.shape
    seq, i = step

    def clamped(s, i, kv_len):  # the right index map, with the kv_len it is given
        pages = pages_needed(kv_len, page_size)
        return int(table[s, min(i, max(pages - 1, 0))]) if pages else 0

    def first_out_of_bounds(index_map) -> tuple | None:
        for s in range(num_seqs):
            for j in range(pages_per_seq):
                block = index_map(s, j)
                if not 0 <= block < total:
                    return (s, j), block
        return None

    if any(index[1:]):
        return (
            "a page is one whole block of kv_pages: the index map returns (page, 0, 0, 0), "
            "with 0 for the token, head and head_dim axes."
        )
    right = clamped(seq, i, lens[seq])
    if index[0] in (right * page_size, i * page_size) and page_size > 1:
        return (
            f"an element offset used as a block index: block {index[0]} is "
            f"{index[0] // page_size} * page_size. An index map returns *block* indices, and "
            "one page is one block: (page, 0, 0, 0), not (page * page_size, 0, 0, 0)."
        )
    pages = pages_needed(lens[seq], page_size)
    mistakes = {
        "no clamp": lambda s, j: int(table[s, j]),
        "off by one": lambda s, j: int(table[s, min(j, pages_needed(lens[s], page_size))])
        if min(j, pages_needed(lens[s], page_size)) < pages_per_seq else 0,
        "empty slot": lambda s, j: int(
            table[s, min(j, max(pages_needed(lens[s], page_size) - 1, 0))]
        ),
        "kv_lens_ref[i]": lambda s, j: clamped(s, j, lens[j % num_seqs]),
        "kv_lens_ref[0]": lambda s, j: clamped(s, j, lens[0]),
    }  # fmt: skip
    fits = [m for m, index_map in mistakes.items()
            if first_out_of_bounds(index_map) == (tuple(step), index[0])]  # fmt: skip
    if fits and fits[0] == "empty slot":
        return (
            f"sequence {seq} has kv_len 0, no page at all, and its whole row of page_indices "
            "is garbage: give a sequence with no page page 0 of the pool, "
            "`jnp.where(num_pages > 0, page, 0)`."
        )
    if fits and fits[0] in ("no clamp", "off by one"):
        return None  # the rung's advice: clamp i
    if fits or pages > 0 and i >= pages:
        which = fits[0] if fits else "kv_lens_ref[...] of another sequence"
        return (
            f"the clamp used another sequence's kv_len: sequence {seq} has kv_len "
            f"{lens[seq]} ({pages} pages), yet grid step ({seq}, {i}) read past its pages, "
            f"as `{which}` does. The sequence is `seq = pl.program_id(0)` (i = "
            "pl.program_id(1) is the page): clamp with `kv_lens_ref[seq]`."
        )
    return None


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
                "i to the sequence's last page, `jnp.minimum(i, jnp.maximum(num_pages - 1, 0))` "
                "with num_pages = cdiv(kv_len, page_size) (the `maximum`: num_pages - 1 is -1 "
                "for kv_len 0), and give a sequence with no page at all page 0 (`jnp.where`)."
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
        if kind == "smem" and rung < 5:
            return (
                "kv_lens or page_indices read outside it: a sequence index past the last "
                "sequence (the sequence is `pl.program_id(0)`), or a page index past "
                "pages_per_seq or below 0 (`num_pages - 1` is -1 for kv_len 0). Clamp every "
                "index into them, as the index map does."
            )
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


def _ledger_check(rung: int, fn: Callable) -> Callable:
    """The rung's own checks of its index maps and copies, which hold whatever the output."""

    def check(run, case: Case) -> str | None:
        read = index_map_read_outside(fn, case)
        problem = _table_read_problem(read, case) if read is not None else None
        if problem is None:
            problem = _copy_through_garbage(run, case, rung)
        if problem is None and rung >= 4:
            problem = copies_never_overlap(run, case)
        if problem is None and rung == 5:
            problem = first_page_not_prefetched(run, case)
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
        ledger_check=_ledger_check(rung, fn),
        error_ledger_check=_read_that_stopped(fn),
        block_cause=_block_cause_of(fn),
        pattern=_pattern,
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
    Passed: paged_decode_attention matches the reference on all 6 cases...
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
    Passed: paged_decode_async_copy matches the reference on all 6 cases...
    'passed'
    """
    return _check_decode_kernel("paged_decode_async_copy", fn, seed, verbose, details, rung=3)


def check_double_buffered_decode(
    fn: Callable, *, seed: int = 0, verbose: bool = True, details: bool = False
) -> CheckResult:
    """Rung 4: like `check_paged_decode_attention`, for the kernel that double-buffers the pages
    of one sequence (two slots, two semaphores). No race, every copy waited for, one
    semaphore per slot, no copy into a slot still being filled, and page i + 1's copy started
    before page i's wait (else nothing overlaps).

    >>> from minilib.ladder.double_buffer import paged_decode_attention_double_buffered as fn
    >>> check_double_buffered_decode(fn).status
    Passed: double_buffered_decode matches the reference on all 6 cases...
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
    Passed: prefetching_decode matches the reference on all 6 cases...
    'passed'
    """
    return _check_decode_kernel(
        "prefetching_decode", fn, seed, verbose, details, rung=5, buffer="bufs",
        semaphores=("sems[0]", "sems[1]"),
    )  # fmt: skip
