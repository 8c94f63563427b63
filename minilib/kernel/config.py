"""What the kernel knows at compile time: `KernelConfig`, one static argument of the jit, and
`Levers`, which speed levers it runs with.

The attention options (`minilib.options`), with the block sizes filled in, the shapes they were
chosen for, and the levers that apply (`levers.levers_that_apply`). Frozen and hashable, so a
change of any of them is a new compile. `call.kernel_config` builds it.
"""

from __future__ import annotations

import dataclasses

from minilib.options import AttentionOptions

__all__ = ["KERNEL_NAMES", "LANES", "KernelConfig", "Levers"]

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
class Levers:
    """One switch per speed lever: what each replaces, and where it plugs in, is the table of
    `minilib.kernel.levers`. All off (`Levers.off()`) is the plain algorithm; a lever that is
    on runs where it applies (`levers.levers_that_apply`), and is dropped where it does not.

    >>> Levers.off().on()
    ()
    >>> Levers.only("fixed_max").on()
    ('fixed_max',)
    >>> len(Levers.every().on()) == len(Levers.names())
    True
    """

    decode_kernel: bool = False  # one-token sequences in a kernel of their own (`decode`)
    open_blocks: bool = False  # the KV blocks no row masks walked apart (`open_blocks`)
    strided_kv_loads: bool = False  # each KV head read with one strided load (`strided`)
    padded_slot: bool = False  # a bf16 slot with a spare row per token (`padded_slot`)
    narrow_rows: bool = False  # head_dim 64 read in rows of 64 lanes (`narrow_rows`)
    lane_blocks: bool = False  # head_dim above 128 in blocks of 128 lanes (`lane_blocks`)
    whole_rows: bool = False  # head_dim 256 whole in a padded slot's rows (`lane_blocks`)
    strided_fold: bool = False  # q folded, the output unfolded, by strided copies
    heads_in_flight: bool = False  # the KV heads software-pipelined (`heads_in_flight`)
    newton_reciprocal: bool = False  # acc / l by a refined reciprocal (`reciprocal`)
    fixed_max: bool = False  # one fixed max where a soft cap bounds the scores (`fixed_max`)
    fp8_as_stored: bool = False  # an fp8 cache to the MXU as stored, four to a word (`fp8`)

    @classmethod
    def off(cls) -> Levers:
        """Every lever off: the plain algorithm, in one kernel."""
        return cls()

    @classmethod
    def every(cls) -> Levers:
        """Every lever on (each where it applies)."""
        return cls(**{name: True for name in cls.names()})

    @classmethod
    def only(cls, *names: str) -> Levers:
        """These levers on, the others off."""
        unknown = [name for name in names if name not in cls.names()]
        if unknown:
            raise ValueError(f"{unknown=} are not levers: name some of {', '.join(cls.names())}")
        return cls(**{name: True for name in names})

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every lever's name, in the order of the table of `minilib.kernel.levers`."""
        return tuple(field.name for field in dataclasses.fields(cls))

    def on(self) -> tuple[str, ...]:
        """The names of the levers that are on."""
        return tuple(name for name in self.names() if getattr(self, name))


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
    # The speed levers of this kernel, as they apply (`levers.levers_that_apply`), and those of
    # the decode kernel beside it (None: no decode kernel). `kernel_config` decides both.
    levers: Levers = Levers()
    decode_levers: Levers | None = None
    # The two kernels of `ragged_paged_attention` (`split_configs`): the decode kernel serves
    # one-token sequences, one q row each (`DecodeWalker`); the mixed kernel leaves them to it
    # (treats them as idle). With both False, one kernel serves every sequence.
    decode: bool = False
    leaves_decode: bool = False
    decode_seqs_per_block: int = 1  # the decode kernel's q block: sequences per grid step
    # The KV heads whose P·V waits behind the next head's Q·K where `levers.heads_in_flight` is
    # on, sized by `levers.with_head_pipeline`; 0: the plain order, each head's P·V before the
    # next Q·K.
    heads_in_flight: int = 0
    reload_v: bool = False

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
        """How many 128-lane blocks head_dim has (`lane_blocks`, which applies above 1): 2 at
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
