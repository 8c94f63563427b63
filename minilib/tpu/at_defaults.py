"""Each kernel at its own default block sizes, and whole programs on two workloads: static
estimates from the compiled programs, never timings.

`minilib.tpu.kernel_costs` compiles ours, JAX's kernel and vLLM's RPA v3 at one block size
for all three (128 KV tokens). A ratio that flips when each runs at the block sizes it picks
for itself is not a result, so this module compiles each at its own:

* **ours**: `minilib.block_sizes` (`kernel_config`, under the chip's abstract mesh);
* **JAX's**: its `get_tuned_block_sizes`, which reads the chip from `jax.devices()` (the CPU
  here): `jax_defaults` lets it read the chip's compile-only device instead;
* **v3**: its own `get_default_block_sizes` (`v3/kernel.py`), what vLLM runs: tpu-inference
  0.32.0 (`layers/common/attention_interface.py`) calls v3 without block sizes unless the
  `RPA_V3_*_BLOCK_SIZES` variables are set. The wheel's table `v3/tuned_block_sizes.py` is
  imported by nothing for head_dim 128 (only the head_dim-64 kernel reads a table), so it is
  not used. v3 also keeps its own VMEM limit (the whole VMEM).

`defaults_table` gives bundles per KV block, and **per 128 KV tokens** (x 128 / the block's
KV tokens), which compares across block sizes; and per 128 KV tokens and q row, as a KV-block
pass serves the q rows of its block (v3's mixed kernel: 128 rows, ours: 32). v3 splits a KV
block into compute chunks (`bkv_csz`): its chunk loop counts once per chunk (`block_bundles`).

**Whole programs** (`whole_program`). XLA compiles more than the kernels: our call gathers the
decode rows and tables, runs two `pallas_call`s and scatters the decode rows back
(`minilib/kernel/call.py`); v3 reshapes q, K and V around its kernels. The estimate of one
call sums, over every program XLA compiles for it (top-level program, fusions, copies,
Pallas kernels):

* a program of XLA's own: each bundle once. Its loops run as often as the shapes say, which
  the dump does not print, so they count once (a lower bound; the table says how many of its
  bundles sit in loops);
* a Pallas kernel: each bundle x the passes, in the call, of the innermost loop around it (1
  outside loops). The passes come from the batch (`ours_trips`, `v3_trips`): the KV-block
  loop (`COUNTING_RULE`) once per KV block visited (our mixed kernel's two, `kv_block_pair`,
  each per block it walks: its open blocks', its masked one), the loops around it once per
  sequence, q block or grid step, v3's chunk loop once per chunk; any other loop (a table
  scan, v3's K/V-write loop) once per pass of the loop around it. Both sides of a branch count.

v3 always writes the new tokens' K/V into the cache in its kernel. Ours is counted alone (no
write: not like for like), with the write in its kernels (`ours fused`: `minilib.kernel.kv_write`)
and followed by the scatter (`write_tokens`' XLA program). A written cache is donated, as in
vLLM, so XLA copies none of it (`write_tokens` without donation copies the whole cache).
Both are given the new K/V as the model makes them (q's dtype) and cast them to an fp8
cache's dtype in their programs (`v3_whole_call`), as vLLM does before v3.
The workloads, their trip counts and each loop against its chip's limit are in
`minilib.tpu.suite` (`python -m minilib compile --workloads`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import re
import sys
import types

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from minilib.tpu import compile as tpu
from minilib.tpu import dump_cache, suite
from minilib.tpu.bundles import (
    COUNTING_RULE,
    VECTOR_COMPARE,
    block_bundles,
    count_ops,
    kv_block_pair,
    loop_bodies,
    parse_bundles,
    weighted_bundles,
)
from minilib.tpu.dump_reader import DUMP_FILE, NON_KERNEL_PROGRAMS
from minilib.tpu.kernel_costs import COMPARISON_CASE, rpa_function, rpa_specs
from minilib.tpu.suite import SUITE, Workload, ours_trips, recorded_suite, suite_table, v3_trips

__all__ = ["defaults_rows", "record_suite", "suite_result", "whole_program"]

LABEL = "static estimate from the compiled program, not a timing"


# Each kernel's own defaults. --------------------------------------------------------------------


def on_chip(chip: str):
    """The abstract mesh of `chip`'s compile-only device, under which kernels lower."""
    tpu.dump_here()  # libtpu starts with its dump flags before the device is made
    return jax.sharding.use_abstract_mesh(tpu.abstract_mesh(tpu.topology_device(chip)))


