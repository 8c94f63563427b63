"""Ragged paged attention as a Pallas TPU kernel.

The vectorized version gathers every page of every sequence slot, however short the sequence.
This kernel reads only the pages that are needed, and overlaps reading them with computing.

Data movement, the new idea of this chapter:

* `kv_lens`, `page_indices`, `cu_q_lens` and `num_seqs` are *scalar-prefetched*: copied into
  SMEM before the kernel starts, so the kernel can branch on them and compute DMA addresses.
* `q` and the output move in blocks of `num_queries_per_block` rows, which Pallas copies
  between HBM and VMEM for us (a `BlockSpec`).
* `kv_pages` stays in HBM (`memory_space=pl.ANY`). The kernel copies the pages it needs into
  VMEM itself, `num_kv_pages_per_block` pages at a time (one "KV block"), with
  `pltpu.make_async_copy` and a DMA semaphore.
* Two VMEM buffers (slots 0 and 1) hold KV blocks. While the kernel computes with one slot, the
  DMA engine fills the other with the *next* KV block: the next block of this sequence, or the
  first block of the next sequence, q block or heads block. This is double buffering.

The grid is `(num_heads_blocks, num_q_blocks)`. One grid step takes one block of q rows and
one block of heads, and walks over the sequences that own those rows:

    for each sequence with rows in this q block:
        for each KV block those rows can see:
            start copying the next KV block into the other slot
            wait for this KV block
            attend: update the online softmax (m, l, acc) of the sequence's rows

Every KV head serves `num_q_heads // num_kv_heads` q heads (GQA). Those q heads are folded
into the rows of one matrix, so each KV head meets its whole group in one matmul.

The functions below follow that order: the public entry point, the block sizes, the
`pallas_call`, then the kernel body and the small functions it is made of. `minilib.schedule`
replays the same walk in plain Python, and its tests check that it is the kernel's walk.

Compared with JAX's kernel (jax/experimental/pallas/ops/tpu/ragged_paged_attention), which
makes the same walk: KV blocks that no row of the q block can see (past the causal diagonal,
or before the sliding window) are skipped; only the pages a sequence has are copied; idle
sequences (q_len 0) are skipped; and the softmax state is reset once per q block, so no masked
stores are needed.

Written for JAX's TPU interpret mode as well as for the chip: refs are never reshaped or
bitcast (interpret mode cannot), only values are; no masked loads or stores (a `jnp.where` on
values keeps the rows that must not change).

What is checked without a TPU: parity in interpret mode, and lowering to a Mosaic custom call
for v5e and v6e with `jax.export`. Mosaic's own compiler passes run only in libtpu, on a TPU
host; the likeliest place for them to object is `load_kv_head`, which reads one head slot of
every token (a size-1 slice of the second-to-last axis) and reshapes it to [tokens, head_dim].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.block_sizes import (  # noqa: F401  (re-exported: the policy's old home)
    DEFAULT_NUM_QUERIES_PER_BLOCK,
    KV_BUFFERS_VMEM_BUDGET,
    MAX_PAGES_PER_BLOCK,
    TARGET_KV_TOKENS_PER_BLOCK,
    default_block_sizes,
    num_kv_heads_per_block,
    packing,
)
from minilib.reference import DEFAULT_MASK_VALUE, dequantize
from minilib.validation import static_validate_inputs

# The m and l scratch rows are 128 lanes wide, one vector register row: TPU vector memory is
# laid out in (8, 128) tiles, so a [rows, 1] array would take the same space anyway.
LANES = 128

# The block-size policy lives in minilib.block_sizes (per-chip defaults and their cost model);
# its names stay importable from here.

# Event kinds in the trace the kernel can record for minilib.schedule.
TRACE_START, TRACE_WAIT, TRACE_COMPUTE = 1, 2, 3
TRACE_FIELDS = 7  # kind, step heads block, step q block, heads block, seq, kv block, slot


def ragged_paged_attention(
    q: jax.Array,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret=None,
) -> jax.Array:  # [max_num_batched_tokens, num_q_heads, head_dim]
    """Ragged paged attention on a TPU, or on CPU in Pallas' TPU interpret mode.

    Same arguments as JAX's `ragged_paged_attention`, plus `interpret`:
      None: compile for the chip when `jax.default_backend() == "tpu"`, else interpret;
      False: compile; True or a `pltpu.InterpretParams`: interpret (True means the defaults).

    Returns an array shaped like `q`; rows past `cu_q_lens[num_seqs]` are zeros.
    `num_kv_pages_per_block` and `num_queries_per_block` default to `default_block_sizes`.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> ragged_paged_attention(*batch.args(), sm_scale=0.125).shape
    (4, 4, 64)
    """
    static_validate_inputs(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )
    config = kernel_config(
        q,
        kv_pages,
        page_indices,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=DEFAULT_MASK_VALUE if mask_value is None else mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
    )
    out, _ = _rpa_jit(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        config=config,
        vmem_limit_bytes=vmem_limit_bytes,
        interpret=resolve_interpret(interpret),
        trace_capacity=0,
    )
    return out


def resolve_interpret(interpret):
    """What to pass to `pl.pallas_call(interpret=...)`: False on a TPU, else TPU interpret mode.

    Only `jax.default_backend()` is consulted, never `jax.devices()`, so that lowering for a
    TPU on a machine without one (`jax.export`) takes the compiled path when asked to.
    """
    if interpret is None:
        return False if jax.default_backend() == "tpu" else pltpu.InterpretParams()
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret


# ---------------------------------------------------------------------------------------------
# Block sizes: everything the kernel needs to know that is fixed at compile time.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The static shape of the computation: block sizes and attention options."""

    num_queries_per_block: int  # q rows per grid step
    num_kv_pages_per_block: int  # pages per KV block (one DMA batch, one softmax update)
    page_size: int
    pages_per_seq: int
    num_heads_blocks: int  # grid axis 0
    num_kv_heads_per_block: int
    num_q_heads_per_kv_head: int  # the GQA group size
    head_dim: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    mask_value: float
    k_scale: float | None
    v_scale: float | None

    @property
    def kv_tokens_per_block(self) -> int:
        return self.num_kv_pages_per_block * self.page_size

    @property
    def num_q_heads_per_block(self) -> int:
        return self.num_kv_heads_per_block * self.num_q_heads_per_kv_head

    @property
    def rows_per_kv_head(self) -> int:
        """Rows of the folded q matrix of one KV head: each q row once per q head of the group."""
        return self.num_queries_per_block * self.num_q_heads_per_kv_head


