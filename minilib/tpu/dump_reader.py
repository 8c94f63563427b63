"""Read what libtpu wrote down about a compiled Pallas kernel: its bundles, loops and VMEM.

`minilib.tpu.compile` asks libtpu (through `LIBTPU_INIT_ARGS`, see `DUMP_FLAGS`) to dump, per
kernel, two text files, and this module reads them. It needs no libtpu and no JAX: its rules
are checked on small excerpts (the examples below, and `tests/test_tpu_dump_reader.py`).

* `*-final_bundles.txt`: one line per bundle. A loop's first bundle is marked `LB:`, and every
  bundle inside loops carries one `>` per nesting level. The deepest loop that holds a
  `vmatmul` (an MXU matmul) is the KV-block loop of an attention kernel; `bundles_per_kv_block`
  is its length. With source annotations on, each op carries the `loc("file":line)` it came
  from, which gives `top_source_lines` (with jax 0.7.2 the locations are coarser, often the
  enclosing `pl.when`).
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
import re
from pathlib import Path

__all__ = [
    "CHECKED_LIBTPU",
    "DUMP_FLAGS",
    "KernelStats",
    "kv_block_loop",
    "loop_extents",
    "parse_bundles",
    "read_dump",
    "vmem_usage",
]

# jax version -> the libtpu that its `jax[tpu]` extra brings, and that this reader was checked
# against by hand.
CHECKED_LIBTPU = {"0.10.2": "0.0.42.1", "0.7.2": "0.0.23"}
NEWEST_CHECKED_JAX = "0.10.2"

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
    bundles_per_kv_block: int | None  # the deepest loop holding a vmatmul; None if none does
    vmem_bytes: int | None  # peak: the highest end of a VMEM allocation
    spill_bytes: int | None  # VMEM taken by spilled vector registers
    top_source_lines: tuple[tuple[str, int], ...]  # ((file:line, ops in the KV-block loop), ...)
    source_code: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)


# "  0x2b1 LB: >>> { ops ;; ops }": address, optional control tag, loop depth, then the bundle.
BUNDLE_LINE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:([A-Z]{2}):|:)\s*(>*)\s*\{")
SOURCE_LOC = re.compile(r'loc\("([^"]+)":(\d+)')
VMEM_ALLOCATION = re.compile(
    r"#allocation(\w*) \[shape = '[^']*', space=vmem, size = (0x[0-9a-f]+|\d+), "
    r"offset = (0x[0-9a-f]+|\d+)"
)
DUMP_FILE = re.compile(r"^\d+-(.+)-\d\d-(final_bundles|post-delay-converter)\.txt$")

# Excerpts in libtpu 0.0.42.1's format, for the examples below: a loop (`LB:` opens it, `>`
# marks its depth) holding a matmul, and one VMEM allocation plus one spilled vector register.
EXAMPLE_BUNDLES = "\n".join([
    "   0x0   :  { %s1 = smov 0 }",
    "   0x1 LB: > { %v2 = vld [vmem:[#allocation2]] }",
    "   0x2   : > { %v3 = vmatmul.bf16 %v2 }",
    "   0x3 PF:  { %s4 = shalt }",
])  # fmt: skip
EXAMPLE_ALLOCATIONS = "\n".join([
    "#allocation2 [shape = 'f32[8,128]', space=vmem, size = 0x1000, offset = 0x0, scoped]",
    "#allocation7_spill [shape = 'u32[8,128]', space=vmem, size = 0x1000, offset = 0x1000, "
    "scoped]",
])  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Bundle:
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
       0x1 LB: > { %v2 = vld [vmem:[#allocation2]] }
       0x2   : > { %v3 = vmatmul.bf16 %v2 }
       0x3 PF:  { %s4 = shalt }
    >>> [(b.tag, b.depth) for b in parse_bundles(text)]
    [(None, 0), ('LB', 1), (None, 1), ('PF', 0)]
    """
    bundles: list[list] = []
    for line in text.splitlines():
        m = BUNDLE_LINE.match(line)
        if m:
            bundles.append([m.group(2), len(m.group(3)), line[m.end() - 1 :]])
        elif bundles:
            bundles[-1][2] += "\n" + line
    return [Bundle(tag, depth, text) for tag, depth, text in bundles]


def loop_extents(bundles: list[Bundle]) -> list[tuple[int, int]]:
    """[start, end) of every loop body: from its `LB` bundle to the next *marked* bundle (one
    with a tag, such as `LB` or `PF`) of smaller depth.

    Only marked bundles end a loop: the scheduler may move predicated ops of an outer loop into
    an inner loop's body, and those bundles show the outer loop's smaller depth in the middle
    of the inner loop.

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


def kv_block_loop(bundles: list[Bundle]) -> tuple[int, int] | None:
    """The deepest loop that holds a vmatmul (the longest, if several are as deep).

    >>> kv_block_loop(parse_bundles(EXAMPLE_BUNDLES))
    (1, 3)
    """
    holding = [
        (bundles[s].depth, e - s, (s, e))
        for s, e in loop_extents(bundles)
        if any("vmatmul" in b.text for b in bundles[s:e])
    ]
    return max(holding)[2] if holding else None


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


def kernel_stats(name: str, bundles_text: str, allocations_text: str | None):
    notes = []
    bundles = parse_bundles(bundles_text)
    if not bundles:
        return None, [f"{name}: bundle dump format not recognised ({dump_hint()})"]
    loop = kv_block_loop(bundles)
    if loop is None:
        notes.append(f"{name}: no loop holds a vmatmul, so there is no KV-block loop to count")
    body = bundles[loop[0] : loop[1]] if loop else bundles
    ops = ops_by_source_line(body)
    top = [(f"{short_path(path)}:{line}", n, linecache.getline(path, line).strip())
           for (path, line), n in ops.most_common(8)]  # fmt: skip
    usage = vmem_usage(allocations_text) if allocations_text else None
    if usage is None:
        notes.append(f"{name}: no VMEM allocations found in the dump ({dump_hint()})")
    stats = KernelStats(
        name=name,
        total_bundles=len(bundles),
        bundles_per_kv_block=(loop[1] - loop[0]) if loop else None,
        vmem_bytes=usage[0] if usage else None,
        spill_bytes=usage[1] if usage else None,
        top_source_lines=tuple((location, n) for location, n, _ in top),
        source_code={location: code for location, _, code in top},
    )
    return stats, notes


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
