"""vLLM's production RPA kernel (tpu-inference's "RPA v3"), loaded from its published wheel.

vLLM serves attention on TPUs with the ragged paged attention kernel of its `tpu-inference`
package. Compiling it next to ours and JAX's (`minilib.tpu.kernel_costs`) says how far our
kernel is from the one in production. Nothing of it is copied into minilib: this module
fetches the published wheel, version `V3_VERSION` (the one our figures were measured with),
and imports its kernel files at run time.

Why not `pip install tpu-inference`: its metadata asks for jax 0.11.2, a newer libtpu, torch and
vLLM, and its package `__init__` imports vLLM. We need none of that: the kernel itself needs only
JAX and its own `util` module. So:

1. `fetch` runs `pip download tpu-inference==0.32.0 --no-deps` (the wheel alone, nothing
   installed), checks the wheel's SHA-256 and unpacks only `v3/util.py`, `v3/kernel.py` and
   `v3/kernel_hd64.py` (its kernel for head_dim 64) into `v3_folder()`: `<venv>/minilib-v3`,
   outside the repository, or `$MINILIB_V3_DIR`.
   `python3 tasks.py test` does it for `.venv-tpu`; by hand: `python -m minilib.tpu.v3 fetch`.
2. `load_v3` registers the four parent packages (`tpu_inference`, `.kernels`,
   `.kernels.ragged_paged_attention`, `.v3`) in `sys.modules` as bare namespace modules whose
   `__path__` is the unpacked folder, so no package `__init__.py` runs, then imports `v3.util`
   and `v3.kernel` the normal way. No vLLM, no torch.
3. It patches one name, `get_tpu_version`, in `util` and in `kernel` (which bound its own copy
   at import). v3 branches on the TPU generation (int16 masks from v6 on, output shapes from
   v7 on), and its `get_tpu_version` reads `jax.devices()`: on a machine without a TPU, the
   CPU, for which it answers -1. The replacement answers the generation of the chip being
   compiled for (the device kind of the abstract mesh `minilib.tpu.compile` lowers under, the
   same place JAX's `pltpu.get_tpu_info()` reads), and falls back to v3's own answer outside
   such a mesh, as on a real TPU. Nothing else is changed.

v3 0.32.0 compiles with jax 0.10.2 and 0.12.0.1. With jax 0.7.2 its import fails (it calls
`jax.jit` with options only, as a decorator factory, which that jax does not accept), so
`v3_available` says no for any jax older than 0.10.2, and the comparison then reads "not
available: ...".

v3's kernel for head_dim 64, `v3/kernel_hd64.py`, is loaded the same way by `load_v3_hd64`
(with jax 0.12.0.1: with jax 0.10.2 it imports, but its kernel calls `pltpu.reciprocal`,
which that jax lacks, so `load_v3_hd64` says no there), with one more step: it imports its
table of tuned block sizes (`tuned_block_sizes_hd64`), whose module imports tpu_inference's
`logger` and `utils`, and through them vLLM and torch. Block sizes are always passed here,
so that table is never read: `load_v3_hd64` registers in its place a module whose
`get_tuned_block_sizes` raises, saying to pass them.

>>> ok, reason = v3_available()
>>> ok or "v3" in reason
True
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp

from minilib.chips import DEVICE_KINDS, FACTS

__all__ = [
    "V3Unavailable",
    "fetch",
    "load_v3",
    "load_v3_hd64",
    "rpa_v3",
    "rpa_v3_hd64",
    "v3_available",
    "v3_folder",
    "v3_specs",
]

V3_VERSION = "0.32.0"
WHEEL = f"tpu_inference-{V3_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "7c25a3c76cefd383f06ef115a6ed4d7bed82c081f047046bfef55f5913ea06d4"
PACKAGE = "tpu_inference.kernels.ragged_paged_attention.v3"
PARENTS = (
    "tpu_inference",
    "tpu_inference.kernels",
    "tpu_inference.kernels.ragged_paged_attention",
    PACKAGE,
)
# All that is unpacked and imported, in this order (kernel_hd64.py by `load_v3_hd64` alone).
FILES = ("util.py", "kernel.py", "kernel_hd64.py")
OLDEST_JAX = (0, 10, 2)
HD64_OLDEST_JAX = (0, 12, 0)  # the head_dim-64 kernel calls pltpu.reciprocal
FETCH_COMMAND = "python -m minilib.tpu.v3 fetch"


class V3Unavailable(RuntimeError):
    """v3 cannot be loaded here: the wheel is not fetched, or this JAX is too old for it.

    >>> try:
    ...     _ = load_v3()
    ... except V3Unavailable as err:
    ...     print(str(err) == v3_available()[1])
    ... else:
    ...     print(v3_available()[0])
    True
    """


def v3_folder() -> Path:
    """Where the wheel and its two unpacked files live: `$MINILIB_V3_DIR`, else
    `<this Python's environment>/minilib-v3` (inside the venv, so outside git).

    >>> v3_folder().name == "minilib-v3" or "MINILIB_V3_DIR" in os.environ
    True
    """
    return Path(os.environ.get("MINILIB_V3_DIR") or Path(sys.prefix) / "minilib-v3")


def package_folder(root: Path) -> Path:
    return root.joinpath(*PACKAGE.split("."))


def fetch(folder: Path | None = None) -> Path:
    """Download the wheel alone (`pip download --no-deps`, nothing installed), check its
    SHA-256 and unpack the `FILES` of v3 into `folder` (default `v3_folder()`).
    Does nothing when they are there already. Returns the folder.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> package_folder(folder).mkdir(parents=True)
    >>> for name in FILES:                 # as if unpacked before: nothing is downloaded
    ...     _ = (package_folder(folder) / name).write_text("")
    >>> fetch(folder) == folder
    True
    """
    folder = v3_folder() if folder is None else folder
    if all((package_folder(folder) / name).is_file() for name in FILES):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / WHEEL
    if not wheel.is_file():
        with tempfile.TemporaryDirectory(dir=folder) as download:
            pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
            subprocess.run([*pip, f"tpu-inference=={V3_VERSION}", "-d", download], check=True)
            Path(download, WHEEL).replace(wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise V3Unavailable(
            f"{WHEEL} has SHA-256 {digest}, not the {WHEEL_SHA256} measured here: removed it. "
            f"Run `{FETCH_COMMAND}` again."
        )
    with zipfile.ZipFile(wheel) as archive:
        for name in FILES:
            archive.extract(f"{PACKAGE.replace('.', '/')}/{name}", folder)
    return folder


def v3_available() -> tuple[bool, str]:
    """(True, where v3 comes from) when it can be loaded here, else (False, why, and the fix).

    >>> ok, reason = v3_available()
    >>> isinstance(ok, bool) and reason.startswith(("v3", "vLLM"))
    True
    """
    if jax_version() < OLDEST_JAX:
        oldest = ".".join(map(str, OLDEST_JAX))
        return False, (
            f"vLLM's RPA v3 ({WHEEL}) needs jax {oldest} or newer (with jax 0.7.2 its import "
            f"fails); this is jax {jax.__version__}"
        )
    folder = v3_folder()
    missing = [name for name in FILES if not (package_folder(folder) / name).is_file()]
    if missing:
        return False, (
            f"vLLM's RPA v3 is not fetched: no {', '.join(missing)} in {folder}. Run "
            f"`{FETCH_COMMAND}` (it downloads the {WHEEL} wheel alone, about 2 MB, and installs "
            "nothing), or `python3 tasks.py test`, which does it for .venv-tpu"
        )
    return True, f"v3 from {WHEEL} in {folder}"


def jax_version() -> tuple[int, ...]:
    """This jax's version as numbers: (0, 12, 0, 1) for 0.12.0.1."""
    return tuple(int(part) for part in jax.__version__.split(".") if part.isdigit())


