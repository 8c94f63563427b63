"""Compile a Pallas kernel for a real TPU chip on a machine without one, and read the result.

libtpu, the library that `pip install "jax[tpu]"` brings, holds XLA's TPU compiler and Mosaic,
the compiler of Pallas TPU kernels. It runs on any Linux host: JAX can describe a TPU chip
that is not there (a *compile-only device*) and compile for it. So without a TPU we can still
learn two things:

1. whether Mosaic accepts the kernel (the chip's own compiler, not interpret mode), and
2. what it made of it: the scheduled VLIW *bundles* of the compiled kernel, and its VMEM.

A TPU core issues one bundle per cycle when nothing stalls, so the bundle count of one
KV-block iteration is a *static estimate* of its compute time: DMA waits, stalls and the
clock are not modelled. These are figures of the compiled program, never timings.

The recipe (`compile_for_tpu`):

* `jax.experimental.topologies.get_topology_desc("v5e:1x1", platform="tpu", ...)` gives the
  compile-only device of one chip;
* every argument becomes a `jax.ShapeDtypeStruct` placed on that device;
* lowering runs under an abstract mesh whose device kind is the chip's (JAX's own RPA kernel
  reads the device kind while tracing);
* `jax.jit(fn).lower(*structs).compile()` runs XLA's TPU compiler and Mosaic. It fails where
  the chip would fail, and the report keeps the compiler's message.

What libtpu wrote down. `LIBTPU_INIT_ARGS` (see `DUMP_FLAGS`) asks libtpu to dump, per kernel:

* `*-final_bundles.txt`: one line per bundle. A loop's first bundle is marked `LB:`, and every
  bundle inside loops carries one `>` per nesting level. The deepest loop that holds a
  `vmatmul` (an MXU matmul) is the KV-block loop of an attention kernel; `bundles_per_kv_block`
  is its length. With source annotations on, each op carries the `loc("file":line)` it came
  from, which gives `top_source_lines` (with jax 0.7.2 the locations are coarser, often the
  enclosing `pl.when`).
* `*-post-delay-converter.txt`: the kernel's memory allocations. Peak VMEM is the highest end
  offset of a VMEM allocation; spill bytes are the sizes of the `_spill` ones (vector
  registers that did not fit and went to VMEM).

The dump flags are libtpu internals, not an API: the parser was checked by hand against
libtpu 0.0.42.1 (with jax 0.10.2) and 0.0.23 (jax 0.7.2), see `CHECKED_LIBTPU`. With another
libtpu the report still says whether the kernel compiled, and its notes say when the dump was
not recognised, and how to get the pinned libtpu. A pair known not to compile at all (Colab's
jax 0.7.2 with libtpu 0.0.21.1, see `CANNOT_COMPILE`) is refused, saying why.

When libtpu reads its flags. libtpu reads `LIBTPU_INIT_ARGS` once, when it starts in a
process, and never again. Two cases:

* libtpu has not started in this process yet. That is the usual case on a laptop, in pytest,
  or in a notebook that used JAX only on the CPU (`JAX_PLATFORMS=cpu`, or no libtpu at the
  time). Then the first compile sets the flags, with one dump folder for the whole process,
  and starts libtpu; every compile reads the files that appeared in that folder and deletes
  them. This costs nothing beyond the compile itself (`CompileReport.seconds`).
* libtpu already started without these flags (on a TPU host, where JAX's TPU backend starts it
  at the first JAX call). Then each compile runs in a fresh Python process (`python -m
  minilib.tpu_compile`), which adds to every compile the start of Python, of JAX and of
  libtpu (`CompileReport.seconds` counts the compile alone). `fn` must then be picklable: a
  module-level function, or a `functools.partial` of one.

A subprocess for every compile would have been simpler, but would add those starts to each of
the hundred compiles of the test matrix, and would not work for the lambdas a learner writes.

libtpu also logs a few lines about host discovery; `TPU_ACCELERATOR_TYPE` and
`TPU_WORKER_HOSTNAMES` (set only when unset) quiet them. `ALLOW_MULTIPLE_LIBTPU_LOAD=1` lets
several processes use libtpu at once (a notebook and a test run), which libtpu's lock file
otherwise forbids.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import linecache
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

# The module's public names: compiling, its report, and the dump reader's rules. The other
# functions are the steps of compiling and reading, documented where they are defined.
__all__ = [
    "CHIPS",
    "CompileReport",
    "KernelStats",
    "TPUCompileUnavailable",
    "compile_for_tpu",
    "kv_block_loop",
    "loop_extents",
    "parse_bundles",
    "require_libtpu",
    "tpu_compile_available",
    "vmem_usage",
]

CHIPS = ("v4", "v5e", "v5p", "v6e")
TOPOLOGY_NAMES = {"v4": "v4:1x1x1", "v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1"}

# jax version -> the libtpu that its `jax[tpu]` extra brings, and that the dump parser below
# was checked against by hand.
CHECKED_LIBTPU = {"0.10.2": "0.0.42.1", "0.7.2": "0.0.23"}
NEWEST_CHECKED_JAX = "0.10.2"
# (jax, libtpu) pairs checked by hand that cannot compile here, and why. Colab's TPU runtime
# pairs jax 0.7.2 with libtpu 0.0.21.1 (its runtime 2026.07: 0.0.21). libtpu 0.0.21.1's
# bundle dump (of a kernel lowered at IR version 7), written before the crash, is in the format
# read below.
CANNOT_COMPILE = {
    ("0.7.2", libtpu): (
        f"the compile-only TPU devices of libtpu {libtpu} crash jax 0.7.2 (a segfault when jax "
        "asks them for a default layout, after every compile), and its Mosaic reads kernels up "
        "to IR version 7, where jax 0.7.2 writes version 8 for a libtpu built after 2025-08-14, "
        "as this one is (libtpu 0.0.22 and 0.0.23 read it)"
    )
    for libtpu in ("0.0.21", "0.0.21.1")
}

DUMP_FLAGS = (
    "--xla_jf_dump_llo_pass_label_regex=final_bundles|post-delay-converter",
    "--xla_mosaic_enable_llo_source_annotations=true",
)
QUIET_LIBTPU_ENV = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
# Dump files of XLA's own programs, not of a Pallas kernel.
NON_KERNEL_PROGRAMS = ("TLP", "<late-initialization>", "<late-finalization>")


class TPUCompileUnavailable(RuntimeError):
    """libtpu is not installed here, so nothing can be compiled for a TPU.

    >>> ok, reason = tpu_compile_available()
    >>> try:
    ...     require_libtpu()
    ... except TPUCompileUnavailable as err:  # without libtpu: the reason, with the fix
    ...     print(str(err) == reason)
    ... else:
    ...     print(ok)
    True
    """


def install_hint() -> str:
    """How to get libtpu: for this jax when the reader was checked with its libtpu."""
    version = jax.__version__ if jax.__version__ in CHECKED_LIBTPU else NEWEST_CHECKED_JAX
    return (
        f'Install it with: pip install "jax[tpu]=={version}" (it brings libtpu '
        f"{CHECKED_LIBTPU[version]}, about 700 MB; it runs on any Linux host without a TPU), "
        "or in a checkout run `python3 tasks.py test`, which makes the .venv-tpu environment."
    )


def tpu_compile_available() -> tuple[bool, str]:
    """(True, what will be used) when libtpu is installed, else (False, how to install it).

    >>> ok, reason = tpu_compile_available()
    >>> isinstance(ok, bool) and len(reason) > 0
    True
    """
    try:
        version = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return False, f"libtpu is not installed (jax {jax.__version__}). {install_hint()}"
    from jax._src import xla_bridge

    if xla_bridge.get_tpu_library_path() is None:
        return False, f"libtpu {version} is installed but JAX cannot find it. {install_hint()}"
    pair = (jax.__version__, version)
    if pair in CANNOT_COMPILE:
        reason = f"libtpu {version} with jax {jax.__version__} cannot compile here"
        return False, f"{reason}: {CANNOT_COMPILE[pair]}. {install_hint()}"
    checked = CHECKED_LIBTPU.get(jax.__version__)
    note = (
        ""
        if checked == version
        else f" (the bundle-dump reader was checked on libtpu {checked or 'of another jax'}; "
        "figures may be missing if the dump format changed)"
    )
    return True, f"libtpu {version} with jax {jax.__version__}{note}"


def require_libtpu() -> None:
    """Raise `TPUCompileUnavailable`, saying how to install libtpu, when it is missing.

    >>> try:
    ...     require_libtpu()
    ...     print(tpu_compile_available()[0])       # with libtpu: nothing raised
    ... except TPUCompileUnavailable as err:
    ...     print("Install it with" in str(err))    # without: how to install it
    True
    """
    ok, reason = tpu_compile_available()
    if not ok:
        raise TPUCompileUnavailable(reason)


# ---------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelStats:
    """What the bundle dump says about one compiled Pallas kernel (static estimates).

    >>> stats = KernelStats("rpa.1", total_bundles=900, bundles_per_kv_block=120,
    ...                     vmem_bytes=3 << 20, spill_bytes=0, top_source_lines=())
    >>> CompileReport("v5e", compiled=True, kernels=(stats,)).bundles_per_kv_block
    120
    """

    name: str
    total_bundles: int
    bundles_per_kv_block: int | None  # the deepest loop holding a vmatmul; None if none does
    vmem_bytes: int | None  # peak: the highest end of a VMEM allocation
    spill_bytes: int | None  # VMEM taken by spilled vector registers
    top_source_lines: tuple[tuple[str, int], ...]  # ((file:line, ops in the KV-block loop), ...)
    source_code: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)


def _largest_kernel_field(field: str, missing=None) -> property:
    """A `CompileReport` property: `field` of its largest kernel, or `missing` when it has none
    (see `CompileReport.kernel`)."""

    def get(report):
        return missing if report.kernel is None else getattr(report.kernel, field)

    return property(get)


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """The result of `compile_for_tpu`. All figures are static estimates, never timings.

    The figures are those of the largest Pallas kernel in the program (`kernels` has them all),
    or None when there is none, when compiling failed, or when the dump was not recognised
    (then `notes` says why).

    >>> report = CompileReport("v5e", compiled=False, libtpu_version="0.0.42.1",
    ...                        error="RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem")
    >>> report.vmem_overflow, report.bundles_per_kv_block
    (True, None)
    >>> print(report)
    TPU compile for v5e (libtpu 0.0.42.1): FAILED
      RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem
    """

    chip: str
    compiled: bool
    error: str | None = None
    kernels: tuple[KernelStats, ...] = ()
    notes: tuple[str, ...] = ()
    libtpu_version: str = ""
    seconds: float = 0.0

    @property
    def kernel(self) -> KernelStats | None:
        return max(self.kernels, key=lambda k: k.total_bundles, default=None)

    # The largest kernel's figures, read through: None (top_source_lines: ()) without one.
    bundles_per_kv_block = _largest_kernel_field("bundles_per_kv_block")  # int | None
    total_bundles = _largest_kernel_field("total_bundles")  # int | None
    vmem_bytes = _largest_kernel_field("vmem_bytes")  # int | None
    spill_bytes = _largest_kernel_field("spill_bytes")  # int | None
    top_source_lines = _largest_kernel_field("top_source_lines", missing=())

    @property
    def vmem_overflow(self) -> bool:
        """Compiling failed because the kernel needs more VMEM than the chip's limit."""
        return not self.compiled and is_vmem_overflow(self.error or "")

    def __str__(self) -> str:
        head = f"TPU compile for {self.chip} (libtpu {self.libtpu_version}): "
        if not self.compiled:
            lines = [head + "FAILED", indent(first_lines(self.error or "", 12))]
        else:
            lines = [head + f"compiled in {self.seconds:.1f} s"]
            k = self.kernel
            if k is not None:
                lines += [
                    f"  kernel {k.name}: static estimates from the compiled program, not timings",
                    f"  bundles per KV block: {fmt(k.bundles_per_kv_block)}; "
                    f"total: {fmt(k.total_bundles)}",
                    f"  VMEM: {kib(k.vmem_bytes)}, of which spills: {kib(k.spill_bytes)}",
                ]
                for location, ops in k.top_source_lines[:5]:
                    code = k.source_code.get(location, "")
                    lines.append(f"  {ops:6d} ops  {location}  {code}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def is_vmem_overflow(message: str) -> bool:
    text = message.lower()
    return (
        "resource_exhausted" in text
        and "vmem" in text
        or "out of memory in memory space vmem" in text
    )


def fmt(value) -> str:
    return "-" if value is None else f"{value:,}"


def kib(value) -> str:
    return "-" if value is None else f"{value / 1024:,.0f} KiB"


def first_lines(text: str, n: int) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n] + ([f"... ({len(lines) - n} more lines)"] if len(lines) > n else []))


def indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


# ---------------------------------------------------------------------------------------------
# Compiling.
# ---------------------------------------------------------------------------------------------


def compile_for_tpu(fn, *args, chip: str = "v5e") -> CompileReport:
    """Compile `fn(*args)` for one TPU chip with libtpu, here, without a TPU.

    fn: a function of arrays (bind static options with `functools.partial`).
    args: arrays or `jax.ShapeDtypeStruct`s (pytrees of them); only shapes and dtypes are used.

    Never raises for a compile failure: `report.compiled` is False and `report.error` holds
    Mosaic's or XLA's message. Raises `TPUCompileUnavailable` when libtpu is missing, and
    ValueError for a chip that is not one of `CHIPS`.

    >>> import jax.numpy as jnp
    >>> from minilib.pallas_basics import add_vectors
    >>> add = functools.partial(add_vectors, block_size=1024, interpret=False)
    >>> x = jax.ShapeDtypeStruct((4096,), jnp.float32)
    >>> ok, _ = tpu_compile_available()
    >>> report = compile_for_tpu(add, x, x, chip="v5e") if ok else None  # needs libtpu
    >>> report is None or (report.compiled and report.total_bundles > 0)
    True
    """
    if chip not in CHIPS:
        raise ValueError(f"{chip=} is not a TPU chip this can compile for; use one of {CHIPS}.")
    require_libtpu()
    specs = jax.tree.map(as_spec, args)
    if dump_here():
        return compile_here(fn, specs, chip)
    return compile_in_subprocess(fn, specs, chip)


