"""Our RPA kernel against JAX's and vLLM's RPA v3, as the TPU compiler sees them: static
estimates from the compiled programs, not timings.

`python -m minilib compile` compiles the three kernels for each chip (with
`minilib.tpu.compile`, so it needs libtpu but no TPU) on one workload, and prints bundles per
KV block, counted by the one rule of `minilib.tpu.dump_reader` (`COUNTING_RULE`), with spills,
per chip and config:

* **32 q per block** and **8 q per block**: the kernel that serves prefills and mixed batches,
  with q blocks of 32 or 8 tokens;
* **decode**: the loop of the kernel that serves decode sequences (one token each). v3 compiles
  a decode kernel of its own (`RPAd-...`, one q token per sequence). A kernel without one
  serves a decode sequence with its 8 q per block kernel, one live row of 8; its cell says so.

Each program may hold several `pallas_call`s (v3's holds a decode and a mixed one, ours may hold
two): `kernel_for` picks each config's kernel by its name, never by its position or size.

The workload (`COMPARISON_CASE`): bf16, 32 q / 8 KV heads, head_dim 128, page_size 16, 8 pages
(128 KV tokens) per KV block, 256 tokens, 16 sequences of up to 32 pages, and an 8192-page
cache for all three kernels. A small cache is a trap: with 512 pages, XLA places the whole
cache in VMEM, the page copies stop being DMAs, and the loop measured is not a KV-block loop.
v3 gets `m_block_sizes=(nq, 128, nq, 128)` and `d_block_sizes=(1, 128, 1, 128)` (one compute
chunk per fetched block, so one loop pass is one block, as in ours and JAX's) and an explicit
`vmem_limit_bytes` of 32 MiB (`V3_VMEM_LIMIT_BYTES`, v6e's default scoped limit, under which
ours and JAX's, which set none, compile there). Left to itself v3 asks for the whole VMEM
(128 MiB on v5e and v6e), and its loops there come out a little shorter.

At head_dim 64 (`--head-dim 64`), v3's column is v3's kernel for head_dim 64, as vLLM picks
it (`v3_hd64_here`; with jax older than 0.12, its head_dim-128 kernel, and the cells say so).
That one kernel runs a copy of its KV-block loop for each kind of sequence: the 8 and 32 q
per block cells read its mixed copy, the decode cell its decode copy (`cell_of`), each
counted by the rule; its spills are the whole kernel's. JAX's kernel does not compile at
head_dim 64 (an assertion: its rows of softmax statistics are 128 lanes wide).

What we claim from these figures, the figures recorded for where nothing compiles, and the
command line are in `minilib.tpu.comparison`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from minilib.tpu.bundles import COUNTING_RULE
from minilib.tpu.compile import CompileReport, compile_for_tpu, kib
from minilib.tpu.dump_reader import KernelStats
from minilib.tpu.loop_paths import PATH_RULES
from minilib.tpu.sinks import compile_with_sinks

__all__ = [
    "COUNTS",
    "Cell",
    "compare_kernels",
    "comparison_table",
    "compile_rpa",
    "compile_v3",
    "kernel_for",
    "rpa_function",
    "rpa_specs",
    "side_by_side",
]

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32, "fp8": jnp.float8_e4m3fn}

# The cost model's case (minilib.block_sizes): a GQA model in bfloat16, page_size 16.
TARGET_CASE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
# The three-way comparison: the same model, 256 tokens, 16 sequences, an 8192-page cache.
COMPARISON_CASE = dict(
    **TARGET_CASE, pages_per_seq=32, max_num_seqs=16, max_num_batched_tokens=256, num_pages=8192
)
COMPARISON_KV_PAGES_PER_BLOCK = 8
COMPARISON_QUERIES_PER_BLOCK = (32, 8)
COMPARISON_CHIPS = ("v5e", "v6e", "tpu7x")
V3_VMEM_LIMIT_BYTES = 32 * 1024 * 1024
KERNELS = ("v3", "JAX", "ours")


def rpa_specs(
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    pages_per_seq: int = 64,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 256,
    num_pages: int | None = None,
    dtype=jnp.bfloat16,
    kv_dtype=None,
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes and dtypes of (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs); the
    cache holds `num_pages` pages (default: `max_num_seqs * pages_per_seq`).

    >>> [s.shape for s in rpa_specs(num_q_heads=4, num_kv_heads=2, max_num_seqs=2)][:2]
    [(256, 4, 128), (128, 16, 4, 128)]
    """
    spec = jax.ShapeDtypeStruct
    num_pages = max_num_seqs * pages_per_seq if num_pages is None else num_pages
    return (
        spec((max_num_batched_tokens, num_q_heads, head_dim), dtype),
        spec((num_pages, page_size, 2 * num_kv_heads, head_dim), kv_dtype or dtype),
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


def compile_v3(
    chip: str,
    *,
    num_queries_per_block: int,
    num_kv_pages_per_block: int = COMPARISON_KV_PAGES_PER_BLOCK,
    case: dict = COMPARISON_CASE,
    vmem_limit_bytes: int | None = V3_VMEM_LIMIT_BYTES,
    kv_dtype=None,
    hd64: bool = False,
    **options,
) -> CompileReport:
    """Compile vLLM's RPA v3 (`minilib.tpu.v3`) for `chip` on `case`'s shapes, its mixed
    kernel with q blocks of `num_queries_per_block` tokens, both kernels with KV blocks of
    `num_kv_pages_per_block` pages. Its program holds two kernels, decode and mixed (see
    `kernel_for`). With `hd64`, its kernel for head_dim 64 instead (`rpa_v3_hd64`): one
    kernel, with a KV-block loop for each kind of sequence (see `cell_of`). Raises
    `V3Unavailable` when v3 cannot be loaded here.

    Needs libtpu and v3 (jax 0.10.2 and the fetched wheel), so the example is not run:

    >>> report = compile_v3("v5e", num_queries_per_block=8)  # doctest: +SKIP
    >>> [k.name for k in report.kernels]  # doctest: +SKIP
    ['RPAd-p_16-bq_1_1-bkv_128_128.1', 'RPAm-p_16-bq_8_8-bkv_128_128.1']
    """
    from minilib.tpu.v3 import rpa_v3, rpa_v3_hd64, v3_specs

    specs = v3_specs(rpa_specs(**case, kv_dtype=kv_dtype), hd64=hd64)
    run = functools.partial(
        rpa_v3_hd64 if hd64 else rpa_v3,
        sm_scale=case["head_dim"] ** -0.5,
        num_queries_per_block=num_queries_per_block,
        kv_tokens_per_block=num_kv_pages_per_block * case["page_size"],
        vmem_limit_bytes=vmem_limit_bytes,
        **options,
    )
    return compile_for_tpu(run, *specs, chip=chip)


def serves_decode(kernel_name: str) -> bool:
    """Whether a compiled kernel serves decode sequences, read from its name: ours has
    `decode` in its decode kernel's name; v3 names its kernels `RPAd-...` (decode),
    `RPAp-...` (prefill) and `RPAm-...` (mixed).

    >>> serves_decode("RPAd-p_16-bq_1_1-bkv_128_128.1"), serves_decode("RPAm-p_16-bq_8_8.1")
    (True, False)
    >>> serves_decode("minilib_ragged_paged_attention.1")
    False
    """
    return "decode" in kernel_name or kernel_name.startswith("RPAd-")


def kernel_for(report: CompileReport, *, decode: bool) -> KernelStats | None:
    """The kernel of a compiled program that serves decode sequences (`decode=True`), or the
    one that serves the others, picked by name (`serves_decode`); None if there is none.
    (Of several of a kind, the one with the most bundles.)

    >>> def stats(name):
    ...     return KernelStats(name, 1000, 100, 1 << 20, 0, ())
    >>> v3 = CompileReport("v5e", compiled=True, kernels=(stats("RPAd-p_16.1"), stats("RPAm-p_16.1")))
    >>> kernel_for(v3, decode=True).name, kernel_for(v3, decode=False).name
    ('RPAd-p_16.1', 'RPAm-p_16.1')
    >>> jax_rpa = CompileReport("v5e", compiled=True, kernels=(stats("ragged_paged_attention_kernel.1"),))
    >>> kernel_for(jax_rpa, decode=True) is None
    True
    """  # noqa: E501
    kernels = [kernel for kernel in report.kernels if serves_decode(kernel.name) == decode]
    return max(kernels, key=lambda kernel: kernel.total_bundles, default=None)


def stats_figure(name: str) -> property:
    """A `Cell` property: the figure `name` of the cell's `KernelStats`, or None."""
    return property(lambda cell: None if cell.stats is None else getattr(cell.stats, name))


@dataclasses.dataclass(frozen=True)
class Cell:
    """One kernel's compiled figures for one chip and config, or why there are none.

    >>> cell = Cell("ours", "v5e", "decode", KernelStats("k.1", 2000, 1128, 9 << 20, 0, ()),
    ...             note="no decode kernel: its 8 q per block kernel serves decode")
    >>> cell.bundles_per_kv_block, cell.spill_bytes, Cell("v3", "v5e", "decode").bundles_per_kv_block
    (1128, 0, None)
    """  # noqa: E501

    kernel: str  # "v3", "JAX", "ours"
    chip: str
    config: str  # "32 q per block", "8 q per block", "decode"
    stats: KernelStats | None = None
    missing: str = ""  # why `stats` is None: "not available: ...", "did not compile: ..."
    note: str = ""  # which kernel serves decode, when it has no decode kernel

    # The figures of `stats`, None when there are none.
    bundles_per_kv_block = stats_figure("bundles_per_kv_block")
    longest_path = stats_figure("longest_path")
    interior_path = stats_figure("interior_path")
    spill_bytes = stats_figure("spill_bytes")


# The three counts of a KV block, each a `Cell` property: the listing's length of the loop
# (`COUNTING_RULE`), and two paths through one pass of it (`PATH_RULES`).
COUNTS = {
    "bundles_per_kv_block": "listing",
    "longest_path": "longest path",
    "interior_path": "interior path",
}


def compare_kernels(
    chip: str,
    *,
    case: dict = COMPARISON_CASE,
    num_kv_pages_per_block: int = COMPARISON_KV_PAGES_PER_BLOCK,
    queries_per_block: tuple[int, ...] = COMPARISON_QUERIES_PER_BLOCK,
    kv_dtype=None,
    attention_sink: bool = False,
    **options,
) -> list[Cell]:
    """Compile v3, JAX's kernel and ours for `chip` on `case`, once per q block size, and
    return one `Cell` per kernel and config: `f"{n} q per block"` for each n, then "decode",
    read from the program of the smallest q block (a kernel without a decode kernel serves
    decode sequences with that one; its cell's note says so). `attention_sink`: ours alone,
    with sinks (`minilib.tpu.sinks`).

    Six compiles with the defaults (seconds each, with libtpu): not run here.

    >>> cells = compare_kernels("v5e")  # doctest: +SKIP
    >>> [(c.kernel, c.config, c.bundles_per_kv_block) for c in cells][:3]  # doctest: +SKIP
    [('v3', '32 q per block', 1586), ('JAX', '32 q per block', 2573), ('ours', ...)]
    """
    from minilib.tpu.v3 import V3Unavailable

    specs = rpa_specs(**case, kv_dtype=kv_dtype)
    hd64, fallback = v3_hd64_here(case)
    programs: dict[tuple[str, int], CompileReport | str] = {}
    for queries in queries_per_block:
        blocks = dict(num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=queries)
        if attention_sink:  # the other two have no sinks
            programs["v3", queries] = programs["JAX", queries] = "left out: no attention sinks"
            programs["ours", queries] = compile_with_sinks(specs, chip=chip, **blocks, **options)
            continue
        try:
            programs["v3", queries] = compile_v3(chip, case=case, kv_dtype=kv_dtype, hd64=hd64,
                                                 **blocks, **options)  # fmt: skip
        except V3Unavailable as err:
            programs["v3", queries] = f"not available: {err}"
        programs["JAX", queries] = compile_rpa("jax", specs, chip=chip, **blocks, **options)
        programs["ours", queries] = compile_rpa("ours", specs, chip=chip, **blocks, **options)
    cells = []
    for queries in queries_per_block:
        for kernel in KERNELS:
            cells.append(cell_of(programs[kernel, queries], kernel, chip, f"{queries} q per block"))
    smallest = min(queries_per_block)
    for kernel in KERNELS:
        cells.append(cell_of(programs[kernel, smallest], kernel, chip, "decode", smallest))
    if fallback:
        cells = [with_note(c, fallback) if c.kernel == "v3" and c.stats else c for c in cells]
    return cells


def v3_hd64_here(case: dict) -> tuple[bool, str]:
    """Whether v3's column uses v3's kernel for head_dim 64, as vLLM does when head_dim is 64:
    (True, "") when it loads here; (False, why) when head_dim is 64 and it does not, and its
    head_dim-128 kernel serves instead; (False, "") for any other head_dim.

    >>> v3_hd64_here(COMPARISON_CASE)
    (False, '')
    """
    from minilib.tpu.v3 import V3Unavailable, load_v3_hd64

    if case["head_dim"] != 64:
        return False, ""
    try:
        load_v3_hd64()
    except V3Unavailable as err:
        return False, f"v3's head_dim-128 kernel, as its head_dim-64 kernel is not here: {err}"
    return True, ""


def with_note(cell: Cell, note: str) -> Cell:
    return dataclasses.replace(cell, note="; ".join(filter(None, (cell.note, note))))


def cell_of(program: CompileReport | str, kernel: str, chip: str, config: str,
            decode_queries: int | None = None) -> Cell:  # fmt: skip
    """The `Cell` of one kernel in one compiled program (`decode_queries`: the decode cell,
    read from the program of that q block size)."""
    cell = functools.partial(Cell, kernel, chip, config)
    if isinstance(program, str):
        return cell(missing=program)
    if not program.compiled:
        return cell(missing=f"did not compile: {first_line(program.error or '')}")
    stats, note = kernel_for(program, decode=decode_queries is not None), ""
    mixed = kernel_for(program, decode=False)
    branches = mixed.branches if kernel == "v3" and mixed else ()
    if len(branches) == len(V3_HD64_BRANCHES):  # v3's head_dim-64 kernel
        which = "decode" if decode_queries is not None else "mixed"
        stats = branches[V3_HD64_BRANCHES.index(which)]
        note = (
            "v3's head_dim-64 kernel has a KV-block loop for each kind of sequence "
            f"({', '.join(V3_HD64_BRANCHES)}): its {which} one, counted by the rule"
        )
    if stats is None and decode_queries is not None:
        stats = kernel_for(program, decode=False)
        note = (
            f"no decode kernel: its {decode_queries} q per block kernel serves a decode "
            f"sequence, one live row of {decode_queries}"
        )
    if stats is None:
        return cell(missing="no Pallas kernel read: " + "; ".join(program.notes))
    if stats.bundles_per_kv_block and stats.longest_path is None:  # said, never guessed
        why = [n for n in program.notes if n.startswith(f"{stats.name}: paths")]
        note = "; ".join(filter(None, [note, *why]))
    return cell(stats=stats, note=note)


# The branches of v3's kernel for head_dim 64, in its program order: its sequence loop runs
# `process` under `pl.when(seq_idx < decode_end)`, then for prefill, then for mixed sequences.
V3_HD64_BRANCHES = ("decode", "prefill", "mixed")


def first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else ""


def comparison_table(
    cells: list[Cell],
    *,
    libtpu_version: str,
    case: dict = COMPARISON_CASE,
    num_kv_pages_per_block: int = COMPARISON_KV_PAGES_PER_BLOCK,
    options: dict | None = None,
) -> str:
    """The three-way table of `compare_kernels`' cells, with the rules and the workload (and
    the kernel options the cells were compiled with, `options`): per chip and config, the
    three counts of `COUNTS`.

    >>> def cell(kernel, config, bundles, paths, spills=0, note=""):
    ...     stats = KernelStats("k.1", 5000, bundles, 9 << 20, spills << 10, (),
    ...                         longest_path=paths[0], interior_path=paths[1])
    ...     return Cell(kernel, "v5e", config, stats, note=note)
    >>> cells = [cell("v3", "8 q per block", 953, (953, 900), 160),
    ...          cell("JAX", "8 q per block", 1209, (1209, 1209), 464),
    ...          cell("ours", "8 q per block", 1128, (1128, 1128), 256),
    ...          cell("v3", "decode", 696, (696, 640), 136),
    ...          cell("JAX", "decode", 1209, (1209, 1209), 464, note="no decode kernel: ..."),
    ...          Cell("ours", "v5e", "decode", missing="did not compile: ...")]
    >>> print(comparison_table(cells, libtpu_version="0.0.42.1"))  # doctest: +ELLIPSIS
    Bundles per KV block: static estimates from the compiled programs (libtpu 0.0.42.1), not timings: ...
    Rule: bundles per KV block = one pass of the innermost loop that holds every matmul of the ...
    Paths: longest path = the most bundles one pass of the KV-block loop can issue, ...
    Workload: bf16 ..., 8 pages (128 tokens) per KV block, ...
    <BLANKLINE>
    chip   config           count               v3     JAX    ours  ours/v3  ours/JAX  spills KiB v3 / JAX / ours
    v5e    8 q per block    listing            953   1,209   1,128    1.18x     0.93x  160 / 464 / 256
                            longest path       953   1,209   1,128    1.18x     0.93x
                            interior path      900   1,209   1,128    1.25x     0.93x
    v5e    decode           listing            696  1,209*       -                     136 / 464 / -
                            longest path       696   1,209       -
                            interior path      640   1,209       -
    <BLANKLINE>
    * no decode kernel: ...
    ours (v5e, decode): did not compile: ...
    >>> fp8 = COMPARISON_CASE | {"kv_dtype": jnp.float8_e4m3fn}
    >>> table = comparison_table(cells, libtpu_version="0.0.42.1", case=fp8,
    ...                          options={"k_scale": 0.5, "v_scale": 0.5})
    >>> print(table.splitlines()[3])  # doctest: +ELLIPSIS
    Workload: bf16 (cache fp8), ...; all three kernels with k_scale=0.5, v_scale=0.5.
    """  # noqa: E501
    by_place = {(c.chip, c.config, c.kernel): c for c in cells}
    places = list(dict.fromkeys((c.chip, c.config) for c in cells))
    lines = [
        "Bundles per KV block: static estimates from the compiled programs (libtpu "
        f"{libtpu_version}), not timings: bundles issued in one KV block's loop, without the "
        "stalls on DMA waits and MXU results.",
        f"Rule: {COUNTING_RULE} (listing).",
        f"Paths: {PATH_RULES}.",
        f"Workload: {describe_case(case, num_kv_pages_per_block)}"
        + (f"; all three kernels with {_keywords(options)}" if options else "")
        + ".",
        "",
        f"{'chip':7}{'config':17}{'count':14}{'v3':>8}{'JAX':>8}{'ours':>8}{'ours/v3':>9}"
        f"{'ours/JAX':>10}  spills KiB v3 / JAX / ours",
    ]
    notes: dict[str, None] = {}
    missing: dict[tuple[str, str], list[str]] = {}  # (kernel, why) -> where
    for chip, config in places:
        row = {kernel: by_place.get((chip, config, kernel)) for kernel in KERNELS}
        for cell in row.values():
            if cell is not None and cell.note:
                notes[f"* {cell.note}"] = None
            if cell is not None and cell.missing:
                missing.setdefault((cell.kernel, cell.missing), []).append(f"{chip}, {config}")
        for n, (count, label) in enumerate(COUNTS.items()):
            value = {k: None if row[k] is None else getattr(row[k], count) for k in KERNELS}
            mark = {
                k: "*" if n == 0 and row[k] is not None and row[k].note else "" for k in KERNELS
            }
            figures = ["-" if value[k] is None else f"{value[k]:,}{mark[k]}" for k in KERNELS]
            ours = value["ours"]
            ratios = [f"{ours / value[k]:.2f}x" if ours and value[k] else "" for k in ("v3", "JAX")]
            place = f"{chip:7}{config:17}" if n == 0 else " " * 24
            line = (
                f"{place}{label:14}{figures[0]:>8}{figures[1]:>8}{figures[2]:>8}"
                f"{ratios[0]:>9}{ratios[1]:>10}"
            )
            if n == 0:
                spill_bytes = [None if row[k] is None else row[k].spill_bytes for k in KERNELS]
                line += "  " + " / ".join(
                    "-" if b is None else f"{b // 1024:,}" for b in spill_bytes
                )
            lines.append(line.rstrip())
    if notes or missing:
        lines.append("")
    lines += list(notes)
    lines += [f"{kernel} ({'; '.join(where)}): {why}" for (kernel, why), where in missing.items()]
    return "\n".join(lines)


def describe_case(case: dict, num_kv_pages_per_block: int) -> str:
    """The workload in one line.

    >>> describe_case(COMPARISON_CASE, 8)  # doctest: +ELLIPSIS
    'bf16 (cache bf16), 32 q / 8 KV heads, head_dim 128, page_size 16, 8 pages (128 tokens) ...'
    """
    dtype = jnp.dtype(case.get("dtype", jnp.bfloat16))
    kv_dtype = jnp.dtype(case.get("kv_dtype") or dtype)
    tokens = num_kv_pages_per_block * case["page_size"]
    pages = case.get("num_pages") or case["max_num_seqs"] * case["pages_per_seq"]
    v3_blocks = (
        f"m_block_sizes=(nq, {tokens}, nq, {tokens}), d_block_sizes=(1, {tokens}, 1, {tokens})"
    )
    if case["head_dim"] == 64:  # v3_hd64_here
        v3_blocks = (
            f"its head_dim-64 kernel where it loads (num_queries_per_block=nq, "
            f"num_kv_pages_per_block={num_kv_pages_per_block}), else {v3_blocks}"
        )
    return (
        f"{short_dtype(dtype)} (cache {short_dtype(kv_dtype)}), {case['num_q_heads']} q / "
        f"{case['num_kv_heads']} KV heads, head_dim {case['head_dim']}, page_size "
        f"{case['page_size']}, {num_kv_pages_per_block} pages ({tokens} tokens) per KV block, "
        f"{case['max_num_batched_tokens']} tokens, {case['max_num_seqs']} sequences of up to "
        f"{case['pages_per_seq']} pages, a cache of {pages} pages; v3: {v3_blocks}, "
        f"vmem_limit_bytes={V3_VMEM_LIMIT_BYTES >> 20} MiB"
    )


def _keywords(options: dict) -> str:
    """{"k_scale": 0.5} as 'k_scale=0.5'."""
    return ", ".join(f"{name}={value}" for name, value in options.items())


def short_dtype(dtype) -> str:
    return {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "fp8"}.get(
        dtype.name, dtype.name
    )


def side_by_side(ours: CompileReport, theirs: CompileReport) -> str:
    """A table of ours against JAX's kernel, then each one's top source lines (each program's
    kernel that serves prefills and mixed batches, see `kernel_for`).

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

    def value(report: CompileReport, field: str):
        kernel = kernel_for(report, decode=False) if report.compiled else None
        return None if kernel is None else getattr(kernel, field)

    def cell(report: CompileReport, field: str):
        if not report.compiled:
            return "did not compile"
        figure = value(report, field)
        return "-" if figure is None else (kib(figure) if "bytes" in field else f"{figure:,}")

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
        a, b = value(ours, field), value(theirs, field)
        ratio = f"{a / b:.2f}x" if a and b else ""
        lines.append(f"{label:24}{cell(ours, field):>18}{cell(theirs, field):>18}{ratio:>12}")
    for name, report in (("ours", ours), ("JAX's", theirs)):
        if not report.compiled:
            lines += [f"\n{name} did not compile:", report.error or ""]
            continue
        lines.append(f"\n{name}: ops per source line in the KV-block loop")
        lines += source_lines(kernel_for(report, decode=False))
        lines += [f"  note: {note}" for note in report.notes]
    return "\n".join(lines)


def source_lines(kernel: KernelStats | None, count: int = 5) -> list[str]:
    """The source lines that produced the most ops in a kernel's KV-block loop: ops, file and
    the line's code. The line's number is left out: it moves with every edit of the file, and
    the code says which line it is.

    >>> stats = KernelStats("rpa.1", 5000, 900, 0, 0, (("kernel/plain.py:342", 512),),
    ...                     {"kernel/plain.py:342": "l_next = alpha * l_prev"})
    >>> source_lines(stats)
    ['     512  kernel/plain.py  l_next = alpha * l_prev']
    """
    if kernel is None:
        return []
    lines = []
    for location, ops in kernel.top_source_lines[:count]:
        file = location.rsplit(":", 1)[0]
        code = kernel.source_code.get(location, "")[:70]
        lines.append(f"  {ops:6d}  {file}  {code}")
    return lines