def kernel_config(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]; only shape and dtype are used
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]; shape and dtype
    page_indices,  # i32[max_num_seqs, pages_per_seq]; shape
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float = DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
) -> KernelConfig:
    """Choose the heads blocks and fill in default block sizes. Inputs must be validated."""
    max_num_batched_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_kv_heads, _ = kv_pages.shape
    num_kv_heads = num_combined_kv_heads // 2
    _, pages_per_seq = page_indices.shape
    kv_heads_per_block = num_kv_heads_per_block(num_q_heads, num_kv_heads, q.dtype, kv_pages.dtype)
    default_pages, default_queries = default_block_sizes(
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        max_num_batched_tokens=max_num_batched_tokens,
        bytes_per_page=page_size * 2 * kv_heads_per_block * head_dim * kv_pages.dtype.itemsize,
    )
    return KernelConfig(
        num_queries_per_block=num_queries_per_block or default_queries,
        num_kv_pages_per_block=num_kv_pages_per_block or default_pages,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        num_heads_blocks=num_kv_heads // kv_heads_per_block,
        num_kv_heads_per_block=kv_heads_per_block,
        num_q_heads_per_kv_head=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
    )


# ---------------------------------------------------------------------------------------------
# The pallas_call: grid, block specs, scratch memory.
# ---------------------------------------------------------------------------------------------


@functools.partial(
    jax.jit, static_argnames=("config", "vmem_limit_bytes", "interpret", "trace_capacity")
)
def _rpa_jit(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, config, vmem_limit_bytes,
    interpret, trace_capacity
):  # fmt: skip
    call = rpa_pallas_call(
        q,
        kv_pages,
        config=config,
        vmem_limit_bytes=vmem_limit_bytes,
        interpret=interpret,
        trace_capacity=trace_capacity,
    )
    outs = call(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_pages)
    return (outs[0], outs[1]) if trace_capacity else (outs[0], None)


