"""Read what libtpu wrote down about a compiled Pallas kernel: its bundles, loops and VMEM.

`minilib.tpu.compile` asks libtpu (through `LIBTPU_INIT_ARGS`, see `DUMP_FLAGS`) to dump, per
kernel, two text files, and this module reads them. It needs no libtpu and no JAX: its rules
are checked on small excerpts (the examples below, and `tests/tpu/test_tpu_dump_reader.py`).

* `*-final_bundles.txt`: one line per bundle (`minilib.tpu.bundles`). `bundles_per_kv_block`
  is the length of one loop, chosen by `COUNTING_RULE` (`bundles.kv_block_loop`);
  `minilib.tpu.loop_paths` follows its branches through one pass: the longest path, and an
  interior block's (`PATH_RULES`). With source annotations on, each op carries the
  `loc("file":line)` it came from, which gives `top_source_lines` (with jax 0.7.2 the
  locations are coarser, often the enclosing `pl.when`).
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

from minilib.tpu.bundles import (
    COMMENT,
    COUNTING_RULE,
    EXAMPLE_BUNDLES,  # noqa: F401 (the examples use it)
    Bundle,
    branch_kv_block_loops,
    kv_block_loop,
    parse_bundles,
)
from minilib.tpu.loop_paths import PathsNotRead, kv_block_paths

__all__ = [
    "CHECKED_LIBTPU",
    "DUMP_FLAGS",
    "EXAMPLE_ALLOCATIONS",
    "KernelStats",
    "op_kinds",
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


SOURCE_LOC = re.compile(r'loc\("([^"]+)":(\d+)')
VMEM_ALLOCATION = re.compile(
    r"#allocation(\w*) \[shape = '[^']*', space=vmem, size = (0x[0-9a-f]+|\d+), "
    r"offset = (0x[0-9a-f]+|\d+)"
)
DUMP_FILE = re.compile(r"^\d+-(.+)-\d\d-(final_bundles|post-delay-converter)\.txt$")

EXAMPLE_ALLOCATIONS = "\n".join([
    "#allocation2 [shape = 'f32[8,128]', space=vmem, size = 0x1000, offset = 0x0, scoped]",
    "#allocation7_spill [shape = 'u32[8,128]', space=vmem, size = 0x1000, offset = 0x1000, "
    "scoped]",
])  # fmt: skip
# What a bundle's ops do, by mnemonic (the word after "="), for `op_kinds`. Pushing weights
# into the MXU, streaming rows through it and popping results are all "MXU"; the EUP computes
# exponentials (`vexp2`: exp(x) is 2**(x * log2(e))), reciprocals and tanh, and its results
# are popped from its own queue (`vpop.eup`, where an MXU result is `vpop.f32.mrf.mxu0`);
# everything else starting with "v" is vector ALU work (selects, compares, adds, packs,
# shifts), and s*/p* ops run on the scalar unit.
EUP = "EUP (exp, 1/x)"
OP_KINDS = {
    "vld": "vector load",
    "vst": "vector store",
    "vmatpush": "MXU",
    "vmatpush3": "MXU",
    "vmatprep": "MXU",
    "vmatmul": "MXU",
    "vpop": "MXU",
    "vpop.eup": EUP,
    "vpow2": EUP,
    "vexp2": EUP,
    "vexp": EUP,
    "vrcp": EUP,
    "vtanh": EUP,
}
MNEMONIC = re.compile(r"=\s*([a-z][a-z0-9_]*(?:\.eup\b)?)")
# The EUP's ops as libtpu 0.0.50.1 writes them for v5e, from `jnp.exp(x) + 1 / x + jnp.tanh(x)`
# in a Pallas kernel: each issued, then its result popped.
EXAMPLE_EUP_BUNDLES = """\
   0x6   :  { %64 = vrcp.f32 %v23_v0  ;;  %v24_v1 = vmul.f32 1.442695, %v23_v0 }
   0x8   :  { %66 = vexp2.f32 %v24_v1 }
   0x9   :  { %68 = vtanh.f32 %v23_v0 }
   0xa   :  { %v65_v2 = vpop.eup %64 }
   0xc   :  { %v67_v10 = vpop.eup %66 }
   0xd   :  { %v28_v5 = vsub.f32 1.0, %v27_v3  ;;  %v69_v12 = vpop.eup %68 }
"""


def op_kinds(bundles: list[Bundle]) -> collections.Counter:
    """How many ops of each kind (`OP_KINDS`; "vector ALU", "scalar", "DMA", "other" for the
    rest) `bundles` hold, comments cut.

    >>> sorted(op_kinds(parse_bundles(EXAMPLE_BUNDLES)).items())
    [('DMA', 1), ('MXU', 1), ('scalar', 2), ('vector load', 1)]
    >>> sorted(op_kinds(parse_bundles(EXAMPLE_EUP_BUNDLES)).items())
    [('EUP (exp, 1/x)', 6), ('vector ALU', 2)]
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
