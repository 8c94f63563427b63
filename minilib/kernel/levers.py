"""The switchboard: which speed levers are on (`Levers`), decided in one place.

`Levers` holds one switch per lever. `Levers.off()` is the plain algorithm, the ladder's last
rung in production shape; `ragged_paged_attention(..., levers=Levers.off())` runs it.
With `levers=None` (the default) each kernel takes the levers chosen for its chip
(`chosen_levers`). Either way `kernel_config` turns what was asked into what applies, once
(`levers_that_apply`), and keeps the result in `KernelConfig.levers`; `choose_points` then
fills the plain kernel's `Points` from it:

    lever              what it replaces                        point it fills
    decode_kernel      one-token rows in the mixed kernel's    a second kernel (`decode`), the
                       q blocks                                mixed one's seq_table and q
    open_blocks        the mask on every KV block              walker (`open_blocks`)
    strided_kv_loads   one load per token and KV head          load_kv (`strided`, `fp8`)
    padded_slot        the plain slot                          slot (`padded_slot`)
    narrow_rows        the plain load at head_dim 64           none: the strided load reads
                                                               rows of 64 lanes (`narrow_rows`)
    lane_blocks        head_dim whole in the slot and output   slot, load_kv (`lane_blocks`)
    whole_rows         a page copy per 128-lane block          slot (`lane_blocks.WholeRows`)
    strided_fold       q folded and unfolded a row at a time   fold_q, write_output
    heads_in_flight    each head's P·V before the next Q·K     attend_heads
    newton_reciprocal  acc / l                                 divide (`reciprocal`)
    fixed_max          the running max                         softmax (`fixed_max`)
    fp8_as_stored      an fp8 cache cast before the MXU        load_kv (`fp8`)

Levers meet only here: a lever that needs another has it checked here (the padded slot
needs the strided load), and a lever that needs another's piece is handed it (`strided` the
padded slot's words, `lane_blocks` the load or slot it repeats per block of lanes).
"""

from __future__ import annotations

import dataclasses
import functools

from jax.experimental.pallas import tpu as pltpu

from minilib import masking
from minilib.block_sizes import default_head_pipeline, packing_of_size
from minilib.kernel import (
    decode,
    fixed_max,
    fp8,
    heads_in_flight,
    lane_blocks,
    narrow_rows,
    open_blocks,
    padded_slot,
    reciprocal,
    strided,
    strided_fold,
)
from minilib.kernel.config import KernelConfig, Levers
from minilib.kernel.plain import Points, QBlockWalker, SeqSpan, load_kv, read_kv_head

__all__ = [
    "DecodeOpenBlocksWalker",
    "Levers",
    "choose_points",
    "chosen_levers",
    "levers_that_apply",
    "split_configs",
    "with_head_pipeline",
]


def chosen_levers(chip: str | None, *, head_dim: int, decode_kernel: bool = False) -> Levers:
    """The levers asked for when the caller asks for none (`levers=None`): every lever, but
    the padded slot only on the chips of `padded_slot.PADDED_SLOT_CHIPS`, at head_dim 64, and
    in the decode kernel (`decode_kernel`: its loop is mostly the strided loads of K and V, and
    its slots are small); whole rows on those of `lane_blocks.WHOLE_ROWS_CHIPS`, the refined
    reciprocal on those of `reciprocal.NEWTON_CHIPS` (benchmarks/LEVERS.md: where each pays).

    >>> [chosen_levers(chip, head_dim=128).padded_slot for chip in ("v4", "v5e")]
    [False, True]
    >>> chosen_levers("v4", head_dim=128, decode_kernel=True).padded_slot
    True
    """
    padded = decode_kernel or head_dim == narrow_rows.NARROW_HEAD_DIM
    return dataclasses.replace(
        Levers.every(),
        padded_slot=padded or chip in padded_slot.PADDED_SLOT_CHIPS,
        whole_rows=chip in lane_blocks.WHOLE_ROWS_CHIPS,
        newton_reciprocal=chip in reciprocal.NEWTON_CHIPS,
    )