def ours_defaults(chip: str, specs, **options) -> dict[str, dict]:
    """Our kernel's block sizes on `chip` (kernel_config, under the chip's mesh, with the
    layer's `options`): per kernel, {"kv_tokens", "q_rows", "pages", "kv_heads", "open_blocks"}
    (q rows: sequences per grid step for decode; KV heads of one block; whether its open KV
    blocks have a loop of their own)."""
    from minilib.kernel import kernel_config
    from minilib.kernel.levers import split_configs

    q, kv_pages, _, page_indices, _, _ = specs
    with on_chip(chip):
        mixed, decode = split_configs(kernel_config(q, kv_pages, page_indices, **options))
    return {name: dict(kv_tokens=c.num_kv_pages_per_block * c.page_size,
                       q_rows=c.num_queries_per_block, pages=c.num_kv_pages_per_block,
                       kv_heads=c.num_kv_heads_per_block, open_blocks=c.levers.open_blocks)
            for name, c in (("mixed", mixed), ("decode", decode))}  # fmt: skip


def jax_defaults(chip: str, specs) -> dict[str, int]:
    """JAX's kernel's (num_kv_pages_per_block, num_queries_per_block) on `chip`, from its own
    `get_tuned_block_sizes`, which reads `jax.devices()[0]`: here it reads the chip's
    compile-only device instead."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel, tuned_block_sizes

    q, kv_pages, _, page_indices, _, _ = specs
    q_heads, kv_heads = kernel.get_min_heads_per_blk(q.shape[1], kv_pages.shape[2], q.dtype,
                                                     kv_pages.dtype)  # fmt: skip
    tpu.dump_here()
    device = tpu.topology_device(chip)
    real_jax = tuned_block_sizes.jax
    tuned_block_sizes.jax = types.SimpleNamespace(devices=lambda: [device])
    try:
        pages, queries = tuned_block_sizes.get_tuned_block_sizes(
            q.dtype, kv_pages.dtype, q_heads, kv_heads // 2, q.shape[2], kv_pages.shape[1],
            q.shape[0], page_indices.shape[1],
        )  # fmt: skip
    finally:
        tuned_block_sizes.jax = real_jax
    return dict(kv_tokens=pages * kv_pages.shape[1], q_rows=queries, pages=pages)


def v3_defaults(chip: str, specs) -> dict[str, dict]:
    """v3's own block sizes on `chip` (its `get_default_block_sizes`, which vLLM runs), per
    kernel: {"bq_sz", "bkv_sz", "bq_csz", "bkv_csz"}."""
    from minilib.tpu.v3 import load_v3

    v3 = load_v3()
    q, kv_pages, kv_lens, page_indices, _, _ = specs
    args = (q.dtype, kv_pages.dtype, q.shape[1], kv_pages.shape[2] // 2, q.shape[2],
            kv_pages.shape[1], q.shape[0], kv_lens.shape[0], page_indices.shape[1])  # fmt: skip
    cases = {"decode": v3.RpaCase.DECODE, "mixed": v3.RpaCase.MIXED}
    with on_chip(chip):  # v3's get_tpu_version reads the mesh (minilib.tpu.v3)
        return {name: v3.get_default_block_sizes(*args, case=case) for name, case in cases.items()}


# Compiling a whole call, and reading every program XLA compiled for it. -------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    """A program of a compiled call: its bundles; a Pallas kernel, or one of XLA's own."""

    name: str
    bundles: tuple
    kernel: bool


_COMPILED: dict = {}


def compile_programs(fn, specs, chip: str, donate: tuple[int, ...] = ()) -> tuple[Program, ...]:
    """Compile `fn(*specs)` for `chip` (as `minilib.tpu.compile` does) and return every
    program libtpu dumped for it. Runs in this process only: raises RuntimeError when libtpu
    started here without its dump flags."""
    return compile_call(fn, specs, chip, donate)[1]