@functools.cache
def load_v3() -> types.ModuleType:
    """v3's kernel module (`...ragged_paged_attention.v3.kernel`), imported from the unpacked
    wheel without any of tpu_inference's package `__init__` files (see the module docstring).
    Raises `V3Unavailable` with the fix when it cannot be loaded here.

    >>> v3 = load_v3() if v3_available()[0] else None
    >>> v3 is None or v3.get_tpu_version.__module__ == __name__
    True
    """
    ok, reason = v3_available()
    if not ok:
        raise V3Unavailable(reason)
    root = v3_folder()
    for name in PARENTS:
        if name not in sys.modules:
            namespace = types.ModuleType(name)
            namespace.__path__ = [str(root.joinpath(*name.split(".")))]
            sys.modules[name] = namespace
    util = importlib.import_module(f"{PACKAGE}.util")
    kernel = importlib.import_module(f"{PACKAGE}.kernel")
    answer = tpu_version_of_target(util.get_tpu_version)
    util.get_tpu_version = kernel.get_tpu_version = answer
    return kernel


@functools.cache
def load_v3_hd64() -> types.ModuleType:
    """v3's kernel module for head_dim 64 (`...v3.kernel_hd64`), loaded as `load_v3` loads
    v3's, without vLLM or torch: its table of tuned block sizes is replaced by a module that
    asks for block sizes (see the module docstring). Raises `V3Unavailable` when it cannot be
    loaded here.

    >>> hd64 = load_v3_hd64() if v3_available()[0] else None
    >>> hd64 is None or callable(hd64.ragged_paged_attention_hd64)
    True
    """
    load_v3()  # the bare parent packages and v3's util, patched
    if jax_version() < HD64_OLDEST_JAX:
        oldest = ".".join(map(str, HD64_OLDEST_JAX))
        raise V3Unavailable(
            f"vLLM's RPA v3 head_dim-64 kernel ({WHEEL}) needs jax {oldest} or newer (it calls "
            f"pltpu.reciprocal); this is jax {jax.__version__}"
        )
    tuned = f"{PACKAGE}.tuned_block_sizes_hd64"
    if tuned not in sys.modules:
        sys.modules[tuned] = stand_in = types.ModuleType(tuned)
        stand_in.get_tuned_block_sizes = tuned_block_sizes_not_loaded
    try:
        return importlib.import_module(f"{PACKAGE}.kernel_hd64")
    except (ImportError, AttributeError, TypeError) as err:  # a jax too old for it
        raise V3Unavailable(
            f"vLLM's RPA v3 head_dim-64 kernel ({WHEEL}) does not load with jax "
            f"{jax.__version__}: {type(err).__name__}: {err}"
        ) from err


