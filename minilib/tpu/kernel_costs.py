"""Our RPA kernel against JAX's, as the TPU compiler sees them: static estimates, not timings.

`python -m minilib compile --chip v5e` compiles both kernels for one chip on the same shapes
(with `minilib.tpu.compile`, so it needs libtpu but no TPU) and prints, side by side:
bundles per KV-block iteration, total bundles, peak VMEM, spill bytes, and the source lines
that produced the most ops in the KV-block loop.

`static_targets` judges the kernel's static targets: on v5e and v6e, at 32 and at 8 queries
per block, our bundles per KV block and our spill bytes are at most JAX's.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from minilib.tpu.chips import CHIPS
from minilib.tpu.compile import CompileReport, compile_for_tpu, kib

# `add_arguments` and `run` are `python -m minilib compile`'s command line, not the library's.
__all__ = ["compile_rpa", "rpa_function", "rpa_specs", "side_by_side", "static_targets"]

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32, "fp8": jnp.float8_e4m3fn}

# The case of the static targets: a GQA model in bfloat16, 8 pages of 16 tokens per KV block.
TARGET_CASE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
TARGET_NUM_KV_PAGES_PER_BLOCK = 8
TARGET_CHIPS = ("v5e", "v6e")
TARGET_QUERIES_PER_BLOCK = (32, 8)


def rpa_specs(
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    pages_per_seq: int = 64,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 256,
    dtype=jnp.bfloat16,
    kv_dtype=None,
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes and dtypes of (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs).

    >>> [s.shape for s in rpa_specs(num_q_heads=4, num_kv_heads=2, max_num_seqs=2)][:2]
    [(256, 4, 128), (128, 16, 4, 128)]
    """
    spec = jax.ShapeDtypeStruct
    return (
        spec((max_num_batched_tokens, num_q_heads, head_dim), dtype),
        spec(
            (max_num_seqs * pages_per_seq, page_size, 2 * num_kv_heads, head_dim),
            kv_dtype or dtype,
        ),
        spec((max_num_seqs,), jnp.int32),
        spec((max_num_seqs, pages_per_seq), jnp.int32),
        spec((max_num_seqs + 1,), jnp.int32),
        spec((1,), jnp.int32),
    )


def rpa_function(which: str):
    """`ours`: minilib's kernel, compiled (not interpreted); `jax`: JAX's own.

    >>> rpa_function("ours").keywords, rpa_function("jax").__module__
    ({'interpret': False}, 'jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel')
    """
    if which == "ours":
        from minilib.kernel import ragged_paged_attention

        return functools.partial(ragged_paged_attention, interpret=False)
    if which == "jax":
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention,
        )

        return ragged_paged_attention
    raise ValueError(f"{which=} must be 'ours' or 'jax'.")


def compile_rpa(which: str, specs, *, chip: str = "v5e", **options) -> CompileReport:
    """Compile one RPA kernel (`ours` or `jax`) for `chip`; options as for the kernel.

    Needs libtpu (not a TPU): the example compiles only where libtpu is installed.

    >>> from minilib.tpu.compile import tpu_compile_available
    >>> specs = rpa_specs(num_q_heads=4, num_kv_heads=2, pages_per_seq=8, max_num_seqs=4,
    ...                   max_num_batched_tokens=64)
    >>> ok, _ = tpu_compile_available()
    >>> report = compile_rpa("ours", specs, chip="v5e", num_kv_pages_per_block=4,
    ...                      num_queries_per_block=16) if ok else None  # needs libtpu
    >>> report is None or report.bundles_per_kv_block > 0
    True
    """
    options.setdefault("sm_scale", specs[0].shape[-1] ** -0.5)
    return compile_for_tpu(functools.partial(rpa_function(which), **options), *specs, chip=chip)


def side_by_side(ours: CompileReport, theirs: CompileReport) -> str:
    """A table of ours against JAX's kernel, then each one's top source lines.

    >>> from minilib.tpu.dump_reader import KernelStats
    >>> def report(bundles, spills):
    ...     stats = KernelStats("rpa.1", 5000, bundles, 9 << 20, spills, ())
    ...     return CompileReport("v5e", compiled=True, kernels=(stats,), libtpu_version="0.0.42.1")
    >>> print(side_by_side(report(860, 0), report(1000, 4096)))
    TPU v5e: static estimates from the compiled programs (libtpu 0.0.42.1), not timings.
                                        ours               JAX  ours / JAX
    bundles per KV block                 860             1,000       0.86x
    total bundles                      5,000             5,000       1.00x
    peak VMEM                      9,216 KiB         9,216 KiB       1.00x
    VMEM spills                        0 KiB             4 KiB
    <BLANKLINE>
    ours: ops per source line in the KV-block loop
    <BLANKLINE>
    JAX's: ops per source line in the KV-block loop
    """

    def cell(report: CompileReport, field: str):
        if not report.compiled:
            return "did not compile"
        value = getattr(report, field)
        return "-" if value is None else (kib(value) if "bytes" in field else f"{value:,}")

    rows = [
        ("bundles per KV block", "bundles_per_kv_block"),
        ("total bundles", "total_bundles"),
        ("peak VMEM", "vmem_bytes"),
        ("VMEM spills", "spill_bytes"),
    ]
    lines = [
        f"TPU {ours.chip}: static estimates from the compiled programs (libtpu "
        f"{ours.libtpu_version}), not timings.",
        f"{'':24}{'ours':>18}{'JAX':>18}{'ours / JAX':>12}",
    ]
    for label, field in rows:
        a, b = getattr(ours, field), getattr(theirs, field)
        ratio = f"{a / b:.2f}x" if a and b else ""
        lines.append(f"{label:24}{cell(ours, field):>18}{cell(theirs, field):>18}{ratio:>12}")
    for name, report in (("ours", ours), ("JAX's", theirs)):
        if not report.compiled:
            lines += [f"\n{name} did not compile:", report.error or ""]
            continue
        lines.append(f"\n{name}: ops per source line in the KV-block loop")
        kernel = report.kernel
        for location, ops in report.top_source_lines[:5]:
            code = kernel.source_code.get(location, "") if kernel else ""
            lines.append(f"  {ops:6d}  {location}  {code[:70]}")
        lines += [f"  note: {note}" for note in report.notes]
    return "\n".join(lines)


