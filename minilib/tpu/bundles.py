"""A compiled kernel's listing (libtpu's `*-final_bundles.txt`): its bundles, its loops, and
the loop whose length is "bundles per KV block" (`COUNTING_RULE`).

One line per bundle. A loop's first bundle is marked `LB:`, and every bundle inside loops
carries one `>` per nesting level. `kv_block_loop` picks the loop of `COUNTING_RULE`;
`minilib.tpu.loop_paths` follows the branches through it, and `minilib.tpu.dump_reader` reads
the dump files. Nothing here needs libtpu or JAX: the rules are checked on small excerpts (the
examples below, and `tests/tpu/test_tpu_dump_reader.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import re

__all__ = [
    "COUNTING_RULE",
    "VECTOR_COMPARE",
    "EXAMPLE_BUNDLES",
    "EXAMPLE_TWO_LOOPS",
    "block_bundles",
    "branch_kv_block_loops",
    "compute_loop",
    "count_ops",
    "kv_block_loop",
    "kv_block_loops",
    "kv_block_pair",
    "loop_bodies",
    "loop_extents",
    "parse_bundles",
    "weighted_bundles",
]

# "  0x2b1 LB: >>> { ops ;; ops }": address, optional control tag, loop depth, then the bundle.
BUNDLE_LINE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:([A-Z]{2}):|:)\s*(>*)\s*\{")

# The rule that picks the loop whose length is "bundles per KV block", for every kernel alike
# (ours, JAX's, vLLM's RPA v3), so that their figures compare. `kv_block_loop` applies it.
COUNTING_RULE = (
    "bundles per KV block = one pass of the innermost loop that holds every matmul of the "
    "kernel and at least one DMA start; where two such loops share them, one after the "
    "other, the second"
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
# A vector compare, `vcmp.<condition>...`: a score mask is built of them (key positions against
# the row's, or kv_len); the loop of the open KV blocks (`minilib.kernel.open_blocks`) has none.
VECTOR_COMPARE = re.compile(r"=\s*vcmp\.")
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
    return sum(_ops_in(bundle.text, pattern) for bundle in bundles)


@functools.lru_cache(maxsize=1 << 18)
def _ops_in(text: str, pattern: re.Pattern) -> int:
    """`count_ops` of one bundle's text, kept: the rules count the same bundles many times
    (each loop, then each loop around it), and a listing holds thousands."""
    return len(pattern.findall(COMMENT.sub("", text)))


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
    if not holding:
        return None
    pair = kv_block_pair(bundles)
    return pair[1] if pair else max(holding)[2]


def kv_block_loops(bundles: list[Bundle]) -> list[tuple[int, int]]:
    """The loops that hold a matmul and a DMA start, and no such loop inside, in program
    order: a kernel's KV-block loops, one or more.

    >>> kv_block_loops(parse_bundles(EXAMPLE_TWO_LOOPS))
    [(1, 15)]
    """
    candidates = [
        (s, e)
        for s, e in loop_bodies(bundles)
        if count_ops(bundles[s:e], MATMUL) > 0 and count_ops(bundles[s:e], DMA_START) > 0
    ]
    return [
        (s, e)
        for s, e in candidates
        if not any(s <= s2 and e2 <= e for s2, e2 in candidates if (s2, e2) != (s, e))
    ]


def kv_block_pair(bundles: list[Bundle]) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """A kernel that walks its KV blocks in two loops, one after the other, that hold every
    matmul between them (ours: the blocks that need no mask, then the rest, `open_blocks`):
    (the first, the second). None for a kernel of one KV-block loop, or of more than two.

    >>> kv_block_pair(parse_bundles(EXAMPLE_TWO_LOOPS)) is None   # one KV-block loop
    True
    """
    loops = kv_block_loops(bundles)
    if len(loops) != 2:
        return None
    matmuls = sum(count_ops(bundles[s:e], MATMUL) for s, e in loops)
    return (loops[0], loops[1]) if matmuls == count_ops(bundles, MATMUL) else None


def branch_kv_block_loops(bundles: list[Bundle]) -> list[tuple[int, int]]:
    """`COUNTING_RULE` applied to each branch of a kernel that traces its KV-block loop once
    per branch: the loops that hold a matmul and a DMA start, and no such loop inside, in
    program order. [] for a kernel of one KV-block loop, the rule's own, or of a pair
    (`kv_block_pair`: the rule counts its second).

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
    innermost = kv_block_loops(bundles)
    return [] if loop in innermost else innermost


# Counting: bundles x the passes of the loop around them. ----------------------------------------


