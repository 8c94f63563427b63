"""Ragged paged attention as a Pallas TPU kernel: `ragged_paged_attention`.

The vectorized version gathers every page of every sequence slot, however short the sequence.
This kernel reads only the pages that are needed, and overlaps reading them with computing.

Data movement, the new idea of this chapter:

* `kv_lens`, `page_indices`, `cu_q_lens` and `num_seqs` are *scalar-prefetched*: copied into
  SMEM before the kernel starts, so the kernel can branch on them and compute DMA addresses.
  The page table goes in as the page copies read it (`page_table.block_page_table`): one flat row of
  whole KV blocks per sequence, so that a page's number is one load at a known offset.
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

The modules, in the order to read them. First the plain kernel, in one sitting: what runs
with every speed lever off, the production shape of the ladder's last rung:

    config       KernelConfig: what the kernel knows at compile time; Levers, one switch
                 per speed lever (`Levers.off()`: the plain kernel)
    plain        the kernel body: the walk over sequences and KV blocks, the double-buffered
                 copies, the plain K/V load, the online softmax, one KV head at a time; and
                 `Points`, where the levers plug in
    walk         the walk in scalar code: the prefetched tables (`SeqTable`), the sequences of
                 a q block, the KV blocks their rows see, the next block to copy (`next_work`)
    call         ragged_paged_attention (`levers=`), the jitted wrapper (`rpa_jit`: tables
                 clamped once, then the kernels: `run_kernels`)
    pallas_call  one kernel's pallas_call: grid, block specs, scratch

Then the levers beside it, each replacing one point of the plain kernel. `levers` is the
switchboard: it decides, once per configuration, which levers apply, and fills the points
(benchmarks/LEVERS.md records what each saves, and on which chips):

    levers           which levers are on (`chosen_levers`, `levers_that_apply`), and the points
                     they fill (`choose_points`)
    decode           one-token sequences in a kernel of their own, each attended alone
    mixed_layout     ... and the mixed kernel's q, each sequence starting on a q block
    strided          each KV head read with one strided load, K and V from 32-bit words
    strided_fold     q folded and the output unfolded by strided copies of 32-bit words
    padded_slot      a bf16 slot with a spare row per token, so each strided load is whole
    fp8              an fp8 cache to the MXU as stored, four values to a word, scales moved
    lane_blocks      head_dim in blocks of 128 lanes, so head_dim 256 is read strided too
                     (on v6e and TPU7x whole in the padded slot's rows: a copy per page)
    narrow_rows      head_dim 64 read strided in rows of 64 lanes
    heads_in_flight  the KV heads software-pipelined on the MXU (heads_in_flight, reload_v)
    open_blocks      the KV blocks every row sees whole walked first, in a loop with no mask
                     (and no V zeroed), in both kernels
    reciprocal       on v5e the output divided by a reciprocal refined by Newton's method
    fixed_max        one fixed max where a soft cap bounds the scores

And two wrappers the kernel body never mentions:

    kv_write    the new tokens' K/V written into the cache by the kernel, before it reads them
                (`new_keys`, `new_values`), in place of a separate scatter
    tracing     the kernel recording its DMA starts, waits and computes (`minilib.kernel_trace`)

Compared with JAX's kernel (jax/experimental/pallas/ops/tpu/ragged_paged_attention), which
makes the same walk: KV blocks that no row of the q block can see (past the causal diagonal,
or before the sliding window) are skipped when masked keys weigh exactly 0, as with the default
mask value (a small `mask_value` gives them a weight, as in JAX's reference, and then every
block before kv_len is visited: `masking.mask_value_vanishes`); only the pages a sequence has
are copied; idle sequences (q_len 0) are skipped; the softmax state is reset once per q block,
so no masked stores are needed; q is folded (each KV head's group of q heads into rows) once
per grid step, not in every KV block; m and l are kept 128 lanes wide, so the softmax update
needs no cross-lane broadcasts; K is never cleaned past kv_len (the score mask replaces
whatever is there), only V is zeroed (0 * NaN = NaN in p @ v).

Written for JAX's TPU interpret mode as well as for the chip. Interpret mode cannot view a ref
as another shape or dtype, so there K and V are read by plain indexing (`plain`), and the
strided load is used only when the kernel is compiled (or run by plain `interpret=True`).
No masked loads or stores: a `jnp.where` on values keeps the rows that must not change.

Nothing in the batch description is trusted: under `jit` it cannot be validated, so the jitted
wrapper clamps the tables once before the kernels (`call.clamp_tables`): sequences to
max_num_seqs, kv_lens to pages_per_seq pages, page numbers to the pages there are. A garbage
batch gives garbage, but no hang and no copy from outside `kv_pages`. That is also why the
page copies can go without the compiler's bounds checks, a chain of scalar compares per copy
(benchmarks/LEVERS.md says what that saves), as v3's do.

What is checked without a TPU: parity in TPU interpret mode (DMAs, semaphores and races
simulated) and, for the strided loads, in plain interpret mode; and Mosaic's own compiler, in
libtpu, which compiles for the TPU chips on any host where libtpu is installed
(`jax.experimental.topologies` gives a compile-only TPU device): what it accepts, and the
bundles it schedules, are what the chip would run (`python -m minilib compile`).
`minilib.schedule` replays the same walks in plain Python, and its tests check that they are
the kernels' walks.
"""

from __future__ import annotations

from minilib.kernel.call import (
    clamp_tables,
    count_seqs_in_order,
    kernel_config,
    ragged_paged_attention,
    resolve_interpret,
    rpa_jit,
    rpa_write_jit,
)
from minilib.kernel.config import KERNEL_NAMES, LANES, KernelConfig, Levers
from minilib.kernel.decode import (
    DecodeBatch,
    DecodeWalker,
    decode_batch,
    decode_score_mask,
    fold_decode_q,
    write_output_row,
)
from minilib.kernel.heads_in_flight import attend_kv_heads
from minilib.kernel.levers import (
    choose_points,
    chosen_levers,
    levers_that_apply,
    split_configs,
    with_head_pipeline,
)
from minilib.kernel.mixed_layout import mixed_layout
from minilib.kernel.pallas_call import rpa_pallas_call
from minilib.kernel.plain import (
    KVBlockCopier,
    OnlineSoftmax,
    PlainSlot,
    Points,
    QBlockWalker,
    ScoreMask,
    SeqSpan,
    attend_heads,
    fold_q_heads,
    load_kv,
    other_slot,
    q_row,
    read_kv_head,
    rpa_kernel,
    score_mask,
    widen,
    zero_tokens_past_kv_len,
)
from minilib.kernel.walk import (
    SeqTable,
    Work,
    first_seq_in_q_block,
    first_work,
    next_live_seq,
    next_work,
    seq_kv_blocks,
    seq_or_last,
    work_after_seq,
)

# The public names. The kernel's inner steps (SeqTable, QBlockWalker, KVBlockCopier, next_work,
# OnlineSoftmax, ...) run only inside the kernel body; each is documented in its module, and
# importable from here.
__all__ = [
    "KERNEL_NAMES",
    "LANES",
    "KernelConfig",
    "Levers",
    "decode_batch",
    "kernel_config",
    "ragged_paged_attention",
    "resolve_interpret",
    "rpa_jit",
    "rpa_pallas_call",
    "rpa_write_jit",
    "split_configs",
]