def rpa_pallas_call(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]; shape and dtype
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]; shape and dtype
    *,
    config: KernelConfig,
    vmem_limit_bytes: int | None = None,
    interpret=False,
    trace_capacity: int = 0,
):
    """Build the `pallas_call`. Called with (kv_lens, page_indices, cu_q_lens, num_seqs, q,
    kv_pages); returns (out,) or, with `trace_capacity > 0`, (out, trace).

    trace: i32[1 + trace_capacity, TRACE_FIELDS]; `trace[0, 0]` counts the events, which are
    rows 1.. of (kind, step heads block, step q block, heads block, seq, kv block, slot).
    """
    max_num_batched_tokens, _, head_dim = q.shape
    c = config
    num_q_blocks = pl.cdiv(max_num_batched_tokens, c.num_queries_per_block)
    q_block = (c.num_queries_per_block, c.num_q_heads_per_block, head_dim)

    def q_index_map(heads_blk, q_blk, *scalar_prefetch_refs):
        return (q_blk, heads_blk, 0)

    in_specs = [
        pl.BlockSpec(q_block, q_index_map),
        pl.BlockSpec(memory_space=pl.ANY),  # kv_pages stay in HBM; the kernel copies pages
    ]
    out_specs = [pl.BlockSpec(q_block, q_index_map)]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if trace_capacity:
        out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        out_shape.append(jax.ShapeDtypeStruct((1 + trace_capacity, TRACE_FIELDS), jnp.int32))
    rows = c.rows_per_kv_head
    scratch_shapes = [
        pltpu.VMEM(  # kv_bufs: two slots of one KV block each
            (2, c.num_kv_pages_per_block, c.page_size, 2 * c.num_kv_heads_per_block, head_dim),
            kv_pages.dtype,
        ),
        pltpu.SemaphoreType.DMA((2,)),  # sems: one per slot
        pltpu.VMEM((c.num_kv_heads_per_block, rows, LANES), jnp.float32),  # m_ref
        pltpu.VMEM((c.num_kv_heads_per_block, rows, LANES), jnp.float32),  # l_ref
        pltpu.VMEM((c.num_kv_heads_per_block, rows, head_dim), jnp.float32),  # acc_ref
        pltpu.SMEM((1,), jnp.int32),  # slot_ref: the slot the next KV block is loading into
    ]
    kernel = functools.partial(rpa_kernel, config=c, trace_capacity=trace_capacity)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(c.num_heads_blocks, num_q_blocks),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch_shapes,
        ),
        compiler_params=pltpu.CompilerParams(
            # "arbitrary": the grid runs in order on one core, because each step starts the
            # copy that the next step waits for.
            dimension_semantics=("arbitrary", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        out_shape=out_shape,
        interpret=interpret,
        name="minilib_ragged_paged_attention",
    )


# ---------------------------------------------------------------------------------------------
# The kernel body.
# ---------------------------------------------------------------------------------------------


def rpa_kernel(
    # Scalar prefetch, in SMEM:
    kv_lens_ref,  # i32[max_num_seqs]
    page_indices_ref,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    num_seqs_ref,  # i32[1]
    # Inputs:
    q_ref,  # [num_queries_per_block, num_q_heads_per_block, head_dim], VMEM
    kv_pages_hbm_ref,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim], HBM
    # Outputs, then scratch:
    *refs,
    config: KernelConfig,
    trace_capacity: int,
):
    """One grid step: one block of q rows, one block of heads."""
    if trace_capacity:
        o_ref, trace_ref, kv_bufs, sems, m_ref, l_ref, acc_ref, slot_ref = refs
    else:
        (o_ref, kv_bufs, sems, m_ref, l_ref, acc_ref, slot_ref), trace_ref = refs, None
    # o_ref: [num_queries_per_block, num_q_heads_per_block, head_dim], VMEM
    # kv_bufs: [2, num_kv_pages_per_block, page_size, 2*num_kv_heads_per_block, head_dim]
    # m_ref, l_ref: f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
    # acc_ref: f32[num_kv_heads_per_block, rows_per_kv_head, head_dim]
    # slot_ref: i32[1], SMEM, kept from one grid step to the next
    batch = SeqTable(kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, config)
    dma = KVBlockCopier(kv_pages_hbm_ref, kv_bufs, sems, batch, config)
    softmax = OnlineSoftmax(m_ref, l_ref, acc_ref, config)
    trace = Trace(trace_ref, trace_capacity)
    step = (pl.program_id(0), pl.program_id(1))  # (heads_blk, q_blk)

    @pl.when((step[0] == 0) & (step[1] == 0))
    def _start_the_first_copy():
        slot_ref[0] = 0
        trace.reset()

        @pl.when(batch.total_q_len() > 0)
        def _():
            first = first_work(batch)
            dma.start(first, 0)
            trace.record(TRACE_START, step, first, 0)

    softmax.init()

    @pl.when(step[1] * config.num_queries_per_block < batch.total_q_len())
    def _attend_this_q_block():
        walker = QBlockWalker(step, q_ref, kv_bufs, softmax, batch, dma, trace, config)
        slot_ref[0] = walker.run(slot_ref[0])

    softmax.write_output(o_ref)


