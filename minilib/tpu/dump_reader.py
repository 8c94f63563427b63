"""Read what libtpu wrote down about a compiled Pallas kernel: its bundles, loops and VMEM.

`minilib.tpu.compile` asks libtpu (through `LIBTPU_INIT_ARGS`, see `DUMP_FLAGS`) to dump, per
kernel, two text files, and this module reads them. It needs no libtpu and no JAX: its rules
are checked on small excerpts (the examples below, and `tests/test_tpu_dump_reader.py`).

* `*-final_bundles.txt`: one line per bundle. A loop's first bundle is marked `LB:`, and every
  bundle inside loops carries one `>` per nesting level. `bundles_per_kv_block` is the length
  of one loop, chosen by `COUNTING_RULE` (see `kv_block_loop`). That length holds regions a
  branch jumps over, so `kv_block_paths` follows the loop's branches (`sbr.rel ... target =
  $region157` jumps to the bundle whose comment says `Start region 157`) through one pass:
  the longest path, and an interior block's (`PATH_RULES`). With source annotations on,
  each op carries the `loc("file":line)` it came from, which gives `top_source_lines` (with
  jax 0.7.2 the locations are coarser, often the enclosing `pl.when`).
* `*-post-delay-converter.txt`: the kernel's memory allocations. Peak VMEM is the highest end
  offset of a VMEM allocation; spill bytes are the sizes of the `_spill` ones (vector
  registers that did not fit and went to VMEM).

The dump files are libtpu internals, not an API: the reader was checked by hand against the
libtpu versions of `CHECKED_LIBTPU`. With another libtpu, a kernel's notes say when its dump
was not recognised, and how to get a checked libtpu.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import linecache
import math
import re
from pathlib import Path

__all__ = [
    "CHECKED_LIBTPU",
    "COUNTING_RULE",
    "DUMP_FLAGS",
    "KernelStats",
    "PATH_RULES",
    "PathsNotRead",
    "branch_kv_block_loops",
    "branches",
    "count_ops",
    "delay_slots",
    "kv_block_loop",
    "kv_block_passes",
    "kv_block_paths",
    "loop_bodies",
    "loop_extents",
    "op_kinds",
    "parse_bundles",
    "read_dump",
    "vmem_usage",
]

# jax version -> the libtpu that its `jax[tpu]` extra brings, and that this reader was checked
# against by hand.
CHECKED_LIBTPU = {"0.12.0.1": "0.0.50.1", "0.10.2": "0.0.42.1", "0.7.2": "0.0.23"}
NEWEST_CHECKED_JAX = "0.12.0.1"

# What `minilib.tpu.compile` asks libtpu to write: the two files above, with source locations.
DUMP_FLAGS = (
    "--xla_jf_dump_llo_pass_label_regex=final_bundles|post-delay-converter",
    "--xla_mosaic_enable_llo_source_annotations=true",
)
# Dump files of XLA's own programs, not of a Pallas kernel.
NON_KERNEL_PROGRAMS = ("TLP", "<late-initialization>", "<late-finalization>")


@dataclasses.dataclass(frozen=True)
class KernelStats:
    """What the bundle dump says about one compiled Pallas kernel (static estimates).

    >>> stats = KernelStats("rpa.1", total_bundles=900, bundles_per_kv_block=120,
    ...                     vmem_bytes=3 << 20, spill_bytes=0, top_source_lines=())
    >>> stats.bundles_per_kv_block, stats.spill_bytes
    (120, 0)
    """

    name: str
    total_bundles: int
    bundles_per_kv_block: int | None  # the loop of COUNTING_RULE; None if no loop fits it
    vmem_bytes: int | None  # peak: the highest end of a VMEM allocation
    spill_bytes: int | None  # VMEM taken by spilled vector registers
    top_source_lines: tuple[tuple[str, int], ...]  # ((file:line, ops in the KV-block loop), ...)
    source_code: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)
    # The ops of the KV-block loop by kind (`op_kinds`): (("vector load", 553), ...)
    loop_op_kinds: tuple[tuple[str, int], ...] = ()
    # Paths through one pass of that loop, following its branches (`kv_block_paths`): the
    # longest, and the shortest that holds every matmul and a page copy (an interior block's
    # stand-in). None where the loop was not counted or its branches were not read (a note
    # says why).
    longest_path: int | None = None
    interior_path: int | None = None
    # A kernel with a KV-block loop per branch (`branch_kv_block_loops`): each branch's figures,
    # in program order; its own bundles_per_kv_block is then None.
    branches: tuple[KernelStats, ...] = ()


# "  0x2b1 LB: >>> { ops ;; ops }": address, optional control tag, loop depth, then the bundle.
BUNDLE_LINE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:([A-Z]{2}):|:)\s*(>*)\s*\{")
SOURCE_LOC = re.compile(r'loc\("([^"]+)":(\d+)')
VMEM_ALLOCATION = re.compile(
    r"#allocation(\w*) \[shape = '[^']*', space=vmem, size = (0x[0-9a-f]+|\d+), "
    r"offset = (0x[0-9a-f]+|\d+)"
)
DUMP_FILE = re.compile(r"^\d+-(.+)-\d\d-(final_bundles|post-delay-converter)\.txt$")

# The rule that picks the loop whose length is "bundles per KV block", for every kernel alike
# (ours, JAX's, vLLM's RPA v3), so that their figures compare. `kv_block_loop` applies it.
COUNTING_RULE = (
    "bundles per KV block = one pass of the innermost loop that holds every matmul of the "
    "kernel and at least one DMA start"
)
# The two kinds of op the rule looks for, as libtpu 0.0.42.1 prints them on v5e, v6e and TPU7x:
# * a matmul is one `vmatmul` op, one vector register of left-hand rows streamed through an
#   MXU (16 rows of bf16, 8 of f32): `vmatmul.bf16.gmra.mxu0` on v5e, `vmatmul.mubr.bf16...`
#   on v6e. Pushing the weights in (`vmatpush`, `vmatprep`) and popping the results out
#   (`vpop`) belong to a matmul; they are not matmuls of their own.
# * a DMA start is `dma.<from>_to_<to>`: `dma.hbm_to_vmem` (a page copy), `dma.vmem_to_hbm`,
#   `dma.hbm_to_smem`. Its wait, `dma.done.wait`, is not a start.
MATMUL = re.compile(r"=\s*vmatmul\.")
DMA_START = re.compile(r"=\s*dma\.(?!done\.)")
# Comments are cut before ops are matched: a bounds check's comment quotes the DMA it guards
# ("... for %14572 = dma.hbm_to_vmem ..."), which is not a DMA start of its own.
COMMENT = re.compile(r"/\*.*?\*/", re.S)

# Excerpts in libtpu 0.0.42.1's format, for the examples below: a loop (`LB:` opens it, `>`
# marks its depth) that starts a copy and holds a matmul, and one VMEM allocation plus one
# spilled vector register.
EXAMPLE_BUNDLES = "\n".join([
    "   0x0   :  { %s1 = smov 0 }",
    "   0x1 LB: > { %v2 = vld [vmem:[#allocation2]]  ;;  %5 = dma.hbm_to_vmem [thread:$0]  %s1 }",
    "   0x2   : > { %v3 = vmatmul.bf16 %v2 }",
    "   0x3 PF:  { %s4 = shalt }",
])  # fmt: skip
EXAMPLE_ALLOCATIONS = "\n".join([
    "#allocation2 [shape = 'f32[8,128]', space=vmem, size = 0x1000, offset = 0x0, scoped]",
    "#allocation7_spill [shape = 'u32[8,128]', space=vmem, size = 0x1000, offset = 0x1000, "
    "scoped]",
])  # fmt: skip
# A real listing cut down to 17 bundles (source locations and most operands removed): a small
# kernel of our own with two nested loops, compiled for v5e. Its KV-block loop (0xd) starts
# the next block's copy (0x27) and waits for this one (0x29); inside it, a loop over compute
# chunks (0x36), whose trip count is read at run time, holds every matmul (0x4c, 0x4e) and
# starts no copy. 0x53 is a predicated op of the KV loop that the scheduler placed inside the
# chunk loop, so it shows the smaller depth there. 0x6c is the KV loop's last delay slot,
# printed at depth 0; 0x78 is the epilogue's output copy.
EXAMPLE_TWO_LOOPS = "\n".join([
    "   0xa   :  { %45 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s41_s23, /*vmem=*/%s43_s24 }",
    "   0xd LB: > { %p68_p0 = scmp.lt.s32.totalorder %s1422_s1, 0 }",
    "  0x27   : > { %625 = dma.hbm_to_vmem [thread:$0]  (%p626_p3), /*hbm=*/%s103_s10 }",
    "  0x29   : > { %1352 = dma.done.wait %s108_s1, 2048 }",
    "  0x31   : > { %415 = sbr.rel (%p581_p7) target = $region58 }",
    "  0x35   :  {} /* End region 56 :: End region 59 */",
    "  0x36 LB: >> { %v592_v40 = vld [vmem:[#allocation5] sm:$0xff] }",
    "  0x4c   : >> { %281 = vmatmul.bf16.vlgmr.msra.gmra.mxu0 %v592_v40 }",
    "  0x4e   : >> { %286 = vmatmul.bf16.gmra.mxu0 %v593_v44 }",
    "  0x53   : > { %v2068_v31 = vmov (%p1893_p3), %v2043_v50 }",
    "  0x54   : >> { %v302_v52 = vpop.f32.mrf.mxu2 }",
    "  0x63   : > { %121 = sbr.rel (!%p1893_p3) target = $region64 }",
    "  0x67   : >> { %v2045_v0 = vmov %v337_v16 } /* End region 75 :: End region 57 */",
    "  0x68 PF: > { %50 = sbr.rel (!%p506_p1) target = $region75 }",
    "  0x6b   : > { %v2084_v15 = vmov %v1554_v31 }",
    "  0x6c   :  { %342 = vst [vmem:[#allocation8 + $0x20] sm:$0xff] (%p506_p1) }",
    "  0x78   :  { %366 = dma.vmem_to_hbm [thread:$0]  /*vmem=*/%s359_s10 }",
])  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Bundle:
    address: int  # the bundle's address in the listing: 0x2b1
    tag: str | None  # "LB" on a loop's first bundle
    depth: int  # loop nesting: the number of ">"
    text: str  # the ops, ";;"-separated, comments included

    @property
    def is_empty(self) -> bool:
        return re.match(r"\{\s*\}", self.text) is not None  # "{}", perhaps with a comment


def parse_bundles(text: str) -> list[Bundle]:
    """The bundles of a `*-final_bundles.txt`, in order (comments may span several lines).

    >>> text = EXAMPLE_BUNDLES
    >>> print(text)
       0x0   :  { %s1 = smov 0 }
       0x1 LB: > { %v2 = vld [vmem:[#allocation2]]  ;;  %5 = dma.hbm_to_vmem [thread:$0]  %s1 }
       0x2   : > { %v3 = vmatmul.bf16 %v2 }
       0x3 PF:  { %s4 = shalt }
    >>> [(hex(b.address), b.tag, b.depth) for b in parse_bundles(text)]
    [('0x0', None, 0), ('0x1', 'LB', 1), ('0x2', None, 1), ('0x3', 'PF', 0)]
    """
    bundles: list[list] = []
    for line in text.splitlines():
        m = BUNDLE_LINE.match(line)
        if m:
            bundles.append([int(m.group(1), 0), m.group(2), len(m.group(3)), line[m.end() - 1 :]])
        elif bundles:
            bundles[-1][3] += "\n" + line
    return [Bundle(address, tag, depth, text) for address, tag, depth, text in bundles]


def count_ops(bundles: list[Bundle], pattern: re.Pattern) -> int:
    """How many ops of `bundles` match `pattern` (`MATMUL`, `DMA_START`), comments cut.

    >>> bundles = parse_bundles(EXAMPLE_TWO_LOOPS)
    >>> count_ops(bundles, MATMUL), count_ops(bundles, DMA_START)  # dma.done.wait: no start
    (2, 3)
    >>> count_ops(parse_bundles("0x5 : { %1 = shalt.err /* for %7 = dma.hbm_to_vmem */ }"),
    ...           DMA_START)                                        # a comment: no start
    0
    """
    return sum(len(pattern.findall(COMMENT.sub("", bundle.text))) for bundle in bundles)


def loop_extents(bundles: list[Bundle]) -> list[tuple[int, int]]:
    """[start, end) of every loop: from its `LB` bundle to the next *marked* bundle (one with a
    tag, such as `LB` or `PF`) of smaller depth.

    Only marked bundles end a loop: the scheduler may move predicated ops of an outer loop into
    an inner loop's body, and those bundles show the outer loop's smaller depth in the middle
    of the inner loop. Ending a loop at the first shallower bundle would cut it there.

    >>> loop_extents(parse_bundles(EXAMPLE_BUNDLES))   # the loop: bundles 1 and 2
    [(1, 3)]
    """
    extents = []
    for start, bundle in enumerate(bundles):
        if bundle.tag != "LB":
            continue
        end = next(
            (
                j
                for j in range(start + 1, len(bundles))
                if bundles[j].tag is not None and bundles[j].depth < bundle.depth
            ),
            len(bundles),
        )
        extents.append((start, end))
    return extents


def loop_bodies(bundles: list[Bundle]) -> list[tuple[int, int]]:
    """[start, end) of every loop: its `loop_extents`, cut after the last bundle at the loop's
    own depth or deeper.

    The next marked bundle of smaller depth may come a few bundles after the loop: the
    enclosing loop's code that follows the inner loop (or the inner loop's delay slots,
    printed at the outer depth) is not marked until then. Those bundles are cut. The shallower
    bundles *inside* the loop stay, as in `loop_extents`.

    >>> bundles = parse_bundles(EXAMPLE_TWO_LOOPS)
    >>> loop_extents(bundles)  # the KV loop (0xd) runs on to the end of the listing...
    [(1, 17), (6, 13)]
    >>> loop_bodies(bundles)   # ... its body ends at 0x6b; 0x53 stays in the chunk loop (0x36)
    [(1, 15), (6, 13)]
    """
    bodies = []
    for start, end in loop_extents(bundles):
        depth = bundles[start].depth
        last = max(i for i in range(start, end) if bundles[i].depth >= depth)
        bodies.append((start, last + 1))
    return bodies


def kv_block_loop(bundles: list[Bundle]) -> tuple[int, int] | None:
    """The loop of `COUNTING_RULE`, as [start, end): the innermost of the `loop_bodies` that
    hold every matmul of the kernel and at least one DMA start (the shortest, if several are
    as deep). None if no loop does, or the kernel has no matmul.

    Each condition rules out a wrong loop. "Every matmul": a loop over part of a block's work.
    "A DMA start": a loop over compute chunks inside the KV-block loop (vLLM's RPA v3 has one),
    which holds every matmul but never starts the next block's copy. "Innermost": the
    sequence and grid loops around the KV-block loop. So the deepest loop holding a matmul is
    not enough; in the example it is one compute chunk:

    >>> bundles = parse_bundles(EXAMPLE_TWO_LOOPS)
    >>> [(hex(bundles[s].address), count_ops(bundles[s:e], MATMUL),
    ...   count_ops(bundles[s:e], DMA_START)) for s, e in loop_bodies(bundles)]
    [('0xd', 2, 1), ('0x36', 2, 0)]
    >>> kv_block_loop(bundles)          # the KV-block loop, 0xd to 0x6b
    (1, 15)

    What the rule cannot see: the count is static. An inner loop that runs n times per KV
    block is counted once (v3's chunk loop runs once per block only when its chunk is the
    whole block, as in `minilib.tpu.kernel_costs`' comparison).
    """
    total = count_ops(bundles, MATMUL)
    if total == 0:
        return None
    holding = [
        (bundles[s].depth, -(e - s), (s, e))
        for s, e in loop_bodies(bundles)
        if count_ops(bundles[s:e], MATMUL) == total and count_ops(bundles[s:e], DMA_START) > 0
    ]
    return max(holding)[2] if holding else None


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
    minilib.tpu.dump_reader.PathsNotRead: the branch at 0x2: its target region starts at no bundle
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


# What a bundle's ops do, by mnemonic (the word after "="), for `op_kinds`. Pushing weights
# into the MXU, streaming rows through it and popping results are all "MXU"; the EUP computes
# exponentials and reciprocals; everything else starting with "v" is vector ALU work (selects,
# compares, adds, packs, shifts), and s*/p* ops run on the scalar unit.
OP_KINDS = {
    "vld": "vector load",
    "vst": "vector store",
    "vmatpush": "MXU",
    "vmatpush3": "MXU",
    "vmatprep": "MXU",
    "vmatmul": "MXU",
    "vpop": "MXU",
    "vpow2": "EUP (exp, 1/x)",
    "vrcp": "EUP (exp, 1/x)",
    "vexp": "EUP (exp, 1/x)",
    "vtanh": "EUP (exp, 1/x)",
}
MNEMONIC = re.compile(r"=\s*([a-z][a-z0-9_]*)")


def op_kinds(bundles: list[Bundle]) -> collections.Counter:
    """How many ops of each kind (`OP_KINDS`; "vector ALU", "scalar", "DMA", "other" for the
    rest) `bundles` hold, comments cut.

    >>> sorted(op_kinds(parse_bundles(EXAMPLE_BUNDLES)).items())
    [('DMA', 1), ('MXU', 1), ('scalar', 2), ('vector load', 1)]
    """
    kinds: collections.Counter = collections.Counter()
    for bundle in bundles:
        for mnemonic in MNEMONIC.findall(COMMENT.sub("", bundle.text)):
            if mnemonic in OP_KINDS:
                kinds[OP_KINDS[mnemonic]] += 1
            elif mnemonic.startswith("dma"):
                kinds["DMA"] += 1
            elif mnemonic.startswith("v"):
                kinds["vector ALU"] += 1
            elif mnemonic.startswith(("s", "p", "int_to_ptr")):
                kinds["scalar"] += 1
            else:
                kinds["other"] += 1
    return kinds


def ops_by_source_line(bundles: list[Bundle]) -> collections.Counter:
    """How many ops each source line produced (the first `loc` of each op)."""
    counts: collections.Counter = collections.Counter()
    for bundle in bundles:
        for op in bundle.text.strip("{} \n").split(";;"):
            m = SOURCE_LOC.search(op)
            if m:
                counts[(m.group(1), int(m.group(2)))] += 1
    return counts


def short_path(path: str) -> str:
    """.../site-packages/jax/x.py -> jax/x.py; /repo/minilib/kernel.py -> minilib/kernel.py."""
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    return "/".join(parts[-2:])


def vmem_usage(text: str) -> tuple[int, int] | None:
    """(peak VMEM bytes, spill bytes) from a `*-post-delay-converter.txt`.

    >>> print(EXAMPLE_ALLOCATIONS)
    #allocation2 [shape = 'f32[8,128]', space=vmem, size = 0x1000, offset = 0x0, scoped]
    #allocation7_spill [shape = 'u32[8,128]', space=vmem, size = 0x1000, offset = 0x1000, scoped]
    >>> vmem_usage(EXAMPLE_ALLOCATIONS)
    (8192, 4096)
    """
    peak = spills = 0
    found = False
    for m in VMEM_ALLOCATION.finditer(text):
        found = True
        size, offset = int(m.group(2), 0), int(m.group(3), 0)
        peak = max(peak, offset + size)
        if m.group(1).endswith("_spill"):
            spills += size
    return (peak, spills) if found else None


def branch_kv_block_loops(bundles: list[Bundle]) -> list[tuple[int, int]]:
    """`COUNTING_RULE` applied to each branch of a kernel that traces its KV-block loop once
    per branch: the loops that hold a matmul and a DMA start, and no such loop inside, in
    program order. [] for a kernel of one KV-block loop, the rule's own.

    vLLM's RPA v3 kernel for head_dim 64 is one: under `pl.when`s on the kind of sequence it
    runs its KV-block loop for decode, prefill and mixed sequences, three copies in its
    sequence loop. No single KV-block loop holds every matmul, and the rule's loop is the
    sequence loop around the three, not one KV block. In the example, the one KV-block loop:

    >>> branch_kv_block_loops(parse_bundles(EXAMPLE_TWO_LOOPS))
    []
    """
    loop = kv_block_loop(bundles)
    if loop is None:
        return []
    candidates = [
        (s, e)
        for s, e in loop_bodies(bundles)
        if count_ops(bundles[s:e], MATMUL) > 0 and count_ops(bundles[s:e], DMA_START) > 0
    ]
    innermost = [
        (s, e)
        for s, e in candidates
        if not any(s <= s2 and e2 <= e for s2, e2 in candidates if (s2, e2) != (s, e))
    ]
    return [] if innermost == [loop] else innermost


def kernel_stats(name: str, bundles_text: str, allocations_text: str | None):
    notes = []
    bundles = parse_bundles(bundles_text)
    if not bundles:
        return None, [f"{name}: bundle dump format not recognised ({dump_hint()})"]
    loop = kv_block_loop(bundles)
    if loop is None:
        notes.append(
            f"{name}: no loop holds every matmul and a DMA start, so there is no KV-block loop "
            f"to count ({COUNTING_RULE})"
        )
    usage = vmem_usage(allocations_text) if allocations_text else None
    if usage is None:
        notes.append(f"{name}: no VMEM allocations found in the dump ({dump_hint()})")
    branch_loops = branch_kv_block_loops(bundles)
    branches = tuple(
        loop_stats(f"{name}, branch {i} of {len(branch_loops)}", bundles, branch, usage, notes)
        for i, branch in enumerate(branch_loops, 1)
    )
    stats = loop_stats(name, bundles, None if branches else loop, usage, notes)
    return dataclasses.replace(stats, branches=branches), notes


def loop_stats(name: str, bundles: list[Bundle], loop: tuple[int, int] | None, usage, notes):
    """The `KernelStats` of a kernel, its KV-block loop being `loop` (None: none counted).
    When the loop's branches do not fit `kv_block_paths`, its paths are None and `notes` gets
    a line saying why."""
    body = bundles[loop[0] : loop[1]] if loop else bundles
    paths = (None, None)
    if loop:
        try:
            paths = kv_block_paths(bundles, loop)
        except PathsNotRead as err:
            notes.append(f"{name}: paths through the KV-block loop not counted: {err}")
    ops = ops_by_source_line(body)
    top = [(f"{short_path(path)}:{line}", n, linecache.getline(path, line).strip())
           for (path, line), n in ops.most_common(8)]  # fmt: skip
    return KernelStats(
        name=name,
        total_bundles=len(bundles),
        bundles_per_kv_block=(loop[1] - loop[0]) if loop else None,
        longest_path=paths[0],
        interior_path=paths[1],
        vmem_bytes=usage[0] if usage else None,
        spill_bytes=usage[1] if usage else None,
        top_source_lines=tuple((location, n) for location, n, _ in top),
        source_code={location: code for location, _, code in top},
        loop_op_kinds=tuple(op_kinds(body).most_common()) if loop else (),
    )


def libtpu_version() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def dump_hint() -> str:
    checked = CHECKED_LIBTPU[NEWEST_CHECKED_JAX]
    return (
        f"libtpu {libtpu_version()} here; the reader was checked on libtpu {checked}: "
        f'pip install "jax[tpu]=={NEWEST_CHECKED_JAX}" libtpu=={checked}'
    )


def read_dump(dump_dir: Path, names: list[str], kernel_names: set[str]):
    """KernelStats of every Pallas kernel among the dump files `names`, and notes.

    XLA's own programs (the top-level program, fusions such as `broadcast.0`) are dumped too;
    a Pallas kernel's file is named after the kernel (`name.1`), and its first bundle says it
    is a custom call.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> for kind, text in (("final_bundles", EXAMPLE_BUNDLES),
    ...                    ("post-delay-converter", EXAMPLE_ALLOCATIONS)):
    ...     _ = (folder / f"0001-add.1-00-{kind}.txt").write_text(text)
    >>> kernels, notes = read_dump(folder, sorted(p.name for p in folder.iterdir()), {"add"})
    >>> [(k.name, k.total_bundles, k.bundles_per_kv_block, k.spill_bytes) for k in kernels], notes
    ([('add.1', 4, 2, 4096)], ())
    """
    files: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for name in names:
        m = DUMP_FILE.match(name)
        if m and m.group(1) not in NON_KERNEL_PROGRAMS:
            files[m.group(1)][m.group(2)] = (dump_dir / name).read_text(errors="replace")
    kernels, notes = [], []
    for kernel_name, texts in sorted(files.items()):
        bundles_text = texts.get("final_bundles", "")
        base_name = re.sub(r"\.\d+$", "", kernel_name)
        if base_name not in kernel_names and "custom-call(" not in bundles_text[:20000]:
            continue
        stats, kernel_notes = kernel_stats(
            kernel_name, bundles_text, texts.get("post-delay-converter")
        )
        notes += kernel_notes
        if stats is not None:
            kernels.append(stats)
    if kernel_names and not kernels:
        notes.append(f"libtpu wrote no readable bundle dump for the Pallas kernel ({dump_hint()})")
    return tuple(kernels), tuple(notes)
