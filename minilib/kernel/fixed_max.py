"""Lever: where a soft cap bounds every score, p = 2**(s - M) with one fixed M, in place of the
running max m (`plain.OnlineSoftmax`): no max across lanes, no alpha, no rescaling of l and acc,
no m to load and store per KV block (benchmarks/LEVERS.md).

The running max is there to keep p in float32's range: p = 2**(s - m) <= 1. A soft cap does
that already: every score lies in [-C, C], C = soft_cap * LOG2_E (log2 units), so with
M = max(C - 64, 0) every p lies in [2**(-C - M), 2**64]: over a million keys l stays below
2**84, and acc within float32 while |V| stays below 2**44. The answer is the same: p differs
from the running max's by a factor 2**(m - M) per row, which acc / l divides out. So it
applies where C + M <= 100 (the smallest p at least 2**-100, far from float32's smallest
normal, 2**-126): soft caps up to 56.8 (Gemma-2's is 50), with a mask value that vanishes
(masked keys weigh exactly 0, as every p of a masked key must).
"""

from __future__ import annotations

import jax.numpy as jnp

from minilib.kernel.plain import LOG2_E, OnlineSoftmax, ScoreMask, lane_sums
from minilib.masking import mask_value_vanishes

__all__ = ["fixed_max"]

LARGEST_P_LOG2 = 64  # the largest p: 2**64
SMALLEST_P_LOG2 = -100  # the smallest: 2**-100


def fixed_max(soft_cap: float | None, mask_value: float) -> float | None:
    """M, the fixed max for scores soft-capped at `soft_cap` (log2 units), or None where the
    scores are not bounded enough for one: no soft cap, too large a one, or a mask value
    that gives masked keys a weight.

    >>> round(fixed_max(50.0, -1e38), 3), fixed_max(20.0, -1e38)   # Gemma-2's cap: C = 72.1
    (8.135, 0.0)
    >>> fixed_max(None, -1e38), fixed_max(60.0, -1e38), fixed_max(50.0, -1e4)
    (None, None, None)
    """
    if soft_cap is None or not mask_value_vanishes(mask_value):
        return None
    bound = soft_cap * LOG2_E
    shift = max(bound - LARGEST_P_LOG2, 0.0)
    return shift if -bound - shift >= SMALLEST_P_LOG2 else None


class FixedMaxSoftmax(OnlineSoftmax):
    """`OnlineSoftmax` with m fixed at `fixed_max`: l and acc only add up. m is still written
    once per reset, for an attention sink's share of l (`sink_term`), taken against it."""

    @property
    def shift(self) -> float:  # M
        return fixed_max(self.config.soft_cap, self.config.mask_value)

    def init(self):
        self.m_ref[...] = jnp.full(self.m_ref.shape, self.shift, jnp.float32)
        self.l_ref[...] = jnp.zeros(self.l_ref.shape, jnp.float32)
        self.acc_ref[...] = jnp.zeros(self.acc_ref.shape, jnp.float32)

    def scores_and_stats(self, kv_head: int, q, k, mask: ScoreMask | None):
        """p = 2**(s - M), l updated; alpha is None: nothing to rescale."""
        p = jnp.exp2(self.scores(q, k, mask) - self.shift)  # [rows, kv_tokens]
        self.l_ref[kv_head] = self.l_ref[kv_head] + lane_sums(p)
        return p, None

    def accumulate(self, kv_head: int, v, p, alpha):  # v: [kv_tokens, hd]
        pv = jnp.einsum("rt,td->rd", p.astype(self.dtype), v, preferred_element_type=jnp.float32)
        self.acc_ref[kv_head] = self.acc_ref[kv_head] + pv