class QBlockWalker:
    """Walks one grid step's work: the sequences owning rows of the q block, and for each the
    KV blocks its rows can see. `run` returns the slot the next KV block is loading into."""

    def __init__(self, step, q_ref, kv_bufs, softmax, batch, dma, trace, config: KernelConfig):
        self.heads_blk, self.q_blk = step
        self.q_ref = q_ref  # [num_queries_per_block, num_q_heads_per_block, head_dim]
        self.kv_bufs = kv_bufs  # [2, num_kv_pages_per_block, page_size, 2*kvh_per_blk, hd]
        self.softmax = softmax
        self.batch = batch
        self.dma = dma
        self.trace = trace
        self.config = config
        self.q_blk_end = (self.q_blk + 1) * config.num_queries_per_block
        self.first_live = next_live_seq(batch, 0)  # where the next heads block starts

    def run(self, slot):
        first_seq = first_seq_in_q_block(self.batch, self.q_blk * self.config.num_queries_per_block)
        _, slot = lax.while_loop(self.has_rows_here, self.attend_seq, (first_seq, slot))
        return slot

    def has_rows_here(self, carry):
        seq, _ = carry
        return (seq < self.batch.num_seqs()) & (self.batch.q_start(seq) < self.q_blk_end)

    def attend_seq(self, carry):
        seq, slot = carry
        first_kv_blk, end_kv_blk = kv_block_range(self.batch, self.config, seq, self.q_blk)
        attend = functools.partial(self.attend_kv_block, seq)
        slot = lax.fori_loop(first_kv_blk, end_kv_blk, attend, slot)
        return next_live_seq(self.batch, seq + 1), slot

    def attend_kv_block(self, seq, kv_blk, slot):
        """Start copying the next KV block into the other slot, wait for this one, and fold
        it into the softmax of the sequence's rows, one KV head at a time."""
        step = (self.heads_blk, self.q_blk)
        here = Work(self.heads_blk, seq, kv_blk)
        nxt = next_work(self.batch, self.config, self.q_blk, here, self.first_live)

        @pl.when(nxt.heads_blk < self.config.num_heads_blocks)
        def _prefetch_the_next_block():
            self.dma.start(nxt, 1 - slot)
            self.trace.record(TRACE_START, step, nxt, 1 - slot)

        self.dma.wait(here, slot)
        self.trace.record(TRACE_WAIT, step, here, slot)
        visible, in_seq = score_mask(self.batch, seq, self.q_blk, kv_blk, self.config)
        for kv_head in range(self.config.num_kv_heads_per_block):
            k, v = load_kv_head(self.kv_bufs, slot, kv_head, self.config)
            q = load_q_group(self.q_ref, kv_head, self.config)
            k, v = prepare_kv(k, v, q.dtype, kv_blk, self.batch.kv_len(seq), self.config)
            self.softmax.update(kv_head, q, k, v, visible, in_seq)
        self.trace.record(TRACE_COMPUTE, step, here, slot)
        return 1 - slot


# ---------------------------------------------------------------------------------------------
# Where the rows and pages are: scalar arithmetic on the prefetched tables.
# ---------------------------------------------------------------------------------------------