def levers_that_apply(config: KernelConfig, asked: Levers, interpret=False) -> Levers:
    """The levers of `asked` that apply to the kernel `config` describes, run as `interpret`
    says (False: compiled; True or a `pltpu.InterpretParams`: interpret mode). The rules:

    - the strided load and the strided fold view refs: compiled, or plain `interpret=True`,
      not TPU interpret mode; the fold also stores through a view (`strided_fold`);
    - the strided load needs rows Mosaic can stride over (`strided_load_fits`);
    - the padded slot and narrow rows need a libtpu that compiles them
      (`padded_slot.padding_compiles`); the padded slot needs the strided load and a bf16
      cache, whole rows a padded slot of several lane blocks, narrow rows head_dim 64;
    - the strided fold folds the mixed kernel's q of whole tiles (`strided_fold.folds_q_strided`);
    - the fixed max needs scores a soft cap bounds (`fixed_max.fixed_max`);
    - no KV block is open under a sliding window (`masking.open_kv_blocks_end`).

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config, resolve_interpret
    >>> b = make_batch([(3, 3)], num_q_heads=16, num_kv_heads=8, head_dim=128)
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices, levers=Levers.off())
    >>> levers_that_apply(config, Levers.every(), interpret=False).strided_kv_loads
    True
    >>> levers_that_apply(config, Levers.every(), resolve_interpret(True)).strided_kv_loads
    False
    >>> levers_that_apply(config, Levers.every()).fixed_max    # no soft cap
    False
    """
    c = config
    views = not isinstance(interpret, pltpu.InterpretParams)
    compiles = padded_slot.padding_compiles()
    narrow = asked.narrow_rows and compiles and c.head_dim == narrow_rows.NARROW_HEAD_DIM
    lanes = asked.lane_blocks and c.lane_blocks > 1
    fp8_words = asked.fp8_as_stored and c.kv_itemsize == 1
    fits = strided_load_fits(c, narrow_rows=narrow, in_lane_blocks=lanes, fp8_words=fp8_words)
    loads = asked.strided_kv_loads and views and fits
    narrow = narrow and loads  # rows of 64 lanes are read by the strided load only
    pads = asked.padded_slot and compiles and loads and c.kv_itemsize == 2
    stores = interpret is False or strided_fold.interpret_stores_through_views()
    folds = views and stores and not c.decode and strided_fold.folds_q_strided(c)
    bounded = fixed_max.fixed_max(c.soft_cap, c.mask_value) is not None
    return Levers(
        decode_kernel=asked.decode_kernel and not c.decode,
        open_blocks=asked.open_blocks and c.sliding_window is None,
        strided_kv_loads=loads,
        padded_slot=pads,
        narrow_rows=narrow,
        lane_blocks=lanes,
        whole_rows=asked.whole_rows and pads and lanes,
        strided_fold=asked.strided_fold and folds,
        heads_in_flight=asked.heads_in_flight,
        newton_reciprocal=asked.newton_reciprocal,
        fixed_max=asked.fixed_max and bounded,
        fp8_as_stored=fp8_words,
    )


def strided_load_fits(
    config: KernelConfig, *, narrow_rows: bool, in_lane_blocks: bool = True, fp8_words: bool = True
) -> bool:
    """Whether the strided load (`strided`, `fp8.read_kv_words`) can read this slot: rows of
    exactly 128 lanes (head_dim 128, or above it in lane blocks: Mosaic strides over no wider
    row), or 64 read in narrow rows; and either the KV dtype is f32 or bf16 and the combined
    heads of a token fill whole (8 * packing, 128) tiles (so the flat view is free), or it is
    fp8 read as words (`fp8_words`) and the KV heads pair up into whole words. Above 128 lanes
    it reads each lane block's rows (`in_lane_blocks`).

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(3, 3)], num_q_heads=16, num_kv_heads=8, head_dim=128)
    >>> strided_load_fits(kernel_config(b.q, b.kv_pages, b.page_indices), narrow_rows=False)
    True
    """
    c = config
    rows_of_128 = c.head_dim == lane_blocks.LANES
    rows_of_128 = rows_of_128 or (in_lane_blocks and c.head_dim % lane_blocks.LANES == 0)
    if not rows_of_128 and not narrow_rows:
        return False
    kv_packing = packing_of_size(c.kv_itemsize)
    if kv_packing == 4:
        return fp8_words and c.num_kv_heads_per_block % fp8.KV_HEADS_PER_WORD == 0
    tiles_whole = (2 * c.num_kv_heads_per_block) % (8 * kv_packing) == 0
    return kv_packing in (1, 2) and tiles_whole


