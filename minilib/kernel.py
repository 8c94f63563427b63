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

Two kernels, one call. A decode sequence (q_len 1, the common case when serving) owns one row
of a q block, but a q block computes all its rows against every KV block and throws the
others away. So `ragged_paged_attention` runs two `pallas_call`s (`split_configs`): first the
*decode kernel* (named `minilib_ragged_paged_attention_decode` in a compiled program) on the
one-token sequences, gathered into a batch of their own (`decode_batch`), a few sequences per
grid step, each attended alone, with one row per q head and no row selects (`DecodeWalker`);
then the *mixed kernel* (`minilib_ragged_paged_attention`) on the others, which treats the
one-token sequences as idle. The decode rows are scattered into its output. Both kernels are
this module's code: the walk, the copies and the softmax are shared, and `KernelConfig.decode`
says which rows a KV block meets.

The functions below follow that order: the public entry point, the block sizes, the two
kernels' split, the `pallas_call`, then the kernel body and the small functions it is made of.
`minilib.schedule` replays the same walks in plain Python, and its tests check that they are
the kernels' walks.

Compared with JAX's kernel (jax/experimental/pallas/ops/tpu/ragged_paged_attention), which
makes the same walk: KV blocks that no row of the q block can see (past the causal diagonal,
or before the sliding window) are skipped when masked keys weigh exactly 0, as with the default
mask value (a small `mask_value` gives them a weight, as in JAX's reference, and then every
block before kv_len is visited: `masking.mask_value_vanishes`); only the pages a sequence has
are copied; idle sequences (q_len 0) are skipped; and the softmax state is reset once per q
block, so no masked stores are needed.

What makes it lean on the chip (each measured in bundles per KV block, with
`minilib.tpu.compile`; static estimates, not timings):
* K and V of a head are read with one strided load through a flat 32-bit view of the slot; in
  bf16 a truncation and a mask split each word into K and V (`load_kv_head_strided`).
  head_dim 256 (or any multiple of 128) is copied in lane blocks of 128, each read the same
  way (`KVBlockCopier`).
* K is never cleaned: no row can see a key at or past kv_len, so the score mask replaces
  whatever is there (`apply_mask_value`). Only V is zeroed there, in float32 (0 * NaN = NaN in
  p @ v).
* m and l are kept 128 lanes wide, so the softmax update needs no cross-lane broadcasts.
* q is folded (each KV head's group of q heads into rows) once per grid step (per sequence in
  the decode kernel), into scratch, not in every KV block (`fold_q_heads`).
* The KV heads are software-pipelined: several heads' Q·K go to the MXU before their P·V, so
  the MXU and the vector units work at once (`attend_kv_heads`).
* One-token sequences have a kernel of their own (above).
* What follows a sequence (for the prefetch) is worked out once per sequence.

Written for JAX's TPU interpret mode as well as for the chip. Interpret mode cannot view a ref
as another shape or dtype, so there K and V are read by plain indexing (`load_kv_head`), and
the strided load is used only when the kernel is compiled (or run by plain `interpret=True`).
No masked loads or stores: a `jnp.where` on values keeps the rows that must not change.

Nothing in the batch description is trusted (`SeqTable`): under `jit` it cannot be validated,
so every loop bound is clamped (sequences to max_num_seqs, pages and KV blocks to
pages_per_seq) and every page number to the pages there are. A garbage batch gives garbage,
but no hang and no copy from outside `kv_pages`.

What is checked without a TPU: parity in TPU interpret mode (DMAs, semaphores and races
simulated) and, for the strided loads, in plain interpret mode; and Mosaic's own compiler, in
libtpu, which compiles for v4, v5e, v5p and v6e on any host where libtpu is installed
(`jax.experimental.topologies` gives a compile-only TPU device): what it accepts, and the
bundles it schedules, are what the chip would run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from minilib.block_sizes import (
    default_block_sizes,
    default_decode_seqs_per_block,
    default_head_pipeline,
    num_kv_heads_per_block,
    packing,
    packing_of_size,
)
from minilib.kernel_trace import TRACE_COMPUTE, TRACE_FIELDS, TRACE_START, TRACE_WAIT, Trace
from minilib.masking import (
    apply_mask_value,
    is_masked,
    kv_blocks_to_visit,
    mask_value_vanishes,
    q_position,
)
from minilib.options import DEFAULT_MASK_VALUE, AttentionOptions, attention_options
from minilib.reference import apply_soft_cap, dequantize
from minilib.validation import validate_inputs

# The public names. The kernel's inner steps (SeqTable, QBlockWalker, KVBlockCopier, next_work,
# OnlineSoftmax, ...) run only inside the kernel body; each is documented where it is defined.
__all__ = [
    "KERNEL_NAMES",
    "LANES",
    "KernelConfig",
    "decode_batch",
    "kernel_config",
    "ragged_paged_attention",
    "resolve_interpret",
    "rpa_pallas_call",
    "split_configs",
]

# The m and l scratch rows are 128 lanes wide, one vector register row: TPU vector memory is
# laid out in (8, 128) tiles, so a [rows, 1] array would take the same space anyway.
LANES = 128