class SeqTable:
    """Read access to the scalar-prefetched batch description (SMEM refs)."""

    def __init__(self, kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, config):
        self.kv_lens_ref = kv_lens_ref  # i32[max_num_seqs]
        self.page_indices_ref = page_indices_ref  # i32[max_num_seqs, pages_per_seq]
        self.cu_q_lens_ref = cu_q_lens_ref  # i32[max_num_seqs + 1]
        self.num_seqs_ref = num_seqs_ref  # i32[1]
        self.config = config

    def num_seqs(self):
        return self.num_seqs_ref[0]

    def q_start(self, seq):
        return self.cu_q_lens_ref[seq]

    def q_end(self, seq):
        return self.cu_q_lens_ref[seq + 1]

    def kv_len(self, seq):
        return self.kv_lens_ref[seq]

    def total_q_len(self):
        return self.cu_q_lens_ref[self.num_seqs()]

    def num_pages(self, seq):
        """Pages holding the sequence's kv_len tokens (never more than pages_per_seq)."""
        pages = pl.cdiv(self.kv_len(seq), self.config.page_size)
        return jnp.minimum(pages, self.config.pages_per_seq)

    def page(self, seq, page_pos):
        return self.page_indices_ref[seq, page_pos]


def next_live_seq(batch: SeqTable, seq):
    """The first sequence from `seq` on that has q rows (idle ones, q_len 0, have no work);
    `num_seqs` if there is none."""
    n = batch.num_seqs()

    def is_idle(s):
        s_safe = jnp.minimum(s, n - 1)  # never read past the live entries
        return (s < n) & (batch.q_end(s_safe) == batch.q_start(s_safe))

    return lax.while_loop(is_idle, lambda s: s + 1, seq)


def first_seq_in_q_block(batch: SeqTable, q_blk_start):
    """The sequence owning row `q_blk_start`: the first whose rows end after it."""
    last = batch.num_seqs() - 1
    return lax.while_loop(
        lambda s: (s < last) & (batch.q_end(s) <= q_blk_start), lambda s: s + 1, 0
    )


def kv_block_range(batch: SeqTable, config: KernelConfig, seq, q_blk):
    """The KV blocks [first, end) that the rows of `seq` in q block `q_blk` can see.

    Row r of the sequence sits at position kv_len - q_len + r and sees the keys up to that
    position (causal), and with a sliding window only the last `sliding_window` of them. Blocks
    outside that range are skipped: their copy and their compute would be thrown away.
    """
    c = config
    q_start, q_end, kv_len = batch.q_start(seq), batch.q_end(seq), batch.kv_len(seq)
    first_row = jnp.maximum(q_start, q_blk * c.num_queries_per_block)
    last_row = jnp.minimum(q_end, (q_blk + 1) * c.num_queries_per_block) - 1
    first_pos = kv_len - q_end + first_row  # = kv_len - q_len + (first_row - q_start)
    last_pos = kv_len - q_end + last_row
    first_key = 0 if c.sliding_window is None else jnp.maximum(first_pos - c.sliding_window + 1, 0)
    return first_key // c.kv_tokens_per_block, last_pos // c.kv_tokens_per_block + 1


@dataclasses.dataclass(frozen=True)
class Work:
    """One KV block's worth of work: which heads, which sequence, which KV block."""

    heads_blk: jax.Array
    seq: jax.Array
    kv_blk: jax.Array


def first_work(batch: SeqTable) -> Work:
    seq = next_live_seq(batch, 0)
    first_kv_blk, _ = kv_block_range(batch, batch.config, seq, 0)
    return Work(jnp.int32(0), seq, first_kv_blk)


