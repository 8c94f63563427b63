"""The reader of libtpu's dumps, on excerpts in libtpu 0.0.42.1's format (no libtpu needed).

`tests/test_tpu_compile.py` checks it on real dumps; these check the rules themselves: loop
extents, the KV-block loop, delay slots, VMEM and spills, and that an unknown format is said.
"""

from __future__ import annotations

from minilib.tpu.dump_reader import (
    kernel_stats,
    kv_block_loop,
    loop_extents,
    parse_bundles,
    read_dump,
    vmem_usage,
)

# An outer loop (the grid) holding a KV loop with a matmul, which holds a small scalar loop.
# As in real dumps, a loop ends at the next *marked* bundle (`PF:`, `LB:`) of smaller depth;
# the scheduler has moved one predicated op of the grid loop (depth 1) into the KV loop at 0x5,
# and a delay slot (`{}`, no depth marks) sits after the grid loop.
BUNDLES = """\
= control target key start
LB: loop body
= control target key end

     0   :  { %s1 = smov 0 } /* entry bundle: %k.1 = custom-call(%a) */
   0x1 LB: > { %s2 = sadd.s32 1, %s1 }
   0x2   : > { %s3 = sld [smem:[#allocation9]] }
   0x3 LB: >> { %v4 = vld [vmem:[#allocation2]] /* loc("/src/minilib/kernel.py":10:5) */ }
   0x4   : >> { %v5 = vmatmul.bf16.gmra.mxu0 %v4 /* loc("/src/minilib/kernel.py":20:3) */  ;;  %v6 = vsel %v4 /* loc("/src/minilib/kernel.py":10:5) */ }
   0x5   : > { %s12 = sld [smem:[#allocation9]] (%p1) }
   0x6 LB: >>> { %s7 = sadd.s32 1, %s2 }
   0x7   : >>> { %s8 = sbr.rel %s7 }
   0x8 PF: >> { %v9 = vadd.f32 %v5, %v6 /* loc("/src/minilib/kernel.py":10:5) */ }
   0x9 PF: > { %s10 = sbr.rel %s2 }
   0xa   :  {} /* End region 4 */
   0xb PF:  { %s11 = shalt }
"""  # noqa: E501

ALLOCATIONS = """\
  #allocation2 [shape = 'bf16[2,8,16,16,128]', space=vmem, size = 0x100000, offset = 0x9000, scoped, tag = 'scratch operand']
  #allocation9 [shape = 'u8[512]{0}', space=smem, size = 0x200, offset = 0x200, scoped, tag = 'prefetched SMEM operand 0']
                  #allocation101_spill [shape = 'u32[8,128]{1,0}', space=vmem, size = 0x1000, offset = 0x109000, scoped, tag = 'spilled vreg/vmreg']
                  #allocation102_spill [shape = 'u32[8,128]{1,0}', space=vmem, size = 0x1000, offset = 0x10a000, scoped, tag = 'spilled vreg/vmreg']
"""  # noqa: E501


def test_loops_run_from_their_first_bundle_to_the_last_one_as_deep():
    bundles = parse_bundles(BUNDLES)
    assert len(bundles) == 12
    # The grid loop ends at the marked halt; the KV loop holds the grid loop's predicated op at
    # 0x5 and the inner loop, and ends at the marked bundle of depth 1 at 0x9.
    assert loop_extents(bundles) == [(1, 11), (3, 9), (6, 8)]


def test_the_kv_block_loop_is_the_deepest_loop_holding_a_vmatmul():
    bundles = parse_bundles(BUNDLES)
    assert kv_block_loop(bundles) == (3, 9)  # not the deeper scalar loop, not the grid loop


def test_vmem_peak_and_spills():
    peak, spills = vmem_usage(ALLOCATIONS)
    assert peak == 0x10A000 + 0x1000
    assert spills == 2 * 0x1000


def test_kernel_stats_counts_ops_per_source_line_in_the_kv_loop():
    stats, notes = kernel_stats("k.1", BUNDLES, ALLOCATIONS)
    assert notes == []
    assert stats.bundles_per_kv_block == 6
    assert stats.total_bundles == 12
    assert stats.top_source_lines == (("minilib/kernel.py:10", 3), ("minilib/kernel.py:20", 1))


def test_an_unrecognised_dump_is_said_with_the_fix(tmp_path):
    (tmp_path / "123-k.1-02-final_bundles.txt").write_text("a format from another libtpu\n")
    kernels, notes = read_dump(tmp_path, ["123-k.1-02-final_bundles.txt"], {"k"})
    assert kernels == ()
    assert any("not recognised" in note and "pip install" in note for note in notes), notes


def test_no_dump_for_a_pallas_kernel_is_said(tmp_path):
    kernels, notes = read_dump(tmp_path, [], {"k"})
    assert kernels == () and any("no readable bundle dump" in note for note in notes), notes
