"""Compile a Pallas kernel for a real TPU chip on a machine without one, and read the result.

libtpu, the library that `pip install "jax[tpu]"` brings, holds XLA's TPU compiler and Mosaic,
the compiler of Pallas TPU kernels. It runs on any Linux host: JAX can describe a TPU chip
that is not there (a *compile-only device*) and compile for it. So without a TPU we can still
learn two things:

1. whether Mosaic accepts the kernel (the chip's own compiler, not interpret mode), and
2. what it made of it: the scheduled VLIW *bundles* of the compiled kernel, and its VMEM.

A TPU core issues one bundle per cycle when nothing stalls, so the bundles one KV block issues
along a path through the loop's body (`minilib.tpu.dump_reader`: the loop's length in the
listing, its longest path and an interior block's) are a *static count* of issue cycles, not
a time: stalls on DMA waits and on the MXU's results, and the clock, are not in it. These are
figures of the compiled program, never timings.

The recipe (`compile_for_tpu`):

* `jax.experimental.topologies.get_topology_desc("v5e:1x1", platform="tpu", ...)` gives the
  compile-only device of one chip;
* every argument becomes a `jax.ShapeDtypeStruct` placed on that device;
* lowering runs under an abstract mesh whose device kind is the chip's (JAX's own RPA kernel
  reads the device kind while tracing);
* `jax.jit(fn).lower(*structs).compile()` runs XLA's TPU compiler and Mosaic. It fails where
  the chip would fail, and the report keeps the compiler's message.

What libtpu wrote down: `LIBTPU_INIT_ARGS` (see `DUMP_FLAGS`) asks libtpu to dump each
kernel's final bundles and its memory allocations, and `minilib.tpu.dump_reader` reads them:
bundles per KV block, total bundles, peak VMEM, spills, and the source lines that cost most.
The dump files are libtpu internals, not an API; with a libtpu the reader was not checked on
(`CHECKED_LIBTPU`), the report still says whether the kernel compiled, and its notes say when
the dump was not recognised. Colab's jax 0.7.2 with libtpu 0.0.21.1 compiles too: kernels at
the IR version it reads (`minilib.jax_patches`), and `compile_here` steps around a crash of its
compile-only devices (`LAYOUT_QUERY_CRASHES`).

When libtpu reads its flags. libtpu reads `LIBTPU_INIT_ARGS` once, when it starts in a
process, and never again. Two cases:

* libtpu has not started in this process yet. That is the usual case on a laptop, in pytest,
  or in a notebook that used JAX only on the CPU (`JAX_PLATFORMS=cpu`, or no libtpu at the
  time). Then the first compile sets the flags, with one dump folder for the whole process,
  and starts libtpu; every compile reads the files that appeared in that folder and deletes
  them. This costs nothing beyond the compile itself (`CompileReport.seconds`); a compile
  an earlier run kept (`MINILIB_TPU_DUMP_CACHE`, `minilib.tpu.dump_cache`) is read back.
* libtpu already started without these flags (on a TPU host, where JAX's TPU backend starts it
  at the first JAX call). Then each compile runs in a fresh Python process (`python -m
  minilib.tpu.compile`), which adds to every compile the start of Python, of JAX and of
  libtpu (`CompileReport.seconds` counts the compile alone). `fn` must then be picklable: a
  module-level function, or a `functools.partial` of one.

(A subprocess for every compile would add those starts to each compile of the test matrix,
and could not take the lambdas a learner writes.)

libtpu also logs a few lines about host discovery; `TPU_ACCELERATOR_TYPE` and
`TPU_WORKER_HOSTNAMES` (set only when unset) quiet them. `ALLOW_MULTIPLE_LIBTPU_LOAD=1` lets
several processes use libtpu at once (a notebook and a test run), which libtpu's lock file
otherwise forbids.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from minilib.chips import CHIPS, FACTS
from minilib.tpu import dump_cache
from minilib.tpu.dump_reader import (
    CHECKED_LIBTPU,
    DUMP_FLAGS,
    NEWEST_CHECKED_JAX,
    KernelStats,
    libtpu_version,
    read_dump,
)

# The module's public names: compiling and its report. The other functions are the steps of
# compiling, documented where they are defined.
__all__ = [
    "CompileReport",
    "TPUCompileUnavailable",
    "chips_here",
    "compile_for_tpu",
    "require_libtpu",
    "tpu_compile_available",
]

# Colab's TPU runtime pairs jax 0.7.2 with libtpu 0.0.21.1 (its runtime 2026.07: 0.0.21). It
# compiles here thanks to two fixes: kernels lowered at the Mosaic IR version that libtpu reads
# (`minilib.jax_patches.mosaic_version`, on a real TPU too) and, on the compile-only devices alone,
# this one; tests/tpu/test_tpu_colab_pair.py checks that each is still needed.
# (jax, libtpu) pairs whose compile-only devices crash the process (a segfault in libtpu) when
# jax, after every compile, asks them for an argument's default layout
# (`pxla.is_default_layout`, which calls `client.get_default_layout`). The program compiled
# and libtpu dumped it by then. jax asks only to know whether an argument must be relaid out
# before the program runs, and a compile-only device never runs it, so `compile_here` answers
# "default" itself for these pairs (`default_layouts_assumed`).
LAYOUT_QUERY_CRASHES = {("0.7.2", "0.0.21"), ("0.7.2", "0.0.21.1")}

QUIET_LIBTPU_ENV = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


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


# libtpu for the jax of each TPU environment of `tasks.py test` (tests/core/test_doctor.py checks
# them against constraints/): {jax: (what to pip install, its libtpu, its size, the venv)}.
# For Colab's jax 0.7.2 it is Colab's own libtpu, 0.0.21.1, not the 0.0.23 of `jax[tpu]==0.7.2`.
LIBTPU_FOR_JAX = {
    "0.12.0.1": ('"jax[tpu]==0.12.0.1"', "0.0.50.1", "640 MB", ".venv-tpu"),
    "0.7.2": ('"libtpu==0.0.21.1"', "0.0.21.1", "360 MB", ".venv-tpu-oldest"),
}


def install_hint(jax_version: str | None = None) -> str:
    """How to install libtpu, for a TPU compile on any Linux host, with `jax_version` (by
    default the jax installed): the pair of its TPU environment where `tasks.py test` makes
    one, else the newest jax the reader was checked with.

    >>> print(install_hint("0.7.2"))
    Install it with: pip install "libtpu==0.0.21.1" (libtpu 0.0.21.1, the one Colab's TPU \
runtime pairs with jax 0.7.2, not the 0.0.23 of jax[tpu]==0.7.2; about 360 MB installed; it \
runs on any Linux host without a TPU), or in a checkout run `python3 tasks.py test`, which \
makes .venv-tpu-oldest with that pair.
    """
    version = jax.__version__ if jax_version is None else jax_version
    if version in LIBTPU_FOR_JAX:
        install, libtpu, size, venv = LIBTPU_FOR_JAX[version]
        if install.startswith('"jax[tpu]'):
            what = f"it brings libtpu {libtpu}"
        else:
            what = (
                f"libtpu {libtpu}, the one Colab's TPU runtime pairs with jax {version}, not "
                f"the {CHECKED_LIBTPU[version]} of jax[tpu]=={version}"
            )
        return (
            f"Install it with: pip install {install} ({what}; about {size} installed; it runs "
            f"on any Linux host without a TPU), or in a checkout run `python3 tasks.py test`, "
            f"which makes {venv} with that pair."
        )
    target = version if version in CHECKED_LIBTPU else NEWEST_CHECKED_JAX
    change = "" if target == version else f", and replaces jax {version} with {target}"
    return (
        f'Install it with: pip install "jax[tpu]=={target}" (it brings libtpu '
        f"{CHECKED_LIBTPU[target]}{change}; it runs on any Linux host without a TPU)."
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
                    f"  bundles per KV block: {fmt(k.bundles_per_kv_block)} (longest path "
                    f"{fmt(k.longest_path)}, interior path {fmt(k.interior_path)}); "
                    f"total: {fmt(k.total_bundles)}",
                    f"  VMEM: {kib(k.vmem_bytes)}, of which spills: {kib(k.spill_bytes)}",
                ]
                for location, ops in k.top_source_lines[:5]:
                    file = location.rsplit(":", 1)[0]  # the code says which line
                    lines.append(f"  {ops:6d} ops  {file}  {k.source_code.get(location, '')}")
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
    if chip not in chips_here():
        raise TPUCompileUnavailable(chip_unknown_here(chip))
    specs = jax.tree.map(as_spec, args)
    if dump_here():
        return compile_here(fn, specs, chip)
    return compile_in_subprocess(fn, specs, chip)


def as_spec(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def libtpu_started() -> bool:
    from jax._src.lib import xla_client

    initialized = getattr(xla_client, "pjrt_plugin_initialized", None)
    return bool(initialized and xla_client.pjrt_plugin_loaded("tpu") and initialized("tpu"))


@dataclasses.dataclass
class DumpFolder:
    """Where this process's libtpu writes its dumps, and the report of each program compiled.

    libtpu reads `LIBTPU_INIT_ARGS` once per process, so there is at most one folder, for every
    compile. JAX compiles a program once and libtpu dumps it once: a program compiled again
    gets its first report back.
    """

    path: Path
    reports: dict[tuple[str, str], CompileReport] = dataclasses.field(default_factory=dict)


@functools.cache
def dump_folder() -> DumpFolder | None:
    """This process's `DumpFolder`: libtpu starts with the dump flags at the first call, if it
    has not started yet. None if it already started without them (then compiles go to a fresh
    process). Cached: libtpu starts once per process, and the answer never changes."""
    if libtpu_started():
        return None
    path = Path(tempfile.mkdtemp(prefix="minilib-tpu-dump-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # read as each compile ends
    # Processes started from this one must not inherit the dump flags: set them only while
    # libtpu starts, which is when it reads them.
    with environment(libtpu_env(path, os.environ)):
        topology_device("v5e")
    return DumpFolder(path)


def dump_here() -> bool:
    """Whether compiles run in this process, its libtpu started with the dump flags (starting
    it if it has not started yet); else they go to a fresh process."""
    return dump_folder() is not None


@contextlib.contextmanager
def environment(changes: dict[str, str]):
    """`os.environ` with `changes` inside the block, and every variable as it was after it."""
    before = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def libtpu_env(dump_dir: Path, environ) -> dict[str, str]:
    env = {k: v for k, v in QUIET_LIBTPU_ENV.items() if k not in environ}
    flags = [environ.get("LIBTPU_INIT_ARGS", ""), f"--xla_jf_dump_to={dump_dir}", *DUMP_FLAGS]
    env["LIBTPU_INIT_ARGS"] = " ".join(f for f in flags if f)
    return env


@functools.cache
def topology_device(chip: str):
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        topology_name=FACTS[chip].topology, platform="tpu", chips_per_host_bounds=(1, 1, 1)
    )
    return topology.devices[0]


@functools.cache
def chips_here() -> tuple[str, ...]:
    """The chips of `CHIPS` whose compile-only device this libtpu has (() without libtpu).

    Not every libtpu knows every chip: libtpu 0.0.23, which jax 0.7.2's `jax[tpu]` brings,
    refuses TPU7x ("Invalid TPU external name: TPU7x"); libtpu 0.0.42.1 (jax 0.10.2's) and
    0.0.50.1 (jax 0.12.0.1's) have it.

    >>> set(chips_here()) <= set(CHIPS)
    True
    """
    if not tpu_compile_available()[0]:
        return ()
    dump_here()  # libtpu starts with the dump flags, if it has not started yet
    return tuple(chip for chip in CHIPS if topology_error(chip) is None)


@functools.cache
def topology_error(chip: str) -> str | None:
    """libtpu's message when it has no compile-only device for `chip`, else None."""
    try:
        topology_device(chip)
    except Exception as err:  # XlaRuntimeError: INVALID_ARGUMENT: Invalid TPU external name
        return error_text(err)
    return None


def chip_unknown_here(chip: str) -> str:
    """Why `chip` is not among `chips_here()`, with the fix."""
    newest = CHECKED_LIBTPU[NEWEST_CHECKED_JAX]
    return (
        f"libtpu {libtpu_version()} here has no compile-only {FACTS[chip].name} device "
        f"({topology_error(chip)}); libtpu {newest} (jax {NEWEST_CHECKED_JAX}'s) has it: "
        f'pip install "jax[tpu]=={NEWEST_CHECKED_JAX}"'
    )


def abstract_mesh(device):
    """A one-device abstract mesh whose device kind is the chip's (JAX's kernel reads it).

    Its axis is Auto, as is the concrete mesh of the arguments' sharding (`compile_here`):
    jax refuses to trace when the two differ ("context mesh ... should match the aval mesh"),
    and from jax 0.12 on a new `AbstractMesh` is Explicit unless told otherwise. (Every jax
    from 0.7.2 on takes `axis_types`; before 0.12 Auto was already the default.)
    """
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    kwargs = dict(device_kind=device.device_kind, num_cores=1)
    if "platform" in inspect.signature(AbstractDevice).parameters:  # jax >= 0.8
        kwargs["platform"] = "tpu"
    return AbstractMesh(
        (1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=AbstractDevice(**kwargs)
    )


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
    folder, text = dump_folder(), lowered.as_text()
    key = (chip, hashlib.sha256(text.encode()).hexdigest())
    if key in folder.reports:  # JAX reuses its compiled executable: libtpu writes no new dump
        return folder.reports[key]
    before = set(os.listdir(folder.path))
    try:
        with default_layouts_assumed():
            _, new_files = dump_cache.compiled(chip, lowered, folder.path)
        seconds = time.perf_counter() - start
        kernels, notes = read_dump(folder.path, new_files, pallas_kernel_names(text))
    except Exception as err:
        return report(compiled=False, error=error_text(err), seconds=time.perf_counter() - start)
    finally:  # the dump of each compile is read once, then removed
        for name in set(os.listdir(folder.path)) - before:
            (folder.path / name).unlink(missing_ok=True)
    result = report(compiled=True, kernels=kernels, notes=notes, seconds=seconds)
    folder.reports[key] = result
    return result


@contextlib.contextmanager
def default_layouts_assumed():
    """Inside the block, jax takes every argument's layout for the default one without asking
    the device, when this jax and libtpu are a pair of `LAYOUT_QUERY_CRASHES`; else nothing
    changes. For compiling on compile-only devices: the answer only matters to run."""
    if (jax.__version__, libtpu_version()) not in LAYOUT_QUERY_CRASHES:
        yield
        return
    from jax._src.interpreters import pxla

    ask_the_device = pxla.is_default_layout
    pxla.is_default_layout = lambda layout, sharding, aval: True
    try:
        yield
    finally:
        pxla.is_default_layout = ask_the_device


def error_text(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


def pallas_kernel_names(hlo_text: str) -> set[str]:
    """The names of the Pallas kernels (Mosaic custom calls) in a lowered program."""
    names = set(re.findall(r'kernel_name = "([^"]+)"', hlo_text))
    if not names and "tpu_custom_call" in hlo_text:
        names.add("")  # a kernel without a name: recognise it by its custom-call entry bundle
    return names


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
        done = subprocess.run([sys.executable, "-m", "minilib.tpu.compile", str(request),
                               str(response)], env=env, capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0 or not response.exists():
            raise RuntimeError(
                f"the compile process failed ({done.returncode=}):\n{first_lines(done.stderr, 30)}"
            )
        return pickle.loads(response.read_bytes())


# ---------------------------------------------------------------------------------------------
# `python -m minilib.tpu.compile REQUEST REPORT`: the fresh process of compile_in_subprocess.
# ---------------------------------------------------------------------------------------------


def _serve_one_request(request: Path, response: Path) -> None:
    fn, specs, chip = pickle.loads(request.read_bytes())
    if not dump_here():
        raise RuntimeError("libtpu started before its dump flags could be set")
    response.write_bytes(pickle.dumps(compile_here(fn, specs, chip)))


if __name__ == "__main__":
    # Through the package, so that the report pickles as minilib.tpu.compile.CompileReport.
    from minilib.tpu.compile import _serve_one_request as serve

    serve(Path(sys.argv[1]), Path(sys.argv[2]))