def next_work(batch: SeqTable, config: KernelConfig, q_blk, here: Work, first_live) -> Work:
    """The KV block the kernel will attend to after `here` (in q block `q_blk`), so that its
    copy can start now. After the very last one, `heads_blk` is `num_heads_blocks`.

    In order: the next KV block of this sequence; else the same sequence in the next q block
    (if its rows go on); else the next live sequence; else the first live sequence of the next
    heads block.
    """
    c = config
    bq = c.num_queries_per_block
    _, end_kv_blk = kv_block_range(batch, c, here.seq, q_blk)
    more_kv = here.kv_blk + 1 < end_kv_blk
    rows_go_on = batch.q_end(here.seq) > (q_blk + 1) * bq
    following = next_live_seq(batch, here.seq + 1)
    heads_done = following >= batch.num_seqs()

    # From the last resort to the first choice, each overriding the one before:
    # the first live sequence of the next heads block (its q block is 0) ...
    seq, seq_q_blk = first_live, 0
    # ... the next live sequence, in the q block holding its first row ...
    following_q_blk = batch.q_start(jnp.minimum(following, batch.num_seqs() - 1)) // bq
    seq = jnp.where(heads_done, seq, following)
    seq_q_blk = jnp.where(heads_done, seq_q_blk, following_q_blk)
    # ... this sequence, in the next q block ...
    seq = jnp.where(rows_go_on, here.seq, seq)
    seq_q_blk = jnp.where(rows_go_on, q_blk + 1, seq_q_blk)
    # ... (all of which start at their first visible KV block) ... this sequence's next block.
    first_kv_blk, _ = kv_block_range(batch, c, seq, seq_q_blk)
    seq = jnp.where(more_kv, here.seq, seq)
    kv_blk = jnp.where(more_kv, here.kv_blk + 1, first_kv_blk)
    next_heads = heads_done & ~rows_go_on & ~more_kv
    heads_blk = jnp.where(next_heads, here.heads_blk + 1, here.heads_blk)
    return Work(heads_blk, seq, kv_blk)


# ---------------------------------------------------------------------------------------------
# Moving KV blocks: HBM pages -> a VMEM slot.
# ---------------------------------------------------------------------------------------------


class KVBlockCopier:
    """Starts and waits for the page copies of one KV block into one slot of `kv_bufs`."""

    def __init__(self, kv_pages_hbm_ref, kv_bufs, sems, batch: SeqTable, config: KernelConfig):
        self.kv_pages_hbm_ref = kv_pages_hbm_ref  # [total_num_pages, page_size, 2*kvh, hd]
        self.kv_bufs = kv_bufs  # [2, num_kv_pages_per_block, page_size, 2*kvh_per_blk, hd]
        self.sems = sems  # DMA semaphores [2]
        self.batch = batch
        self.config = config

    def start(self, work: Work, slot):
        self._for_each_page(work, slot, lambda copy: copy.start())

    def wait(self, work: Work, slot):
        self._for_each_page(work, slot, lambda copy: copy.wait())

    def _for_each_page(self, work: Work, slot, action):
        """Page i of the block goes to kv_bufs[slot, i]; only the pages the sequence has.

        Pages past the end of the sequence are not copied at all: their part of the buffer
        keeps stale data, which the compute zeroes. `wait` must see the same pages as `start`,
        so both come through here.
        """
        num_pages = self.batch.num_pages(work.seq)
        for i in range(self.config.num_kv_pages_per_block):
            page_pos = work.kv_blk * self.config.num_kv_pages_per_block + i
            pl.when(page_pos < num_pages)(
                functools.partial(self._copy_page, work, slot, i, page_pos, action)
            )

    def _copy_page(self, work: Work, slot, i: int, page_pos, action):
        """Copy (or wait for) one page: this heads block's K/V heads of every token in it."""
        kv_heads = self.config.num_kv_heads_per_block
        combined_heads = pl.ds(work.heads_blk * 2 * kv_heads, 2 * kv_heads)
        page = self.batch.page(work.seq, page_pos)
        copy = pltpu.make_async_copy(
            self.kv_pages_hbm_ref.at[page, :, combined_heads, :],  # [page_size, 2*kvh, hd]
            self.kv_bufs.at[slot, i],  # [page_size, 2*num_kv_heads_per_block, head_dim]
            self.sems.at[slot],
        )
        action(copy)


# ---------------------------------------------------------------------------------------------
# Computing with a KV block: online softmax, one KV head and its group of q heads at a time.
# ---------------------------------------------------------------------------------------------


