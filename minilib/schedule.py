"""The kernel's schedule: what each grid step computes, and which copy is in flight meanwhile.

`minilib.kernel` runs two kernels, one after the other: the decode kernel, on the sequences
with one q row (their rows gathered into a q block of their own, `num_queries_per_block`
sequences per grid step), then the mixed kernel, on the others. Each walks, in each grid step
(heads block, q block), over the sequences that own rows of the q block and over the KV blocks
those rows can see. Each such KV block is one piece of *work*. Double buffering means: while a
kernel computes work i out of slot i % 2, the copy of work i + 1 into the other slot is
already running. Each kernel has its own chain of copies: the decode kernel's last work has
no copy behind it, and the mixed kernel starts its own first copy.

Two ways to get the schedule, with the same result (the tests check that they agree):

    plan_schedule(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                  sliding_window=None, num_kv_pages_per_block=None,
                  num_queries_per_block=None) -> Schedule
        Plain Python, instant: lists the work in the kernel's order, then lays the copies over
        it. Use it for interactive widgets.

    record_schedule(...same arguments...) -> Schedule
        Runs the kernel in TPU interpret mode with its trace on: every DMA start, DMA wait and
        compute writes one row into an extra SMEM output; it runs the whole kernel, so it is slower
        than `plan_schedule`. Use it to show that
        the plan is what the kernel really does.

Only shapes and dtypes of q and kv_pages matter (a `jax.ShapeDtypeStruct` will do for
`plan_schedule`); kv_lens, page_indices, cu_q_lens and num_seqs must be concrete, and are checked
with `dynamic_validate_inputs`. `sliding_window` matters because KV blocks that no row can see
are skipped.

A `Schedule` has:
    grid                    (num_heads_blocks, num_q_blocks): the mixed kernel's grid
    decode_grid             (num_heads_blocks, decode q blocks): the decode kernel's grid
    mixed_q_rows            per sequence slot, its rows (start, end) in the mixed kernel's q,
                            which holds no one-token sequence and starts the others on q-block
                            boundaries while the padding fits (`minilib.kernel.mixed_layout`)
    num_queries_per_block, num_kv_pages_per_block, page_size, kv_tokens_per_block,
    num_q_heads_per_block, num_kv_heads_per_block, decode_seqs_per_block
    events                  list[Event], in the order they happened (decode kernel first)
    computes()              the "compute" events only: the work list
    steps(kernel="mixed")   {(heads_blk, q_blk): [Event, ...]} for every grid step of that
                            kernel ("mixed" or "decode"), in grid order
    in_flight()             [(compute Event, start Event or None)]: the copy running while each
                            compute runs (None for the last one of each kernel)
    describe()              a readable listing

An `Event` (frozen dataclass) has:
    kind        "start" (a DMA starts), "wait" (the kernel waits for it), "compute"
    step        (heads_blk, q_blk): the grid step of its kernel during which it happened
    heads_blk, seq, kv_blk   the KV block concerned (a start may be for the next grid step);
                seq is the sequence's number in the batch, in both kernels
    slot        0 or 1, the VMEM buffer
    pages       the physical pages of that KV block (what the DMA copies)
    kv_tokens   (start, end): the block's token positions in its sequence, clipped to kv_len
    q_rows      (start, end): rows of the batch's q computed (compute and wait events; None
                for start)
    kernel      "decode" or "mixed": which of the two kernels

>>> from minilib.batch import make_batch
>>> batch = make_batch([(5, 5), (1, 20)], page_size=8)
>>> s = plan_schedule(*batch.args(), num_kv_pages_per_block=1, num_queries_per_block=8)
>>> [(e.kernel, e.seq, e.kv_blk, e.slot) for e in s.computes()]
[('decode', 1, 0, 0), ('decode', 1, 1, 1), ('decode', 1, 2, 0), ('mixed', 0, 0, 0)]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from minilib import kernel
from minilib.errors import ScheduleTooBig
from minilib.kernel_trace import TRACE_COMPUTE, TRACE_START, TRACE_WAIT
from minilib.kv_cache import cdiv, pages_needed
from minilib.masking import kv_blocks_to_visit, q_position
from minilib.options import AttentionOptions
from minilib.validation import dynamic_validate_inputs

__all__ = [
    "KINDS",
    "Event",
    "Schedule",
    "describe_event",
    "plan_schedule",
    "record_schedule",
    "record_trace",
]

KINDS = {TRACE_START: "start", TRACE_WAIT: "wait", TRACE_COMPUTE: "compute"}


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing the kernel did: start a copy, wait for it, or compute with it.

    >>> from minilib.batch import make_batch
    >>> e = plan_schedule(*make_batch([(3, 3)]).args()).computes()[0]
    >>> e.kind, e.seq, e.kv_blk, e.q_rows
    ('compute', 0, 0, (0, 3))
    """

    kind: str  # "start" | "wait" | "compute"
    step: tuple[int, int]  # (heads_blk, q_blk) of the grid step it happened in
    heads_blk: int
    seq: int
    kv_blk: int
    slot: int
    pages: tuple[int, ...]
    kv_tokens: tuple[int, int]
    q_rows: tuple[int, int] | None
    kernel: str = "mixed"  # "decode" | "mixed"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The kernel's schedule for one batch; see the module docstring.

    >>> from minilib.batch import make_batch
    >>> s = plan_schedule(*make_batch([(3, 3), (1, 20)], page_size=8).args(),
    ...                   num_kv_pages_per_block=1, num_queries_per_block=8)
    >>> s.grid, s.kv_tokens_per_block, len(s.computes()), len(s.in_flight())
    ((1, 1), 8, 4, 4)
    >>> s.decode_grid, s.decode_seqs_per_block
    ((1, 1), 2)
    """

    grid: tuple[int, int]
    num_queries_per_block: int
    num_kv_pages_per_block: int
    page_size: int
    num_q_heads_per_block: int
    num_kv_heads_per_block: int
    events: tuple[Event, ...]
    decode_grid: tuple[int, int] = (1, 1)
    decode_seqs_per_block: int = 1
    mixed_q_rows: tuple[tuple[int, int], ...] = ()  # per sequence slot: rows of the mixed q

    @property
    def kv_tokens_per_block(self) -> int:
        return self.num_kv_pages_per_block * self.page_size

    def computes(self) -> list[Event]:
        return [e for e in self.events if e.kind == "compute"]

    def steps(self, kernel: str = "mixed") -> dict[tuple[int, int], list[Event]]:
        """{grid step: its events} for every grid step of the `kernel` ("mixed" or "decode")."""
        heads, q_blocks = self.decode_grid if kernel == "decode" else self.grid
        steps = {(h, q): [] for h in range(heads) for q in range(q_blocks)}
        for e in self.events:
            if e.kernel == kernel:
                steps[e.step].append(e)
        return steps

    def in_flight(self) -> list[tuple[Event, Event | None]]:
        """For each compute, the copy that was started just before it and runs meanwhile."""
        pairs, last_start = [], None
        for e in self.events:
            if e.kind == "start":
                last_start = e
            elif e.kind == "compute":
                running = last_start if last_start and last_start.slot != e.slot else None
                pairs.append((e, running))
                last_start = None
        return pairs

    def describe(self) -> str:
        num_decode = len({e.seq for e in self.events if e.kernel == "decode"})
        lines = [
            f"Schedule: {len(self.computes())} KV blocks computed: the decode kernel on "
            f"{num_decode} one-token sequence(s), a grid of {self.decode_grid[0]} heads "
            f"block(s) x {self.decode_grid[1]} block(s) of {self.decode_seqs_per_block}; then "
            f"the mixed kernel on a grid of {self.grid[0]} heads block(s) x {self.grid[1]} q "
            "block(s)",
            f"  num_queries_per_block={self.num_queries_per_block} "
            f"num_kv_pages_per_block={self.num_kv_pages_per_block} page_size={self.page_size} "
            f"({self.kv_tokens_per_block} tokens per KV block); "
            f"{self.num_q_heads_per_block} q heads / {self.num_kv_heads_per_block} KV heads "
            f"per heads block",
        ]
        for (h, blk), events in self.steps("decode").items():
            if events:
                lines.append(f"decode kernel, grid step (heads block {h}, block {blk}): "
                             f"sequences {sorted({e.seq for e in events})}")  # fmt: skip
                lines += ["  " + describe_event(e) for e in events]
        for (h, q_blk), events in self.steps().items():
            first_row = q_blk * self.num_queries_per_block
            rows = f"mixed q rows [{first_row}, {first_row + self.num_queries_per_block})"
            empty = "" if events else ": no rows for this kernel, output zeros"
            lines.append(f"grid step (heads block {h}, q block {q_blk}): {rows}{empty}")
            lines += ["  " + describe_event(e) for e in events]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()


def describe_event(e: Event) -> str:
    """One line saying what `e` did.

    >>> from minilib.batch import make_batch
    >>> s = plan_schedule(*make_batch([(3, 3)]).args())
    >>> for e in s.events:
    ...     print(describe_event(e))
    DMA start  slot 0 <- heads 0 seq 0 kv block 0: pages [1]
    DMA wait   slot 0    heads 0 seq 0 kv block 0
    compute    slot 0    seq 0: q rows [0, 3) x keys [0, 3)
    """
    block = f"heads {e.heads_blk} seq {e.seq} kv block {e.kv_blk}"
    if e.kind == "start":
        return f"DMA start  slot {e.slot} <- {block}: pages {list(e.pages)}"
    if e.kind == "wait":
        return f"DMA wait   slot {e.slot}    {block}"
    return (f"compute    slot {e.slot}    seq {e.seq}: q rows [{e.q_rows[0]}, {e.q_rows[1]}) "
            f"x keys [{e.kv_tokens[0]}, {e.kv_tokens[1]})")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The plan, in plain Python.
# ---------------------------------------------------------------------------------------------


def plan_schedule(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]; shape and dtype
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]; shape and dtype
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    sliding_window: int | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    max_computes: int | None = None,
    max_grid_steps: int | None = None,
) -> Schedule:
    """The kernel's schedule, worked out in Python: the work list, then the copies around it.

    `max_computes`, `max_grid_steps`: raise `ScheduleTooBig` when the kernel would compute
    more KV blocks, or run more grid steps, than this, before listing any of them (so that
    interactive tools stay responsive).

    >>> from minilib.batch import make_batch
    >>> s = plan_schedule(*make_batch([(3, 3)]).args())
    >>> [e.kind for e in s.events]
    ['start', 'wait', 'compute']
    """
    options = AttentionOptions(
        sliding_window=sliding_window,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
    )
    config, table = _config_and_table(
        (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs), options
    )
    mixed, decode = kernel.split_configs(config)
    mixed_table = table.in_mixed_layout(config)
    num_q_blocks = cdiv(q.shape[0], config.num_queries_per_block)
    grid_steps = config.num_heads_blocks * num_q_blocks
    if max_grid_steps is not None and grid_steps > max_grid_steps:
        raise ScheduleTooBig(
            f"The grid has {config.num_heads_blocks} heads blocks x {num_q_blocks} q blocks = "
            f"{grid_steps} steps, more than {max_grid_steps=}. Use a bigger "
            "num_queries_per_block, or fewer q rows or heads."
        )
    if max_computes is not None:
        count = count_computes(mixed_table, mixed, num_q_blocks) + count_computes(table, decode)
        if count > max_computes:
            raise ScheduleTooBig(
                f"The kernel computes {count} KV blocks for this batch, more than "
                f"{max_computes=}. Use bigger blocks, fewer heads or shorter sequences."
            )
    events = chain_of_copies(work_list(table, decode), "decode")
    events += chain_of_copies(work_list(mixed_table, mixed, num_q_blocks), "mixed")
    return _schedule(q, config, table, events)


def chain_of_copies(work, kernel_name: str):
    """The events of one kernel's work list: the first grid step starts the first copy; then,
    for each work, the copy of the next one into the other slot, the wait, the compute."""
    events = []
    for i, (step, heads_blk, seq, kv_blk) in enumerate(work):
        if i == 0:  # the first grid step starts the very first copy
            events.append(("start", (0, 0), heads_blk, seq, kv_blk, 0, kernel_name))
        if i + 1 < len(work):  # prefetch the next work into the other slot
            _, *next_block = work[i + 1]
            events.append(("start", step, *next_block, (i + 1) % 2, kernel_name))
        events.append(("wait", step, heads_blk, seq, kv_blk, i % 2, kernel_name))
        events.append(("compute", step, heads_blk, seq, kv_blk, i % 2, kernel_name))
    return events


def work_list(table: _Table, config: kernel.KernelConfig, num_q_blocks: int | None = None):
    """[(step, heads_blk, seq, kv_blk)] in the order of the kernel `config` describes (the
    mixed one, with its num_q_blocks, or the decode one): grid steps in row-major order; in
    each, the sequences with rows in the q block, in order; for each, the KV blocks its rows
    can see."""
    work = []
    for heads_blk in range(config.num_heads_blocks):
        for q_blk, seq, first, end in _seq_blocks(table, config, num_q_blocks):
            work += [((heads_blk, q_blk), heads_blk, seq, b) for b in range(first, end)]
    return work


def count_computes(table: _Table, config: kernel.KernelConfig, num_q_blocks=None) -> int:
    """len(work_list(...)), without listing the work: a few steps per (q block, sequence)."""
    pairs = _seq_blocks(table, config, num_q_blocks)
    return config.num_heads_blocks * sum(end - first for _, _, first, end in pairs)


def _seq_blocks(table: _Table, config: kernel.KernelConfig, num_q_blocks=None):
    """[(q_blk, seq, first KV block, end KV block)] for every sequence the kernel serves, in
    its order (q blocks, then sequences). The mixed kernel (`leaves_decode`) leaves the
    one-token sequences to the decode kernel, which serves them alone: decode sequence i (the
    i-th one-token sequence) is row i of its q. Only each sequence's own q blocks are
    visited, so this costs (number of q blocks + number of sequences) steps."""
    bq = config.num_queries_per_block
    if config.decode:
        return [(i // bq, seq, *table.seq_kv_blocks(seq, table.q_rows(seq), config))
                for i, seq in enumerate(table.decode_seqs())]  # fmt: skip
    seqs_of_block = [[] for _ in range(num_q_blocks)]
    for seq in range(table.num_seqs):
        start, end = table.q_rows(seq)
        if config.leaves_decode and end - start == 1:
            continue
        for q_blk in range(start // bq, min(cdiv(end, bq), num_q_blocks)):
            seqs_of_block[q_blk].append(seq)
    return [
        (q_blk, seq, *table.seq_kv_blocks(seq, (q_blk * bq, (q_blk + 1) * bq), config))
        for q_blk, seqs in enumerate(seqs_of_block)
        for seq in seqs
        if table.has_rows_in(seq, (q_blk * bq, (q_blk + 1) * bq))
    ]


@functools.partial(jax.jit, static_argnames="config")
def _mixed_cu_q_lens(cu_q_lens, num_seqs, config):
    """`kernel.mixed_layout`'s cu_q_lens, one program per shape and config (op by op, each of
    its ops would compile for each new shape)."""
    return kernel.mixed_layout(cu_q_lens, num_seqs, config).cu_q_lens


class _Table:
    """The batch description as Python ints, with the questions the schedule asks of it. Its
    q rows are the batch's, or the mixed kernel's (`in_mixed_layout`)."""

    def __init__(self, kv_lens, page_indices, cu_q_lens, num_seqs, batch_cu_q_lens=None):
        self.kv_lens = np.asarray(kv_lens)
        self.page_indices = np.asarray(page_indices)
        self.cu_q_lens = np.asarray(cu_q_lens)
        self.batch_cu_q_lens = self.cu_q_lens if batch_cu_q_lens is None else batch_cu_q_lens
        # Clamped to the slots that exist, as the kernel's loops are.
        self.num_seqs = min(max(int(np.asarray(num_seqs)[0]), 0), len(self.kv_lens))

    def in_mixed_layout(self, config: kernel.KernelConfig) -> _Table:
        """This batch as the mixed kernel sees it: its sequences' rows in the mixed kernel's q
        (`kernel.mixed_layout`: one-token sequences none, the others on q-block boundaries
        while the padding fits)."""
        cu_q_lens = _mixed_cu_q_lens(self.cu_q_lens, np.array([self.num_seqs]), config)
        return _Table(self.kv_lens, self.page_indices, np.asarray(cu_q_lens),
                      [self.num_seqs], batch_cu_q_lens=self.cu_q_lens)  # fmt: skip

    def q_rows(self, seq) -> tuple[int, int]:
        return int(self.cu_q_lens[seq]), int(self.cu_q_lens[seq + 1])

    def batch_rows(self, seq, rows) -> tuple[int, int]:
        """The batch's rows of `seq` that are among `rows` of this table's q: the padding
        before a sequence's rows in the mixed kernel's q is none of them."""
        q_end, batch_start, batch_end = self.q_rows(seq)[1], *self.batch_q_rows(seq)
        shift = q_end - batch_end  # row r of the batch is row r + shift here
        return max(batch_start, rows[0] - shift), min(batch_end, rows[1] - shift)

    def batch_q_rows(self, seq) -> tuple[int, int]:
        return int(self.batch_cu_q_lens[seq]), int(self.batch_cu_q_lens[seq + 1])

    def decode_seqs(self) -> list[int]:
        """The one-token sequences, in order: those the decode kernel serves."""
        return [s for s in range(self.num_seqs) if self.q_rows(s)[1] - self.q_rows(s)[0] == 1]

    def has_rows_in(self, seq, rows) -> bool:
        start, end = self.q_rows(seq)
        return start < end and start < rows[1] and end > rows[0]

    def seq_kv_blocks(self, seq, rows, config) -> tuple[int, int]:
        """The KV blocks [first, end) that the rows of `seq` within `rows` visit, as in the
        kernel's `seq_kv_blocks` (whose clamps change nothing for a valid batch)."""
        q_start, q_end = self.q_rows(seq)
        kv_len = int(self.kv_lens[seq])
        first_row, last_row = max(q_start, rows[0]), min(q_end, rows[1]) - 1
        first, end = kv_blocks_to_visit(
            q_position(first_row, q_end, kv_len),
            q_position(last_row, q_end, kv_len),
            config.kv_tokens_per_block,
            config.sliding_window,
        )
        return int(first), int(end)

    def pages(self, seq, kv_blk, config) -> tuple[int, ...]:
        num_pages = pages_needed(int(self.kv_lens[seq]), config.page_size)
        first = kv_blk * config.num_kv_pages_per_block
        end = min(first + config.num_kv_pages_per_block, num_pages)
        return tuple(int(p) for p in self.page_indices[seq, first:end])


