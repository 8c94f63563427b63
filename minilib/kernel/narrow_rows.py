"""Lever: head_dim 64 read by the strided load in rows of 64 lanes (and from a padded slot), in
place of the plain load, which reads a vector register per token (benchmarks/LEVERS.md).
"""

from __future__ import annotations

from minilib.kernel.config import LANES, KernelConfig

__all__: list[str] = []  # the kernel body's own: see `reads_narrow_rows`

NARROW_HEAD_DIM = 64  # the one head_dim under 128 lanes the strided load was measured at


def strided_rows_fit(config: KernelConfig) -> bool:
    """Whether a slot's rows suit Mosaic's strided load: whole blocks of 128 lanes (`lane_blocks`)
    or, with `KernelConfig.narrow_rows`, one row of 64 lanes at head_dim 64."""
    if config.head_dim % LANES == 0:
        return True
    return reads_narrow_rows(config)


def reads_narrow_rows(config: KernelConfig) -> bool:
    """Whether the config asks for rows of 64 lanes and its head_dim is 64 (a cache of any
    dtype: f32 and bf16 through `strided`, fp8 through `fp8`)."""
    return config.narrow_rows and config.head_dim == NARROW_HEAD_DIM
