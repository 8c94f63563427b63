"""What one KV block's static figures mean in time, per chip: its bundles at the chip's clock,
its bytes at the chip's HBM bandwidth, and which of the two bounds the loop (static estimates,
no stalls, no DMA queueing; notebook 09).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from minilib.chips import FACTS
from minilib.tpu.kernel_costs import COMPARISON_CASE

__all__ = ["KVBlockTimes", "kv_block_times", "kv_bytes_per_block"]


@dataclasses.dataclass(frozen=True)
class KVBlockTimes:
    """One pass of a KV-block loop, two ways (static estimates: no stalls, no DMA queueing).

    * issue: the loop's bundles at the chip's clock, one bundle per cycle;
    * copy: the block's KV bytes at the chip's HBM bandwidth.

    With double buffering the next block's copy runs while this block's bundles issue, so the
    slower of the two bounds the loop, and the static MBU (memory-bandwidth utilisation)
    estimate is copy / max(copy, issue): 1.0 when the copy bounds the loop.

    >>> times = kv_block_times(1128, chip="v5e", kv_bytes_per_block=512 * 1024)
    >>> round(times.issue_s * 1e6, 2), round(times.copy_s * 1e6, 2), times.bound
    (0.75, 0.64, 'issue')
    >>> round(times.static_mbu, 2)
    0.85
    """

    bundles: int
    issue_s: float | None  # None: the chip's clock is not published
    copy_s: float

    @property
    def bound(self) -> str:
        """'issue', 'copy', or 'unknown' (no clock)."""
        if self.issue_s is None:
            return "unknown"
        return "issue" if self.issue_s > self.copy_s else "copy"

    @property
    def static_mbu(self) -> float | None:
        """copy / max(copy, issue): the share of HBM bandwidth the loop could use."""
        return None if self.issue_s is None else self.copy_s / max(self.copy_s, self.issue_s)


def kv_block_times(bundles: int, *, chip: str, kv_bytes_per_block: int) -> KVBlockTimes:
    """`KVBlockTimes` of a loop of `bundles` bundles that copies `kv_bytes_per_block` bytes,
    on `chip` (its clock and HBM bandwidth from `minilib.chips`).

    >>> kv_block_times(700, chip="tpu7x", kv_bytes_per_block=512 * 1024).bound  # no clock
    'unknown'
    """
    facts = FACTS[chip]
    issue_s = None if facts.clock_hz is None else bundles / facts.clock_hz
    return KVBlockTimes(bundles, issue_s, kv_bytes_per_block / facts.hbm_bytes_per_s)


def kv_bytes_per_block(case: dict = COMPARISON_CASE, num_kv_pages_per_block: int = 8) -> int:
    """The KV bytes one KV block copies: its pages' K and V, of every KV head.

    >>> kv_bytes_per_block() // 1024   # KiB: 8 pages x 16 tokens x 2 x 8 heads x 128 x 2 bytes
    512
    """
    itemsize = jnp.dtype(case.get("kv_dtype") or case.get("dtype", jnp.bfloat16)).itemsize
    tokens = num_kv_pages_per_block * case["page_size"]
    return tokens * 2 * case["num_kv_heads"] * case["head_dim"] * itemsize
