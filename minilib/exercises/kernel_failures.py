"""What went wrong in a run of the learner's kernel, in plain words, with the likely cause.

Each function turns one kind of evidence of a `KernelRun` (`minilib.exercises.kernel_run`) into
one paragraph: what happened, then "Likely cause: ...".

* `dma_problem`: the first problem in the ledger of the kernel's copies: a deadlock, a copy
  started and never waited for, two copies in flight on one semaphore, a copy into a slot that
  an earlier copy is still filling;
* `race_report`: the race detector's first race, condensed;
* `interpreter_error`: an out-of-bounds read or write, a revisited output block, or another
  error of JAX's TPU interpreter;
* `likely_cause`: for a wrong output, the known mistake it matches, or what NaN in it means.
* `copies_never_overlap`, `first_page_not_prefetched`: a decode rung's copy schedule that
  computes the right answer but does not double-buffer (rung 4) or prefetch (rung 5).

`Names` says how a report names a kernel's copies (its buffer, its semaphores, a page), and a
rung's `advice(kind)` may put the likely cause in the rung's own words. JAX's own output (the
race detector's, the interpreter's) stays out of these paragraphs; `DETAILS_HINT` says how to
see it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from minilib.exercises.checking import Case
from minilib.exercises.comparisons import compare_arrays
from minilib.exercises.kernel_run import KernelRun
from minilib.kv_cache import pages_needed
from minilib.ladder.watch import Copy, Watch
from minilib.tpu.numerics import BF16_PASS_TOLERANCE, one_bf16_pass

__all__ = [
    "DETAILS_HINT",
    "NAN_CAUSES",
    "Names",
    "dma_problem",
    "interpreter_error",
    "likely_cause",
    "race_report",
    "smem_read_outside",
]

DETAILS_HINT = "(JAX's own output: run the check again with details=True.)"

NAN_CAUSES = (
    "NaN in the output. In this interpret mode scratch memory starts as NaN, and unused page "
    "slots and the keys past kv_len hold NaN. Usual causes: m, l or acc not initialised before "
    "the first KV block (`pl.when(... == 0)`); alpha upside down (`exp(m_next - m_prev)` is "
    "inf on the first block, where m_prev = -inf, and inf * 0 = NaN: alpha = exp(m_prev - "
    "m_next)); the max taken before the mask (the scores of the keys past kv_len are NaN: "
    "mask first, then take the max); V rows past kv_len not zeroed (a masked score gives "
    "p = 0, but 0 * NaN = NaN in p @ v); a page past the sequence's last one read or "
    "computed; the output written before the last KV block, or never written (the output "
    "block then keeps whatever its buffer held)."
)


@dataclasses.dataclass(frozen=True)
class Names:
    """How a report names the kernel's copies: its VMEM buffer, its semaphores in the order of
    `scratch_shapes`, and a page of `kv_pages` (a function of the page number).

    >>> names = Names(buffer="bufs", semaphores=("sems[0]", "sems[1]"))
    >>> names.copy(Copy(0, source=(7, ":"), destination=(1, ":"), buffer=0, semaphore=0, core=0))
    'the copy of kv_pages[7] into bufs[1]'
    """

    buffer: str = "buf"
    semaphores: tuple[str, ...] = ("sem",)
    page: Callable[[int], str] = "kv_pages[{}]".format

    def place(self, copy: Copy) -> str:
        return self.buffer if copy.slot is None else f"{self.buffer}[{copy.slot}]"

    def copy(self, copy: Copy) -> str:
        source = self.page(copy.page) if copy.page is not None else "kv_pages"
        return f"the copy of {source} into {self.place(copy)}"

    def semaphore(self, watch: Watch, sem_id: int) -> str:
        index = watch.semaphore_index(sem_id)
        return self.semaphores[index] if index < len(self.semaphores) else f"semaphore {index}"


def dma_problem(
    run: KernelRun, names: Names, advice: Callable[[str], str | None] | None = None
) -> str | None:
    """The first DMA problem in the run's ledger, as a paragraph, or None.

    `advice(kind)` may replace the likely cause of a "deadlock", "overwrite", "shared" or
    "never_waited" with the rung's own words (None keeps the general one).

    >>> print(dma_problem(KernelRun(out=None), Names()))
    None
    """
    watch = run.watch
    if watch is None:
        return None

    def cause(kind: str, general: str) -> str:
        return f"Likely cause: {(advice(kind) if advice else None) or general}"

    first = min(watch.found, key=watch.found.get, default=None)  # what went wrong first
    if first == "deadlock":
        return _deadlock(watch, names, cause)
    if first == "overwrite":
        new, old = watch.overwrite
        if old.outstanding > 0:  # and nothing ever waited for the old one
            return (
                f"a copy was started and never waited for: {names.copy(old)}; the next copy "
                f"into the same place, {names.copy(new)}, then overwrote it. "
                + cause("never_waited", "every `start()` needs its `wait()` before the buffer "
                        "is read, or the next copy into it is started.")
            )  # fmt: skip
        return (
            f"the next copy overwrote a slot still in use: {names.copy(new)} started while "
            f"{names.copy(old)}, into the same place, had not been waited for. "
            + cause(
                "overwrite",
                "the next page must go into the *other* slot (`1 - slot`), the one the page "
                "before has finished with; a slot is free again only after its copy was "
                "waited for and its page computed.",
            )
        )
    if first == "shared":
        a, b = watch.shared[:2]
        sem = names.semaphore(watch, a.semaphore)
        return (
            f"two slots share one semaphore: {names.copy(a)} and {names.copy(b)} were in "
            f"flight together, both signalling {sem}. A wait on it returns as soon as "
            "*either* has landed, so the kernel may read a slot whose copy is still running "
            "(here the counts balance at exit and, since copies land at once in interpret "
            "mode, no race shows). "
            + cause(
                "shared",
                "each slot needs its own semaphore: copy into `bufs.at[slot]` with "
                "`sems.at[slot]`, and wait on the same one.",
            )
        )
    never = watch.never_waited()
    if never:
        listed = "; ".join(names.copy(c) for c in never[:3])
        more = f" (and {len(never) - 3} more)" if len(never) > 3 else ""
        return (
            f"a copy was started and never waited for: {listed}{more}. It is still in flight "
            "when the kernel exits, writing into VMEM that no longer belongs to it (JAX's "
            'interpreter only prints "Semaphore ... has non-zero count ... at kernel exit"). '
            + cause(
                "never_waited",
                "a copy started when there is nothing left to compute (the page after the "
                "last page, a page started again on every grid step): guard each start with "
                "the same condition as its wait, so that every copy started is waited for.",
            )
        )
    return None


def _deadlock(watch: Watch, names: Names, cause) -> str:
    d = watch.deadlock
    sem = names.semaphore(watch, d["semaphore"])
    if not d["copies"]:
        history = f"No copy was ever started on {sem}."
    else:
        history = (
            f"The copies started on {sem} were all waited for already (the last: "
            f"{names.copy(d['copies'][-1])})."
        )
    return (
        f"a deadlock: a `.wait()` on {sem} waits for {d['wanted']} bytes, {d['count']} have "
        f"arrived, and no copy in flight will signal it: on a TPU the kernel would hang here "
        f"for ever. {history} "
        + cause(
            "deadlock",
            "a wait for a copy that was never started (the first copy, or one skipped by a "
            "`pl.when`), or a wait on the other slot's semaphore.",
        )
    )


def race_report(run: KernelRun, names: Names) -> str:
    """The race detector's first race, condensed: the buffer, the two accesses, the fix.

    >>> print(race_report(KernelRun(out=None, raced=True), Names()))   # no race in the ledger
    the race detector of TPU interpret mode found a DMA race. Every `start()` needs its `wait()`
    before the buffer is read, and the next copy may go only into the slot nobody reads. (JAX's
    own output: run the check again with details=True.)
    """
    races = run.watch.races() if run.watch is not None else []
    if not races:
        return (
            "the race detector of TPU interpret mode found a DMA race. Every `start()` "
            "needs its `wait()` before the buffer is read, and the next copy may go only into "
            f"the slot nobody reads. {DETAILS_HINT}"
        )
    race = races[0]
    accesses = []
    for kind, who, line in (race.first, race.second):
        copy = run.watch.copy_by_dma_id(who)
        if copy is not None:
            accesses.append(f"{names.copy(copy)} ({kind}s it; started at {_short(line)})")
        else:
            accesses.append(f"the kernel {kind}s it at {_short(line)}")
    slot = race.slot if names.buffer == "bufs" else None
    buffer = names.buffer + (f"[{slot}]" if slot is not None else "")
    return (
        f"a DMA race on {buffer}: {accesses[0]}, while {accesses[1]}, and no wait orders "
        "the two. A buffer may be read only after `.wait()` for the copy into it, and a copy "
        f"may be started only into a slot nobody reads any more. {DETAILS_HINT}"
    )


def _short(line: str) -> str:
    """'/long/path/x.py:12:4 (fn)' as 'x.py line 12 (fn)'."""
    m = re.match(r"(.*?):(\d+)(?::\d+)? \((.*)\)$", line.strip())
    if not m:
        return line.strip() or "a line JAX does not name"
    path, number, function = m.groups()
    where = "your code" if ("ipykernel" in path or "<" in path) else path.rsplit("/", 1)[-1]
    return f"{where} line {number} ({function})"


_OOB_BLOCK = re.compile(
    r"Out-of-bounds block index \(([^)]*)\) for (?:input|output) \"(\w+)\" in iteration "
    r"\(([^)]*)\).*?(?:input|output) has shape \(([^)]*)\)"
)
_OOB_ACCESS = re.compile(
    r"Out-of-bounds (read|write|swap) of \((\S+) (\S+) (\S+) (\d+)\): (?:reading|writing)? ?"
    r"\[(.*?)\] but buffer has shape \(([^)]*)\)"
)
_INDEX = re.compile(r"slice\((-?\d+), (-?\d+), -?\d+\)|(-?\d+)")


def _past_the_end(where: str, shape: str) -> str:
    """'index 1007 of axis 0 (it has 7)' for the first axis an index runs past."""
    dims = [int(x) for x in shape.replace(",", " ").split()]
    for axis, (m, dim) in enumerate(zip(_INDEX.finditer(where), dims, strict=False)):
        start, stop, single = m.groups()
        if single is not None and not 0 <= int(single) < dim:
            return f"index {single} of axis {axis} (it has {dim})"
        if start is not None and (int(start) < 0 or int(stop) > dim):
            return f"indices {start}..{int(stop) - 1} of axis {axis} (it has {dim})"
    return "an index past its end"


def interpreter_error(
    run: KernelRun,
    names: Names,
    advice: Callable[[str], str] | None = None,
    block_cause: Callable[[tuple, tuple], str | None] | None = None,
) -> str:
    """The interpreter's error as one paragraph: what happened, then the likely cause.

    `advice(kind)` gives the rung's likely cause for an out-of-bounds "block" (an index map),
    "copy" (a DMA source), "smem" or "vmem" access (None: the general one).
    `block_cause(step, index)` may name the cause of an out-of-bounds block from what the
    index map chose (`index`) at which grid step (`step`), before `advice("block")`.

    >>> text = ('IndexError: Out-of-bounds block index (1007, 0, 0, 0) for input "page_ref" in '
    ...         'iteration (0, 1) on device 0 (core 0): reading [...] but input has shape '
    ...         '(7, 8, 4, 128).')
    >>> message = interpreter_error(KernelRun(out=None, error=text), Names())
    >>> print(message[:82])
    an out-of-bounds read: at grid step (0, 1) the index map of `page_ref` chose block
    >>> "Likely cause: an index past the end" in message
    True
    """
    text = run.error or ""
    general = _general_advice

    def advice_for(kind: str) -> str:
        return (advice(kind) if advice else None) or general(kind)

    if run.watch is not None and run.watch.deadlock is not None:
        return dma_problem(run, names, advice)
    block = _OOB_BLOCK.search(text)
    if block:
        index, ref, step, shape = block.groups()
        what = (
            f"an out-of-bounds read: at grid step ({step}) the index map of `{ref}` chose "
            f"block ({index}), but the array has shape ({shape})."
        )
        cause = block_cause(_ints(step), _ints(index)) if block_cause else None
        return f"{what} Likely cause: {cause or advice_for('block')} {DETAILS_HINT}"
    access = _OOB_ACCESS.search(text)
    if access:
        kind, space, where, shape = (access.group(i) for i in (1, 4, 6, 7))
        copies = run.watch.copies if run.watch is not None else []
        source = next((c for c in reversed(copies) if c.page is not None), None)
        in_hbm = space in ("hbm", "any")
        if kind == "read" and in_hbm and source is not None:
            what = (
                f"an out-of-bounds read: a copy read {names.page(source.page)}, but kv_pages "
                f"has shape ({shape})."
            )
            return f"{what} Likely cause: {advice_for('copy')} {DETAILS_HINT}"
        past = _past_the_end(where, shape)
        if kind == "write" and in_hbm:  # an output block written back past the output's end
            what = f"an out-of-bounds write: an output block went to {past} of the output."
            return f"{what} Likely cause: {advice_for('block')} {DETAILS_HINT}"
        memory = {"smem": "SMEM", "vmem": "VMEM"}.get(space, space)
        what = f"an out-of-bounds {kind} of a {memory} array of shape ({shape}), at {past}."
        return f"{what} Likely cause: {advice_for(space)} {DETAILS_HINT}"
    if "Revisited block" in text:
        line = next(x for x in text.splitlines() if "Revisited block" in x)
        return (
            f"an output block was revisited: {line.split('Revisited', 1)[1].strip()} Pallas "
            "copies an output block back to HBM when the block index changes, so coming back to "
            "it later overwrites what was written first. Likely cause: the output's index map "
            f"depends on an axis it should not (the KV axis?). {DETAILS_HINT}"
        )
    first = next((x for x in text.splitlines() if x.strip()), "an unknown error")
    return (
        f"JAX's TPU interpreter stopped with an internal error: {first[:300]}. Likely cause: "
        "a ref indexed with a shape or dtype it does not have, or a value read from a ref "
        f"outside the kernel's grid step. {DETAILS_HINT}"
    )


def smem_read_outside(run: KernelRun) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(index, shape) of the out-of-bounds SMEM read that stopped `run`, or None. Every
    supported jax stops on a read past an end; on a negative index only jax 0.12.1 and later
    do (before, the read wraps around to the end of the axis, and the run goes on).

    >>> run = KernelRun(out=None, error="IndexError: Out-of-bounds read of (0 0 smem 104): "
    ...                 "reading [(4, -1)] but buffer has shape (6, 5).")
    >>> smem_read_outside(run)
    ((4, -1), (6, 5))
    """
    access = _OOB_ACCESS.search(run.error or "")
    if access is None or access.group(1) != "read" or access.group(4) != "smem":
        return None
    if "slice" in access.group(6):  # a slice of a table, not one entry: not named
        return None
    return _ints(access.group(6)), _ints(access.group(7))


