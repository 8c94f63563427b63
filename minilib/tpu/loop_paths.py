"""Paths through one pass of a KV-block loop, following its branches (`PATH_RULES`).

The listing of the KV-block loop (`minilib.tpu.bundles.kv_block_loop`) holds regions a branch
jumps over: the next block's copy, skipped on the last block; a first block's
initialisation; v3's update of the KV cache. So its length is not the path any one KV block
takes. A branch (`sbr.rel ... target = $region157`) jumps to the bundle whose comment says
`Start region 157`, after its delay slots; `kv_block_paths` gives the longest pass and an
interior block's pass.
"""

from __future__ import annotations

import math
import re

from minilib.tpu.bundles import (
    COMMENT,
    MATMUL,
    Bundle,
    count_ops,
    kv_block_loop,  # noqa: F401 (the examples use it)
    parse_bundles,  # noqa: F401 (the examples use it)
)

__all__ = [
    "EXAMPLE_BRANCHES",
    "PAGE_COPY",
    "PATH_RULES",
    "PathsNotRead",
    "branches",
    "delay_slots",
    "kv_block_passes",
    "kv_block_paths",
    "pass_successors",
]

# The two paths `kv_block_paths` follows through one pass of the KV-block loop, for every
# kernel alike. A pass runs from the loop's first bundle to its back edge, and at each branch
# either falls through or jumps to its target.
PATH_RULES = (
    "longest path = the most bundles one pass of the KV-block loop can issue, following its "
    "branches; interior path = the fewest bundles of a pass that issues every matmul and a page "
    "copy (an interior KV block's path: the next block's copy started, no first-block or "
    "last-block work; the listing does not say which branch an interior block takes, so this "
    "is the shortest pass that does an interior block's work); an inner loop counted once"
)
# A branch, as libtpu 0.0.50.1 prints it: `%7 = sbr.rel (%p3_p1) target = $region157`
# (`(!%p..)` when it jumps on false). Its target is the bundle whose comment says the region
# starts there: `/* Start region 157 */`, or `/* Start/End empty region 157 */`, a region
# with no bundle of its own (the branch jumps over everything up to there). A loop's back edge
# jumps to the region that starts at its `LB` bundle.
BRANCH = re.compile(r"=\s*sbr\.rel\b[^;]*?target = \$region(\d+)")
REGION_START = re.compile(r"Start(?:/End empty)? region (\d+)\b")
# A page copy into VMEM: the copy of a KV block's pages (the next block's, in a pass). Most
# are `dma.hbm_to_vmem`; a strided copy, whose strides are read from a descriptor, is a
# `dma.general` (our kernel's page copies on TPU7x at head_dim 256). Copies out of VMEM
# (`dma.vmem_to_hbm`: an output, or v3's update of the KV cache) are not page copies.
PAGE_COPY = re.compile(r"=\s*dma\.(?:hbm_to_vmem|general)\b")
# A cut-down real listing (v5e, operands shortened; a branch's delay slots are the 4 bundles
# after it): a KV-block loop (0x1 to 0x15) that skips the next block's copy (0x7) on the last
# block, skips the first block's initialisation (0xe, 0xf) on every other block, then issues
# its matmul and jumps back (0x11) to the region that starts at 0x1.
EXAMPLE_BRANCHES = "\n".join([
    "   0x0   :  { %s1 = smov 0 }",
    "   0x1 LB: > { %p2_p8 = scmp.ge.s32.totalorder %s1158_s24, 1 } /* Start region 648 */",
    "   0x2   : > { %1167 = sbr.rel (%p2_p8) target = $region157 }",
    "   0x3   : > { %s8997_s8 = sshll.u32 (!%p2_p8), %s1160_s30, 3 }",
    "   0x4   : > {}",
    "   0x5   : > {}",
    "   0x6   : > {} /* End region 156 */",
    "   0x7   : > { %7031 = dma.hbm_to_vmem [thread:$0]  %s1458_s13, 2048, %s1460_s14 } "
    "/* Start region 158 */",
    "   0x8 PF: > { %8174 = dma.done.wait %s9264_s26, 2048 } /* Start/End empty region 157 */",
    "   0x9   : > { %1590 = sbr.rel (!%p1162_p6) target = $region160 }",
    "   0xa   : > {}",
    "   0xb   : > {}",
    "   0xc   : > {}",
    "   0xd   : > {} /* End region 159 */",
    "   0xe   : > { %585 = vst [vmem:[#allocation5] sm:$0xf] %v4804_v5 } /* Start region 161 */",
    "   0xf   : > { %586 = vst [vmem:[#allocation5 + $0x4] sm:$0xf] %v4804_v5 }",
    "  0x10 PF: > { %v281 = vmatmul.bf16.gmra.mxu0 %v592_v40 } /* Start/End empty region 160 */",
    "  0x11   : > { %v4558_v31 = vpop.f32.mrf.mxu3  ;;  %1154 = sbr.rel (!%p1151_p3) "
    "target = $region648 }",
    "  0x12   : > { %v4568_v2 = vadd.f32 %v4564_v7, %v4558_v31 }",
    "  0x13   : > {}",
    "  0x14   : > { %v4572_v37 = vsel %vm10064_vm0, %v4568_v2, %v4539_v28 }",
    "  0x15   : > { %4576 = vst [vmem:[#allocation7 + $0x8] sm:$0xff] %v4572_v37 }",
    "  0x16   :  { %366 = dma.vmem_to_hbm [thread:$0]  %s359_s10 }",
])  # fmt: skip