def compile_call(fn, specs, chip: str, donate: tuple[int, ...] = ()) -> tuple[str, tuple]:
    """`compile_programs`, and the compiled call's HLO text before them (what it aliases and
    copies: tests/tpu/test_tpu_kv_write.py)."""
    tpu.require_libtpu()
    if not tpu.dump_here():
        raise RuntimeError("libtpu started here without its dump flags, so whole programs "
                           "cannot be read. Hint: run them in a fresh Python process.")  # fmt: skip
    sharding = NamedSharding(Mesh(np.array([tpu.topology_device(chip)]), "x"), PartitionSpec())
    structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
    with on_chip(chip):
        lowered = jax.jit(fn, donate_argnums=donate).lower(*structs)
    program = lowered.as_text()
    key = (chip, hashlib.sha256(program.encode()).hexdigest())
    if key in _COMPILED:  # JAX reuses its executable: libtpu writes no new dump
        return _COMPILED[key]
    folder = tpu.dump_folder().path
    before = set(os.listdir(folder))
    try:
        with tpu.default_layouts_assumed():
            hlo, files = dump_cache.compiled(chip, lowered, folder)
        kernel_names = tpu.pallas_kernel_names(program)
        programs = []
        for file in files:
            m = DUMP_FILE.match(file)
            if m and m.group(2) == "final_bundles":
                text = (folder / file).read_text(errors="replace")
                name = m.group(1)
                base = re.sub(r"\.\d+$", "", name)
                kernel = name not in NON_KERNEL_PROGRAMS and (
                    base in kernel_names or "custom-call(" in text[:20000])  # fmt: skip
                programs.append(Program(name, tuple(parse_bundles(text)), kernel))
    finally:
        for file in set(os.listdir(folder)) - before:
            (folder / file).unlink(missing_ok=True)
    _COMPILED[key] = hlo, tuple(programs)
    return _COMPILED[key]


# The calls compiled, at each kernel's own defaults. ---------------------------------------------


def ours_whole_call(*args, sm_scale, **options):
    """Our `ragged_paged_attention`, compiled, at its default block sizes; a seventh
    argument is the attention sinks."""
    sink = dict(attention_sink=args[6]) if len(args) == 7 else {}
    return rpa_function("ours")(*args[:6], sm_scale=sm_scale, **sink, **options)


def ours_fused_call(*args, sm_scale, **options):
    """Ours writing the new K and V (arguments 7, 8) into the cache; a ninth: the sinks."""
    sink = dict(attention_sink=args[8]) if len(args) == 9 else {}
    new = dict(new_keys=args[6], new_values=args[7])
    return rpa_function("ours")(*args[:6], sm_scale=sm_scale, **new, **sink, **options)