# The pallas_calls' names, which a compiled program shows (`minilib.tpu.compile` reads them).
KERNEL_NAMES = {
    "mixed": "minilib_ragged_paged_attention",
    "decode": "minilib_ragged_paged_attention_decode",
}


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
    validate: bool = True,
) -> jax.Array:  # [max_num_batched_tokens, num_q_heads, head_dim]
    """Ragged paged attention on a TPU, or on CPU in Pallas' TPU interpret mode.

    Same arguments as JAX's `ragged_paged_attention`, plus `interpret`:
      None: compile for the chip when `jax.default_backend() == "tpu"`, else interpret;
      False: compile; True or a `pltpu.InterpretParams`: interpret (True means the defaults).

    Returns an array shaped like `q`; rows past `cu_q_lens[num_seqs]` are zeros.
    `num_kv_pages_per_block` and `num_queries_per_block` default to `default_block_sizes`.

    Called eagerly, it first checks the values of the inputs (`dynamic_validate_inputs`);
    `validate=False` skips that. Under `jax.jit` only the static checks can run: validate the
    batch outside jit, as JAX does.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> ragged_paged_attention(*batch.args(), sm_scale=0.125).shape
    (4, 4, 64)
    """
    options = AttentionOptions(
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
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    validate_inputs(*args, options, validate=validate)
    config = kernel_config(q, kv_pages, page_indices, options)
    out, _ = _rpa_jit(
        *args, config=config, interpret=resolve_interpret(interpret), trace_capacity=0
    )
    return out


def resolve_interpret(interpret):
    """What to pass to `pl.pallas_call(interpret=...)`: False on a TPU, else TPU interpret mode.

    Only `jax.default_backend()` is consulted, never `jax.devices()`, so that lowering for a
    TPU on a machine without one (`jax.export`) takes the compiled path when asked to.

    >>> resolve_interpret(False), type(resolve_interpret(True)).__name__
    (False, 'InterpretParams')
    """
    if interpret is None:
        return False if jax.default_backend() == "tpu" else pltpu.InterpretParams()
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret


# ---------------------------------------------------------------------------------------------
# Block sizes: everything the kernel needs to know that is fixed at compile time.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig(AttentionOptions):
    """The static shape of the computation: the attention options, with the block sizes
    filled in, and the shapes and head blocks they were chosen for. Frozen and hashable: the
    jitted kernel takes it as one static argument. `kernel_config` builds it.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(5, 20)], num_q_heads=8, num_kv_heads=2, page_size=16)
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices,
    ...                        num_queries_per_block=8, num_kv_pages_per_block=2)
    >>> config.kv_tokens_per_block, config.num_q_heads_per_kv_head, config.rows_per_kv_head
    (32, 4, 32)
    """

    num_queries_per_block: int  # q rows per grid step
    num_kv_pages_per_block: int  # pages per KV block (one DMA batch, one softmax update)
    page_size: int
    pages_per_seq: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_heads_blocks: int  # grid axis 0
    num_kv_heads_per_block: int
    num_q_heads_per_kv_head: int  # the GQA group size
    head_dim: int
    q_itemsize: int  # bytes per value of q's dtype, the compute dtype
    kv_itemsize: int  # ... and of kv_pages' dtype
    # Read each KV head with one strided load through a flat view of the slot (see
    # `load_kv_head`); set by `rpa_pallas_call` where refs can be viewed (not in TPU interpret).
    strided_kv_loads: bool = False
    # The two kernels of `ragged_paged_attention` (`split_configs`): the decode kernel serves
    # one-token sequences, one q row each (`DecodeWalker`); the mixed kernel leaves them to it
    # (treats them as idle). With both False, one kernel serves every sequence.
    decode: bool = False
    leaves_decode: bool = False
    decode_seqs_per_block: int = 1  # the decode kernel's q block: sequences per grid step
    # The software pipeline over KV heads (`attend_kv_heads`), set by `with_head_pipeline`.
    heads_in_flight: int = 1
    reload_v: bool = False

    @property
    def kv_tokens_per_block(self) -> int:
        return self.num_kv_pages_per_block * self.page_size

    @property
    def num_q_heads_per_block(self) -> int:
        return self.num_kv_heads_per_block * self.num_q_heads_per_kv_head

    @property
    def lane_blocks(self) -> int:
        """How many 128-lane blocks a KV slot holds head_dim in (see `KVBlockCopier`): 2 at
        head_dim 256; 1 when head_dim is 128, or not a multiple of 128."""
        return self.head_dim // LANES if self.head_dim % LANES == 0 else 1

    @property
    def lane_slices(self) -> tuple[slice, ...]:
        """The columns of head_dim in each lane block: (slice(0, 128), slice(128, 256)) at
        head_dim 256."""
        width = self.head_dim // self.lane_blocks
        return tuple(slice(f * width, (f + 1) * width) for f in range(self.lane_blocks))

    @property
    def rows_per_kv_head(self) -> int:
        """Rows of the folded q matrix of one KV head: each q row once per q head of the group
        (in the decode kernel, the one row of the sequence being walked)."""
        q_rows = 1 if self.decode else self.num_queries_per_block
        return q_rows * self.num_q_heads_per_kv_head


def kernel_config(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]; only shape and dtype are used
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]; shape and dtype
    page_indices,  # i32[max_num_seqs, pages_per_seq]; shape
    options: AttentionOptions | None = None,
    **option_values,
) -> KernelConfig:
    """Choose the heads blocks and fill in default block sizes. Inputs must be validated.

    The options come as one `AttentionOptions`, or as keywords (`num_queries_per_block=8`).

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(5, 20)], num_q_heads=8, num_kv_heads=2, page_size=16)
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, sliding_window=64)
    >>> config.sliding_window, config.num_heads_blocks * config.num_kv_heads_per_block
    (64, 2)
    """
    options = attention_options(options, **option_values)
    max_num_batched_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_kv_heads, _ = kv_pages.shape
    num_kv_heads = num_combined_kv_heads // 2
    max_num_seqs, pages_per_seq = page_indices.shape
    kv_heads_per_block = num_kv_heads_per_block(num_q_heads, num_kv_heads, q.dtype, kv_pages.dtype)
    default_pages, default_queries = default_block_sizes(
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        max_num_batched_tokens=max_num_batched_tokens,
        bytes_per_page=page_size * 2 * kv_heads_per_block * head_dim * kv_pages.dtype.itemsize,
        head_dim=head_dim,
    )
    options = dataclasses.replace(
        options,
        num_queries_per_block=options.num_queries_per_block or default_queries,
        num_kv_pages_per_block=options.num_kv_pages_per_block or default_pages,
    )
    q_heads_per_block = kv_heads_per_block * (num_q_heads // num_kv_heads)
    bytes_per_q_row = q_heads_per_block * head_dim * q.dtype.itemsize  # of one heads block
    config = KernelConfig(
        **dataclasses.asdict(options),
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_heads_blocks=num_kv_heads // kv_heads_per_block,
        num_kv_heads_per_block=kv_heads_per_block,
        num_q_heads_per_kv_head=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        q_itemsize=q.dtype.itemsize,
        kv_itemsize=kv_pages.dtype.itemsize,
        decode_seqs_per_block=default_decode_seqs_per_block(max_num_seqs, bytes_per_q_row),
    )
    return with_head_pipeline(config)


def with_head_pipeline(config: KernelConfig) -> KernelConfig:
    """`config` with the default software pipeline over KV heads for its rows per KV head
    (`block_sizes.default_head_pipeline`)."""
    heads, reload_v = default_head_pipeline(
        rows=config.rows_per_kv_head,
        kv_tokens=config.kv_tokens_per_block,
        head_dim=config.head_dim,
        num_kv_heads=config.num_kv_heads_per_block,
        itemsize=config.q_itemsize,
        strided=can_load_kv_strided(config),
    )
    return dataclasses.replace(config, heads_in_flight=heads, reload_v=reload_v)


# ---------------------------------------------------------------------------------------------
# The pallas_call: grid, block specs, scratch memory.
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config", "interpret", "trace_capacity"))
def _rpa_jit(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, config, interpret, trace_capacity
):
    """The two kernels on one batch: the decode kernel on its one-token sequences (gathered
    into a batch of their own), the mixed kernel on the others; the decode rows scattered
    into the mixed kernel's output. Returns (out, None), or with `trace_capacity > 0`
    (out, (decode trace, mixed trace))."""
    mixed_config, decode_config = split_configs(config)
    decode = decode_batch(kv_lens, page_indices, cu_q_lens, num_seqs, config)
    q_decode = jnp.take(q, decode.rows, axis=0, mode="clip")  # [max_num_seqs, heads, hd]
    decode_call = rpa_pallas_call(
        q_decode, kv_pages, config=decode_config, interpret=interpret,
        trace_capacity=trace_capacity,
    )  # fmt: skip
    decode_outs = decode_call(*decode.tables(), q_decode, kv_pages)
    mixed_call = rpa_pallas_call(
        q, kv_pages, config=mixed_config, interpret=interpret, trace_capacity=trace_capacity
    )
    mixed_outs = mixed_call(kv_lens, page_indices, cu_q_lens, num_seqs, q, kv_pages)
    # Rows of decode slots that hold no sequence point past the output: dropped.
    out = mixed_outs[0].at[decode.rows].set(decode_outs[0], mode="drop")
    return out, (decode_outs[1], mixed_outs[1]) if trace_capacity else None


def split_configs(config: KernelConfig) -> tuple[KernelConfig, KernelConfig]:
    """(mixed, decode): the configs of the two kernels `ragged_paged_attention` runs.

    Why a kernel of its own for decode: a sequence with one q row fills one row of a q
    block, and the mixed kernel computes every row of the block (rows_per_kv_head of them)
    against each KV block, then throws the others away with a select per row. The decode
    kernel computes the sequence's own row alone: one row per q head, no row selects, and
    for a single query the causal mask is only the kv_len (and window) mask. Its q block
    holds `decode_seqs_per_block` sequences, walked one after another in one grid
    step, so the fixed cost of a grid step is shared by several of them.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)], max_num_seqs=4)
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices)
    >>> mixed, decode = split_configs(config)
    >>> mixed.leaves_decode, decode.decode, decode.num_queries_per_block, decode.rows_per_kv_head
    (True, True, 4, 2)
    """
    decode = dataclasses.replace(
        config,
        decode=True,
        num_queries_per_block=config.decode_seqs_per_block,
        max_num_batched_tokens=config.max_num_seqs,  # the decode batch: one row per sequence
    )
    return dataclasses.replace(config, leaves_decode=True), with_head_pipeline(decode)


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """The one-token sequences of a batch, as a batch of their own: decode sequence i is
    sequence `seqs[i]` of the batch, and owns row i of the decode kernel's q (row `rows[i]`
    of the batch's q). Slots past `num_seqs` hold no sequence (their `rows` point past q)."""

    seqs: jax.Array  # i32[max_num_seqs]: sequence ids, then max_num_seqs
    rows: jax.Array  # i32[max_num_seqs]: q rows, then max_num_batched_tokens
    kv_lens: jax.Array  # i32[max_num_seqs]
    page_indices: jax.Array  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array  # i32[max_num_seqs + 1]: 0, 1, 2, ..., num_seqs, num_seqs, ...
    num_seqs: jax.Array  # i32[1]

    def tables(self):
        """The decode kernel's scalar prefetch: (kv_lens, page_indices, cu_q_lens, num_seqs)."""
        return self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs


def decode_batch(kv_lens, page_indices, cu_q_lens, num_seqs, config: KernelConfig) -> DecodeBatch:
    """Gather the one-token sequences (q_len == 1) of the first num_seqs, in order.

    Under `jit` the tables are not trusted here either: the lengths are clamped as `SeqTable`
    clamps them, so a garbage batch sends the decode kernel only rows and sequences that
    exist (the kernel clamps its tables again).

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(3, 3), (1, 9), (0, 4), (1, 5)])
    >>> d = decode_batch(*b.args()[2:], kernel_config(b.q, b.kv_pages, b.page_indices))
    >>> d.seqs.tolist(), d.rows.tolist(), d.kv_lens[:2].tolist(), d.cu_q_lens.tolist()
    ([1, 3, 4, 4], [3, 4, 5, 5], [9, 5], [0, 1, 2, 2, 2])
    """
    max_num_seqs, rows = config.max_num_seqs, config.max_num_batched_tokens
    cu = jnp.clip(cu_q_lens, 0, rows)
    live = jnp.arange(max_num_seqs) < jnp.clip(num_seqs[0], 0, max_num_seqs)
    is_decode = live & (cu[1:] - cu[:-1] == 1)
    (seqs,) = jnp.nonzero(is_decode, size=max_num_seqs, fill_value=max_num_seqs)
    count = jnp.sum(is_decode, dtype=jnp.int32)
    gathered = jnp.minimum(seqs, max_num_seqs - 1)  # a real slot to read for the empty ones
    return DecodeBatch(
        seqs=seqs.astype(jnp.int32),
        rows=jnp.where(seqs < max_num_seqs, cu[gathered], rows).astype(jnp.int32),
        kv_lens=kv_lens[gathered],
        page_indices=page_indices[gathered],
        cu_q_lens=jnp.minimum(jnp.arange(max_num_seqs + 1, dtype=jnp.int32), count),
        num_seqs=count[None],
    )


def rpa_pallas_call(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]; shape and dtype
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]; shape and dtype
    *,
    config: KernelConfig,
    interpret=False,
    trace_capacity: int = 0,
    copier_class: type[KVBlockCopier] | None = None,
):
    """Build the `pallas_call`. Called with (kv_lens, page_indices, cu_q_lens, num_seqs, q,
    kv_pages); returns (out,) or, with `trace_capacity > 0`, (out, trace).

    `copier_class` (default `KVBlockCopier`) moves the KV blocks; the tests pass a subclass
    with a deliberate bug to show that their checks catch it.

    trace: i32[1 + trace_capacity, TRACE_FIELDS]; `trace[0, 0]` counts the events, which are
    rows 1.. of (kind, step heads block, step q block, heads block, seq, kv block, slot).

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices)
    >>> call = rpa_pallas_call(batch.q, batch.kv_pages, config=config,
    ...                        interpret=resolve_interpret(True))
    >>> (out,) = call(batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs,
    ...               batch.q, batch.kv_pages)
    >>> out.shape == batch.q.shape
    True
    """
    max_num_batched_tokens, _, head_dim = q.shape
    c = dataclasses.replace(config, strided_kv_loads=can_load_kv_strided(config, interpret))
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
        pltpu.VMEM(  # kv_bufs: two slots of one KV block each, head_dim in lane blocks
            (
                2,
                c.lane_blocks,
                c.num_kv_pages_per_block,
                c.page_size,
                2 * c.num_kv_heads_per_block,
                head_dim // c.lane_blocks,
            ),
            kv_pages.dtype,
        ),  # fmt: skip
        pltpu.SemaphoreType.DMA((2,)),  # sems: one per slot
        pltpu.VMEM((c.num_kv_heads_per_block, rows, LANES), jnp.float32),  # m_ref
        pltpu.VMEM((c.num_kv_heads_per_block, rows, LANES), jnp.float32),  # l_ref
        pltpu.VMEM((c.num_kv_heads_per_block, rows, head_dim), jnp.float32),  # acc_ref
        pltpu.VMEM((c.num_kv_heads_per_block, rows, head_dim), q.dtype),  # q_fold_ref
        pltpu.SMEM((1,), jnp.int32),  # slot_ref: the slot the next KV block is loading into
        pltpu.SMEM((1,), jnp.int32),  # num_seqs_in_order_ref: see `count_seqs_in_order`
    ]
    kernel = functools.partial(
        rpa_kernel,
        config=c,
        trace_capacity=trace_capacity,
        copier_class=copier_class or KVBlockCopier,
    )
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
            vmem_limit_bytes=c.vmem_limit_bytes,
        ),
        out_shape=out_shape,
        interpret=interpret,
        name=KERNEL_NAMES["decode" if c.decode else "mixed"],
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
    copier_class: type[KVBlockCopier],
):
    """One grid step: one block of q rows, one block of heads (in the decode kernel: one
    block of one-token sequences, a row each)."""
    *outputs, kv_bufs, sems, m_ref, l_ref, acc_ref, q_fold_ref, slot_ref, num_seqs_in_order_ref = (
        refs
    )
    o_ref, trace_ref = outputs[0], outputs[1] if trace_capacity else None
    # o_ref: [num_queries_per_block, num_q_heads_per_block, head_dim], VMEM
    # kv_bufs: [2, lane_blocks, num_kv_pages_per_block, page_size, 2*num_kv_heads_per_block,
    #          head_dim // lane_blocks]
    # m_ref, l_ref: f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
    # acc_ref: f32[num_kv_heads_per_block, rows_per_kv_head, head_dim]
    # q_fold_ref: [num_kv_heads_per_block, rows_per_kv_head, head_dim], q's dtype
    # slot_ref, num_seqs_in_order_ref: i32[1], SMEM, kept from one grid step to the next
    batch = SeqTable(
        kv_lens_ref,
        page_indices_ref,
        cu_q_lens_ref,
        num_seqs_in_order_ref,
        config,
        total_num_pages=kv_pages_hbm_ref.shape[0],
    )
    dma = copier_class(kv_pages_hbm_ref, kv_bufs, sems, batch)
    softmax = OnlineSoftmax(m_ref, l_ref, acc_ref, config)
    trace = Trace(trace_ref, trace_capacity)
    step = (pl.program_id(0), pl.program_id(1))  # (heads_blk, q_blk)

    @pl.when((step[0] == 0) & (step[1] == 0))
    def _start_the_first_copy():
        slot_ref[0] = 0
        num_seqs_in_order_ref[0] = count_seqs_in_order(cu_q_lens_ref, num_seqs_ref, config)
        trace.reset()
        first = first_work(batch)

        @pl.when(first.seq < batch.num_seqs())
        def _():
            dma.start(first, 0)
            trace.record(TRACE_START, step, first, 0)

    walker_class = DecodeWalker if config.decode else QBlockWalker
    walker = walker_class(step, q_ref, q_fold_ref, o_ref, softmax, batch, dma, trace, config)
    walker.attend_grid_step(slot_ref)


