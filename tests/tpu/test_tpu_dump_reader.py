"""The reader of libtpu's dumps, on excerpts in libtpu 0.0.42.1's format (no libtpu needed).

`tests/tpu/test_tpu_compile.py` checks it on real dumps; these check the rules themselves: loop
extents and bodies, the counting rule (where it and the older "deepest loop with a matmul"
pick different loops, and where a loop must not end at an unmarked shallower bundle), delay
slots, the paths through a KV-block loop (on `EXAMPLE_BRANCHES`, in libtpu 0.0.50.1's format),
VMEM and spills, and that an unknown format is said.
"""

from __future__ import annotations

import pytest

from minilib.tpu.bundles import (
    DMA_START,
    EXAMPLE_TWO_LOOPS,
    MATMUL,
    branch_kv_block_loops,
    count_ops,
    kv_block_loop,
    kv_block_loops,
    kv_block_pair,
    loop_bodies,
    loop_extents,
    parse_bundles,
    weighted_bundles,
)
from minilib.tpu.dump_reader import kernel_stats, read_dump, vmem_usage
from minilib.tpu.loop_paths import (
    EXAMPLE_BRANCHES,
    PathsNotRead,
    delay_slots,
    kv_block_passes,
    kv_block_paths,
)

# An outer loop (the grid) holding a KV loop that starts a copy and holds the matmul, which
# holds a small scalar loop.
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
   0x3 LB: >> { %v4 = vld [vmem:[#allocation2]] /* loc("/src/minilib/kernel.py":10:5) */  ;;  %13 = dma.hbm_to_vmem [thread:$0]  %s2 /* loc("/src/minilib/kernel.py":30:7) */ }
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


def test_the_kv_block_loop_is_the_innermost_loop_with_every_matmul_and_a_dma_start():
    bundles = parse_bundles(BUNDLES)
    assert kv_block_loop(bundles) == (3, 9)  # not the deeper scalar loop, not the grid loop


def deepest_loop_with_a_matmul(bundles):
    """The rule the reader used before COUNTING_RULE, kept here to show where they differ."""
    holding = [
        (bundles[s].depth, e - s, (s, e))
        for s, e in loop_extents(bundles)
        if count_ops(bundles[s:e], MATMUL)
    ]
    return max(holding)[2] if holding else None


def addresses(bundles, loop):
    """A loop's first and last bundle, as the listing prints them."""
    start, end = loop
    return hex(bundles[start].address), hex(bundles[end - 1].address)


def test_the_rule_counts_the_kv_loop_not_a_chunk_loop_inside_it():
    """A KV-block loop around a loop over compute chunks (as vLLM's RPA v3 compiles; the
    excerpt is from a small kernel of our own with that shape). The chunk loop holds every
    matmul but starts no copy: the deepest loop with a matmul is one chunk, not one block."""
    bundles = parse_bundles(EXAMPLE_TWO_LOOPS)
    assert addresses(bundles, deepest_loop_with_a_matmul(bundles)) == ("0x36", "0x67")
    loop = kv_block_loop(bundles)
    assert addresses(bundles, loop) == ("0xd", "0x6b")
    body = bundles[loop[0] : loop[1]]
    assert count_ops(body, MATMUL) == count_ops(bundles, MATMUL) == 2
    assert count_ops(body, DMA_START) == 1  # the next block's copy at 0x27; 0x29 only waits


def test_a_loop_ends_after_its_last_bundle_at_its_own_depth():
    """`loop_extents` runs the KV loop to the next marked shallower bundle, the end of the
    listing (the epilogue's output copy at 0x78 included); its body stops at 0x6b, the last
    bundle at depth 1. 0x53, at depth 1 inside the depth-2 chunk loop, stays in the chunk loop."""
    bundles = parse_bundles(EXAMPLE_TWO_LOOPS)
    kv_extent, chunk_extent = loop_extents(bundles)
    kv_body, chunk_body = loop_bodies(bundles)
    assert addresses(bundles, kv_extent) == ("0xd", "0x78")
    assert addresses(bundles, kv_body) == ("0xd", "0x6b")
    assert chunk_body == chunk_extent
    assert "0x53" in [hex(b.address) for b in bundles[chunk_body[0] : chunk_body[1]]]


# Bundles of OUR kernel's listing (v5e, bf16, 32 q / 8 KV heads, head_dim 128, 8 pages of 16 per
# KV block, 32 q rows per block; libtpu 0.0.42.1), one or two ops each, comments cut to the
# region markers: the per-sequence loop (0x319, depth 2), a small loop (0x348) and the KV-block
# loop (0x37a, depth 3) with a page copy and matmuls. At 0x507 the scheduler put a predicated
# reload of the sequence loop (depth 2, unmarked) inside the KV loop; 0xa78 is the KV loop's
# back-branch, whose delay slots end at 0xa7c; 0xa7d..0xa86 are the sequence loop's tail.
OURS_KV_LOOP_EXCERPT = """\
 0x318   :  {  } /* End region 663 */
 0x319 LB: >> { %s27878_s25 = sld [smem:[#allocation93_spill]] } /* Start region 664 */
 0x348 LB: >>> { %s1075_s16 = sadd.s32 1, %s16468_s30 } /* Start region 649 */
 0x360 PF: >> { %27885 = sst [smem:[#allocation99_spill]] %s16472_s29 } /* Start region 655 */
 0x37a LB: >>> { %s27892_s10 = sld [smem:[#allocation98_spill]] } /* Start region 660 */
 0x3aa   : >>> { %14572 = dma.hbm_to_vmem [thread:$0] (%p14636_p5), %s1163_s29, 2048, %s17371_s3 }
 0x48b   : >>> { %2435 = vmatmul.bf16.vlgmr.msra.gmra.mxu0 %v17821_v63 }
 0x506   : >>> { %s29574_s6 = sld [smem:[#allocation93_spill]] (%p1111_p6) }
 0x507   : >> { %s29575_s24 = sld [smem:[#allocation105_spill]] (%p1111_p6) }
 0x508   : >>> { %v2441_v62 = vpop.f32.mrf.mxu0 }
 0x50b   : >>> { %3324 = vmatmul.bf16.gmra.mxu2 %v3276_v47 ;; %27948 = vst [vmem:[#allocation136_spill] sm:$0xff] %v18086_v48 }
 0xa78   : >>> { %1114 = sbr.rel (!%p1111_p6) target = $region660 }
 0xa7c   : >>> { %8816 = vst [vmem:[#allocation5 + $0xc8] sm:$0xff] %v8800_v51 } /* End region 660 */
 0xa7d   : >> { %s30039_s16 = smov (!%p994_p2, %s993_s16), 0 } /* Start region 670 */
 0xa80   : >> { %p999_p3 = pnand %p998_p8, %p992_p7 } /* End region 141 */
 0xa81   : > { %s29576_s28 = sld [smem:[#allocation105_spill]] (%p999_p3) }
 0xa82   : > { %1002 = sbr.rel (!%p999_p3) target = $region671 }
 0xa86   :  {  } /* End region 664 :: End region 142 :: End region 670 */
 0xa87 PF: > { %8850 = sst [smem:[#allocation7]] %s16484_s28 } /* End region 117 */
"""  # noqa: E501


def first_shallower_bundle_ends(bundles):
    """Loop ends taken at the first non-empty bundle of smaller depth, marked or not: the
    hazard that `loop_extents` avoids. Used here only to show what it would count."""
    extents = []
    for start, bundle in enumerate(bundles):
        if bundle.tag == "LB":
            end = next(
                (j for j in range(start + 1, len(bundles))
                 if bundles[j].depth < bundle.depth and not bundles[j].is_empty),
                len(bundles),
            )  # fmt: skip
            extents.append((start, end))
    return extents


def test_a_loop_does_not_end_at_an_unmarked_shallower_bundle():
    bundles = parse_bundles(OURS_KV_LOOP_EXCERPT)
    loop = kv_block_loop(bundles)
    assert addresses(bundles, loop) == ("0x37a", "0xa7c")  # the KV loop, with its delay slots
    inside = [hex(b.address) for b in bundles[loop[0] : loop[1]]]
    assert "0x507" in inside and "0xa7d" not in inside
    # Ending loops at the first shallower bundle would cut the KV loop at 0x507, before its
    # second matmul, and so count the whole per-sequence loop (0x319) instead.
    cut = dict((hex(bundles[s].address), hex(bundles[e].address))
               for s, e in first_shallower_bundle_ends(bundles))  # fmt: skip
    assert cut["0x37a"] == "0x507"
    cut_kv_loop = next(e for s, e in first_shallower_bundle_ends(bundles) if s == loop[0])
    assert count_ops(bundles[loop[0] : cut_kv_loop], MATMUL) < count_ops(bundles, MATMUL)


def test_vmem_peak_and_spills():
    peak, spills = vmem_usage(ALLOCATIONS)
    assert peak == 0x10A000 + 0x1000
    assert spills == 2 * 0x1000


def test_kernel_stats_counts_ops_per_source_line_in_the_kv_loop():
    stats, notes = kernel_stats("k.1", BUNDLES, ALLOCATIONS)
    assert notes == []
    assert stats.bundles_per_kv_block == 6
    assert stats.total_bundles == 12
    assert stats.top_source_lines == (
        ("minilib/kernel.py:10", 3),
        ("minilib/kernel.py:30", 1),  # ties in the order they first appear
        ("minilib/kernel.py:20", 1),
    )


def test_a_kernel_without_a_dma_start_in_its_loops_has_no_kv_block_loop():
    no_copy = BUNDLES.replace("dma.hbm_to_vmem", "vld")
    stats, notes = kernel_stats("k.1", no_copy, ALLOCATIONS)
    assert stats.bundles_per_kv_block is None
    assert any("every matmul and a DMA start" in note for note in notes), notes


# A grid loop that holds one KV loop per branch (as in vLLM's RPA v3 for head_dim 64, where
# decode, prefill and mixed sequences each get a copy): a short one, a longer one, a short one.
THREE_BRANCHES = """\
= control target key start
LB: loop body
= control target key end

     0   :  { %s1 = smov 0 } /* entry bundle: %k.1 = custom-call(%a) */
   0x1 LB: > { %s2 = sadd.s32 1, %s1 }
   0x2 LB: >> { %v4 = vld [vmem:[#allocation2]]  ;;  %13 = dma.hbm_to_vmem [thread:$0]  %s2 }
   0x3   : >> { %v5 = vmatmul.bf16.gmra.mxu0 %v4 }
   0x4 PF: > { %s6 = sbr.rel %s2 }
   0x5 LB: >> { %v7 = vld [vmem:[#allocation2]]  ;;  %14 = dma.hbm_to_vmem [thread:$0]  %s2 }
   0x6   : >> { %v8 = vmatmul.bf16.gmra.mxu0 %v7 }
   0x7   : >> { %v9 = vmatmul.bf16.gmra.mxu0 %v7 }
   0x8 PF: > { %s10 = sbr.rel %s2 }
   0x9 LB: >> { %v11 = vld [vmem:[#allocation2]]  ;;  %15 = dma.hbm_to_vmem [thread:$0]  %s2 }
   0xa   : >> { %v12 = vmatmul.bf16.gmra.mxu0 %v11 }
   0xb PF: > { %s16 = sbr.rel %s2 }
   0xc PF:  { %s17 = shalt }
"""


def test_a_kv_loop_per_branch_is_counted_per_branch_not_as_the_grid_loop():
    bundles = parse_bundles(THREE_BRANCHES)
    assert kv_block_loop(bundles) == (1, 12)  # the rule alone: the grid loop, not a KV block
    assert branch_kv_block_loops(bundles) == [(2, 4), (5, 8), (9, 11)]
    assert kv_block_pair(bundles) is None
    stats, notes = kernel_stats("k.1", THREE_BRANCHES, ALLOCATIONS)
    assert stats.bundles_per_kv_block is None
    assert [(b.name, b.bundles_per_kv_block) for b in stats.branches] == [
        ("k.1, branch 1 of 3", 2),
        ("k.1, branch 2 of 3", 3),
        ("k.1, branch 3 of 3", 2),
    ]
    assert dict(stats.branches[1].loop_op_kinds)["MXU"] == 2


# Two KV-block loops one after the other in the sequence loop (ours with `open_blocks`: the
# blocks that need no mask, then the masked ones, 2 and 3 bundles).
PAIR = "\n".join(THREE_BRANCHES.splitlines()[:13] + ["   0x9 PF:  { %s11 = shalt }", ""])


def test_two_kv_loops_in_a_row_are_a_pair_counted_at_the_second():
    bundles = parse_bundles(PAIR)
    assert kv_block_loops(bundles) == [(2, 4), (5, 8)]
    assert kv_block_pair(bundles) == ((2, 4), (5, 8))
    assert kv_block_loop(bundles) == (5, 8)
    assert branch_kv_block_loops(bundles) == []
    stats, _ = kernel_stats("k.1", PAIR, ALLOCATIONS)
    assert stats.branches == () and stats.bundles_per_kv_block == 3
    # The whole program: each loop by its own passes (10 open, 4 masked), in 2 sequences.
    assert weighted_bundles(bundles, [(10, 4), 2]) == 2 + 3 * 2 + 2 * 10 + 3 * 4  # 2 outside
    with pytest.raises(ValueError, match="passes for 1 KV-block loops, and the kernel has 2"):
        weighted_bundles(bundles, [14, 2])


def test_a_kernel_of_one_kv_loop_has_no_branches():
    assert branch_kv_block_loops(parse_bundles(BUNDLES)) == []
    stats, _ = kernel_stats("k.1", BUNDLES, ALLOCATIONS)
    assert stats.branches == () and stats.bundles_per_kv_block == 6


def test_an_unrecognised_dump_is_said_with_the_fix(tmp_path):
    (tmp_path / "123-k.1-02-final_bundles.txt").write_text("a format from another libtpu\n")
    kernels, notes = read_dump(tmp_path, ["123-k.1-02-final_bundles.txt"], {"k"})
    assert kernels == ()
    assert any("not recognised" in note and "pip install" in note for note in notes), notes


def test_no_dump_for_a_pallas_kernel_is_said(tmp_path):
    kernels, notes = read_dump(tmp_path, [], {"k"})
    assert kernels == () and any("no readable bundle dump" in note for note in notes), notes


def test_the_interior_path_skips_first_block_work_but_no_matmul_and_no_copy():
    """In the example a pass can skip the next block's copy (0x7) and the first block's work
    (0xe, 0xf): the interior path skips the latter only. With a matmul in the first block's
    region, that region is on the interior path too."""
    bundles = parse_bundles(EXAMPLE_BRANCHES)
    loop = kv_block_loop(bundles)
    longest, interior = kv_block_passes(bundles, loop)
    assert longest == list(range(*loop))
    assert [hex(bundles[i].address) for i in longest if i not in interior] == ["0xe", "0xf"]
    with_matmul = EXAMPLE_BRANCHES.replace(
        "%585 = vst [vmem:[#allocation5] sm:$0xf] %v4804_v5", "%v585 = vmatmul.bf16.gmra.mxu0 %v5"
    )
    bundles = parse_bundles(with_matmul)
    assert kv_block_paths(bundles, kv_block_loop(bundles)) == (21, 21)


def test_delay_slots_are_bounded_by_where_the_next_region_starts():
    """v5e and v6e: 4 bundles after a branch before its fall-through region; TPU7x: 1."""
    assert delay_slots(parse_bundles(EXAMPLE_BRANCHES)) == 4
    one_slot = "\n".join(
        line
        for line in EXAMPLE_BRANCHES.splitlines()
        if not line.startswith(("   0x4 ", "   0x5 ", "   0x6 "))
    )
    assert delay_slots(parse_bundles(one_slot)) == 1


def test_a_branch_out_of_the_loop_leaves_its_paths_uncounted_and_says_so():
    """A jump out of the loop body (here to 0x16, after the loop) is no pass of it: the
    listing is still counted, the paths are None, and a note says which branch."""
    out = EXAMPLE_BRANCHES.replace("target = $region160", "target = $region170").replace(
        "%366 = dma.vmem_to_hbm [thread:$0]  %s359_s10 }",
        "%366 = dma.vmem_to_hbm [thread:$0]  %s359_s10 } /* Start region 170 */",
    )
    with pytest.raises(PathsNotRead, match="the branch at 0x9 jumps to 0x16, out of the loop"):
        kv_block_paths(parse_bundles(out), kv_block_loop(parse_bundles(out)))
    stats, notes = kernel_stats("k.1", out, ALLOCATIONS)
    assert stats.bundles_per_kv_block == 21
    assert stats.longest_path is None and stats.interior_path is None
    assert notes == ["k.1: paths through the KV-block loop not counted: the branch at 0x9 "
                     "jumps to 0x16, out of the loop (0x1 to 0x15) or into its own 4 delay "
                     "slots"]  # fmt: skip


def test_a_branch_in_another_branchs_delay_slots_is_said():
    nested = EXAMPLE_BRANCHES.replace(
        "   0x4   : > {}", "   0x4   : > { %9 = sbr.rel (%p2_p8) target = $region157 }"
    )
    with pytest.raises(PathsNotRead, match="0x4 is in the delay slots"):
        kv_block_paths(parse_bundles(nested), kv_block_loop(parse_bundles(nested)))


def test_paths_of_a_loop_with_no_branch_are_its_listing():
    stats, notes = kernel_stats("k.1", BUNDLES, ALLOCATIONS)
    assert notes == []
    assert stats.longest_path == stats.interior_path == stats.bundles_per_kv_block == 6


def test_a_strided_page_copy_counts_as_the_next_blocks_copy_and_an_output_copy_does_not():
    """Our kernel's page copies on TPU7x at head_dim 256 are `dma.general` (strided): the
    interior path keeps them. A copy out of VMEM is no page copy: no pass holds one."""
    general = EXAMPLE_BRANCHES.replace("dma.hbm_to_vmem [thread:$0]", "dma.general")
    bundles = parse_bundles(general)
    assert kv_block_paths(bundles, kv_block_loop(bundles)) == (21, 19)
    out = EXAMPLE_BRANCHES.replace("dma.hbm_to_vmem", "dma.vmem_to_hbm")
    bundles = parse_bundles(out)
    with pytest.raises(PathsNotRead, match="issues every matmul and a page copy"):
        kv_block_paths(bundles, kv_block_loop(bundles))