# ---------------------------------------------------------------------------------------------
# The record, from the kernel's own trace.
# ---------------------------------------------------------------------------------------------


def record_schedule(*args, interpret=None, **options) -> Schedule:
    """Run the kernel on `plan_schedule`'s arguments (the six arrays, then the options), in TPU
    interpret mode unless `interpret` says otherwise, and return the schedule it recorded. q
    and kv_pages must be real arrays here.

    The recorded schedule is the planned one:

    >>> from minilib.batch import make_batch
    >>> args = make_batch([(3, 3)]).args()
    >>> record_schedule(*args).events == plan_schedule(*args).events
    True
    """
    q = args[0]
    config, table = _config_and_table(args, AttentionOptions(**options))
    _, traces = record_trace(
        *args, config=config, capacity=_trace_capacity(q, table, config), interpret=interpret
    )
    # The decode kernel numbers its sequences in its own batch: back to the batch's numbers.
    seq_ids = {"decode": table.decode_seqs(), "mixed": list(range(len(table.kv_lens)))}
    events = [
        (KINDS[r[0]], (int(r[1]), int(r[2])), int(r[3]), seq_ids[name][int(r[4])],
         *(int(x) for x in r[5:]), name)
        for name, rows in traces.items()
        for r in rows
    ]  # fmt: skip
    return _schedule(q, config, table, events)