def new_kv_specs(specs) -> tuple:
    """The shapes of the new tokens' K and V: [max_num_batched_tokens, num_kv_heads, hd]."""
    q, kv_pages = specs[:2]
    return (jax.ShapeDtypeStruct((q.shape[0], kv_pages.shape[2] // 2, q.shape[2]), q.dtype),) * 2


def v3_whole_call(q, k, v, kv_cache, *args, sm_scale, **options):
    """v3's `ragged_paged_attention` (q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens,
    distribution) at its own block sizes and VMEM limit: (out, the cache, K/V written). The
    new K and V come as the model makes them, in q's dtype, and are cast to the cache's first,
    as ours casts them (`combine_kv`): v3 takes them only in the cache's dtype, and vLLM's
    attention layer quantizes them before the call (tpu-inference's `quantize_kv`, which
    also divides by the scale and clips)."""
    from minilib.tpu.v3 import load_v3

    k, v = k.astype(kv_cache.dtype), v.astype(kv_cache.dtype)
    return load_v3().ragged_paged_attention(q, k, v, kv_cache, *args, sm_scale=sm_scale,
                                            **options)  # fmt: skip


def jax_call(*args, sm_scale, pages, queries):
    """JAX's kernel (a function of its own, so that JAX compiles it here again)."""
    return rpa_function("jax")(*args, sm_scale=sm_scale, num_kv_pages_per_block=pages,
                               num_queries_per_block=queries)  # fmt: skip


def kernel_named(programs, prefix: str) -> Program:
    """The one Pallas kernel of `programs` whose name starts with `prefix`."""
    found = [p for p in programs if p.kernel and p.name.startswith(prefix)]
    if len(found) != 1:
        names = [p.name for p in programs if p.kernel]
        raise ValueError(f"expected one kernel named {prefix}..., found {names}")
    return found[0]


def v3_kernels(chip: str, specs, **options) -> tuple[dict, dict[str, Program], tuple]:
    """v3 compiled at its defaults on `specs` (our shapes) with the layer's `options`: (its
    block sizes, its kernels {"decode", "mixed"}, every program). Each kernel's name carries
    its block sizes, checked against `v3_defaults`."""
    from minilib.tpu.v3 import v3_specs

    blocks = v3_defaults(chip, specs)
    call = functools.partial(v3_whole_call, sm_scale=specs[0].shape[2] ** -0.5, **options)
    q, k, v, *rest = v3_specs(specs)
    model_kv = jax.ShapeDtypeStruct(k.shape, q.dtype)  # as the model makes them: see the call
    programs = compile_programs(call, (q, model_kv, model_kv, *rest), chip, donate=(3,))
    kernels = {}
    for kernel, symbol in (("decode", "d"), ("mixed", "m")):
        b = blocks[kernel]
        kernels[kernel] = kernel_named(programs, f"RPA{symbol}-")
        sizes = f"-bq_{b['bq_sz']}_{b['bq_csz']}-bkv_{b['bkv_sz']}_{b['bkv_csz']}"
        if sizes not in kernels[kernel].name:
            raise ValueError(f"v3 compiled {kernels[kernel].name}, not its defaults {sizes}")
    return blocks, kernels, programs


def ours_kernels(chip: str, specs, sinks: bool = False, fused: bool = False,
                 **options) -> tuple[dict, dict, tuple]:  # fmt: skip
    """Ours compiled at its defaults on `specs` with the layer's `options` (and attention
    sinks, an argument of the program; with `fused`, writing the new tokens into the cache,
    donated): (block sizes, kernels, every program)."""
    fn = ours_fused_call if fused else ours_whole_call
    call = functools.partial(fn, sm_scale=specs[0].shape[2] ** -0.5, **options)
    sink = (jax.ShapeDtypeStruct((specs[0].shape[1],), np.float32),) * sinks
    new = new_kv_specs(specs) if fused else ()
    programs = compile_programs(call, (*specs, *new, *sink), chip, donate=(1,) * fused)
    kernels = {"decode": kernel_named(programs, "minilib_ragged_paged_attention_decode"),
               "mixed": kernel_named(programs, "minilib_ragged_paged_attention.")}  # fmt: skip
    return ours_defaults(chip, specs, **options), kernels, programs


@dataclasses.dataclass(frozen=True)
class Row:
    """One kernel's figure at its own block sizes, on one chip and config."""

    chip: str
    config: str  # "mixed" (prefill and mixed sequences) or "decode"
    kernel: str  # "ours", "JAX", "v3"
    kv_tokens: int  # KV tokens per block
    q_rows: int  # live q rows a KV-block pass serves (decode: one sequence's row)
    bundles_per_kv_block: int
    note: str = ""

    per_128_kv_tokens = property(lambda r: r.bundles_per_kv_block * 128 / r.kv_tokens)
    per_128_and_q_row = property(lambda r: r.per_128_kv_tokens / r.q_rows)


def ours_rows(chip: str, specs) -> list[Row]:
    blocks, kernels, _ = ours_kernels(chip, specs)
    return [Row(chip, config, "ours", b["kv_tokens"], 1 if config == "decode" else b["q_rows"],
                block_bundles(kernels[config].bundles),
                f"{b['q_rows']} sequences per grid step" * (config == "decode"))
            for config, b in blocks.items()]  # fmt: skip


def jax_rows(chip: str, specs) -> list[Row]:
    b = jax_defaults(chip, specs)
    call = functools.partial(jax_call, sm_scale=specs[0].shape[2] ** -0.5, pages=b["pages"],
                             queries=b["q_rows"])  # fmt: skip
    (kernel,) = [p for p in compile_programs(call, specs, chip) if p.kernel]
    note = f"no decode kernel: a q block of {b['q_rows']} rows, one live, serves decode"
    return [Row(chip, config, "JAX", b["kv_tokens"], 1 if config == "decode" else b["q_rows"],
                block_bundles(kernel.bundles), note * (config == "decode"))
            for config in ("mixed", "decode")]  # fmt: skip


def v3_rows(chip: str, specs) -> list[Row]:
    blocks, kernels, _ = v3_kernels(chip, specs)
    chunks = {config: -(-b["bkv_sz"] // b["bkv_csz"]) for config, b in blocks.items()}
    return [Row(chip, config, "v3", b["bkv_sz"], b["bq_sz"],
                block_bundles(kernels[config].bundles, chunks[config]),
                f"{chunks[config]} compute chunks of {b['bkv_csz']} per block")
            for config, b in sorted(blocks.items(), reverse=True)]  # fmt: skip


def defaults_rows(chip: str, case: dict = COMPARISON_CASE, kernels=("ours", "JAX", "v3")):
    """[Row]: each of `kernels` compiled at its own defaults on `case` (one compile each).

    >>> [(r.kernel, r.config, r.kv_tokens) for r in defaults_rows("v5e")][-1]  # doctest: +SKIP
    ('v3', 'decode', 512)
    """
    rows_of = {"ours": ours_rows, "JAX": jax_rows, "v3": v3_rows}
    return [row for kernel in kernels for row in rows_of[kernel](chip, rpa_specs(**case))]


def kernel_result(name: str, chip: str, workload: Workload) -> dict:
    """{"parts": [(part, bundles, how counted)], "loops": [KVLoop fields]}: the whole-program
    static estimate of one call of `name` ("ours", "ours fused" or "v3") on `workload` (see
    the module docstring; the parts sum to it) and the KV-block loops it runs."""
    specs, model = workload.specs(), workload.model
    if name.startswith("ours"):
        blocks, kernels, programs = ours_kernels(chip, specs, model.sinks, name == "ours fused",
                                                 **model.options())  # fmt: skip
        mixed = blocks["mixed"]
        trips = ours_trips(workload, mixed["pages"], mixed["q_rows"], mixed["open_blocks"])
        passes = {k: (trips[k], None) for k in kernels}
        loop_of = {k: dict(kv_tokens=b["kv_tokens"], kv_heads=b["kv_heads"],
                           q_tokens=1 if k == "decode" else b["q_rows"], chunks=1)
                   for k, b in blocks.items()}  # fmt: skip
    else:
        blocks, kernels, programs = v3_kernels(chip, specs, **model.options())
        passes = v3_trips(workload, blocks)
        loop_of = {k: dict(kv_tokens=b["bkv_sz"], kv_heads=model.num_kv_heads, q_tokens=b["bq_sz"],
                           chunks=-(-b["bkv_sz"] // b["bkv_csz"]))
                   for k, b in blocks.items()}  # fmt: skip
    parts, loops = [xla_part([p for p in programs if not p.kernel])], []
    for kernel, program in kernels.items():
        outward, chunks = passes[kernel]
        how = "passes of its loops, KV-block loop outward: " + ", ".join(map(str, outward))
        how += f"; compute chunks: {chunks}" if chunks is not None else ""
        parts.append((program.name, weighted_bundles(program.bundles, outward, chunks), how))
        figures = dict(loop_of[kernel])
        bundles = block_bundles(program.bundles, figures.pop("chunks"))
        pair = kv_block_pair(program.bundles)
        if pair:  # the open KV blocks' loop (`open_blocks`), then the masked one
            (open_start, open_end), _ = pair
            compares = [count_ops(program.bundles[s:e], VECTOR_COMPARE) for s, e in pair]
            if compares[0] or not compares[1]:  # the open loop builds no mask, the other does
                why = "its first KV-block loop builds a mask, or its second none: not the open loop"
                raise ValueError(f"{program.name}: {why} its passes are for")
            opened, masked = outward[0]
            program = "open" if kernel == "mixed" else f"{kernel} open"
            loops.append(dict(kernel=name, program=program, bundles=open_end - open_start,
                              **figures, passes=opened))  # fmt: skip
        loops.append(dict(kernel=name, program=kernel, bundles=bundles, **figures,
                          passes=masked if pair else outward[0]))  # fmt: skip
    return {"parts": parts, "loops": loops}


def xla_part(programs) -> tuple[str, int, str]:
    """The part of XLA's own programs: each bundle once."""
    in_loops = sum(len({i for s, e in loop_bodies(p.bundles) for i in range(s, e)})
                   for p in programs)  # fmt: skip
    how = f"each bundle once; {in_loops:,} of them in loops, counted once"
    return (f"{len(programs)} XLA programs", sum(len(p.bundles) for p in programs), how)


def scatter_result(chip: str, workload: Workload) -> dict:
    """{"parts": [the XLA part]}: the separate scatter of the new tokens, `write_tokens` on
    `workload`'s cache, donated, and a page and slot per q row."""
    from minilib.kv_cache import write_tokens

    specs = workload.specs()
    rows = jax.ShapeDtypeStruct((specs[0].shape[0],), np.int32)
    programs = compile_programs(write_tokens, (specs[1], rows, rows, *new_kv_specs(specs)), chip,
                                donate=(0,))  # fmt: skip
    return {"parts": [xla_part(programs)]}


def suite_result(chip: str, workload: Workload) -> dict:
    """{"ours": kernel_result, "ours fused": kernel_result, "scatter": scatter_result, "v3":
    kernel_result or {"unsupported": why}} on `workload`: a few minutes of compiles, so the
    example is not run.

    >>> suite_result("v5e", SUITE["gpt-oss"])["v3"]  # doctest: +SKIP
    {'unsupported': "head_dim 64: vLLM runs v3's head_dim-64 kernel, ..."}
    """
    why = workload.model.v3_unsupported()
    try:
        v3 = {"unsupported": why} if why else kernel_result("v3", chip, workload)
    except jax.errors.JaxRuntimeError as err:  # v3's defaults may not fit the chip's VMEM
        used = re.search(r"Used \S+ of \S+ vmem", str(err))
        if used is None:
            raise
        b = v3_defaults(chip, workload.specs())["mixed"]
        why = (f"v3 at its own block sizes (mixed: bq {b['bq_sz']}, bkv {b['bkv_sz']}) does "
               f"not compile on {chip}: {used.group()}")  # fmt: skip
        v3 = {"unsupported": why}
    return {"ours": kernel_result("ours", chip, workload),
            "ours fused": kernel_result("ours fused", chip, workload),
            "scatter": scatter_result(chip, workload), "v3": v3}  # fmt: skip


def record_suite(path=suite.RECORDED, chips=("v5e", "v6e", "tpu7x"), names=None) -> dict:
    """Compile every workload of `SUITE` (or `names`) for `chips` (needs libtpu and v3's
    wheel; many minutes) and write the results, the stack and the date to `path`, beside the
    other chips' results already there when they were recorded on the same stack.

    >>> record_suite()["libtpu"]  # doctest: +SKIP
    '0.0.50.1'
    """
    from minilib.tpu.v3 import V3_VERSION

    tpu.require_libtpu()
    stack = {"jax": jax.__version__, "libtpu": tpu.libtpu_version(), "v3": V3_VERSION,
             "counting_rule": COUNTING_RULE}  # fmt: skip
    old = json.loads(path.read_text()) if path.exists() else {}
    results = old["results"] if all(old.get(k) == v for k, v in stack.items()) else {}
    record = {"what": f"`python -m minilib compile --workloads`: {suite.LABEL}; written by "
              f"`{suite.COMMAND}`", "date": datetime.date.today().isoformat(), **stack,
              "results": results}  # fmt: skip
    for chip in chips:
        done = results.get(chip, {}) if names else {}
        for name in names or SUITE:  # written after each: a run takes many minutes
            done[name] = suite_result(chip, SUITE[name])
            results[chip] = {n: done[n] for n in SUITE if n in done}
            path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return record


def whole_program(chip: str, workload: Workload) -> dict[str, list[tuple[str, int, str]]]:
    """{kernel: [(part, bundles, how counted)]}: the whole-program static estimate of one
    call of ours and of v3 on `workload` (see the module docstring); each list sums to it.

    >>> sum(n for _, n, _ in whole_program("v5e", SUITE["decode"])["v3"])  # doctest: +SKIP
    392655
    """
    return {name: kernel_result(name, chip, workload)["parts"] for name in ("ours", "v3")}


# Tables, and `python -m minilib compile --defaults / --workloads`. ------------------------------


def defaults_table(rows: list[Row]) -> str:
    """The rows of `defaults_rows` as a table, with ours against v3 per 128 KV tokens."""
    lines = [f"Each kernel at its own default block sizes: bundles, a {LABEL}.",
             f"{'chip':6} {'config':7} {'kernel':6} {'KV tokens':>9} {'q rows':>6} "
             f"{'per KV block':>12} {'per 128 KV tokens':>17} {'and q row':>9}  note"]  # fmt: skip
    for r in rows:
        figures = f"{r.bundles_per_kv_block:12,} {r.per_128_kv_tokens:17,.1f}"
        figures += f" {r.per_128_and_q_row:9,.1f}"
        lines.append(f"{r.chip:6} {r.config:7} {r.kernel:6} {r.kv_tokens:9,} {r.q_rows:6} "
                     f"{figures}  {r.note}")  # fmt: skip
    cells = {(r.chip, r.config, r.kernel): r for r in rows}
    for chip, config, kernel in cells:
        if kernel == "ours" and (chip, config, "v3") in cells:
            a, b = cells[chip, config, "ours"], cells[chip, config, "v3"]
            for label, x, y in (
                ("", a.per_128_kv_tokens, b.per_128_kv_tokens),
                (" and q row", a.per_128_and_q_row, b.per_128_and_q_row),
            ):
                verdict = "holds" if x <= y else "FAILS"
                lines.append(f"ours <= v3 per 128 KV tokens{label} ({chip}, {config}): "
                             f"{verdict}, {x:,.1f} vs {y:,.1f} ({x / y:.2f}x)")  # fmt: skip
    return "\n".join(lines)


def flag_problem(args, flag_defaults: dict) -> str | None:
    """Why `--defaults` / `--workloads` cannot run with these flags (`flag_defaults`: every
    flag's default), or None: they compile each kernel at its own block sizes on fixed shapes,
    so only --chip goes with them (and --record with --workloads: it records the suite).

    >>> from argparse import Namespace
    >>> defaults = dict(chip=None, defaults=False, workloads=False, head_dim=128)
    >>> print(flag_problem(Namespace(**defaults | dict(defaults=True, head_dim=64)), defaults))
    --defaults compiles each kernel at its own block sizes and shapes: drop --head-dim (only --chip goes with it)
    """  # noqa: E501
    mode = "--defaults" if args.defaults else "--workloads"
    allowed = ("chip", "defaults", "workloads") + ("record",) * (not args.defaults)
    for name in [n for n in flag_defaults if n not in allowed]:
        if getattr(args, name) != flag_defaults[name]:
            flag = "--" + name.replace("_", "-")
            only = "--chip and --record go" if "record" in allowed else "--chip goes"
            return (f"{mode} compiles each kernel at its own block sizes and shapes: drop "
                    f"{flag} (only {only} with it)")  # fmt: skip
    return None


def run(args, flag_defaults: dict) -> int:
    """`python -m minilib compile --defaults` and/or `--workloads`: 0, 1 when this host cannot
    compile them, 2 for a flag that does not go with them (`flag_problem`)."""
    from minilib.tpu.kernel_costs import COMPARISON_CHIPS
    from minilib.tpu.v3 import v3_available

    problem = flag_problem(args, flag_defaults)
    if problem is not None:
        print(f"python -m minilib compile: error: {problem} (see --help)", file=sys.stderr)
        return 2
    for ok, reason in (tpu.tpu_compile_available(), v3_available()):
        if not ok:
            print(f"Cannot compile each kernel at its defaults here: {reason}")
            return 1
    chips = [chip for chip in args.chip or COMPARISON_CHIPS if chip in tpu.chips_here()]
    for chip in set(args.chip or ()) - set(chips):
        print(f"Skipping {chip}: {tpu.chip_unknown_here(chip)}")
    if args.defaults:
        print(defaults_table([row for chip in chips for row in defaults_rows(chip)]))
    if args.workloads and args.record:
        record_suite(chips=chips)
        print(f"Recorded the suite for {', '.join(chips)} in {suite.RECORDED}")
        print(suite_table(recorded_suite()))
    elif args.workloads:
        from minilib.tpu.compile import libtpu_version
        from minilib.tpu.v3 import V3_VERSION

        for chip in chips:  # a chip at a time: each takes minutes
            results = {chip: {name: suite_result(chip, w) for name, w in SUITE.items()}}
            print(suite_table(dict(libtpu=libtpu_version(), v3=V3_VERSION, results=results)))
    return 0