def tuned_block_sizes_not_loaded(*args, **kwargs):
    """In place of v3's `get_tuned_block_sizes` for head_dim 64, which is not loaded."""
    raise ValueError(
        "v3's table of tuned block sizes for head_dim 64 is not loaded here (it imports vLLM "
        "and torch). Hint: pass num_kv_pages_per_block and num_queries_per_block."
    )


def tpu_version_of_target(original):
    """A `get_tpu_version` that answers the generation of the chip being compiled for."""

    def get_tpu_version() -> int:
        """The generation of the abstract mesh's chip (minilib.tpu.compile), else v3's own."""
        mesh = jax.sharding.get_abstract_mesh()
        device = getattr(mesh, "abstract_device", None)
        if device is None:
            return original()
        chip = DEVICE_KINDS.get(device.device_kind)
        if chip is None:
            raise ValueError(f"{device.device_kind=} is not a TPU chip of minilib.chips.")
        return FACTS[chip].generation

    return get_tpu_version


def rpa_v3(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]
    k,  # [max_num_batched_tokens, num_kv_heads, head_dim]: the new tokens' keys
    v,  # [max_num_batched_tokens, num_kv_heads, head_dim]: and values
    kv_cache,  # v3's layout: [total_num_pages, page_size, 2 * kv_heads // packing, packing, hd]
    kv_lens,  # [max_num_seqs]
    page_indices,  # [max_num_seqs * pages_per_seq], flat
    cu_q_lens,  # [max_num_seqs + 1]
    distribution,  # [3]: sequences [0, d) decode only, [d, p) prefill only, [p, m) mixed
    *,
    sm_scale: float,
    num_queries_per_block: int,
    kv_tokens_per_block: int,
    vmem_limit_bytes: int | None,
    **options,
):
    """v3's `ragged_paged_attention`, returning only the attention output, with one compute
    chunk per block (like ours and JAX's, so that a loop pass is a block): the mixed kernel
    gets `m_block_sizes=(nq, kv, nq, kv)`, the decode kernel `d_block_sizes=(1, kv, 1, kv)`.
    v3 also writes the new tokens' K/V into `kv_cache`, inside its kernel.

    Needs v3 (`v3_available`), and is meant to be compiled, not run, here:

    >>> from minilib.tpu.kernel_costs import rpa_specs
    >>> specs = v3_specs(rpa_specs(num_q_heads=4, num_kv_heads=2)) if v3_available()[0] else None
    >>> specs is None or len(specs) == 8
    True
    """
    kernel = load_v3()
    out, _ = kernel.ragged_paged_attention(
        q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
        sm_scale=sm_scale,
        m_block_sizes=(num_queries_per_block, kv_tokens_per_block) * 2,
        d_block_sizes=(1, kv_tokens_per_block) * 2,
        vmem_limit_bytes=vmem_limit_bytes,
        **options,
    )  # fmt: skip
    return out