def static_targets() -> list[tuple[str, bool | None, str]]:
    """[(target, passed, detail)]: ours <= JAX's in bundles per KV block and in spill bytes,
    on v5e and v6e at 32 and 8 queries per block. Static estimates from the compiled
    programs, not timings. Without libtpu, one entry with passed None says how to get it.

    With libtpu it compiles eight kernels (ours and JAX's, per chip and q block size), so the
    example is not run:

    >>> for target, passed, detail in static_targets():  # doctest: +SKIP
    ...     print(passed, target, detail)
    True static: bundles per KV block <= JAX's (v5e, 32 q/block) ours ... vs JAX ...
    ...
    """
    from minilib.tpu.compile import tpu_compile_available

    ok, reason = tpu_compile_available()
    if not ok:
        return [("static: bundles and spills <= JAX's kernel", None, f"not measured: {reason}")]
    results = []
    for chip in TARGET_CHIPS:
        for queries in TARGET_QUERIES_PER_BLOCK:
            specs = rpa_specs(**TARGET_CASE)
            options = dict(
                num_kv_pages_per_block=TARGET_NUM_KV_PAGES_PER_BLOCK,
                num_queries_per_block=queries,
            )
            ours = compile_rpa("ours", specs, chip=chip, **options)
            theirs = compile_rpa("jax", specs, chip=chip, **options)
            where = f"{chip}, {queries} q/block"
            for label, field in (("bundles per KV block", "bundles_per_kv_block"),
                                 ("spill bytes", "spill_bytes")):  # fmt: skip
                a, b = getattr(ours, field), getattr(theirs, field)
                measured = a is not None and b is not None
                why = ours.error or theirs.error or "; ".join(ours.notes + theirs.notes)
                detail = f"ours {a:,} vs JAX {b:,}" if measured else f"not measured: {why}"
                results.append((f"static: {label} <= JAX's ({where})", measured and a <= b, detail))
    return results


COMMAND_DESCRIPTION = (
    "Compile our RPA kernel and JAX's for a TPU chip (needs libtpu, not a TPU) and compare "
    "them: bundles per KV block, VMEM, spills. Static estimates from the compiled programs, "
    "not timings."
)

# The flags passed on by name: --num-q-heads N becomes rpa_specs(num_q_heads=N), and so on.
SHAPE_FLAGS = {  # name: default, all ints
    "num_q_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "page_size": 16,
    "pages_per_seq": 64,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 256,
}
OPTION_FLAGS = {  # name: (type, default), the kernel options both kernels take
    "num_kv_pages_per_block": (int, 8),
    "num_queries_per_block": (int, 32),
    "sliding_window": (int, None),
    "soft_cap": (float, None),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m minilib compile`: the chip, the shapes and the kernel options.

    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> parser.parse_args(["--chip", "v6e"]).chip
    'v6e'
    """
    parser.add_argument("--chip", choices=CHIPS, default="v5e")
    for name, default in SHAPE_FLAGS.items():
        parser.add_argument(_flag(name), type=int, default=default)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--kv-dtype", choices=DTYPES, default=None)
    for name, (type_, default) in OPTION_FLAGS.items():
        parser.add_argument(_flag(name), type=type_, default=default)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")  # num_q_heads -> --num-q-heads


def run(args) -> int:
    """Run `python -m minilib compile` with parsed flags. Returns the exit code: 0, or 1 when
    this host cannot compile for a TPU or our kernel did not compile."""
    from minilib.tpu.compile import tpu_compile_available

    ok, reason = tpu_compile_available()
    if not ok:
        print(f"Cannot compile for a TPU here: {reason}")
        return 1
    specs = rpa_specs(
        **{name: getattr(args, name) for name in SHAPE_FLAGS},
        dtype=DTYPES[args.dtype],
        kv_dtype=DTYPES[args.kv_dtype] if args.kv_dtype else None,
    )
    options = {name: getattr(args, name) for name in OPTION_FLAGS}
    ours = compile_rpa("ours", specs, chip=args.chip, **options)
    theirs = compile_rpa("jax", specs, chip=args.chip, **options)
    print(side_by_side(ours, theirs))
    return 0 if ours.compiled else 1
