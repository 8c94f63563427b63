"""Lever: head_dim 64 read by the strided load in rows of 64 lanes (and from a padded slot), in
place of the plain load, which reads a vector register per token (benchmarks/LEVERS.md).

The strided load reads rows of the slot's width, so nothing here runs in the kernel: the lever
is the decision that the strided load may read rows of 64 lanes at all
(`levers.levers_that_apply`, `levers.strided_load_fits`).
"""

from __future__ import annotations

__all__: list[str] = []

NARROW_HEAD_DIM = 64  # the one head_dim under 128 lanes the strided load was measured at
