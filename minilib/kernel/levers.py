"""Which speed levers a configuration turns on, and where they plug into the plain kernel.

`kernel_config` (`call`) turns levers on in the `KernelConfig` (`slot_levers`,
`with_head_pipeline`), `split_configs` gives the decode kernel its own, and `choose_points`
picks, once per configuration, the plain kernel's `Points` or a lever's in their place:

    slot          how a KV slot is laid out and filled  plain, padded_slot, lane_blocks
    load_kv       how K and V reach the MXU             plain, strided, fp8, lane_blocks
    attend_heads  the order of the heads                plain, heads_in_flight
    fold_q        how q's heads are folded              plain, strided_fold
    write_output  ... and the output unfolded           plain, strided_fold
    divide        the output's acc / l                  plain, reciprocal
    softmax       how p is kept in range                plain (a running max), fixed_max

Levers meet only here: a lever that needs another's piece is handed it (`strided` the padded
slot's words, `lane_blocks` the load or slot it repeats per block of lanes).
"""

from __future__ import annotations

import dataclasses
import functools

from jax.experimental.pallas import tpu as pltpu

from minilib import masking
from minilib.block_sizes import default_head_pipeline, packing_of_size
from minilib.kernel import (
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
from minilib.kernel.config import KernelConfig
from minilib.kernel.decode import DecodeWalker
from minilib.kernel.plain import Points, QBlockWalker, SeqSpan, attend_heads, load_kv, read_kv_head

__all__ = [
    "DecodeOpenBlocksWalker",
    "bounded_scores",
    "can_fold_q_strided",
    "can_load_kv_strided",
    "choose_points",
    "split_configs",
    "walker_class",
]


def choose_points(config: KernelConfig) -> Points:
    """The plain kernel's points, with the levers `config` turns on in their place.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(3, 3)], head_dim=128)
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices)
    >>> choose_points(config).attend_heads.__module__    # kernel_config's heads in flight
    'minilib.kernel.heads_in_flight'
    >>> choose_points(dataclasses.replace(config, heads_in_flight=0)) == Points()  # all off
    True
    """
    pads = padded_slot.pads_slot(config)
    slot = padded_slot.PaddedSlot() if pads else Points.slot
    fp8_cache = config.kv_itemsize == 1
    whole_rows = pads and config.whole_rows and config.lane_blocks > 1
    if config.strided_kv_loads:
        word_rows = padded_slot.word_rows if pads else None
        word_rows = lane_blocks.lane_rows if whole_rows else word_rows
        read = functools.partial(strided.read_kv_head, word_rows=word_rows)
        read = fp8.read_kv_words if fp8_cache else read
    else:
        read = read_kv_head
    if whole_rows:
        slot, read = lane_blocks.WholeRows(slot), lane_blocks.each_lane_row(read)
    elif config.lane_blocks > 1:
        slot, read = lane_blocks.LaneBlocks(slot), lane_blocks.each_lane_block(read)
    load = load_kv
    if fp8_cache:
        load = fp8.load_kv_from_words if config.strided_kv_loads else fp8.load_kv_as_stored
    if load is not load_kv or read is not read_kv_head:
        load = functools.partial(load, read=read)
    heads = heads_in_flight.attend_kv_heads if config.heads_in_flight else attend_heads
    if config.strided_fold:
        fold, unfold = strided_fold.fold_q_heads, strided_fold.write_output
    else:
        fold, unfold = Points.fold_q, Points.write_output
    divide = reciprocal.divide if config.newton_reciprocal else Points.divide
    softmax = fixed_max.FixedMaxSoftmax if config.bounded_scores else Points.softmax
    return Points(slot=slot, load_kv=load, attend_heads=heads, fold_q=fold, write_output=unfold,
                  divide=divide, softmax=softmax)  # fmt: skip


def bounded_scores(soft_cap: float | None, mask_value: float) -> bool:
    """Whether a soft cap bounds the scores enough for one fixed max (`fixed_max`): the flag
    `KernelConfig.bounded_scores`, which `kernel_config` sets.

    >>> bounded_scores(50.0, -1e38), bounded_scores(None, -1e38)   # Gemma-2's cap; none
    (True, False)
    """
    return fixed_max.fixed_max(soft_cap, mask_value) is not None


def can_load_kv_strided(config: KernelConfig, interpret=False) -> bool:
    """Whether the strided load (`strided`, `fp8.read_kv_words`) applies: refs can be viewed
    (the chip, or plain `interpret=True`; not TPU interpret mode), head_dim is a multiple of
    128 or 64 (`narrow_rows`), and either the KV dtype is f32 or bf16 and the combined heads of
    a token fill whole (8 * packing, 128) tiles (so the flat view is free), or it is fp8 and
    the KV heads pair up into whole words.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config, resolve_interpret
    >>> b = make_batch([(3, 3)], num_q_heads=16, num_kv_heads=8, head_dim=128)
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices)
    >>> can_load_kv_strided(config), can_load_kv_strided(config, resolve_interpret(True))
    (True, False)
    """
    if isinstance(interpret, pltpu.InterpretParams):
        return False
    kv_packing = packing_of_size(config.kv_itemsize)
    if not narrow_rows.strided_rows_fit(config):
        return False
    if kv_packing == 4:
        return config.num_kv_heads_per_block % fp8.KV_HEADS_PER_WORD == 0
    tiles_whole = (2 * config.num_kv_heads_per_block) % (8 * kv_packing) == 0
    return kv_packing in (1, 2) and tiles_whole


def can_fold_q_strided(config: KernelConfig, interpret=False) -> bool:
    """Whether `strided_fold` applies: q's shapes (`strided_fold.folds_q_strided`, refs viewed
    as for the strided load), compiled, or in plain interpret mode with a jax that stores
    through a view of a ref (`strided_fold.interpret_stores_through_views`: not jax 0.7.2's).

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(3, 3)], num_q_heads=32, num_kv_heads=8, head_dim=128)
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices, num_queries_per_block=8)
    >>> can_fold_q_strided(dataclasses.replace(config, strided_kv_loads=True))
    True
    """
    if not strided_fold.folds_q_strided(config):
        return False
    return interpret is False or strided_fold.interpret_stores_through_views()


def slot_levers(head_dim: int, chip: str | None) -> dict[str, bool]:
    """The lever flags of `KernelConfig` set per chip and head_dim: `narrow_rows` at head_dim
    64, `padded_slot` on the chips of `padded_slot.PADDED_SLOT_CHIPS` or at head_dim 64; neither
    where the installed libtpu refuses them (`padded_slot.padding_compiles`: there head_dim 64
    takes the plain load). `whole_rows` on the chips of `lane_blocks.WHOLE_ROWS_CHIPS` (it acts
    only on a padded slot of several lane blocks: `choose_points`), `newton_reciprocal` on those
    of `reciprocal.NEWTON_CHIPS`.

    >>> slot_levers(64, "v4")  # no libtpu, or new
    {'narrow_rows': True, 'padded_slot': True, 'whole_rows': False, 'newton_reciprocal': False}
    >>> slot_levers(256, "v6e")
    {'narrow_rows': False, 'padded_slot': True, 'whole_rows': True, 'newton_reciprocal': False}
    >>> slot_levers(128, "v5e")["newton_reciprocal"]
    True
    """
    narrow = head_dim == narrow_rows.NARROW_HEAD_DIM
    compiles = padded_slot.padding_compiles()
    padded = narrow or chip in padded_slot.PADDED_SLOT_CHIPS
    whole = chip in lane_blocks.WHOLE_ROWS_CHIPS
    return {"narrow_rows": narrow and compiles, "padded_slot": padded and compiles,
            "whole_rows": whole, "newton_reciprocal": chip in reciprocal.NEWTON_CHIPS}  # fmt: skip


def with_head_pipeline(config: KernelConfig) -> KernelConfig:
    """`config` with the default software pipeline over KV heads (`heads_in_flight`), chosen per
    chip and shape by `block_sizes.default_head_pipeline`."""
    strided_load = can_load_kv_strided(config)
    heads, reload_v = default_head_pipeline(
        rows=config.rows_per_kv_head,
        kv_tokens=config.kv_tokens_per_block,
        head_dim=config.head_dim,
        num_kv_heads=config.num_kv_heads_per_block,
        itemsize=config.q_itemsize,
        strided=strided_load,
        padded=padded_slot.pads_slot(config, strided_load),
    )
    return dataclasses.replace(config, heads_in_flight=heads, reload_v=reload_v)


def split_configs(config: KernelConfig) -> tuple[KernelConfig, KernelConfig]:
    """(mixed, decode): the configs of the two kernels `ragged_paged_attention` runs.

    The decode kernel (`decode`) computes a one-token sequence's own row alone: one row per q
    head, no row selects, and the causal mask is only the kv_len (and window) mask. Its q block
    holds `decode_seqs_per_block` sequences, walked one after another in one grid step. Its
    slot is padded on every chip where libtpu can (`padded_slot`): its loop is mostly the
    strided loads of K and V, and its slots are small, so the VMEM that keeps the mixed
    kernel's slot plain on v5e is not short here. Both walk their open KV blocks first, in a
    loop of their own (`open_blocks`), where there is no sliding window.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> batch = make_batch([(3, 3), (1, 9)], max_num_seqs=4, head_dim=128)
    >>> config = kernel_config(batch.q, batch.kv_pages, batch.page_indices)
    >>> mixed, decode = split_configs(config)
    >>> mixed.leaves_decode, decode.decode, decode.num_queries_per_block, decode.rows_per_kv_head
    (True, True, 4, 2)
    >>> mixed.padded_slot, decode.padded_slot   # head_dim 128 on a CPU: the mixed slot is plain
    (False, True)
    """
    # Under a sliding window no KV block is open (`masking.open_kv_blocks_end`): no loop for them.
    open_blocks = config.sliding_window is None
    decode = dataclasses.replace(
        config,
        decode=True,
        num_queries_per_block=config.decode_seqs_per_block,
        max_num_batched_tokens=config.max_num_seqs,  # the decode batch: one row per sequence
        padded_slot=padded_slot.padding_compiles(),
        open_blocks=open_blocks,
    )
    mixed = dataclasses.replace(config, leaves_decode=True, open_blocks=open_blocks)
    return mixed, with_head_pipeline(decode)


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
        return DecodeOpenBlocksWalker if config.open_blocks else DecodeWalker
    return open_blocks.OpenBlocksWalker if config.open_blocks else QBlockWalker


class DecodeOpenBlocksWalker(DecodeWalker):
    """The decode kernel's walk (`decode`) with its open KV blocks first (`open_blocks`): a
    sequence's one row sits at kv_len - 1, so it sees every key of each block that ends by
    kv_len, with no mask and no V zeroed.

    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(1, 32)], page_size=8)   # 32 tokens: two open blocks of 16
    >>> _, decode = split_configs(kernel_config(b.q, b.kv_pages, b.page_indices,
    ...                                         num_kv_pages_per_block=2))
    >>> walker_class(decode) is DecodeOpenBlocksWalker, decode.kv_tokens_per_block
    (True, 16)
    """

    def walk_kv_blocks(self, first_kv_blk, end_kv_blk, span: SeqSpan, attend, slot):
        c = self.config
        own_row = (span.q_start, span.q_end)  # the decode batch's: one row, its sequence's
        open_end = masking.open_kv_blocks_end(own_row, own_row, span.kv_len,
                                              c.kv_tokens_per_block, c.sliding_window)  # fmt: skip
        return open_blocks.walk_open_blocks_first(first_kv_blk, open_end, end_kv_blk, attend, slot)
