"""What the kernel knows at compile time: `KernelConfig`, one static argument of the jit.

The attention options (`minilib.options`), with the block sizes filled in, the shapes they were
chosen for, and which speed levers are on: `strided_kv_loads`, `padded_slot`, `whole_rows`,
`narrow_rows`, `heads_in_flight` (and `reload_v`), the decode kernel's `decode` and
`leaves_decode`, `open_blocks`, `newton_reciprocal`, `bounded_scores`; `lane_blocks` and an fp8
cache's load follow from head_dim and the cache's dtype (`levers.choose_points`).
Frozen and hashable, so a change of any of them is a new compile. `call.kernel_config` builds it.
"""

from __future__ import annotations

import dataclasses

from minilib.options import AttentionOptions

__all__ = ["KERNEL_NAMES", "LANES", "KernelConfig"]

# The m and l scratch rows are 128 lanes wide, one vector register row: TPU vector memory is
# laid out in (8, 128) tiles, so a [rows, 1] array would take the same space anyway. The slot
# holds head_dim in blocks of LANES with `lane_blocks`.
LANES = 128

# The pallas_calls' names, which a compiled program shows (`minilib.tpu.compile` reads them).
KERNEL_NAMES = {
    "mixed": "minilib_ragged_paged_attention",
    "decode": "minilib_ragged_paged_attention_decode",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig(AttentionOptions):
    """The static shape of the computation: the attention options, with the block sizes
    filled in, and the shapes and head blocks they were chosen for. Frozen and hashable: the
    jitted kernel takes it as one static argument. `kernel_config` builds it.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
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
    # Each KV head read with one strided load (`strided`); set by `rpa_pallas_call` where refs
    # can be viewed (not in TPU interpret mode).
    strided_kv_loads: bool = False
    # q folded and the output unfolded by strided word copies (`strided_fold`); set by
    # `rpa_pallas_call` where refs can be viewed and stored through a view.
    strided_fold: bool = False
    # The two kernels of `ragged_paged_attention` (`split_configs`): the decode kernel serves
    # one-token sequences, one q row each (`DecodeWalker`); the mixed kernel leaves them to it
    # (treats them as idle). With both False, one kernel serves every sequence.
    decode: bool = False
    leaves_decode: bool = False
    decode_seqs_per_block: int = 1  # the decode kernel's q block: sequences per grid step
    # The KV heads whose P·V waits behind the next head's Q·K (`heads_in_flight`), set by
    # `levers.with_head_pipeline`; 0: the plain order, each head's P·V before the next Q·K.
    heads_in_flight: int = 0
    reload_v: bool = False
    # A bf16 slot held as words with a spare row per token (`padded_slot`), set by
    # `kernel_config` (`levers.slot_levers`).
    padded_slot: bool = False
    # A padded slot holding head_dim 256 whole in each token's rows, one copy per page, read
    # per block of 128 lanes (`lane_blocks.WholeRows`), set by `kernel_config`
    # (`levers.slot_levers`).
    whole_rows: bool = False
    # head_dim 64 read by the strided load in rows of 64 lanes (`narrow_rows`), set by
    # `kernel_config` at head_dim 64.
    narrow_rows: bool = False
    # The KV blocks no row needs masked walked apart, without the mask (`open_blocks`), set
    # for both kernels by `levers.split_configs`.
    open_blocks: bool = False
    # The output divided by a refined reciprocal (`reciprocal`), set by `kernel_config`
    # (`levers.slot_levers`).
    newton_reciprocal: bool = False
    # p kept in range by one fixed max where a soft cap bounds the scores (`fixed_max`), set by
    # `kernel_config` (`levers.bounded_scores`).
    bounded_scores: bool = False

    @property
    def score_scale(self) -> float:
        """What the kernel multiplies the scores q . k by: sm_scale, times k_scale when there
        is one (K's dequantization, moved from every value of K to the scores: `fp8`)."""
        return self.sm_scale if self.k_scale is None else self.sm_scale * self.k_scale

    @property
    def kv_tokens_per_block(self) -> int:
        return self.num_kv_pages_per_block * self.page_size

    @property
    def blocks_per_seq(self) -> int:
        """KV blocks of a sequence of pages_per_seq pages (the last one may be partly past
        them): a row of `page_table.block_page_table` holds this many blocks of pages."""
        return -(-self.pages_per_seq // self.num_kv_pages_per_block)

    @property
    def num_q_heads_per_block(self) -> int:
        return self.num_kv_heads_per_block * self.num_q_heads_per_kv_head

    @property
    def lane_blocks(self) -> int:
        """How many 128-lane blocks a KV slot holds head_dim in (`lane_blocks`, on above 1): 2 at
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
