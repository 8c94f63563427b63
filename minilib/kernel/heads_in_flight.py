"""Lever: the KV heads software-pipelined, in place of the plain order (`plain.attend_heads`,
each head's P·V before the next head's Q·K): several heads' Q·K issued before their P·V, so the
MXU and the vector units work at once (benchmarks/LEVERS.md).
"""

from __future__ import annotations

import collections

from minilib.kernel.config import KernelConfig

__all__: list[str] = []  # the kernel body's own: see `attend_kv_heads`


def attend_kv_heads(
    kv_buf, q_fold_ref, softmax, mask, kv_blk, kv_len, config: KernelConfig, load_kv
):
    """`plain.attend_heads` with the P·V of each head deferred until `heads_in_flight` later
    heads' Q·K are issued.

    The MXU takes its matmuls in program order, and a result comes back long after it went
    in: in the plain order the MXU idles while the vector units compute a head's softmax, and
    the other way round. The cost is registers: each head in flight holds its p until its
    P·V, and its V too unless V is loaded again just before (`reload_v`). Both are chosen per
    chip by `block_sizes.default_head_pipeline`."""
    dtype = q_fold_ref.dtype

    def finish(kv_head, v, p, alpha):  # the P·V half of a head in flight
        if v is None:
            _, v = load_kv(
                kv_buf=kv_buf,
                kv_head=kv_head,
                kv_blk=kv_blk,
                kv_len=kv_len,
                dtype=dtype,
                config=config,
            )
        softmax.accumulate(kv_head, v, p, alpha)

    in_flight = collections.deque()  # (kv_head, v or None, p, alpha): P·V still to come
    for kv_head in range(config.num_kv_heads_per_block):
        k, v = load_kv(
            kv_buf=kv_buf,
            kv_head=kv_head,
            kv_blk=kv_blk,
            kv_len=kv_len,
            dtype=dtype,
            config=config,
        )
        p, alpha = softmax.scores_and_stats(kv_head, q_fold_ref[kv_head], k, mask)
        if len(in_flight) == config.heads_in_flight:
            finish(*in_flight.popleft())
        in_flight.append((kv_head, None if config.reload_v else v, p, alpha))
    while in_flight:
        finish(*in_flight.popleft())