def record_trace(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, config: kernel.KernelConfig,
    capacity: int, interpret=None
) -> tuple[jax.Array, dict[str, np.ndarray]]:  # fmt: skip
    """Run the kernel with its trace on (`minilib.kernel_trace`). Returns (out, {"decode":
    events, "mixed": events}), each i32[num_events, TRACE_FIELDS], in the order the two kernels
    run; raises if a kernel recorded more than `capacity` events.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 5)])
    >>> config, _ = _config_and_table(batch.args(), AttentionOptions())
    >>> _, traces = record_trace(*batch.args(), config=config, capacity=8)
    >>> {name: [KINDS[kind] for kind in events[:, 0]] for name, events in traces.items()}
    {'decode': ['start', 'wait', 'compute'], 'mixed': ['start', 'wait', 'compute']}
    """
    if interpret is None:
        interpret = True  # TPU interpret mode by default, even on a TPU
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    # The kernel's own jitted call, with the trace output on.
    interpret = kernel.resolve_interpret(interpret)
    out, traces = kernel.rpa_jit(*args, config=config, interpret=interpret, trace_capacity=capacity)
    events = {}
    for name, trace in zip(("decode", "mixed"), traces, strict=True):
        trace = np.asarray(trace)
        count = int(trace[0, 0])
        if count > capacity:
            raise ValueError(f"the {name} kernel recorded {count} events, more than {capacity=}.")
        events[name] = trace[1 : count + 1]
    return out, events