def load_kv_head(
    kv_bufs,  # [2, num_kv_pages_per_block, page_size, 2*num_kv_heads_per_block, head_dim]
    slot,
    kv_head: int,  # within the heads block
    config: KernelConfig,
):  # -> k, v: [kv_tokens_per_block, head_dim], kv dtype
    """K and V of one KV head from a slot, as [tokens, head_dim] matrices.

    K sits in combined slot 2*kv_head and V in 2*kv_head + 1 of every token. The ref is indexed
    and the *value* reshaped: interpret mode cannot reshape refs.
    """
    c = config
    tokens = c.kv_tokens_per_block
    k = kv_bufs[slot, :, :, 2 * kv_head, :].reshape(tokens, c.head_dim)
    v = kv_bufs[slot, :, :, 2 * kv_head + 1, :].reshape(tokens, c.head_dim)
    return k, v


def load_q_group(q_ref, kv_head: int, config: KernelConfig):  # -> [rows_per_kv_head, head_dim]
    """The q heads that share `kv_head`, folded into rows: row r*group + g is q row r, head g.

    q_ref: [num_queries_per_block, num_q_heads_per_block, head_dim]
    """
    c = config
    group = c.num_q_heads_per_kv_head
    q = q_ref[:, kv_head * group : (kv_head + 1) * group, :]  # [num_queries, group, head_dim]
    return q.reshape(c.rows_per_kv_head, c.head_dim)


def prepare_kv(
    k,  # [kv_tokens_per_block, head_dim], kv dtype
    v,  # [kv_tokens_per_block, head_dim], kv dtype
    dtype,
    kv_blk,
    kv_len,
    config: KernelConfig,
):  # -> k, v: [kv_tokens_per_block, head_dim], dtype
    """Dequantize (fp8) to the compute dtype and zero the tokens at or past kv_len."""
    k = zero_missing_keys(dequantize(k, config.k_scale, dtype), kv_blk, kv_len, config)
    v = zero_missing_keys(dequantize(v, config.v_scale, dtype), kv_blk, kv_len, config)
    return k, v


def zero_missing_keys(x, kv_blk, kv_len, config: KernelConfig):  # x: [kv_tokens, head_dim]
    """Zero the token rows at or past kv_len: they hold NaN or stale pages, and masking the
    score does not help there, since 0 * NaN = NaN in p @ v. (In float32: v5e has no bf16
    vector unit.)"""
    pos = kv_blk * config.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where(pos < kv_len, x.astype(jnp.float32), 0.0).astype(x.dtype)


def score_mask(batch: SeqTable, seq, q_blk, kv_blk, config: KernelConfig):
    """Which scores count, and which rows belong to `seq`.

    Returns visible: bool[rows_per_kv_head, kv_tokens_per_block] (causal, sliding window) and
    in_seq: bool[rows_per_kv_head, 1] (rows of other sequences, or padding, must not change).
    """
    c = config
    shape = (c.rows_per_kv_head, c.kv_tokens_per_block)
    row = q_blk * c.num_queries_per_block + (
        lax.broadcasted_iota(jnp.int32, shape, 0) // c.num_q_heads_per_kv_head
    )
    q_pos = batch.kv_len(seq) - batch.q_end(seq) + row  # position of the row in its sequence
    k_pos = kv_blk * c.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, shape, 1)
    visible = k_pos <= q_pos
    if c.sliding_window is not None:
        visible &= k_pos > q_pos - c.sliding_window
    in_seq = (row >= batch.q_start(seq)) & (row < batch.q_end(seq))
    return visible, in_seq[:, :1]