def with_head_pipeline(config: KernelConfig) -> KernelConfig:
    """`config` with its software pipeline over KV heads sized (`heads_in_flight`): by
    `block_sizes.default_head_pipeline` per chip and shape where the lever is on; else none
    (0 heads in flight: the plain order).

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(3, 3)], num_q_heads=16, num_kv_heads=8, head_dim=128)
    >>> plain = kernel_config(b.q, b.kv_pages, b.page_indices, levers=Levers.off())
    >>> pipelined = dataclasses.replace(plain, levers=Levers.only("heads_in_flight"))
    >>> with_head_pipeline(plain).heads_in_flight, with_head_pipeline(pipelined).heads_in_flight
    (0, 4)
    """
    c = config
    if not c.levers.heads_in_flight:
        return dataclasses.replace(c, heads_in_flight=0, reload_v=False)
    heads, reload_v = default_head_pipeline(
        rows=c.rows_per_kv_head,
        kv_tokens=c.kv_tokens_per_block,
        head_dim=c.head_dim,
        num_kv_heads=c.num_kv_heads_per_block,
        itemsize=c.q_itemsize,
        strided=c.levers.strided_kv_loads,
        padded=c.levers.padded_slot,
    )
    return dataclasses.replace(c, heads_in_flight=heads, reload_v=reload_v)


def split_configs(config: KernelConfig) -> tuple[KernelConfig, KernelConfig | None]:
    """(mixed, decode): the configs of the kernels `ragged_paged_attention` runs. Without the
    decode kernel (`Levers.decode_kernel` off), (config, None): one kernel serves every sequence.

    The decode kernel (`decode`) computes a one-token sequence's own row alone: one row per q
    head, no row selects, and the causal mask is only the kv_len (and window) mask. Its q block
    holds `decode_seqs_per_block` sequences, walked one after another in one grid step; its
    levers are `config.decode_levers`, decided with the others by `kernel_config`.

    >>> import jax.numpy as jnp
    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> batch = make_batch([(3, 3), (1, 9)], max_num_seqs=4, num_q_heads=16, num_kv_heads=8,
    ...                    head_dim=128, dtype=jnp.bfloat16)
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices, interpret=False)
    >>> mixed, decode = split_configs(config)
    >>> mixed.leaves_decode, decode.decode, decode.num_queries_per_block, decode.rows_per_kv_head
    (True, True, 4, 2)
    >>> mixed.levers.padded_slot, decode.levers.padded_slot   # chosen for no chip (a CPU)
    (False, True)
    >>> split_configs(kernel_config(batch.q, batch.kv_pages, batch.page_indices,
    ...                             levers=Levers.off()))[1] is None
    True
    """
    if config.decode_levers is None:
        return config, None
    mixed = dataclasses.replace(config, leaves_decode=True)
    decode_config = dataclasses.replace(
        decode_shape(config), levers=config.decode_levers, decode_levers=None
    )
    return mixed, with_head_pipeline(decode_config)


def decode_shape(config: KernelConfig) -> KernelConfig:
    """`config` as the decode kernel's: one row per sequence, `decode_seqs_per_block` of them
    a q block, the decode batch one row per sequence."""
    return dataclasses.replace(
        config,
        decode=True,
        num_queries_per_block=config.decode_seqs_per_block,
        max_num_batched_tokens=config.max_num_seqs,
    )