def rpa_v3_hd64(
    q,
    k,
    v,
    kv_cache,
    kv_lens,
    page_indices,
    cu_q_lens,
    distribution,  # as for `rpa_v3`
    *,
    sm_scale: float,
    num_queries_per_block: int,
    kv_tokens_per_block: int,
    vmem_limit_bytes: int | None,
    **options,
):
    """v3's `ragged_paged_attention_hd64`, its kernel for head_dim 64 (which vLLM calls when
    head_dim is 64), returning only the attention output; arguments as for `rpa_v3`, the
    cache in that kernel's layout (`v3_specs(..., hd64=True)`). One kernel serves decode,
    prefill and mixed sequences, with q blocks of `num_queries_per_block` tokens and KV blocks
    of `kv_tokens_per_block` tokens, fetched and computed whole. Needs `load_v3_hd64`; here
    its output's shape, traced without compiling:

    >>> from minilib.tpu.kernel_costs import rpa_specs
    >>> ours = rpa_specs(num_q_heads=4, num_kv_heads=2, head_dim=64, num_pages=64)
    >>> run = functools.partial(rpa_v3_hd64, sm_scale=0.125, num_queries_per_block=8,
    ...                         kv_tokens_per_block=128, vmem_limit_bytes=None)
    >>> hd64 = v3_available()[0]
    >>> not hd64 or jax.eval_shape(run, *v3_specs(ours, hd64=True)).shape == (256, 4, 64)
    True
    """
    out, _ = load_v3_hd64().ragged_paged_attention_hd64(
        q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
        sm_scale=sm_scale,
        num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=kv_tokens_per_block // kv_cache.shape[1],
        vmem_limit_bytes=vmem_limit_bytes,
        **options,
    )  # fmt: skip
    return out


def v3_specs(
    specs: tuple[jax.ShapeDtypeStruct, ...], *, hd64: bool = False
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The same case as `specs`, our kernel's arrays (`kernel_costs.rpa_specs`), in `rpa_v3`'s:
    the new tokens' K and V apart, the cache in v3's own layout (in kv_pages' dtype; with
    `hd64`, that of its head_dim-64 kernel, K and V side by side in 128 lanes), the page
    table flat, and the distribution of the sequences. Needs v3.

    >>> from minilib.tpu.kernel_costs import rpa_specs
    >>> ours = rpa_specs(num_q_heads=4, num_kv_heads=2, num_pages=8192)
    >>> specs = v3_specs(ours) if v3_available()[0] else None
    >>> specs is None or specs[3].shape == (8192, 16, 2, 2, 128)   # (K, V) pairs, packed
    True
    >>> ours = rpa_specs(num_q_heads=4, num_kv_heads=2, head_dim=64, num_pages=8192)
    >>> specs = v3_specs(ours, hd64=True) if v3_available()[0] else None
    >>> specs is None or specs[3].shape == (8192, 16, 1, 2, 128)   # K and V in 128 lanes
    True
    """
    q, kv_pages, kv_lens, page_indices, cu_q_lens, _ = specs
    num_pages, page_size, num_combined_kv_heads, head_dim = kv_pages.shape
    num_kv_heads, kv_dtype = num_combined_kv_heads // 2, kv_pages.dtype
    max_num_seqs, pages_per_seq = page_indices.shape
    spec = jax.ShapeDtypeStruct
    new_kv = spec((q.shape[0], num_kv_heads, head_dim), kv_dtype)
    kernel = load_v3_hd64() if hd64 else load_v3()
    cache = kernel.get_kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim, kv_dtype)
    return (
        q,
        new_kv,  # k
        new_kv,  # v
        spec(cache, kv_dtype),
        kv_lens,
        spec((max_num_seqs * pages_per_seq,), jnp.int32),
        cu_q_lens,
        spec((3,), jnp.int32),
    )


def main(argv: list[str]) -> int:
    """`python -m minilib.tpu.v3 [fetch]`: fetch the wheel, then say whether v3 loads."""
    if argv[:1] == ["fetch"]:
        print(f"v3: {WHEEL} unpacked in {fetch()}")
    elif argv:
        print(f"usage: python -m minilib.tpu.v3 [fetch]  (not {' '.join(argv)})")
        return 2
    ok, reason = v3_available()
    print(reason)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