class QBlockWalker:
    """Walks one grid step's work: the sequences owning rows of the q block, and for each the
    KV blocks its rows can see. `run` returns the slot the next KV block is loading into."""

    def __init__(self, step, q_ref, q_fold_ref, o_ref, softmax, batch, dma, trace, config):
        self.heads_blk, self.q_blk = step
        self.q_ref = q_ref  # [num_queries_per_block, num_q_heads_per_block, head_dim]
        self.q_fold_ref = q_fold_ref  # [num_kv_heads_per_block, rows_per_kv_head, head_dim]
        self.o_ref = o_ref  # [num_queries_per_block, num_q_heads_per_block, head_dim]
        self.softmax = softmax
        self.batch = batch
        self.dma = dma
        self.trace = trace
        self.config: KernelConfig = config
        self.q_blk_start = self.q_blk * config.num_queries_per_block
        self.q_blk_end = self.q_blk_start + config.num_queries_per_block
        self.first_live = next_live_seq(batch, 0)  # where the next heads block starts

    def attend_grid_step(self, slot_ref):
        """The softmax state is reset once per q block (so no masked stores are needed), q is
        folded once, the walk runs if any sequence has rows here, and the output is written.
        `slot_ref` carries the slot of the copy in flight from one grid step to the next."""
        self.softmax.init()

        @pl.when(self.q_blk_start < self.batch.total_q_len())
        def _attend_this_q_block():
            fold_q_heads(self.q_ref, self.q_fold_ref, self.config)
            slot_ref[0] = self.run(slot_ref[0])

        self.softmax.write_output(self.o_ref)

    def run(self, slot):
        _, slot = lax.while_loop(self.has_rows_here, self.attend_seq, (self.first_seq(), slot))
        return slot

    def first_seq(self):
        """The first live sequence with rows in this q block."""
        return next_live_seq(self.batch, first_seq_in_q_block(self.batch, self.q_blk_start))

    def has_rows_here(self, carry):
        seq, _ = carry
        return (seq < self.batch.num_seqs()) & (self.batch.q_start(seq) < self.q_blk_end)

    def attend_seq(self, carry):
        seq, slot = carry
        first_kv_blk, end_kv_blk = seq_kv_blocks(self.batch, seq, self.q_blk)
        following = next_live_seq(self.batch, seq + 1)
        span = SeqSpan(self.batch.q_start(seq), self.batch.q_end(seq), self.batch.kv_len(seq))
        num_pages = pl.cdiv(span.kv_len, self.config.page_size)
        seq_work = Work(self.heads_blk, seq, first_kv_blk, num_pages)
        after_seq = work_after_seq(self.batch, self.q_blk, seq_work, following, self.first_live)
        attend = functools.partial(self.attend_kv_block, seq_work, end_kv_blk, span, after_seq)
        slot = lax.fori_loop(first_kv_blk, end_kv_blk, attend, slot)
        return following, slot

    def attend_kv_block(
        self, seq_work: Work, end_kv_blk, span: SeqSpan, after_seq: Work, kv_blk, slot
    ):
        """Start copying the next KV block into the other slot, wait for this one, and fold
        it into the softmax of the sequence's rows, one KV head at a time.

        `seq_work` is the sequence's work here (at its first KV block), `end_kv_blk` the end of
        its KV blocks, `after_seq` the work after them, and `span` its rows and kv_len: all
        worked out once per sequence, in `attend_seq`."""
        step = (self.heads_blk, self.q_blk)
        here = dataclasses.replace(seq_work, kv_blk=kv_blk)
        nxt = next_work(here, end_kv_blk, after_seq)
        other = other_slot(slot)

        @pl.when(nxt.heads_blk < self.config.num_heads_blocks)
        def _prefetch_the_next_block():
            self.dma.start(nxt, other)
            self.trace.record(TRACE_START, step, nxt, other)

        self.dma.wait(here, slot)
        self.trace.record(TRACE_WAIT, step, here, slot)
        mask = self.score_mask(span, kv_blk)
        attend_kv_heads(self.dma.buffer(slot), self.q_fold_ref, self.softmax, mask, kv_blk,
                        span.kv_len, self.config)  # fmt: skip
        self.trace.record(TRACE_COMPUTE, step, here, slot)
        return other

    def score_mask(self, span: SeqSpan, kv_blk) -> ScoreMask:
        return score_mask(span, self.q_blk, kv_blk, self.config)