def _size(loop):
    return loop[1] - loop[0]


def _inside(inner, outer) -> bool:
    return inner != outer and outer[0] <= inner[0] and inner[1] <= outer[1]


def compute_loop(bundles, kv) -> tuple[int, int] | None:
    """The innermost loop inside the KV-block loop `kv` that holds all its matmuls (v3's
    compute-chunk loop), or None.

    >>> bundles = parse_bundles(EXAMPLE_TWO_LOOPS)     # a KV loop of 14, a chunk loop of 7
    >>> compute_loop(bundles, kv_block_loop(bundles))
    (6, 13)
    """
    matmuls = count_ops(bundles[kv[0] : kv[1]], MATMUL)
    holding = [loop for loop in loop_bodies(bundles) if _inside(loop, kv)
               and count_ops(bundles[loop[0] : loop[1]], MATMUL) == matmuls]  # fmt: skip
    return min(holding, key=_size, default=None)


def block_bundles(bundles, chunks_per_block: int = 1) -> int:
    """Bundles of one KV block: the KV-block loop (`COUNTING_RULE`), its compute-chunk loop
    (if any, `compute_loop`) counted `chunks_per_block` times.

    >>> bundles = parse_bundles(EXAMPLE_TWO_LOOPS)     # a KV loop of 14, a chunk loop of 7
    >>> block_bundles(bundles), block_bundles(bundles, chunks_per_block=3)
    (14, 28)
    """
    kv = kv_block_loop(bundles)
    if kv is None:
        raise ValueError("no KV-block loop in this kernel: nothing to count per block")
    chunk = compute_loop(bundles, kv)
    return _size(kv) + (chunks_per_block - 1) * (_size(chunk) if chunk else 0)


def weighted_bundles(bundles, passes_outward: list[int], chunk_passes: int | None = None) -> int:
    """A Pallas kernel's bundles for one call: each bundle x the passes, in the call, of the
    innermost loop around it (1 outside every loop). `passes_outward`: the passes of the
    KV-block loop, then of each loop around it, outward; for a kernel of two KV-block loops
    (`kv_block_pair`), the first entry is the passes of each, in program order. `chunk_passes`:
    of the compute-chunk loop inside it. Any other loop runs once per pass of the loop around
    it.

    >>> bundles = parse_bundles(EXAMPLE_TWO_LOOPS)  # 17 bundles: 3 outside, KV loop 14 (7 chunk)
    >>> weighted_bundles(bundles, [10], chunk_passes=20)     # 3 + 7 x 10 + 7 x 20
    213
    >>> weighted_bundles(bundles, [10, 2])
    Traceback (most recent call last):
    ...
    ValueError: expected the KV-block loop inside 1 loop(s), found 0: the kernel's loops are not the ones its trip counts describe
    >>> weighted_bundles(bundles, [(4, 6)])
    Traceback (most recent call last):
    ...
    ValueError: passes for 2 KV-block loops, and the kernel has 1
    """  # noqa: E501
    kv = kv_block_loop(bundles)
    if kv is None:
        raise ValueError("no KV-block loop in this kernel: its trip counts cannot be placed")
    loops = loop_bodies(bundles)
    chain = [kv, *sorted((loop for loop in loops if _inside(kv, loop)), key=_size)]
    if len(chain) != len(passes_outward):
        raise ValueError(
            f"expected the KV-block loop inside {len(passes_outward) - 1} loop(s), found "
            f"{len(chain) - 1}: the kernel's loops are not the ones its trip counts describe"
        )
    kv_passes, *outward = passes_outward
    pair = kv_block_pair(bundles)
    per_loop = tuple(kv_passes) if isinstance(kv_passes, (tuple, list)) else (kv_passes,)
    if len(per_loop) != (2 if pair else 1):
        raise ValueError(f"passes for {len(per_loop)} KV-block loops, and the kernel has "
                         f"{2 if pair else 1}")  # fmt: skip
    passes = dict(zip(chain, [per_loop[-1], *outward], strict=True))
    if pair:
        passes[pair[0]] = per_loop[0]
    chunk = compute_loop(bundles, kv)
    if chunk is not None:
        passes[chunk] = passes[kv] if chunk_passes is None else chunk_passes

    def passes_of(loop) -> int:
        if loop in passes:
            return passes[loop]
        around = [outer for outer in loops if _inside(loop, outer)]
        return passes_of(min(around, key=_size)) if around else 1

    total = 0
    for i in range(len(bundles)):
        holding = [loop for loop in loops if loop[0] <= i < loop[1]]
        total += passes_of(min(holding, key=_size)) if holding else 1
    return total
