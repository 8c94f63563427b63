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


def test_a_sliding_window_bounds_the_kv_block():
    """A row sees at most `sliding_window` keys: the KV block is that, rounded up to a power of
    two, at least 128 tokens (a register's lanes), and never more than without a window."""
    kw = dict(page_size=16, pages_per_seq=64, max_num_batched_tokens=512,
              bytes_per_page=16 * 16 * 128 * 2, chip="v6e", num_q_heads_per_block=32)  # fmt: skip
    assert default_block_sizes(**kw) == (32, 128)
    for window, pages in ((1, 8), (100, 8), (128, 8), (129, 16), (256, 16), (300, 32), (4096, 32)):
        assert default_block_sizes(**kw, sliding_window=window)[0] == pages, window
    big_pages = kw | dict(page_size=128, bytes_per_page=128 * 16 * 128 * 2)
    assert default_block_sizes(**big_pages, sliding_window=128)[0] == 1


def test_the_kernels_config_takes_the_windows_kv_block():
    from minilib.batch import make_batch
    from minilib.kernel.call import kernel_config

    batch = make_batch([(5, 600)], num_q_heads=8, num_kv_heads=2, page_size=16)
    pages = {window: kernel_config(batch.q, batch.kv_pages, batch.page_indices,
                                   sliding_window=window).num_kv_pages_per_block
             for window in (None, 128, 4096)}  # fmt: skip
    assert pages[128] == 8 and pages[4096] == pages[None] > 8
    asked = kernel_config(batch.q, batch.kv_pages, batch.page_indices, sliding_window=128,
                          num_kv_pages_per_block=16)  # fmt: skip
    assert asked.num_kv_pages_per_block == 16  # a block size asked for is kept


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