class DecodeWalker(QBlockWalker):
    """A grid step of the decode kernel: a block of one-token sequences (decode sequence i
    owns row i of q), walked one after another, each attended alone.

    Each sequence has its own softmax state: reset, q folded (its row's q heads, a row per
    q head), its KV blocks walked as in `QBlockWalker` (the prefetch chain runs on from one
    sequence to the next, and into the next grid step), its output row written. So a KV
    block meets rows_per_kv_head = group rows, not a whole q block's, and no row select is
    needed (`decode_score_mask`).
    """

    def attend_grid_step(self, slot_ref):
        @pl.when(self.q_blk_start < self.batch.total_q_len())
        def _attend_these_sequences():
            seq, slot_ref[0] = lax.while_loop(
                self.has_rows_here, self.attend_seq, (self.first_seq(), slot_ref[0])
            )
            self.softmax.write_output_row(self.o_ref, seq - 1 - self.q_blk_start)

    def first_seq(self):
        return self.q_blk_start  # every decode sequence is live, one row each

    def attend_seq(self, carry):
        seq, _ = carry
        row = seq - self.q_blk_start  # the sequence's row in the q block

        # The sequence before left its state: write its row now. (Written right after its
        # KV loop instead, the compiler moves the write into the loop's last bundles, where
        # it takes issue slots in every iteration.)
        @pl.when(row > 0)
        def _write_the_previous_row():
            self.softmax.write_output_row(self.o_ref, row - 1)

        self.softmax.init()
        fold_decode_q(self.q_ref, row, self.q_fold_ref, self.config)
        return super().attend_seq(carry)

    def score_mask(self, span: SeqSpan, kv_blk) -> ScoreMask:
        return decode_score_mask(span, kv_blk, self.config)


def attend_kv_heads(
    kv_buf,  # [lane_blocks, num_kv_pages_per_block, page_size, 2*kvh_per_blk, hd // lane_blocks]
    q_fold_ref,  # [num_kv_heads_per_block, rows, head_dim]: each KV head's q heads as rows
    softmax: OnlineSoftmax,
    mask: ScoreMask,
    kv_blk,
    kv_len,
    config: KernelConfig,
):
    """Fold one KV block into the softmax, one KV head (and its q heads) at a time, with
    the heads software-pipelined: the Q·K of `heads_in_flight` heads (and their softmax
    statistics) are issued before the P·V of the first of them.

    Why: the MXU takes its matmuls in program order, and a matmul's result comes back long
    after it went in. In the plain order, P·V of head h must wait for head h's softmax (a row
    max, exp on the EUP, a row sum), and Q·K of head h + 1 queues behind it: the MXU idles
    while the vector units work, and the other way round. With several heads in flight, the
    softmax of one head runs while the MXU works on the others. The cost is registers: each
    head in flight holds its p until its P·V, and its V too unless V is loaded again just
    before (`reload_v`: a second strided load of the same words, cheaper than spilling).
    `block_sizes.default_head_pipeline` chooses both, from measured bundle counts.
    """
    dtype = q_fold_ref.dtype

    def finish(kv_head, v, p, alpha):  # the P·V half of a head in flight
        if v is None:
            _, v = load_kv_for_mxu(kv_buf, kv_head, kv_blk, kv_len, dtype, config)
        softmax.accumulate(kv_head, v, p, alpha, mask)

    in_flight = collections.deque()  # (kv_head, v or None, p, alpha): P·V still to come
    for kv_head in range(config.num_kv_heads_per_block):
        k, v = load_kv_for_mxu(kv_buf, kv_head, kv_blk, kv_len, dtype, config)
        p, alpha = softmax.scores_and_stats(kv_head, q_fold_ref[kv_head], k, mask)
        if len(in_flight) == config.heads_in_flight:
            finish(*in_flight.popleft())
        in_flight.append((kv_head, None if config.reload_v else v, p, alpha))
    while in_flight:
        finish(*in_flight.popleft())