def _trace_capacity(q, table: _Table, config: kernel.KernelConfig) -> int:
    """An upper bound on the events of either kernel: 3 per piece of work, plus the first
    start. The mixed kernel's (seq, q block) pairs are at most num_q_blocks + num_seqs, the
    decode kernel's at most num_seqs, each with at most all of its KV blocks."""
    num_q_blocks = cdiv(q.shape[0], config.num_queries_per_block)
    kv_blocks = config.blocks_per_seq
    pairs = num_q_blocks + max(table.num_seqs, 1)
    return 3 * config.num_heads_blocks * pairs * kv_blocks + 1


# ---------------------------------------------------------------------------------------------
# Shared by both.
# ---------------------------------------------------------------------------------------------


def _config_and_table(args: tuple, options: AttentionOptions):
    """The kernel's config for the batch `args` (the six arrays), once the batch and the
    options are validated, and the batch's `_Table`."""
    dynamic_validate_inputs(*args, options)
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = args
    config = kernel.kernel_config(q, kv_pages, page_indices, options)
    return config, _Table(kv_lens, page_indices, cu_q_lens, num_seqs)


def _schedule(q, config: kernel.KernelConfig, table: _Table, raw_events) -> Schedule:
    """Turn (kind, step, heads_blk, seq, kv_blk, slot, kernel) tuples into Events with pages
    and rows (a decode sequence's one row; a mixed q block's rows of the sequence, as rows of
    the batch)."""
    bq = config.num_queries_per_block
    mixed_table = table.in_mixed_layout(config)
    events = []
    for kind, step, heads_blk, seq, kv_blk, slot, kernel_name in raw_events:
        tokens = config.kv_tokens_per_block
        kv_len = int(table.kv_lens[seq])
        q_rows = None
        if kind != "start":
            q_rows = table.q_rows(seq)
            if kernel_name == "mixed":
                q_rows = mixed_table.batch_rows(seq, (step[1] * bq, (step[1] + 1) * bq))
        events.append(
            Event(
                kind=kind,
                step=step,
                heads_blk=heads_blk,
                seq=seq,
                kv_blk=kv_blk,
                slot=slot,
                pages=table.pages(seq, kv_blk, config),
                kv_tokens=(kv_blk * tokens, min((kv_blk + 1) * tokens, kv_len)),
                q_rows=q_rows,
                kernel=kernel_name,
            )
        )
    decode_blocks = cdiv(config.max_num_seqs, config.decode_seqs_per_block)
    return Schedule(
        grid=(config.num_heads_blocks, cdiv(q.shape[0], bq)),
        num_queries_per_block=bq,
        num_kv_pages_per_block=config.num_kv_pages_per_block,
        page_size=config.page_size,
        num_q_heads_per_block=config.num_q_heads_per_block,
        num_kv_heads_per_block=config.num_kv_heads_per_block,
        events=tuple(events),
        decode_grid=(config.num_heads_blocks, decode_blocks),
        decode_seqs_per_block=config.decode_seqs_per_block,
        mixed_q_rows=tuple(mixed_table.q_rows(s) for s in range(len(table.kv_lens))),
    )