class OnlineSoftmax:
    """The running max m, running sum l and unnormalized output acc of every row of the q block,
    per KV head: softmax(s) @ v computed one KV block at a time."""

    def __init__(self, m_ref, l_ref, acc_ref, config: KernelConfig):
        self.m_ref = m_ref  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
        self.l_ref = l_ref  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
        self.acc_ref = acc_ref  # f32[num_kv_heads_per_block, rows_per_kv_head, head_dim]
        self.config = config

    def init(self):
        self.m_ref[...] = jnp.full(self.m_ref.shape, -jnp.inf, jnp.float32)
        self.l_ref[...] = jnp.zeros(self.l_ref.shape, jnp.float32)
        self.acc_ref[...] = jnp.zeros(self.acc_ref.shape, jnp.float32)

    def update(
        self,
        kv_head: int,
        q,  # [rows_per_kv_head, head_dim]
        k,  # [kv_tokens_per_block, head_dim]
        v,  # [kv_tokens_per_block, head_dim]
        visible,  # bool[rows_per_kv_head, kv_tokens_per_block]
        in_seq,  # bool[rows_per_kv_head, 1]
    ):
        """Fold one KV block into the rows `in_seq`, for one KV head and its q heads."""
        c = self.config
        s = jnp.einsum("rd,td->rt", q, k, preferred_element_type=jnp.float32) * c.sm_scale
        if c.soft_cap is not None:
            s = c.soft_cap * jnp.tanh(s / c.soft_cap)
        s = jnp.where(visible, s, c.mask_value)  # [rows, kv_tokens]

        m_prev = self.m_ref[kv_head][:, :1]  # [rows, 1]
        l_prev = self.l_ref[kv_head][:, :1]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.exp(s - m_next)  # [rows, kv_tokens]
        alpha = jnp.exp(m_prev - m_next)  # rescales what was summed under the old max
        l_next = alpha * l_prev + p.sum(axis=1, keepdims=True)
        pv = jnp.einsum("rt,td->rd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_next = alpha * self.acc_ref[kv_head] + pv

        # Rows of other sequences (and padding rows, which may be NaN) keep their state.
        self._store(self.m_ref, kv_head, m_next, in_seq)
        self._store(self.l_ref, kv_head, l_next, in_seq)
        self._store(self.acc_ref, kv_head, acc_next, in_seq)

    @staticmethod
    def _store(ref, kv_head: int, new, in_seq):
        """ref[kv_head] = new on the rows in_seq (broadcast across lanes), old elsewhere."""
        old = ref[kv_head]  # [rows, LANES or head_dim]
        ref[kv_head] = jnp.where(in_seq, jnp.broadcast_to(new, old.shape), old)

    def write_output(self, o_ref):
        """out = acc / l for each KV head's group of q heads. Rows that no sequence owns have
        l = 0 and acc = 0, and come out as zeros.

        o_ref: [num_queries_per_block, num_q_heads_per_block, head_dim]
        """
        c = self.config
        group = c.num_q_heads_per_kv_head
        for kv_head in range(c.num_kv_heads_per_block):
            total = self.l_ref[kv_head][:, :1]  # [rows, 1]
            out = self.acc_ref[kv_head] / jnp.where(total == 0.0, 1.0, total)  # [rows, hd]
            out = out.reshape(c.num_queries_per_block, group, c.head_dim)
            o_ref[:, kv_head * group : (kv_head + 1) * group, :] = out.astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------------
# The schedule trace (for minilib.schedule): one row per DMA start, DMA wait and compute.
# ---------------------------------------------------------------------------------------------


class Trace:
    """Appends events to the SMEM trace output; does nothing when no trace was asked for."""

    def __init__(self, trace_ref, capacity: int):
        self.trace_ref = trace_ref  # i32[1 + capacity, TRACE_FIELDS]; [0, 0] counts the events
        self.capacity = capacity

    def reset(self):
        if self.trace_ref is not None:
            self.trace_ref[0, 0] = 0

    def record(self, kind: int, step, work: Work, slot):
        if self.trace_ref is None:
            return
        n = self.trace_ref[0, 0]

        @pl.when(n < self.capacity)
        def _():
            fields = (kind, *step, work.heads_blk, work.seq, work.kv_blk, slot)
            for j, value in enumerate(fields):
                self.trace_ref[n + 1, j] = jnp.asarray(value, jnp.int32)

        self.trace_ref[0, 0] = n + 1


def record_trace(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, config: KernelConfig,
    capacity: int, interpret=None
) -> tuple[jax.Array, np.ndarray]:  # fmt: skip
    """Run the kernel with its trace on. Returns (out, events: i32[num_events, TRACE_FIELDS]).

    Used by `minilib.schedule.record_schedule`; raises if more than `capacity` events happened.
    """
    interpret = pltpu.InterpretParams() if interpret is None else resolve_interpret(interpret)
    out, trace = _rpa_jit(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        config=config,
        vmem_limit_bytes=None,
        interpret=interpret,
        trace_capacity=capacity,
    )
    trace = np.asarray(trace)
    count = int(trace[0, 0])
    if count > capacity:
        raise ValueError(f"the kernel recorded {count} events, more than {capacity=}.")
    return out, trace[1 : count + 1]
