"""minilib.perf.roofline: bytes, FLOPs and lower-bound times, checked against hand counts.

Every expected value is worked out here from first principles (by hand, or by brute force over
an explicit mask), never by calling the function under test.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from minilib.batch import make_batch
from minilib.perf.roofline import (
    CHIPS,
    Chip,
    batch_cost,
    detect_chip,
    explain,
    kv_pages_read,
    roofline,
    rpa_cost,
    visible_keys,
)

GQA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


def brute_force_visible(q_len, kv_len, sliding_window=None):
    """Visible (row, key) pairs and the set of pages they touch, by walking an explicit mask."""
    pairs, keys = 0, set()
    for i in range(q_len):
        pos = kv_len - q_len + i
        for k in range(kv_len):
            hidden = k > pos or (sliding_window is not None and k <= pos - sliding_window)
            if not hidden:
                pairs += 1
                keys.add(k)
    return pairs, keys


# A single decode ---------------------------------------------------------------------------


def test_decode_bytes_and_flops_by_hand():
    # One decode over 1000 keys, bf16. 1000 keys fill 62.5 pages, so 63 whole pages are read:
    # 63 * 16 = 1008 token slots, each with K and V for 8 heads of 128 values of 2 bytes.
    cost = rpa_cost([(1, 1000)], **GQA, q_itemsize=2)
    assert cost.kv_bytes == 1008 * 2 * 8 * 128 * 2 == 4_128_768
    assert cost.q_bytes == cost.out_bytes == 1 * 32 * 128 * 2 == 8192
    assert cost.bytes == 4_128_768 + 2 * 8192
    # The one row sees all 1000 keys; 4 FLOPs per (key, q head, dim) element.
    assert cost.flops == 4 * 1000 * 32 * 128 == 16_384_000
    assert cost.num_tokens == 1
    assert cost.rows_per_kv_token == pytest.approx(1000 / 1008)


def test_decode_is_memory_bound_on_every_chip():
    cost = rpa_cost([(1, 1024)], **GQA, q_itemsize=2)
    # Intensity: 4*1024*32*128 FLOPs over (1024*2*8*128*2 + 2*32*128*2) bytes, about 4.
    intensity = (4 * 1024 * 32 * 128) / (1024 * 2 * 8 * 128 * 2 + 2 * 32 * 128 * 2)
    assert cost.intensity == pytest.approx(intensity)
    assert 3.9 < intensity < 4.0
    for chip in CHIPS.values():
        point = roofline(cost, chip)
        assert point.bound == "memory"
        assert point.time_s == pytest.approx(cost.bytes / chip.hbm_bytes_per_s)
        assert point.compute_s < point.memory_s


def test_v5e_decode_time_by_hand():
    cost = rpa_cost([(1, 1024)], **GQA, q_itemsize=2)
    point = roofline(cost, CHIPS["v5e"])
    bytes_ = 1024 * 2 * 8 * 128 * 2 + 2 * 32 * 128 * 2  # 4_210_688
    assert point.memory_s == pytest.approx(bytes_ / 819e9)  # about 5.14 microseconds
    assert point.compute_s == pytest.approx(4 * 1024 * 32 * 128 / 197e12)


# Prefill, chunks, idle --------------------------------------------------------------------


def test_prefill_counts_only_the_causal_triangle():
    # q_len == kv_len == 4: rows see 1, 2, 3, 4 keys, 10 pairs, not 16.
    cost = rpa_cost([(4, 4)], num_q_heads=1, num_kv_heads=1, head_dim=1, page_size=2)
    assert cost.visible_pairs == 1 + 2 + 3 + 4
    assert cost.flops == 4 * 1 * 1 * 10
    assert cost.kv_tokens_read == 4  # two pages of two


def test_long_prefill_is_compute_bound_on_v5e():
    # q_len == kv_len == 4096, GQA 32/8, bf16.
    L = 4096
    cost = rpa_cost([(L, L)], **GQA, q_itemsize=2)
    flops = 4 * 128 * 32 * (L * (L + 1) // 2)
    bytes_ = L * 32 * 128 * 2 * 2 + L * 2 * 8 * 128 * 2  # q + out, K + V
    assert cost.flops == flops
    assert cost.bytes == bytes_
    assert flops / bytes_ > 197e12 / 819e9  # above the v5e ridge point
    assert roofline(cost, CHIPS["v5e"]).bound == "compute"
    assert roofline(cost, CHIPS["v5e"]).time_s == pytest.approx(flops / 197e12)


def test_idle_sequence_costs_nothing():
    cost = rpa_cost([(0, 500)], **GQA)
    assert (cost.bytes, cost.flops, cost.num_tokens) == (0, 0, 0)
    assert cost.intensity == 0.0


def test_costs_add_over_sequences():
    # A decode over 16 keys plus a chunk of 2 rows after 14 cached tokens (kv_len 16), page 8.
    # Decode: 16 pairs, 2 pages. Chunk: rows at positions 14, 15 see 15 + 16 = 31 pairs, 2 pages.
    cost = rpa_cost([(1, 16), (2, 16)], num_q_heads=2, num_kv_heads=1, head_dim=4, page_size=8)
    assert cost.visible_pairs == 16 + 31
    assert cost.kv_tokens_read == 4 * 8
    assert cost.flops == 4 * 4 * 2 * 47
    assert cost.q_bytes == 3 * 2 * 4 * 2  # 3 rows, 2 heads, dim 4, bf16 by default


def test_fp8_cache_halves_kv_bytes():
    bf16 = rpa_cost([(1, 256)], **GQA, q_itemsize=2)
    fp8 = rpa_cost([(1, 256)], **GQA, q_itemsize=2, kv_itemsize=1)
    assert fp8.kv_bytes * 2 == bf16.kv_bytes
    assert fp8.q_bytes == bf16.q_bytes
    assert fp8.flops == bf16.flops


@pytest.mark.parametrize(
    "q_len, kv_len, page_size, sliding_window",
    [(1, 1, 4, None), (1, 33, 16, None), (5, 5, 4, None), (3, 20, 4, None), (7, 40, 8, 5),
     (1, 33, 16, 2), (4, 4, 16, 1), (0, 9, 4, None), (2, 17, 16, 3)],
)  # fmt: skip
def test_matches_brute_force_mask(q_len, kv_len, page_size, sliding_window):
    pairs, keys = brute_force_visible(q_len, kv_len, sliding_window)
    assert visible_keys(q_len, kv_len, sliding_window) == pairs
    # Pages read: from the page of the first visible key to the page of the last one.
    pages = len(range(min(keys) // page_size, max(keys) // page_size + 1)) if keys else 0
    assert kv_pages_read(q_len, kv_len, page_size, sliding_window) == pages


def test_random_batches_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        kv_lens = rng.integers(1, 40, 4)
        seqs = [(int(rng.integers(0, kv + 1)), int(kv)) for kv in kv_lens]
        cost = rpa_cost(seqs, num_q_heads=2, num_kv_heads=1, head_dim=3, page_size=8, q_itemsize=4)
        total_pairs = sum(brute_force_visible(q, kv)[0] for q, kv in seqs)
        total_pages = sum(math.ceil(kv / 8) for q, kv in seqs if q > 0)
        assert cost.flops == 4 * 3 * 2 * total_pairs
        assert cost.kv_bytes == total_pages * 8 * 2 * 1 * 3 * 4


def test_batch_cost_reads_shapes_and_dtypes_from_the_batch():
    batch = make_batch([(1, 20), (3, 3)], num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=8,
                       dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)  # fmt: skip
    cost = batch_cost(batch)
    # 20 keys -> 3 pages; 3 keys -> 1 page. fp8 cache: 1 byte; bf16 q and out: 2 bytes.
    assert cost.kv_bytes == (3 + 1) * 8 * 2 * 2 * 8 * 1
    assert cost.q_bytes == cost.out_bytes == 4 * 4 * 8 * 2
    assert cost.flops == 4 * 8 * 4 * (20 + 6)


# Chips --------------------------------------------------------------------------------------


def test_chip_table_figures():
    expected = {"v5e": (819e9, 197e12), "v6e": (1640e9, 918e12), "v5p": (2765e9, 459e12),
                "v4": (1200e9, 275e12)}  # fmt: skip
    for key, (bw, flops) in expected.items():
        assert (CHIPS[key].hbm_bytes_per_s, CHIPS[key].peak_flops_per_s) == (bw, flops)
        assert CHIPS[key].ridge_point == pytest.approx(flops / bw)
    # Every TPU here needs 150+ FLOPs per byte to leave the memory roof.
    assert all(150 < chip.ridge_point < 600 for chip in CHIPS.values())


def test_explain_says_why():
    cost = rpa_cost([(1, 1024)], **GQA, q_itemsize=2)
    text = explain(roofline(cost, CHIPS["v5e"]))
    assert text.startswith("memory-bound on TPU v5e")
    assert "240.5 FLOP/byte" in text and "4.0 FLOP/byte is below" in text
    assert "as in a decode" in text
    prefill = rpa_cost([(4096, 4096)], **GQA, q_itemsize=2)
    assert "compute-bound" in explain(roofline(prefill, CHIPS["v5e"]))
    assert "is above the ridge" in explain(roofline(prefill, CHIPS["v5e"]))
    # A prefill's verdict speaks of reuse, not of decodes.
    assert "as in a prefill" in explain(roofline(prefill, CHIPS["v5e"]))
    assert "decode" not in explain(roofline(prefill, CHIPS["v5e"]))


def test_custom_chip_ridge():
    chip = Chip("toy", hbm_bytes_per_s=10.0, peak_flops_per_s=100.0)
    assert chip.ridge_point == 10.0


def test_detect_chip_is_none_off_tpu():
    import jax

    if jax.default_backend() == "tpu":
        chip = detect_chip()
        assert chip is not None and chip.hbm_bytes_per_s > 0
    else:
        assert detect_chip() is None