def load_kv_for_mxu(kv_buf, kv_head: int, kv_blk, kv_len, dtype, config: KernelConfig):
    """K and V of one KV head, ready for the MXU: V zeroed past kv_len, both in `dtype`
    (dequantized from fp8). [kv_tokens_per_block, head_dim] each."""
    k, v = load_kv_head(kv_buf, kv_head, config)
    v = zero_tokens_past_kv_len(v, kv_blk, kv_len, config)
    return dequantize_kv(k, v, dtype, config)


def other_slot(slot):
    """The slot the next KV block goes into. A select of constants, not `1 - slot`: then
    Mosaic knows the slot is 0 or 1, and needs no run-time bounds check of the copy."""
    return jnp.where(slot == 0, 1, 0)


# ---------------------------------------------------------------------------------------------
# Where the rows and pages are: scalar arithmetic on the prefetched tables.
# ---------------------------------------------------------------------------------------------


class SeqTable:
    """Read access to the scalar-prefetched batch description (SMEM refs), never trusted.

    Under `jit` nothing has validated these values, and a bad one must not send a loop or a
    copy astray: a hang, or a copy from outside `kv_pages`. So each value is clamped to what
    the shapes allow, which changes nothing for a valid batch:
      num_seqs     to [0, max_num_seqs], and cut before the first sequence whose
                   cu_q_lens go backwards (`count_seqs_in_order`);
      cu_q_lens    to [0, max_num_batched_tokens];
      kv_lens      to [0, pages_per_seq * page_size];
      page numbers to [0, total_num_pages).
    Every loop over sequences then ends by max_num_seqs, and every loop over pages or KV
    blocks by pages_per_seq (see also `seq_kv_blocks`).
    """

    def __init__(
        self, kv_lens_ref, page_indices_ref, cu_q_lens_ref, num_seqs_ref, config, total_num_pages
    ):
        self.kv_lens_ref = kv_lens_ref  # i32[max_num_seqs]
        self.page_indices_ref = page_indices_ref  # i32[max_num_seqs, pages_per_seq]
        self.cu_q_lens_ref = cu_q_lens_ref  # i32[max_num_seqs + 1]
        self.num_seqs_ref = num_seqs_ref  # i32[1], already clamped by `count_seqs_in_order`
        self.config = config
        self.total_num_pages = total_num_pages

    def num_seqs(self):
        return self.num_seqs_ref[0]

    def q_start(self, seq):
        return jnp.clip(self.cu_q_lens_ref[seq], 0, self.config.max_num_batched_tokens)

    def q_end(self, seq):
        return jnp.clip(self.cu_q_lens_ref[seq + 1], 0, self.config.max_num_batched_tokens)

    def kv_len(self, seq):
        return jnp.clip(self.kv_lens_ref[seq], 0, self.config.pages_per_seq * self.config.page_size)

    def total_q_len(self):
        """The rows the sequences own: up to the end of the last one (0 if there is none)."""
        n = self.num_seqs()
        return jnp.where(n > 0, self.q_end(jnp.maximum(n - 1, 0)), 0)

    def num_pages(self, seq):
        """Pages holding the sequence's kv_len tokens (never more than pages_per_seq)."""
        return pl.cdiv(self.kv_len(seq), self.config.page_size)

    def page(self, seq, page_pos):
        return jnp.clip(self.page_indices_ref[seq, page_pos], 0, self.total_num_pages - 1)


def count_seqs_in_order(cu_q_lens_ref, num_seqs_ref, config: KernelConfig):
    """num_seqs clamped to [0, max_num_seqs], and cut before the first sequence whose
    cu_q_lens go backwards: the walk relies on the rows of sequence s + 1 following those of s.
    A loop over at most max_num_seqs sequences, run once, in the first grid step.

    cu_q_lens_ref: i32[max_num_seqs + 1]; num_seqs_ref: i32[1]
    """
    n = jnp.clip(num_seqs_ref[0], 0, config.max_num_seqs)

    def in_order(s):
        next_start = cu_q_lens_ref[jnp.minimum(s + 1, config.max_num_seqs)]  # never past the end
        return (s < n) & (next_start >= cu_q_lens_ref[s])

    return lax.while_loop(in_order, lambda s: s + 1, jnp.int32(0))


def next_live_seq(batch: SeqTable, seq):
    """The first sequence from `seq` on that has q rows (idle ones, q_len 0, have no work);
    `num_seqs` if there is none. In the mixed kernel of `split_configs` a one-token sequence
    is idle too: the decode kernel serves it (and the prefetch chain skips it as well)."""
    n = batch.num_seqs()

    def is_idle(s):
        s_safe = seq_or_last(batch, s)
        q_len = batch.q_end(s_safe) - batch.q_start(s_safe)
        no_work = (q_len == 0) | (q_len == 1) if batch.config.leaves_decode else q_len == 0
        return (s < n) & no_work

    return lax.while_loop(is_idle, lambda s: s + 1, seq)


def first_seq_in_q_block(batch: SeqTable, q_blk_start):
    """The sequence owning row `q_blk_start`: the first whose rows end after it."""
    last = batch.num_seqs() - 1
    return lax.while_loop(
        lambda s: (s < last) & (batch.q_end(s) <= q_blk_start), lambda s: s + 1, 0
    )


def seq_kv_blocks(batch: SeqTable, seq, q_blk):
    """The KV blocks [first, end) that the rows of `seq` in q block `q_blk` visit:
    `kv_blocks_to_visit` of the positions of their first and last row. Blocks outside that
    range are skipped: their copy and their compute would be thrown away.
    """
    c = batch.config
    q_start, q_end, kv_len = batch.q_start(seq), batch.q_end(seq), batch.kv_len(seq)
    first_row = jnp.maximum(q_start, q_blk * c.num_queries_per_block)
    last_row = jnp.minimum(q_end, (q_blk + 1) * c.num_queries_per_block) - 1
    if mask_value_vanishes(c.mask_value):  # masked keys weigh exactly 0: skip their blocks
        first, end = kv_blocks_to_visit(
            q_position(first_row, q_end, kv_len),
            q_position(last_row, q_end, kv_len),
            c.kv_tokens_per_block,
            c.sliding_window,
        )
    else:  # a small mask_value gives masked keys a weight (JAX's rule): visit every block
        first, end = 0, pl.cdiv(kv_len, c.kv_tokens_per_block)
    # Clamped to at least one block, all within pages_per_seq: a garbage batch (kv_len < q_len)
    # must neither loop long nor leave a prefetched block without its compute.
    max_kv_blks = pl.cdiv(c.pages_per_seq, c.num_kv_pages_per_block)
    first = jnp.clip(first, 0, max_kv_blks - 1)
    end = jnp.clip(end, first + 1, max_kv_blks)
    return first, end


@dataclasses.dataclass(frozen=True)
class Work:
    """One KV block's worth of work: which heads, which sequence, which KV block; and how
    many pages the sequence has (for the copies), worked out once per sequence."""

    heads_blk: jax.Array
    seq: jax.Array
    kv_blk: jax.Array
    num_pages: jax.Array