class PathsNotRead(ValueError):
    """The branches of a KV-block loop do not fit the model of `kv_block_paths`: its paths
    are not counted (never guessed), and the message says which branch, and why.

    >>> bundles = parse_bundles(EXAMPLE_BRANCHES.replace("$region157", "$region9"))
    >>> kv_block_paths(bundles, kv_block_loop(bundles))
    Traceback (most recent call last):
    ...
    minilib.tpu.loop_paths.PathsNotRead: the branch at 0x2: its target region starts at no bundle
    """


def branches(bundles: list[Bundle]) -> list[tuple[int, int | None]]:
    """(index of each branch bundle, index of the bundle its target region starts at), in
    order; None when no bundle starts the target region.

    >>> bundles = parse_bundles(EXAMPLE_BRANCHES)
    >>> [(hex(bundles[b].address), hex(bundles[t].address)) for b, t in branches(bundles)]
    [('0x2', '0x8'), ('0x9', '0x10'), ('0x11', '0x1')]
    """
    starts: dict[int, int] = {}
    for i, bundle in enumerate(bundles):
        for m in REGION_START.finditer(bundle.text):
            starts.setdefault(int(m.group(1)), i)
    return [
        (i, starts.get(int(m.group(1))))
        for i, bundle in enumerate(bundles)
        for m in BRANCH.finditer(COMMENT.sub("", bundle.text))
    ]


def delay_slots(bundles: list[Bundle]) -> int:
    """How many bundles after a branch issue whether it jumps or not (its delay slots).

    The listing does not print them, but it bounds them: no region starts in a branch's
    delay slots (they run on both paths), so there are fewer than the shortest distance from a
    branch to the next bundle that starts a region or carries a tag. The compiler pads the
    slots it cannot fill with empty bundles. In libtpu 0.0.50.1's listings the bound is 4 on
    v5e and v6e (a branch is followed by 4 bundles, often empty `{}`, then its fall-through
    region) and 1 on TPU7x. On TPU7x a few branches are followed by up to 6 bundles whose
    ops are predicated on the branch's condition, as if they were delay slots: there a jump
    may issue up to 5 bundles more than the paths count.

    >>> delay_slots(parse_bundles(EXAMPLE_BRANCHES))   # 0x2: slots 0x3 to 0x6, 0x7 a region
    4
    """
    starts = [
        i for i, bundle in enumerate(bundles) if bundle.tag or REGION_START.search(bundle.text)
    ]
    gaps = [min((j - b for j in starts if j > b), default=None) for b, _ in branches(bundles)]
    gaps = [gap for gap in gaps if gap is not None]
    if not gaps:
        raise PathsNotRead("no branch is followed by a region: its delay slots are not known")
    return min(gaps) - 1


