"""Speed lever: the KV heads software-pipelined, several heads' Q·K before their P·V.

What it saves. The MXU takes matmuls in program order and returns each result long after it
went in. One head at a time, the MXU idles while the vector units compute a head's softmax,
and the other way round. With `heads_in_flight` heads' Q·K (and softmax statistics) issued
before the first of their P·V, both work at once; V is loaded again for its P·V (`reload_v`)
where keeping it would spill. Bundles per KV block, static estimates, as measured when the
lever was written (libtpu 0.0.42.1, before the padded slot; `python -m minilib compile` gives
today's figures), 32 q / 8 KV heads, head_dim 128, 128 tokens per KV block:
* P·V of head h - 1 after Q·K of head h (one head in flight): v5e 1451 -> 1408 at 32 q per
  block, 1062 -> 950 at 8 q; v6e 1925 -> 1585, 1129 -> 1065 (spills up, v5e 32 q 704 -> 940 KiB).
* Deeper where it pays (`block_sizes.default_head_pipeline`, a per-chip table): v5e 32 q
  1391 -> 1391 (one head kept there), 8 q 921 -> 761, decode 645 -> 572; v6e 1587 -> 1324,
  1054 -> 873, 778 -> 695; TPU7x 1607 -> 1391, 1035 -> 908, 782 -> 720; head_dim 256 v5e 8 q
  1396 -> 1151, decode 1000 -> 1012; head_dim 64 v5e 8 q 2632 -> 2281.
On which chips: all; how deep is chosen per chip and shape by `default_head_pipeline`.
"""

from __future__ import annotations

import collections
import dataclasses

from minilib.block_sizes import default_head_pipeline
from minilib.kernel.config import KernelConfig
from minilib.kernel.kv_load import load_kv_for_mxu
from minilib.kernel.padded_slot import pads_slot
from minilib.kernel.softmax import OnlineSoftmax, ScoreMask
from minilib.kernel.strided import can_load_kv_strided

__all__: list[str] = []  # the kernel body's own: see `attend_kv_heads`


def with_head_pipeline(config: KernelConfig) -> KernelConfig:
    """`config` with the default software pipeline over KV heads for its rows per KV head
    (`block_sizes.default_head_pipeline`)."""
    strided = can_load_kv_strided(config)
    heads, reload_v = default_head_pipeline(
        rows=config.rows_per_kv_head,
        kv_tokens=config.kv_tokens_per_block,
        head_dim=config.head_dim,
        num_kv_heads=config.num_kv_heads_per_block,
        itemsize=config.q_itemsize,
        strided=strided,
        padded=pads_slot(config, strided),
    )
    return dataclasses.replace(config, heads_in_flight=heads, reload_v=reload_v)


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