def choose_points(config: KernelConfig) -> Points:
    """The plain kernel's points, with the levers `config.levers` turns on in their place.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(3, 3)], head_dim=128)
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices)
    >>> choose_points(config).attend_heads.__module__    # the heads in flight
    'minilib.kernel.heads_in_flight'
    >>> off = kernel_config(b.q, b.kv_pages, b.page_indices, levers=Levers.off())
    >>> choose_points(off) == Points()  # all off: the plain kernel
    True
    """
    levers = config.levers
    slot, load_kv_point = kv_points(config)
    fold = Points.fold_q
    unfold = Points.write_output
    if levers.strided_fold:
        fold, unfold = strided_fold.fold_q_heads, strided_fold.write_output
    return Points(
        slot=slot,
        load_kv=load_kv_point,
        attend_heads=heads_in_flight.attend_kv_heads
        if config.heads_in_flight
        else Points.attend_heads,
        fold_q=fold,
        write_output=unfold,
        divide=reciprocal.divide if levers.newton_reciprocal else Points.divide,
        softmax=fixed_max.FixedMaxSoftmax if levers.fixed_max else Points.softmax,
        walker=walker_class(config),
        seq_table=decode.MixedSeqTable if config.leaves_decode else Points.seq_table,
    )


def kv_points(config: KernelConfig):
    """(slot, load_kv): how a KV slot is laid out and filled, and how K and V reach the MXU."""
    levers = config.levers
    slot = padded_slot.PaddedSlot() if levers.padded_slot else Points.slot
    read = read_kv_head
    if levers.strided_kv_loads and levers.fp8_as_stored:
        read = fp8.read_kv_words
    elif levers.strided_kv_loads:
        word_rows = padded_slot.word_rows if levers.padded_slot else None
        word_rows = lane_blocks.lane_rows if levers.whole_rows else word_rows
        read = functools.partial(strided.read_kv_head, word_rows=word_rows)
    if levers.whole_rows:
        slot = lane_blocks.WholeRows(slot)
        read = lane_blocks.each_lane_row(read)
    elif levers.lane_blocks:
        slot = lane_blocks.LaneBlocks(slot)
        read = lane_blocks.each_lane_block(read)
    load = load_kv
    if levers.fp8_as_stored and levers.strided_kv_loads:
        load = fp8.load_kv_from_words
    elif levers.fp8_as_stored:
        load = fp8.load_kv_as_stored
    if load is not load_kv or read is not read_kv_head:
        load = functools.partial(load, read=read)
    return slot, load


def walker_class(config: KernelConfig) -> type[QBlockWalker]:
    """The walk of the grid step `config` describes: the decode kernel's, the plain one, or
    with its open KV blocks apart (`open_blocks`).

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(3, 3), (1, 9)], max_num_seqs=4)
    >>> mixed, decode = split_configs(kernel_config(b.q, b.kv_pages, b.page_indices))
    >>> walker_class(mixed).__name__, walker_class(decode).__name__
    ('OpenBlocksWalker', 'DecodeOpenBlocksWalker')
    >>> windowed = kernel_config(b.q, b.kv_pages, b.page_indices, sliding_window=4)
    >>> [walker_class(c).__name__ for c in split_configs(windowed)]   # no KV block is open
    ['QBlockWalker', 'DecodeWalker']
    """
    if config.decode:
        return DecodeOpenBlocksWalker if config.levers.open_blocks else decode.DecodeWalker
    return open_blocks.OpenBlocksWalker if config.levers.open_blocks else QBlockWalker


class DecodeOpenBlocksWalker(decode.DecodeWalker):
    """The decode kernel's walk (`decode`) with its open KV blocks first (`open_blocks`): a
    sequence's one row sits at kv_len - 1, so it sees every key of each block that ends by
    kv_len, with no mask and no V zeroed.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(1, 32)], page_size=8)   # 32 tokens: two open blocks of 16
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices, num_kv_pages_per_block=2)
    >>> _, decode = split_configs(config)
    >>> choose_points(decode).walker is DecodeOpenBlocksWalker, decode.kv_tokens_per_block
    (True, 16)
    """

    def walk_kv_blocks(self, first_kv_blk, end_kv_blk, span: SeqSpan, attend, slot):
        c = self.config
        own_row = (span.q_start, span.q_end)  # the decode batch's: one row, its sequence's
        open_end = masking.open_kv_blocks_end(
            own_row, own_row, span.kv_len, c.kv_tokens_per_block, c.sliding_window
        )
        return open_blocks.walk_open_blocks_first(first_kv_blk, open_end, end_kv_blk, attend, slot)