def pass_successors(bundles: list[Bundle], loop: tuple[int, int]) -> dict[int, list[int]]:
    """For each bundle of `loop` ([start, end)), the bundles a pass can issue next (`end`:
    the pass is over). After a branch's delay slots a pass falls through or jumps to its
    target. The back edge (the branch to the loop's first bundle) is not followed: the pass
    runs on to the loop's last bundle, its delay slots and, on TPU7x, the few bundles after
    them that the listing prints at the loop's depth (the loop's own work, as `loop_bodies`
    counts it). An inner loop's back edge is not followed either: its body is counted once,
    as `COUNTING_RULE` counts it. Raises `PathsNotRead` for a branch that does not fit: a
    target region that starts nowhere, or out of the loop, or in the branch's own delay
    slots, or a branch in another's delay slots.

    >>> bundles = parse_bundles(EXAMPLE_BRANCHES)
    >>> nexts = pass_successors(bundles, kv_block_loop(bundles))
    >>> nexts[6], nexts[13], nexts[21]   # after 0x2's delay slots; after 0x9's; the last one
    ([7, 8], [14, 16], [22])
    """
    start, end = loop
    nexts = {i: [i + 1] for i in range(start, end)}
    in_loop = [(branch, target) for branch, target in branches(bundles) if start <= branch < end]
    delay = delay_slots(bundles) if in_loop else 0
    in_slots: set[int] = set()
    for branch, target in in_loop:
        where = f"the branch at {hex(bundles[branch].address)}"
        if target is None:
            raise PathsNotRead(f"{where}: its target region starts at no bundle")
        if branch in in_slots:
            raise PathsNotRead(f"{where} is in the delay slots of the branch before it")
        in_slots.update(range(branch + 1, branch + delay + 1))
        last = min(branch + delay, end - 1)  # its last delay slot (in the listing's loop)
        if target == start:  # the back edge: the pass runs on to the loop's last bundle
            continue
        if start < target <= branch:  # an inner loop's back edge: one pass of that loop
            continue
        elif branch + delay < target < end:
            nexts[last].append(target)
        else:
            raise PathsNotRead(
                f"{where} jumps to {hex(bundles[target].address)}, out of the loop "
                f"({hex(bundles[start].address)} to {hex(bundles[end - 1].address)}) or into "
                f"its own {delay} delay slots"
            )
    return nexts


def kv_block_passes(bundles: list[Bundle], loop: tuple[int, int]) -> tuple[list[int], list[int]]:
    """(longest pass, interior pass) of `PATH_RULES` through `loop`, each as the indices of
    the bundles it issues, following the loop's branches (`pass_successors`). Raises
    `PathsNotRead` when a branch does not fit, or no pass issues every matmul of the loop and
    a page copy.

    >>> bundles = parse_bundles(EXAMPLE_BRANCHES)
    >>> longest, interior = kv_block_passes(bundles, kv_block_loop(bundles))
    >>> [hex(bundles[i].address) for i in longest if i not in interior]  # the first block's
    ['0xe', '0xf']
    """
    start, end = loop
    nexts = pass_successors(bundles, loop)
    # matmuls_before[i]: matmul bundles of the loop before bundle i; a jump from i to j skips
    # a matmul when matmuls_before[j] > matmuls_before[i + 1].
    matmuls_before = {start: 0}
    for i in range(start, end):
        matmuls_before[i + 1] = matmuls_before[i] + (count_ops([bundles[i]], MATMUL) > 0)
    # Walking back from the end, each bundle's best (length to the end, next bundle):
    # longest[i]: the most bundles from i to the end of the pass;
    # fewest[i, copied]: the fewest, without skipping a matmul, and with a page copy on the
    # way unless `copied` (one was issued before i).
    longest = {end: (0, end)}
    fewest = {(end, True): (0, end), (end, False): (math.inf, end)}
    for i in reversed(range(start, end)):
        longest[i] = max((1 + longest[j][0], j) for j in nexts[i])
        copies = count_ops([bundles[i]], PAGE_COPY) > 0
        for copied in (False, True):
            fewest[i, copied] = min(
                (
                    (1 + fewest[j, copied or copies][0], j)
                    for j in nexts[i]
                    if matmuls_before[j] == matmuls_before[i + 1]
                ),
                default=(math.inf, end),
            )
    if math.isinf(fewest[start, False][0]):
        raise PathsNotRead(
            f"no pass of the loop at {hex(bundles[start].address)} issues every matmul and a "
            "page copy"
        )
    longest_pass, interior_pass, i, copied = [], [], start, False
    while i < end:
        longest_pass.append(i)
        i = longest[i][1]
    i = start
    while i < end:
        interior_pass.append(i)
        i, copied = fewest[i, copied][1], copied or count_ops([bundles[i]], PAGE_COPY) > 0
    return longest_pass, interior_pass


def kv_block_paths(bundles: list[Bundle], loop: tuple[int, int]) -> tuple[int, int]:
    """(longest path, interior path) of `PATH_RULES`: the bundles of `kv_block_passes`.

    Each pass issues bundles of the listing's loop, none twice, so interior <= longest <= the
    loop's length. In the example (21 bundles) a pass may skip the next block's copy (0x7, on
    the last block) and the first block's initialisation (0xe and 0xf, on every other block):
    the interior path skips the second alone.

    >>> bundles = parse_bundles(EXAMPLE_BRANCHES)
    >>> loop = kv_block_loop(bundles)
    >>> loop[1] - loop[0], kv_block_paths(bundles, loop)
    (21, (21, 19))
    """
    longest, interior = kv_block_passes(bundles, loop)
    return len(longest), len(interior)
