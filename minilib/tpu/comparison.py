"""The three-way comparison of `minilib.tpu.kernel_costs`, kept: what we claim from it
(`CLAIMS`, judged by `static_targets`), its figures recorded on one stack for where nothing
compiles (`recorded_comparison`, notebook 09), and `python -m minilib compile`, the command
that prints it. Static estimates from the compiled programs, not timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import jax

from minilib.chips import CHIPS
from minilib.tpu.bundles import COUNTING_RULE
from minilib.tpu.compile import chips_here
from minilib.tpu.dump_reader import KernelStats
from minilib.tpu.kernel_costs import (
    COMPARISON_CASE,
    COMPARISON_CHIPS,
    COMPARISON_KV_PAGES_PER_BLOCK,
    COMPARISON_QUERIES_PER_BLOCK,
    COUNTS,
    DTYPES,
    Cell,
    compare_kernels,
    comparison_table,
    describe_case,
    source_lines,
)
from minilib.tpu.labels import recorded_label
from minilib.tpu.loop_paths import PATH_RULES

# `add_arguments` and `run` are `python -m minilib compile`'s command line, not the library's.
__all__ = [
    "CLAIMS",
    "cell_from_record",
    "cell_record",
    "comparison_here_or_recorded",
    "record_comparison",
    "recorded_comparison",
    "static_targets",
]

# The cells where we claim ours is at most another kernel: (chip, config) -> ((kernel, figure),
# ...), a figure being "bundles_per_kv_block" or "spill_bytes". A claim on bundles per KV
# block holds on each of its three counts (`COUNTS`: the listing, the longest path and the
# interior path). `static_targets` judges them and `tests/tpu/test_tpu_comparison.py` asserts them;
# every other comparison is reported, not judged. Claim a cell only where the compiled
# figures hold it, with libtpu 0.0.50.1 (the recorded ones) as with 0.0.42.1 before it.
# Against v3, ours claims fewer bundles per KV block in every cell; on TPU7x (32 q, 8 q, decode)
# 1069, 649, 474 to 1440, 856, 704 (before the page copies went without bounds checks, as v3's
# do: 1191, 770, 598; with 0.0.42.1, before one wait per KV block: 1221, 800, 619 to 1399, 849,
# 698). Before the padded slot (`minilib.kernel.padded_slot`) v3 issued fewer at 8 q on
# TPU7x (856 to 884) and about as many at decode (704 to 703). v3 spills less at 32 q (except on
# v6e). Along the paths (libtpu 0.0.50.1), ours and JAX's count as many bundles as their listings;
# v3's interior path skips its KV-cache update, 48 (TPU7x) or 58 (v5e, v6e) bundles: on v6e at
# decode it was 667 to ours' 676 until v6e took the padded slot too (606).
AGAINST_JAX = (("JAX", "bundles_per_kv_block"), ("JAX", "spill_bytes"))
AGAINST_V3 = (("v3", "bundles_per_kv_block"),)
CLAIMS: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    (chip, config): AGAINST_JAX + AGAINST_V3
    for chip in COMPARISON_CHIPS
    for config in ("32 q per block", "8 q per block", "decode")
}


# The comparison's figures as compiled on one stack, for where nothing can be compiled (no
# libtpu, as on a laptop's .venv or Colab): written by `python -m minilib compile --record`,
# and checked against a fresh compile by tests/tpu/test_tpu_comparison.py on that stack.
RECORDED = Path(__file__).with_name("recorded_comparison.json")


def record_comparison(path: Path = RECORDED) -> dict:
    """Compile the comparison (`compare_kernels`, default workload) for every chip of
    `COMPARISON_CHIPS` and write its figures, with the date and the versions, to `path`.
    Needs libtpu, v3 and every chip: raises `RuntimeError` saying which is missing.

    Eighteen compiles, so the example is not run:

    >>> record_comparison()["libtpu"]  # doctest: +SKIP
    '0.0.50.1'
    """
    from minilib.tpu.compile import chip_unknown_here, libtpu_version, require_libtpu
    from minilib.tpu.v3 import V3_VERSION, load_v3

    require_libtpu()
    load_v3()  # raises V3Unavailable, with the fix
    for chip in COMPARISON_CHIPS:
        if chip not in chips_here():
            raise RuntimeError(chip_unknown_here(chip))
    cells = [cell for chip in COMPARISON_CHIPS for cell in compare_kernels(chip)]
    record = {
        "what": "bundles per KV block: static estimates from the compiled programs, not "
        "timings; written by `python -m minilib compile --record`",
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "libtpu": libtpu_version(),
        "v3": f"tpu-inference {V3_VERSION}",
        "rule": COUNTING_RULE,
        "paths": PATH_RULES,
        "workload": describe_case(COMPARISON_CASE, COMPARISON_KV_PAGES_PER_BLOCK),
        "cells": [cell_record(cell) for cell in cells],
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def cell_record(cell: Cell) -> dict:
    """The figures of one cell of the comparison, as `record_comparison` writes them: every
    field that notebook 09 and the README show.

    >>> cells, record = recorded_comparison()
    >>> cell_record(cells[0]) == record["cells"][0]
    True
    """
    stats = cell.stats
    return {
        "chip": cell.chip,
        "config": cell.config,
        "kernel": cell.kernel,
        "name": stats.name if stats else None,
        "bundles_per_kv_block": cell.bundles_per_kv_block,
        "longest_path": cell.longest_path,
        "interior_path": cell.interior_path,
        "total_bundles": stats.total_bundles if stats else None,
        "vmem_bytes": stats.vmem_bytes if stats else None,
        "spill_bytes": cell.spill_bytes,
        "loop_op_kinds": dict(stats.loop_op_kinds) if stats else {},
        "note": cell.note,
        "missing": cell.missing,
    }


def recorded_comparison(path: Path = RECORDED) -> tuple[list[Cell], dict]:
    """The recorded comparison's cells (`record_comparison`), and its record (date, versions).

    >>> cells, record = recorded_comparison()
    >>> sorted({cell.kernel for cell in cells}), record["libtpu"]
    (['JAX', 'ours', 'v3'], '0.0.50.1')
    """
    record = json.loads(path.read_text())
    return [cell_from_record(c) for c in record["cells"]], record


def cell_from_record(c: dict) -> Cell:
    """The `Cell` of one recorded cell (`cell_record`), read back.

    >>> cells, record = recorded_comparison()
    >>> cell_from_record(record["cells"][0]) == cells[0]
    True
    """
    stats = None
    if c["name"] is not None:
        stats = KernelStats(
            c["name"],
            c["total_bundles"],
            c["bundles_per_kv_block"],
            c["vmem_bytes"],
            c["spill_bytes"],
            (),
            loop_op_kinds=tuple(c["loop_op_kinds"].items()),
            longest_path=c["longest_path"],
            interior_path=c["interior_path"],
        )
    return Cell(c["kernel"], c["chip"], c["config"], stats, c["missing"], c["note"])


def comparison_here_or_recorded(chips=("v5e", "v6e")) -> tuple[list[Cell], str, str]:
    """(cells, libtpu version, where they come from) of the comparison for `chips`: compiled
    here when libtpu, v3 and the chips are here; else the recorded figures, saying why not
    and when, and with what, they were made.

    >>> cells, libtpu, source = comparison_here_or_recorded() if not chips_here() else ([], "", "")
    >>> not cells or source.startswith("Recorded on")
    True
    """
    from minilib.tpu.compile import chip_unknown_here, libtpu_version, tpu_compile_available
    from minilib.tpu.v3 import v3_available

    ok, reason = tpu_compile_available()
    if ok:
        v3_ok, reason = v3_available()
        unknown = [chip for chip in chips if chip not in chips_here()]
        ok = v3_ok and not unknown
        reason = reason if not v3_ok else (chip_unknown_here(unknown[0]) if unknown else "")
    if ok:
        cells = [cell for chip in chips for cell in compare_kernels(chip)]
        here = f"Compiled here, now (libtpu {libtpu_version()}, jax {jax.__version__})."
        return cells, libtpu_version(), here
    cells, record = recorded_comparison()
    return (
        [cell for cell in cells if cell.chip in chips],
        record["libtpu"],
        recorded_label(record, "python -m minilib compile --record", not_here=reason),
    )


FIGURES = {**{count: f"bundles per KV block ({label})" for count, label in COUNTS.items()},
           "spill_bytes": "spill bytes"}  # fmt: skip


def claimed_as(figure: str) -> str:
    """The figure of `CLAIMS` that claims `figure`: a claim on bundles per KV block holds on
    each of its three counts (`COUNTS`: the listing, the longest and the interior path).

    >>> claimed_as("interior_path"), claimed_as("spill_bytes")
    ('bundles_per_kv_block', 'spill_bytes')
    """
    return "bundles_per_kv_block" if figure in COUNTS else figure


def static_targets(
    chips=COMPARISON_CHIPS, compare=compare_kernels
) -> list[tuple[str, bool | None, str]]:
    """[(target, passed, detail)]: each claim of `CLAIMS` judged (True or False), a claim on
    bundles per KV block on each of its three counts (`claimed_as`), and ours against v3 and
    JAX's in bundles per KV block where nothing is claimed, reported (None). Static estimates
    from the compiled programs, not timings. Without libtpu, or for a chip this libtpu does
    not know, an entry with passed None says why. `compare(chip)` gives a chip's cells:
    `compare_kernels`, unless the caller has compiled them already.

    With libtpu it compiles six kernels per chip, so the example is not run:

    >>> for target, passed, detail in static_targets():  # doctest: +SKIP
    ...     print(passed, target, detail)
    True static: bundles per KV block (listing), ours <= JAX's (v5e, 32 q per block): ours ...
    True static: bundles per KV block (longest path), ours <= JAX's (v5e, 32 q per block): ...
    ...
    """
    from minilib.tpu.compile import chip_unknown_here, tpu_compile_available

    ok, reason = tpu_compile_available()
    if not ok:
        return [("static: ours against JAX's kernel and v3", None, f"not measured: {reason}")]
    results = []
    for chip in chips:
        if chip not in chips_here():
            results.append((f"static: ours against JAX's and v3 ({chip})", None,
                            f"not measured: {chip_unknown_here(chip)}"))  # fmt: skip
            continue
        cells = {(c.config, c.kernel): c for c in compare(chip)}
        for config in dict.fromkeys(config for config, _ in cells):
            claimed = CLAIMS.get((chip, config), ())
            for other in ("JAX", "v3"):
                for figure, label in FIGURES.items():
                    judged = (other, claimed_as(figure)) in claimed
                    if not judged and figure not in COUNTS:
                        continue
                    verb = f"ours <= {other}'s" if judged else f"ours against {other}'s"
                    name = f"static: {label}, {verb} ({chip}, {config})"
                    ours, theirs = cells[config, "ours"], cells[config, other]
                    a, b = getattr(ours, figure), getattr(theirs, figure)
                    if a is None or b is None:
                        why = "; ".join(c.missing or c.note for c in (ours, theirs)
                                        if getattr(c, figure) is None)  # fmt: skip
                        results.append((name, False if judged else None,
                                        f"not measured: {why or 'no figure read'}"))  # fmt: skip
                        continue
                    ratio = f" ({a / b:.2f}x)" if b else ""
                    detail = f"ours {a:,} vs {other} {b:,}{ratio}" + (
                        "" if judged else ", not claimed"
                    )
                    results.append((name, a <= b if judged else None, detail))
    return results


COMMAND_DESCRIPTION = (
    "Compile our RPA kernel, JAX's and vLLM's RPA v3 for TPU chips (needs libtpu, not a TPU) "
    "and compare bundles per KV block and spills, per chip and config (32 q per block, 8 q "
    "per block, decode). Static estimates from the compiled programs, not timings."
)

# The flags passed on by name: --num-q-heads N becomes rpa_specs(num_q_heads=N), and so on.
SHAPE_FLAGS = {name: value for name, value in COMPARISON_CASE.items()}  # name: default, ints
OPTION_FLAGS = {  # name: (type, default), the kernel options all three kernels take
    "sliding_window": (int, None),
    "soft_cap": (float, None),
    "k_scale": (float, None),  # an fp8 cache's scales (--kv-dtype fp8): x is stored as x / scale
    "v_scale": (float, None),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m minilib compile`: the chips, the shapes and the kernel options.

    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> args = parser.parse_args(["--chip", "v6e", "--num-queries-per-block", "16"])
    >>> args.chip, args.num_queries_per_block, args.num_pages
    (['v6e'], [16], 8192)
    """
    parser.add_argument(
        "--chip", choices=CHIPS, nargs="+", default=None,
        help=f"default: {' '.join(COMPARISON_CHIPS)}, those this libtpu knows",
    )  # fmt: skip
    for name, default in SHAPE_FLAGS.items():
        parser.add_argument(_flag(name), type=int, default=default)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--kv-dtype", choices=DTYPES, default=None)
    parser.add_argument("--num-kv-pages-per-block", type=int, default=COMPARISON_KV_PAGES_PER_BLOCK)
    parser.add_argument(
        "--num-queries-per-block", type=int, nargs="+",
        default=list(COMPARISON_QUERIES_PER_BLOCK),
        help="q block sizes of the mixed kernels; decode is read from the smallest one's program",
    )  # fmt: skip
    for name, (type_, default) in OPTION_FLAGS.items():
        parser.add_argument(_flag(name), type=type_, default=default)
    parser.add_argument(
        "--sinks", "--attention-sink", dest="attention_sink", action="store_true",
        help="compile ours with attention sinks, f32[num_q_heads] (JAX's and v3 have none)",
    )  # fmt: skip
    parser.add_argument(
        "--source-lines", action="store_true",
        help="also list, per kernel, the source lines that fill its KV-block loop",
    )  # fmt: skip
    parser.add_argument(
        "--record", action="store_true",
        help=f"compile the default comparison for {', '.join(COMPARISON_CHIPS)} and write it to "
        f"minilib/tpu/{RECORDED.name}, for where nothing can be compiled (notebook 09)",
    )  # fmt: skip
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="each kernel at its own default block sizes (minilib.tpu.at_defaults)",
    )
    parser.add_argument(
        "--levers",
        action="store_true",
        help="our kernel with Levers.off(), then each lever added in turn, between rung 7 and "
        "v3 (minilib.tpu.lever_costs); with --record, written to "
        "minilib/tpu/recorded_levers.json for notebook 09",
    )
    parser.add_argument(
        "--workloads",
        action="store_true",
        help="the workload suite (minilib.tpu.suite): whole-program bundles per call, ours "
        "and v3, and each KV-block loop's static efficiency; with --record, written to "
        "minilib/tpu/recorded_suite.json for notebook 09",
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")  # num_q_heads -> --num-q-heads


def flag_problem(args) -> str | None:
    """What is wrong with the flags of `python -m minilib compile`, in the validator's words
    (with its hint), or None: checked before libtpu is looked for, so a bad flag is a usage
    error wherever it is given.

    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> print(flag_problem(parser.parse_args(["--num-q-heads", "12", "--num-kv-heads", "8"])))
    num_q_heads=12 must be divisible by num_kv_heads=8 ...
    >>> flag_problem(parser.parse_args([])) is None
    True
    """
    from minilib.errors import RPAInputError
    from minilib.tpu.kernel_costs import rpa_specs
    from minilib.validation import static_validate_inputs

    case = {name: getattr(args, name) for name in SHAPE_FLAGS}
    kv_dtype = DTYPES[args.kv_dtype] if args.kv_dtype else None
    options = {name: getattr(args, name) for name in OPTION_FLAGS}
    try:
        for name, value in case.items():
            if value < 1:
                raise RPAInputError(f"--{name.replace('_', '-')}={value} must be at least 1",
                                    "give a positive whole number")  # fmt: skip
        specs = rpa_specs(**case, dtype=DTYPES[args.dtype], kv_dtype=kv_dtype)
        for num_queries_per_block in args.num_queries_per_block:
            static_validate_inputs(*specs, **options,
                                   num_kv_pages_per_block=args.num_kv_pages_per_block,
                                   num_queries_per_block=num_queries_per_block)  # fmt: skip
    except RPAInputError as err:
        return " ".join(str(err).split())  # one line
    return None


def run(args) -> int:
    """Run `python -m minilib compile` with parsed flags. Returns the exit code: 0, or 1 when
    this host cannot compile for a TPU, or our kernel gave no figure on a chip; 2 for a bad
    flag (`flag_problem`)."""
    from minilib.tpu.compile import chip_unknown_here, libtpu_version, tpu_compile_available

    if args.defaults or args.workloads:  # each kernel at its own block sizes
        from minilib.tpu import at_defaults

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return at_defaults.run(args, flag_defaults=vars(parser.parse_args([])))
    problem = flag_problem(args)
    if problem is not None:
        print(f"python -m minilib compile: error: {problem} (see --help)", file=sys.stderr)
        return 2
    ok, reason = tpu_compile_available()
    if not ok:
        print(f"Cannot compile for a TPU here: {reason}")
        return 1
    if args.record:
        record = record_comparison()
        print(f"Recorded {len(record['cells'])} cells (libtpu {record['libtpu']}) in {RECORDED}")
        return 0
    chips = args.chip or [chip for chip in COMPARISON_CHIPS if chip in chips_here()]
    for chip in [chip for chip in chips if chip not in chips_here()]:
        print(f"Skipping {chip}: {chip_unknown_here(chip)}")
    case = {name: getattr(args, name) for name in SHAPE_FLAGS} | {"dtype": DTYPES[args.dtype]}
    options = {name: getattr(args, name) for name in OPTION_FLAGS if getattr(args, name)}
    cells = []
    for chip in [chip for chip in chips if chip in chips_here()]:
        cells += compare_kernels(
            chip,
            case=case,
            num_kv_pages_per_block=args.num_kv_pages_per_block,
            queries_per_block=tuple(args.num_queries_per_block),
            kv_dtype=DTYPES[args.kv_dtype] if args.kv_dtype else None,
            attention_sink=args.attention_sink,
            **options,
        )
    table = comparison_table(
        cells, libtpu_version=libtpu_version(),
        case=case | {"kv_dtype": DTYPES[args.kv_dtype] if args.kv_dtype else None},
        num_kv_pages_per_block=args.num_kv_pages_per_block, options=options,
    )  # fmt: skip
    print(table)
    if args.source_lines:
        for cell in cells:
            if cell.stats is not None:
                print(f"\n{cell.kernel} ({cell.chip}, {cell.config}): ops per source line in "
                      f"its KV-block loop ({cell.stats.name})")  # fmt: skip
                print("\n".join(source_lines(cell.stats)))
    ours = [cell for cell in cells if cell.kernel == "ours"]
    return 0 if ours and all(cell.bundles_per_kv_block for cell in ours) else 1