def as_spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


# libtpu reads LIBTPU_INIT_ARGS once per process: the folder chosen here is for all compiles.
_DUMP_DIR: Path | None = None
_REPORTS: dict[tuple[str, str], CompileReport] = {}


def libtpu_started() -> bool:
    from jax._src.lib import xla_client

    initialized = getattr(xla_client, "pjrt_plugin_initialized", None)
    return bool(initialized and xla_client.pjrt_plugin_loaded("tpu") and initialized("tpu"))


def dump_here() -> bool:
    """Start libtpu with the dump flags in this process if it has not started yet. Returns
    whether this process's libtpu dumps (else compiles go to a fresh process)."""
    global _DUMP_DIR
    if _DUMP_DIR is not None:
        return True
    if libtpu_started():
        return False
    dump_dir = Path(tempfile.mkdtemp(prefix="minilib-tpu-dump-"))
    saved = dict(os.environ)
    os.environ.update(libtpu_env(dump_dir, os.environ))
    try:
        topology_device("v5e")  # starts libtpu, which reads the flags now
    finally:
        # Processes started from this one must not inherit the dump flags.
        os.environ.clear()
        os.environ.update(saved)
    _DUMP_DIR = dump_dir
    return True


def libtpu_env(dump_dir: Path, environ) -> dict[str, str]:
    env = {k: v for k, v in QUIET_LIBTPU_ENV.items() if k not in environ}
    flags = [environ.get("LIBTPU_INIT_ARGS", ""), f"--xla_jf_dump_to={dump_dir}", *DUMP_FLAGS]
    env["LIBTPU_INIT_ARGS"] = " ".join(f for f in flags if f)
    return env