def first_work(batch: SeqTable) -> Work:
    """The first KV block of the first live sequence, in the q block of its first row.
    `seq` is `num_seqs` if there is no live sequence."""
    seq = next_live_seq(batch, 0)
    seq_q_blk = batch.q_start(seq_or_last(batch, seq)) // batch.config.num_queries_per_block
    first_kv_blk, _ = seq_kv_blocks(batch, seq_or_last(batch, seq), seq_q_blk)
    num_pages = batch.num_pages(seq_or_last(batch, seq))
    return Work(jnp.int32(0), seq, first_kv_blk, num_pages)


def seq_or_last(batch: SeqTable, seq):
    """`seq`, or the last sequence if it is past them: never read past the live entries."""
    return jnp.clip(seq, 0, jnp.maximum(batch.num_seqs() - 1, 0))


def work_after_seq(batch: SeqTable, q_blk, seq_work: Work, following, first_live):
    """The KV block the kernel will attend to after the last one of `seq_work.seq` in q block
    `q_blk`. After the very last one, `heads_blk` is `num_heads_blocks`.

    In order: the same sequence in the next q block (if its rows go on); else the next live
    sequence (`following`); else the first live sequence of the next heads block. Each starts
    at its first visible KV block. It depends on the sequence only, not on the KV block, so
    it is worked out once per sequence, outside the loop over KV blocks.
    """
    bq = batch.config.num_queries_per_block
    rows_go_on = batch.q_end(seq_work.seq) > (q_blk + 1) * bq
    heads_done = following >= batch.num_seqs()

    # From the last resort to the first choice, each overriding the one before: the first live
    # sequence of the next heads block, the next live sequence, this sequence ...
    seq = jnp.where(heads_done, first_live, following)
    seq = jnp.where(rows_go_on, seq_work.seq, seq)
    # ... each in the q block holding its first row, except this one, which goes on in the next.
    seq_q_blk = jnp.where(rows_go_on, q_blk + 1, batch.q_start(seq) // bq)
    first_kv_blk, _ = seq_kv_blocks(batch, seq, seq_q_blk)
    heads_blk = jnp.where(heads_done & ~rows_go_on, seq_work.heads_blk + 1, seq_work.heads_blk)
    return Work(heads_blk, seq, first_kv_blk, batch.num_pages(seq))


def next_work(here: Work, end_kv_blk, after_seq: Work) -> Work:
    """The KV block to attend to after `here`, so that its copy can start now: the next KV
    block of this sequence, or else `after_seq` (from `work_after_seq`)."""
    more_kv = here.kv_blk + 1 < end_kv_blk
    return Work(
        jnp.where(more_kv, here.heads_blk, after_seq.heads_blk),
        jnp.where(more_kv, here.seq, after_seq.seq),
        jnp.where(more_kv, here.kv_blk + 1, after_seq.kv_blk),
        jnp.where(more_kv, here.num_pages, after_seq.num_pages),
    )


# ---------------------------------------------------------------------------------------------
# Moving KV blocks: HBM pages -> a VMEM slot.
# ---------------------------------------------------------------------------------------------


class KVBlockCopier:
    """Starts and waits for the page copies of one KV block into one slot of `kv_bufs`.

    A slot holds head_dim in `lane_blocks` blocks of 128 lanes when head_dim is a multiple
    of 128: lane block f of page i is `kv_bufs[slot, f, i]`, [page_size, 2*kvh, 128]. Why not
    [page_size, 2*kvh, head_dim] as in `kv_pages`: Mosaic's strided load (`load_kv_head_strided`)
    needs a buffer whose rows are exactly 128 lanes. Each block of 128 lanes is whole tiles,
    so it is still one plain DMA per page and lane block; the compute reads each lane block
    with the strided load and puts them side by side. (At head_dim 256 this takes the KV
    block's compute from the general load, which gathers a vector register per token, to
    the strided one: a third of the bundles.)
    """

    def __init__(self, kv_pages_hbm_ref, kv_bufs, sems, batch: SeqTable):
        self.kv_pages_hbm_ref = kv_pages_hbm_ref  # [total_num_pages, page_size, 2*kvh, hd]
        # [2, lane_blocks, num_kv_pages_per_block, page_size, 2*kvh_per_blk, hd // lane_blocks]
        self.kv_bufs = kv_bufs
        self.sems = sems  # DMA semaphores [2]
        self.batch = batch
        self.config = batch.config

    def buffer(self, slot):
        """The VMEM buffer of a slot: [lane_blocks, num_kv_pages_per_block, page_size,
        2*kvh_per_blk, head_dim // lane_blocks]."""
        return self.kv_bufs.at[slot]

    def start(self, work: Work, slot):
        self._for_each_page(work, slot, lambda copy: copy.start())

    def wait(self, work: Work, slot):
        self._for_each_page(work, slot, lambda copy: copy.wait())

    def _for_each_page(self, work: Work, slot, action):
        """Page i of the block goes to kv_bufs[slot, :, i]; only the pages the sequence has.

        Pages past the end of the sequence are not copied at all: their part of the buffer
        keeps stale data, which the compute zeroes. `wait` must see the same pages as `start`,
        so both come through here.
        """
        num_pages = work.num_pages
        for i in range(self.config.num_kv_pages_per_block):
            page_pos = work.kv_blk * self.config.num_kv_pages_per_block + i
            pl.when(page_pos < num_pages)(
                functools.partial(self._copy_page, work, slot, i, page_pos, action)
            )

    def _copy_page(self, work: Work, slot, i: int, page_pos, action):
        """Copy (or wait for) one page: this heads block's K/V heads of every token in it, one
        copy per lane block."""
        c = self.config
        kv_heads = c.num_kv_heads_per_block
        combined_heads = pl.ds(work.heads_blk * 2 * kv_heads, 2 * kv_heads)
        if c.num_heads_blocks == 1:
            # A static whole axis: Mosaic cannot prove a dynamic offset is tile-aligned when
            # the axis is shorter than a tile (MQA in fp8: 2 combined heads, tiles of 4 rows).
            combined_heads = slice(None)
        page = self.batch.page(work.seq, page_pos)
        width = c.head_dim // c.lane_blocks
        for f in range(c.lane_blocks):
            lanes = slice(None) if c.lane_blocks == 1 else pl.ds(f * width, width)
            copy = pltpu.make_async_copy(
                self.kv_pages_hbm_ref.at[page, :, combined_heads, lanes],  # [ps, 2*kvh, width]
                self.buffer(slot).at[f, i],  # [page_size, 2*num_kv_heads_per_block, width]
                self.sems.at[slot],
            )
            action(copy)


# ---------------------------------------------------------------------------------------------
# Computing with a KV block: online softmax, one KV head and its group of q heads at a time.
# ---------------------------------------------------------------------------------------------


def load_kv_head(
    kv_buf,  # [lane_blocks, num_kv_pages_per_block, page_size, 2*kvh_per_blk, hd // lane_blocks]
    kv_head: int,  # within the heads block
    config: KernelConfig,
):  # -> k, v: [kv_tokens_per_block, head_dim], kv dtype, bf16 or float32
    """K and V of one KV head from a slot, as [tokens, head_dim] matrices: each lane block
    loaded on its own (`load_kv_lane_block`), side by side.

    K sits in combined slot 2*kv_head and V in 2*kv_head + 1 of every token. Tokens at or past
    kv_len hold anything (NaN padding, stale or never-written memory): see
    `zero_tokens_past_kv_len`.
    """
    blocks = [load_kv_lane_block(kv_buf.at[f], kv_head, config) for f in range(config.lane_blocks)]
    if len(blocks) == 1:
        return blocks[0]
    k = jnp.concatenate([k for k, _ in blocks], axis=1)
    v = jnp.concatenate([v for _, v in blocks], axis=1)
    return k, v


def load_kv_lane_block(
    kv_lanes,  # [num_kv_pages_per_block, page_size, 2*kvh_per_blk, width]: one lane block
    kv_head: int,
    config: KernelConfig,
):  # -> k, v: [kv_tokens_per_block, width]
    """K and V of one KV head in one lane block of a slot."""
    if config.strided_kv_loads:
        return load_kv_head_strided(kv_lanes, kv_head, config)
    # Index the ref and reshape the *value*: TPU interpret mode cannot reshape refs. On the chip
    # this reads one vector register per token and reassembles the rows: slow.
    tokens, width = config.kv_tokens_per_block, kv_lanes.shape[-1]
    k = kv_lanes[:, :, 2 * kv_head, :].reshape(tokens, width)
    v = kv_lanes[:, :, 2 * kv_head + 1, :].reshape(tokens, width)
    return k, v


def can_load_kv_strided(config: KernelConfig, interpret=False) -> bool:
    """Whether `load_kv_head_strided` applies: refs can be viewed (the chip, or plain
    `interpret=True`; not TPU interpret mode), the combined heads of a token fill whole
    (8 * packing, 128) tiles (so the flat view is free), the KV dtype is f32 or bf16, and
    head_dim is a multiple of 128 (Mosaic's strided loads need rows of exactly 128 lanes: a
    slot's lane blocks)."""
    if isinstance(interpret, pltpu.InterpretParams):
        return False
    kv_packing = packing_of_size(config.kv_itemsize)
    tiles_whole = (2 * config.num_kv_heads_per_block) % (8 * kv_packing) == 0
    return kv_packing in (1, 2) and tiles_whole and config.head_dim % LANES == 0


def load_kv_head_strided(kv_lanes, kv_head: int, config: KernelConfig):
    """`load_kv_lane_block` with one strided load: row `token * 2*kvh + 2*kv_head` of the lane
    block seen as a flat [tokens * 2*kvh, 128] matrix, for every token.

    In bf16 two rows share each 32-bit word (K in the low half, V in the high half), so one
    load of 32-bit words brings K and V together. K is the low half: truncating each word to
    16 bits keeps it, already bf16 (one pack). V is the high half: masked off its low half, a
    word is the float32 of V's bf16 value, exactly; it stays float32 until `dequantize_kv`
    casts it.
    """
    c = config
    tokens = c.kv_tokens_per_block
    flat = kv_lanes.reshape(tokens * 2 * c.num_kv_heads_per_block, LANES)
    if packing(kv_lanes.dtype) == 1:  # f32: one row per combined head
        stride = 2 * c.num_kv_heads_per_block
        k = flat[pl.ds(2 * kv_head, tokens, stride=stride), :]
        v = flat[pl.ds(2 * kv_head + 1, tokens, stride=stride), :]
        return k, v
    words = flat.bitcast(jnp.uint32)  # [tokens * kvh, 128]: one (K, V) pair per row
    pair = words[pl.ds(kv_head, tokens, stride=c.num_kv_heads_per_block), :]  # [tokens, 128]
    k = lax.bitcast_convert_type(pair.astype(jnp.uint16), jnp.bfloat16)
    v = lax.bitcast_convert_type(pair & jnp.uint32(0xFFFF0000), jnp.float32)
    return k, v


def fold_q_heads(
    q_ref,  # [num_queries_per_block, num_q_heads_per_block, head_dim]
    q_fold_ref,  # [num_kv_heads_per_block, rows_per_kv_head, head_dim]
    config: KernelConfig,
):
    """The q heads that share each KV head, folded into rows: row r*group + g of
    q_fold_ref[kv_head] is q row r, head g. Done once per grid step, before the walk.

    Why once, into scratch: the fold moves rows between (8, 128) tiles (a token's q heads
    sit side by side in one tile, its group must go down a column of rows), which Mosaic
    does with strided stores and shuffled loads through VMEM. Every KV block of the q block
    meets the same folded q, so redoing it per KV block (inside the loop) costs as much as a
    quarter of the loop at 32 rows per q block; here it costs one fold per grid step.
    """
    c = config
    group = c.num_q_heads_per_kv_head
    for kv_head in range(c.num_kv_heads_per_block):
        q = q_ref[:, kv_head * group : (kv_head + 1) * group, :]  # [num_queries, group, hd]
        q_fold_ref[kv_head] = q.reshape(c.rows_per_kv_head, c.head_dim)


def fold_decode_q(
    q_ref,  # [decode_seqs_per_block, num_q_heads_per_block, head_dim]: a row per sequence
    row,  # the sequence's row in the q block
    q_fold_ref,  # [num_kv_heads_per_block, num_q_heads_per_kv_head, head_dim]
    config: KernelConfig,
):
    """`fold_q_heads` for one sequence of the decode kernel: the q heads of its row that
    share each KV head, as rows. Once per sequence, before its KV blocks."""
    group = config.num_q_heads_per_kv_head
    for kv_head in range(config.num_kv_heads_per_block):
        q_fold_ref[kv_head] = q_ref[row, kv_head * group : (kv_head + 1) * group, :]


def dequantize_kv(
    k,  # [kv_tokens_per_block, head_dim], kv dtype or float32
    v,  # [kv_tokens_per_block, head_dim], kv dtype or float32
    dtype,
    config: KernelConfig,
):  # -> k, v: [kv_tokens_per_block, head_dim], dtype
    """Dequantize (fp8) to the compute dtype; a plain cast otherwise."""
    return dequantize(k, config.k_scale, dtype), dequantize(v, config.v_scale, dtype)


def zero_tokens_past_kv_len(x, kv_blk, kv_len, config: KernelConfig):  # x: [kv_tokens, hd]
    """Zero the token rows at or past kv_len; needed for V only.

    Those rows hold NaN padding, or stale or never-written memory where pages were not copied.
    K needs nothing: no row can see past kv_len, so `score_mask` replaces those scores (NaN
    included) and p is exactly 0 there. But 0 * NaN = NaN in p @ v, so V must be finite.
    (The select runs in float32: v5e has no bf16 vector unit.)
    """
    pos = kv_blk * config.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where(pos < kv_len, x.astype(jnp.float32), 0.0).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class SeqSpan:
    """One sequence's rows [q_start, q_end) and kv_len, read from the table once per sequence
    rather than in every KV-block iteration."""

    q_start: jax.Array
    q_end: jax.Array
    kv_len: jax.Array


@dataclasses.dataclass(frozen=True)
class ScoreMask:
    """Which scores of a KV block are hidden, and which rows the block may change."""

    masked: jax.Array  # bool[rows, kv_tokens_per_block]: `is_masked` (causal, sliding window)
    # bool[rows, kv_tokens_per_block]: the padding slots, keys that do not exist; None when
    # the mask value vanishes (then `masked` covers them).
    past_kv_len: jax.Array | None
    # bool[rows, LANES]: the rows of the walked sequence (rows of other sequences, or
    # padding, must not change); None when every row is the sequence's.
    in_seq: jax.Array | None


def score_mask(span: SeqSpan, q_blk, kv_blk, config: KernelConfig) -> ScoreMask:
    """The `ScoreMask` of KV block `kv_blk` for the rows of the sequence `span` in q block
    `q_blk` (rows: rows_per_kv_head)."""
    c = config
    shape = (c.rows_per_kv_head, c.kv_tokens_per_block)
    q_pos = q_position(q_row(shape, q_blk, c), span.q_end, span.kv_len)
    k_pos = kv_blk * c.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, shape, 1)
    masked = is_masked(q_pos, k_pos, c.sliding_window)
    # With the default mask_value a padding slot (a future key of every row) is masked like
    # any other; a small one would give it a weight, so it is named apart (`apply_mask_value`).
    past_kv_len = None if mask_value_vanishes(c.mask_value) else k_pos >= span.kv_len
    row = q_row((c.rows_per_kv_head, LANES), q_blk, c)
    in_seq = (row >= span.q_start) & (row < span.q_end)
    return ScoreMask(masked, past_kv_len, in_seq)