def _ints(text: str) -> tuple[int, ...]:
    """'0, 3' as (0, 3)."""
    return tuple(int(x) for x in re.findall(r"-?\d+", text))


def _general_advice(kind: str) -> str:
    return (
        "an index past the end of an array. Entries of page_indices past a sequence's last "
        "page hold garbage (so does a whole row for an empty slot); a sequence index may run "
        "past the last sequence; a slot index past the last slot."
    )


def likely_cause(out, case: Case, mistakes: dict[str, Callable], pattern: str | None = None) -> str:
    """The explanation of the first mistake in `mistakes` whose output `out` matches; else
    `pattern` (what the rung reads in which rows are wrong); else what NaN in the output
    usually means; else advice to compare row by row.

    A NaN output matches every mistake that gives NaN in the same places, whatever made it:
    then every such mistake is named, with the other usual causes of NaN.

    >>> case = Case("x = 1", (np.array([1.0]),))
    >>> likely_cause(np.array([2.0]), case, {"x was doubled.": lambda x: 2 * x})
    'x was doubled.'
    >>> likely_cause(np.array([np.nan]), case, {}) == NAN_CAUSES
    True
    """
    # Where the kernel's matmuls are one bfloat16 pass (a TPU), it is off by up to about 0.01
    # from a mistake made exactly (minilib.tpu.numerics).
    atol = BF16_PASS_TOLERANCE if one_bf16_pass() else 1e-3
    matched = []
    for explanation, mistaken in mistakes.items():
        try:
            compare_arrays(mistaken(*case.args, **case.kwargs), out, "output", atol=atol)
        except Exception:
            continue
        matched.append(explanation)
    try:
        finite = bool(np.isfinite(np.asarray(out, np.float64)).all())
    except Exception:
        finite = True
    if matched and finite:
        return matched[0]
    if not finite:
        listed = "".join(f"\n  - {m}" for m in matched)
        fits = f"each of these mistakes gives NaN just where yours does:{listed}\n"
        fits = fits if matched else ""
        return fits + (f"{pattern}\n" if pattern else "") + NAN_CAUSES
    if pattern:
        return pattern
    return (
        "none of the usual mistakes. Run the reference and your kernel on this case, and compare "
        "them row by row (which rows, heads or positions differ?)."
    )


