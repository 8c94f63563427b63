"""minilib.block_sizes: the kernel's default block sizes and its tile-aligned heads blocks.

The cost model's ranking and the compiled kernel's VMEM headroom, which need libtpu, are
checked in tests/tpu/test_tpu_compile.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from minilib.block_sizes import default_block_sizes, num_kv_heads_per_block


def test_default_block_sizes():
    kw = dict(max_num_batched_tokens=512, bytes_per_page=16 * 16 * 128 * 2)
    assert default_block_sizes(page_size=16, pages_per_seq=64, **kw) == (16, 32)
    assert default_block_sizes(page_size=128, pages_per_seq=64, **kw) == (4, 32)
    assert default_block_sizes(page_size=16, pages_per_seq=3, **kw) == (3, 32)
    # Few q rows: one q block holds them all.
    kw["max_num_batched_tokens"] = 8
    assert default_block_sizes(page_size=16, pages_per_seq=64, **kw) == (16, 8)
    # Huge pages: halve until both KV slots fit the VMEM budget.
    kw["bytes_per_page"] = 1024 * 1024
    assert default_block_sizes(page_size=16, pages_per_seq=64, **kw) == (2, 8)


def test_heads_blocks_are_tile_aligned():
    assert num_kv_heads_per_block(32, 8, jnp.bfloat16, jnp.bfloat16) == 8  # 16 K/V slots
    assert num_kv_heads_per_block(32, 16, jnp.bfloat16, jnp.bfloat16) == 8
    assert num_kv_heads_per_block(16, 8, jnp.float32, jnp.float32) == 4
    assert num_kv_heads_per_block(8, 8, jnp.float32, jnp.float32) == 8  # 4 q heads: too few
    assert num_kv_heads_per_block(32, 16, jnp.bfloat16, jnp.float8_e4m3fn) == 16


def test_an_unknown_chip_is_named():
    with pytest.raises(ValueError, match="chip='v9' is not a TPU chip minilib knows"):
        default_block_sizes(page_size=16, pages_per_seq=8, max_num_batched_tokens=64,
                            bytes_per_page=1024, chip="v9")  # fmt: skip