def decode_score_mask(span: SeqSpan, kv_blk, config: KernelConfig) -> ScoreMask:
    """`score_mask` for the decode kernel's one row: its position is the sequence's last,
    kv_len - 1, so the causal mask is exactly "past kv_len" (and the window counts back from
    there). Every row is the sequence's: no `in_seq`."""
    c = config
    shape = (c.rows_per_kv_head, c.kv_tokens_per_block)
    k_pos = kv_blk * c.kv_tokens_per_block + lax.broadcasted_iota(jnp.int32, shape, 1)
    masked = is_masked(span.kv_len - 1, k_pos, c.sliding_window)
    past_kv_len = None if mask_value_vanishes(c.mask_value) else k_pos >= span.kv_len
    return ScoreMask(masked, past_kv_len, None)


def q_row(shape, q_blk, config: KernelConfig):
    """i32[shape]: the q row (in the whole batch) of each row of the folded q matrix."""
    first = q_blk * config.num_queries_per_block
    return first + lax.broadcasted_iota(jnp.int32, shape, 0) // config.num_q_heads_per_kv_head


def widen(x, width: int):  # x: [rows, LANES], every lane the same -> [rows, width]
    """A lane-replicated column, as wide as `width` columns.

    A multiple of 128 columns is copies of the same vector registers (free); anything else
    takes one lane and broadcasts it (a cross-lane permute on the chip).
    """
    if width % LANES == 0:
        return jnp.concatenate([x] * (width // LANES), axis=1) if width > LANES else x
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def keep_other_rows(in_seq, new, old):  # in_seq: bool[rows, LANES]; new, old: [rows, width]
    """`new` in the rows of the walked sequence, `old` elsewhere: rows of other sequences, and
    padding rows (which may be NaN), keep their state. Nothing to select when every row is
    the sequence's (in_seq None)."""
    if in_seq is None:
        return new
    return jnp.where(widen(in_seq, new.shape[1]), new, old)


class OnlineSoftmax:
    """The running max m, running sum l and unnormalized output acc of every row of the q block,
    per KV head: softmax(s) @ v computed one KV block at a time.

    m and l are kept 128 lanes wide, every lane holding the row's value: that is how a row's
    value must sit to meet 128 columns of s or acc, so they are never broadcast across lanes.
    """

    def __init__(self, m_ref, l_ref, acc_ref, config: KernelConfig):
        self.m_ref = m_ref  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
        self.l_ref = l_ref  # f32[num_kv_heads_per_block, rows_per_kv_head, LANES]
        self.acc_ref = acc_ref  # f32[num_kv_heads_per_block, rows_per_kv_head, head_dim]
        self.config = config

    def init(self):
        self.m_ref[...] = jnp.full(self.m_ref.shape, -jnp.inf, jnp.float32)
        self.l_ref[...] = jnp.zeros(self.l_ref.shape, jnp.float32)
        self.acc_ref[...] = jnp.zeros(self.acc_ref.shape, jnp.float32)

    def scores_and_stats(
        self,
        kv_head: int,
        q,  # [rows, head_dim]
        k,  # [kv_tokens_per_block, head_dim]
        mask: ScoreMask,
    ):  # -> p: f32[rows, kv_tokens_per_block], alpha: f32[rows, LANES]
        """The first half of one online-softmax step, for one KV head and its q heads: the
        scores s = q k^T, the new running max m and sum l (stored), and what the second
        half needs: the weights p = exp(s - m) and alpha, which rescales the old acc."""
        c = self.config
        s = jnp.einsum("rd,td->rt", q, k, preferred_element_type=jnp.float32) * c.sm_scale
        s = apply_soft_cap(s, c.soft_cap)
        s = apply_mask_value(s, mask.masked, c.mask_value, mask.past_kv_len)  # [rows, tokens]
        lanes = (s.shape[0], LANES)

        m_prev = self.m_ref[kv_head]  # [rows, LANES]
        l_prev = self.l_ref[kv_head]  # [rows, LANES]
        m_next = jnp.maximum(m_prev, jnp.broadcast_to(s.max(axis=1, keepdims=True), lanes))
        p = jnp.exp(s - widen(m_next, s.shape[1]))  # [rows, kv_tokens]
        alpha = jnp.exp(m_prev - m_next)  # rescales what was summed under the old max
        l_next = alpha * l_prev + jnp.broadcast_to(p.sum(axis=1, keepdims=True), lanes)
        self.m_ref[kv_head] = keep_other_rows(mask.in_seq, m_next, m_prev)
        self.l_ref[kv_head] = keep_other_rows(mask.in_seq, l_next, l_prev)
        return p, alpha

    def accumulate(
        self,
        kv_head: int,
        v,  # [kv_tokens_per_block, head_dim]
        p,  # f32[rows, kv_tokens_per_block], from `scores_and_stats`
        alpha,  # f32[rows, LANES], from `scores_and_stats`
        mask: ScoreMask,
    ):
        """The second half: acc = alpha * acc + p v. (p is rounded to V's dtype for the
        matmul, which halves the MXU's pushes for a bf16 V, at an error of the order of the
        bf16 output's own rounding: notebook 08 measures it.)"""
        acc_prev = self.acc_ref[kv_head]  # [rows, head_dim]
        pv = jnp.einsum("rt,td->rd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_next = widen(alpha, acc_prev.shape[1]) * acc_prev + pv
        self.acc_ref[kv_head] = keep_other_rows(mask.in_seq, acc_next, acc_prev)

    def normalized(self, kv_head: int, lanes=slice(None)):  # -> f32[rows_per_kv_head, width]
        """out = acc / l for one KV head's group of q heads, in the columns `lanes` of head_dim
        (all of them by default). Rows that no sequence owns have l = 0 and acc = 0, and come
        out as zeros."""
        total = self.l_ref[kv_head][:, :1]  # [rows, 1]
        return self.acc_ref[kv_head, :, lanes] / jnp.where(total == 0.0, 1.0, total)

    def write_output(self, o_ref):
        """The q block's output, unfolded back to [q rows, q heads, head_dim], one KV head and
        one lane block of head_dim (`KernelConfig.lane_slices`) at a time.

        Why lane blocks: the unfold moves rows between (8, 128) tiles, with shuffled loads of
        acc, and the compiler issues the loads of every head early. A whole head at head_dim
        256 (128 rows of acc: 32 vector registers) is too much of that: on v5e at 32 q rows
        the unrolled heads spilled 940 KiB of VMEM here, outside the KV-block loop, and none
        when 128 lanes go at a time (static estimates, `minilib.tpu.compile`).

        o_ref: [num_queries_per_block, num_q_heads_per_block, head_dim]
        """
        c = self.config
        group = c.num_q_heads_per_kv_head
        for kv_head in range(c.num_kv_heads_per_block):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            for lanes in c.lane_slices:
                out = self.normalized(kv_head, lanes)  # [rows, width]
                out = out.reshape(c.num_queries_per_block, group, out.shape[1])
                o_ref[:, heads, lanes] = out.astype(o_ref.dtype)

    def write_output_row(self, o_ref, row):
        """The decode kernel's output of one sequence: row `row` of o_ref."""
        group = self.config.num_q_heads_per_kv_head
        for kv_head in range(self.config.num_kv_heads_per_block):
            out = self.normalized(kv_head)  # [group, head_dim]
            o_ref[row, kv_head * group : (kv_head + 1) * group, :] = out.astype(o_ref.dtype)