# --- the decode rungs' copy schedule, read from the ledger (rungs 4 and 5) ---------------

# Words of the two schedule problems a kernel with a right output can have, and what each rung
# requires instead (`kernel_checking` says so when the output was checked right).
NOTHING_IN_FLIGHT = "no copy was in flight when it started"
OWN_STEP = "nothing overlaps that copy"
REQUIRED = {
    NOTHING_IN_FLIGHT: "this rung requires double buffering: the next copy on its way while "
    "this one is waited for and computes",
    OWN_STEP: "this rung requires prefetching across grid steps: the first copy of a grid step "
    "started by the step before",
}


def start_before_wait(after: str, this: str) -> str:
    """The fix for a copy started with nothing in flight (rungs 4, 6 and 7), in what the ledger
    knows: it sees the copies and the waits, not the computes.

    >>> print(start_before_wait("page i + 1", "page i"))
    Start page i + 1's copy into the other slot *before* waiting for page i (started after \
that wait, it overlaps at most page i's compute).
    """
    return (
        f"Start {after}'s copy into the other slot *before* waiting for {this} (started after "
        f"that wait, it overlaps at most {this}'s compute)."
    )


def copies_never_overlap(run: KernelRun, case: Case) -> str | None:
    """Rungs 4 and 5: page i + 1 of a sequence must be on its way while the kernel waits for
    page i, so its copy starts before page i's wait. A kernel that starts each page only after
    waiting for the one before computes the right answer with no copy in flight when it starts
    one: what the ledger (its copies and waits) shows."""
    _, kv_pages, kv_lens, page_indices = case.args
    page_size, table = kv_pages.shape[1], np.asarray(page_indices)
    later_pages = {}  # page number -> (seq, i), for pages i >= 1 of a sequence
    for seq, n in enumerate(int(n) for n in np.asarray(kv_lens)):
        for i in range(1, pages_needed(n, page_size)):
            later_pages[int(table[seq, i])] = (seq, i)
    for copy in run.watch.copies:
        if copy.page in later_pages and copy.in_flight == 0:
            seq, i = later_pages[copy.page]
            return (
                f"page {i} of sequence {seq} was copied only after every earlier copy had been "
                f"waited for ({NOTHING_IN_FLIGHT}): the copy of page i + 1 was not on its way "
                "while the kernel waited for page i, so the two slots do not double-buffer the "
                "way the rung asks. " + start_before_wait("page i + 1", "page i")
            )
    return None


def first_page_not_prefetched(run: KernelRun, case: Case) -> str | None:
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
                f"page 0 of sequence {seq} was copied in its own grid step ({seq}): {OWN_STEP}. "
                "Prefetching across grid steps means the step before "
                "starts it, when it computes its last page (next_work); a grid step starts no "
                "copy of its own, but grid step 0 the very first."
            )
    return None