@functools.cache
def topology_device(chip: str):
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        topology_name=TOPOLOGY_NAMES[chip], platform="tpu", chips_per_host_bounds=(1, 1, 1)
    )
    return topology.devices[0]


def abstract_mesh(device):
    """A one-device abstract mesh whose device kind is the chip's (JAX's kernel reads it)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    kwargs = dict(device_kind=device.device_kind, num_cores=1)
    if "platform" in inspect.signature(AbstractDevice).parameters:  # jax >= 0.8
        kwargs["platform"] = "tpu"
    return AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(**kwargs))


def compile_here(fn, specs, chip: str) -> CompileReport:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    start = time.perf_counter()
    device = topology_device(chip)
    sharding = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    structs = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), specs
    )
    report = functools.partial(CompileReport, chip=chip, libtpu_version=libtpu_version())
    try:
        with jax.sharding.use_abstract_mesh(abstract_mesh(device)):
            lowered = jax.jit(fn).lower(*structs)
    except Exception as err:  # a kernel Mosaic's lowering rejects: the message is the result
        return report(compiled=False, error=error_text(err), seconds=time.perf_counter() - start)
    key = (chip, hashlib.sha256(lowered.as_text().encode()).hexdigest())
    if key in _REPORTS:  # JAX reuses its compiled executable, and libtpu writes no new dump
        return _REPORTS[key]
    before = set(os.listdir(_DUMP_DIR))
    try:
        lowered.compile()
        seconds = time.perf_counter() - start
        new_files = sorted(set(os.listdir(_DUMP_DIR)) - before)
        kernels, notes = read_dump(_DUMP_DIR, new_files, pallas_kernel_names(lowered.as_text()))
    except Exception as err:
        return report(compiled=False, error=error_text(err), seconds=time.perf_counter() - start)
    finally:  # the dump of each compile is read once, then removed
        for name in set(os.listdir(_DUMP_DIR)) - before:
            (_DUMP_DIR / name).unlink(missing_ok=True)
    result = report(compiled=True, kernels=kernels, notes=notes, seconds=seconds)
    _REPORTS[key] = result
    return result


def error_text(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


def pallas_kernel_names(hlo_text: str) -> set[str]:
    """The names of the Pallas kernels (Mosaic custom calls) in a lowered program."""
    names = set(re.findall(r'kernel_name = "([^"]+)"', hlo_text))
    if not names and "tpu_custom_call" in hlo_text:
        names.add("")  # a kernel without a name: recognise it by its custom-call entry bundle
    return names


def libtpu_version() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def compile_in_subprocess(fn, specs, chip: str) -> CompileReport:
    """Compile in a fresh Python process, whose libtpu starts with the dump flags."""
    try:
        payload = pickle.dumps((fn, specs, chip))
    except Exception as err:
        raise ValueError(
            f"libtpu already started in this process without the dump flags, so the compile "
            f"must run in a fresh process, and fn={fn!r} cannot be sent there ({err}).\n"
            "Hint: pass a module-level function or a functools.partial of one, or restart and "
            "compile before JAX starts the TPU backend."
        ) from err
    with tempfile.TemporaryDirectory(prefix="minilib-tpu-compile-") as tmp:
        request, response = Path(tmp) / "request.pkl", Path(tmp) / "report.pkl"
        request.write_bytes(payload)
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env.pop("LIBTPU_INIT_ARGS", None)  # the child's own dump folder; the host's flags stay
        done = subprocess.run(
            [sys.executable, "-m", "minilib.tpu_compile", str(request), str(response)],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not response.exists():
            raise RuntimeError(
                f"the compile process failed ({done.returncode=}):\n{first_lines(done.stderr, 30)}"
            )
        return pickle.loads(response.read_bytes())


# ---------------------------------------------------------------------------------------------
# Reading the dump.
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# `python -m minilib.tpu_compile REQUEST REPORT`: the fresh process of compile_in_subprocess.
# ---------------------------------------------------------------------------------------------


def _serve_one_request(request: Path, response: Path) -> None:
    fn, specs, chip = pickle.loads(request.read_bytes())
    if not dump_here():
        raise RuntimeError("libtpu started before its dump flags could be set")
    response.write_bytes(pickle.dumps(compile_here(fn, specs, chip)))


if __name__ == "__main__":
    # Through the package, so that the report pickles as minilib.tpu_compile.CompileReport.
    from minilib.tpu_compile import _serve_one_request as serve

    serve(Path(sys.argv[1]), Path(sys.argv[2]))
