"""The results of the notebooks' TPU compiles, recorded on one stack for where nothing compiles.

Notebooks 07, 08 and 09 compile kernels for TPU chips with libtpu, which runs on any Linux
CPU (notebook 07). Where libtpu is not installed (a laptop's `.venv`, Colab's CPU runtime)
each such cell shows, beside its reason, the result recorded here, labelled by
`recorded_result`: "Recorded on <date> with jax X, libtpu Y by `python -m minilib.tpu.recorded`",
why it was not computed here and how to make it live.

Each result is one function of `RESULTS`, the same compile as its notebook cell's.
`python -m minilib.tpu.recorded` runs them all and writes `RECORDED` (it also rewrites
`minilib.tpu.memory`'s recorded chip table; `--chips` rewrites only that, with no libtpu);
`tests/tpu/test_tpu_recorded.py` holds each recorded result equal to a fresh compile. Static
estimates from the compiled programs, never timings. Notebook 09's three-way table has its own
record (`minilib.tpu.comparison`), as has its raw listing (`minilib.tpu.listing`).
"""

from __future__ import annotations

import datetime
import functools
import json
import sys
from pathlib import Path

import jax
from jax.experimental import topologies

from minilib.chips import FACTS
from minilib.tpu.compile import chips_here, compile_for_tpu, dump_here, tpu_compile_available
from minilib.tpu.kernel_costs import (
    COMPARISON_CASE,
    TARGET_CASE,
    compile_rpa,
    compile_v3,
    first_line,
    kernel_for,
    rpa_specs,
    side_by_side,
)
from minilib.tpu.labels import recorded_label

__all__ = ["RECORDED", "RESULTS", "record_results", "recorded_result", "recorded_results"]

RECORDED = Path(__file__).with_name("recorded_results.json")
COMMAND = "python -m minilib.tpu.recorded"


def aligned_blocks_verdict() -> str:
    """Notebook 07: the verdict of the compile for v5e of `minilib.ladder.aligned_blocks`'
    kernel, on the notebook's batch (3 sequences, 4 q / 2 KV heads, head_dim 32)."""
    from minilib.batch import make_batch
    from minilib.ladder import aligned_blocks
    from minilib.pallas_basics import q_by_sequence
    from minilib.vectorized import gather_all_kv

    dump_here()  # libtpu starts with the dump flags, before the batch starts JAX's backends
    batch = make_batch(
        [(6, 6), (1, 19), (3, 11)], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8
    )
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    q_seq = q_by_sequence(batch.q, batch.cu_q_lens[:-1], q_lens, 16)
    k_all, v_all = gather_all_kv(batch.kv_pages, batch.page_indices, batch.kv_lens)
    aligned = functools.partial(
        aligned_blocks.attention_pallas_call_aligned, sm_scale=0.2, num_queries_per_block=8
    )
    report = compile_for_tpu(aligned, q_seq, k_all, v_all, q_lens, batch.kv_lens, chip="v5e")
    return "Mosaic compiles it for v5e." if report.compiled else report.error


def cores_per_device() -> list[list]:
    """Notebook 08: [chip, topology, JAX devices, TensorCores per device] of each chip's
    compile-only topology of one chip."""
    rows = []
    for chip in chips_here():
        devices = topologies.get_topology_desc(
            topology_name=FACTS[chip].topology, platform="tpu", chips_per_host_bounds=(1, 1, 1)
        ).devices
        rows.append([chip, FACTS[chip].topology, len(devices), devices[0].num_cores])
    return rows


def kernel_on_v5e() -> list[list]:
    """Notebook 08: [kernel, bundles per KV block, KiB of VMEM spills] of each kernel of our
    program compiled for v5e on `TARGET_CASE`, 8 pages per KV block, 8 q rows per q block."""
    report = compile_rpa(
        "ours", rpa_specs(**TARGET_CASE), chip="v5e",
        num_kv_pages_per_block=8, num_queries_per_block=8,
    )  # fmt: skip
    return [[s.name, s.bundles_per_kv_block, s.spill_bytes // 1024] for s in report.kernels]


V5E_SPECS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


def ours_against_jax() -> str:
    """Notebook 09: `side_by_side` of ours and JAX's kernel compiled for v5e (GQA 32/8,
    head_dim 128, bf16, page_size 16; 8 pages per KV block, 32 q rows per block)."""
    specs = rpa_specs(**V5E_SPECS)
    blocks = dict(num_kv_pages_per_block=8, num_queries_per_block=32)
    ours = compile_rpa("ours", specs, chip="v5e", **blocks)
    theirs = compile_rpa("jax", specs, chip="v5e", **blocks)
    return side_by_side(ours, theirs)


def kv_block_sizes() -> list[list]:
    """Notebook 09: [pages per KV block, bundles per KV block, operations in the loop] of our
    mixed kernel compiled for v5e with 4, 8 and 16 pages per KV block, 32 q rows per block."""
    specs = rpa_specs(**V5E_SPECS)
    rows = []
    for pages in (4, 8, 16):
        report = compile_rpa("ours", specs, chip="v5e", num_kv_pages_per_block=pages,
                             num_queries_per_block=32)  # fmt: skip
        loop = kernel_for(report, decode=False)
        rows.append([pages, loop.bundles_per_kv_block, sum(n for _, n in loop.loop_op_kinds)])
    return rows


def vmem_by_kv_block() -> list[list]:
    """Notebook 09: [chip, pages per KV block, peak VMEM bytes] of our mixed kernel compiled for
    v5e and v6e with 4, 8, 16 and 32 pages per KV block, 32 q rows per block."""
    specs = rpa_specs(**V5E_SPECS)
    rows = []
    for chip in ("v5e", "v6e"):
        for pages in (4, 8, 16, 32):
            report = compile_rpa("ours", specs, chip=chip, num_kv_pages_per_block=pages,
                                 num_queries_per_block=32)  # fmt: skip
            rows.append([chip, pages, kernel_for(report, decode=False).vmem_bytes])
    return rows


RUNG_7_BLOCKS = dict(num_kv_pages_per_block=8, num_queries_per_block=8)


def rung_7_beside_ours_and_v3(rung_7=None) -> list[list]:
    """Notebook 08: [chip, rung 7, ours, v3], the bundles per KV block (`COUNTING_RULE`) of
    rung 7 (`rung_7`; by default the tested one, `minilib.ladder.ragged`), of our kernel and of
    v3's mixed kernel, each compiled for v5e and v6e on the comparison's workload
    (`COMPARISON_CASE`: bf16, 32 q / 8 KV heads, head_dim 128, page_size 16, an 8192-page
    cache), KV blocks of 8 pages, q blocks of 8 rows. A kernel without a figure has, in its
    place, why: it did not compile, or v3 cannot be loaded here (`minilib.tpu.v3`)."""
    from minilib.ladder import ragged
    from minilib.tpu.v3 import V3Unavailable

    rung_7 = rung_7 or ragged.ragged_paged_attention_ladder
    specs = rpa_specs(**COMPARISON_CASE)
    sm_scale = COMPARISON_CASE["head_dim"] ** -0.5
    rows = []
    for chip in ("v5e", "v6e"):
        yours = functools.partial(rung_7, sm_scale=sm_scale, **RUNG_7_BLOCKS)
        reports = [compile_for_tpu(yours, *specs, chip=chip),
                   compile_rpa("ours", specs, chip=chip, **RUNG_7_BLOCKS)]  # fmt: skip
        try:
            reports.append(compile_v3(chip, **RUNG_7_BLOCKS))
        except V3Unavailable as err:
            reports.append(f"v3 is not available here: {err}")
        rows.append([chip, *map(mixed_kernel_bundles, reports)])
    return rows


def mixed_kernel_bundles(report) -> int | str:
    """Bundles per KV block of the program's kernel that serves prefills and mixed batches
    (`kernel_for`), or why there is no figure: `report` is the reason, or did not compile."""
    if isinstance(report, str):
        return report
    if not report.compiled:
        return f"did not compile: {first_line(report.error or '')}"
    stats = kernel_for(report, decode=False)
    if stats is None or not stats.bundles_per_kv_block:
        return "no KV-block loop read: " + "; ".join(report.notes)
    return stats.bundles_per_kv_block


RESULTS = {
    fn.__name__: fn
    for fn in (aligned_blocks_verdict, cores_per_device, kernel_on_v5e, ours_against_jax,
               kv_block_sizes, vmem_by_kv_block, rung_7_beside_ours_and_v3)
}  # fmt: skip


def record_results(path: Path = RECORDED) -> dict:
    """Compute every result of `RESULTS` (needs libtpu, which compiles for every chip) and
    write them, with the date and the versions, to `path`.

    A dozen compiles, so the example is not run:

    >>> record_results()["libtpu"]  # doctest: +SKIP
    '0.0.50.1'
    """
    from minilib.tpu.compile import libtpu_version, require_libtpu

    require_libtpu()
    dump_here()  # libtpu starts with the dump flags, before a batch starts JAX's backends
    record = {
        "what": "results of notebooks 07, 08 and 09's TPU compiles (static estimates from the "
        f"compiled programs, not timings); written by `{COMMAND}`",
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "libtpu": libtpu_version(),
        "results": {name: fn() for name, fn in RESULTS.items()},
    }
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return record


def recorded_results(path: Path = RECORDED) -> dict:
    """The record `record_results` wrote: date, versions and each result by name.

    >>> record = recorded_results()
    >>> sorted(record["results"]) == sorted(RESULTS), record["libtpu"]
    (True, '0.0.50.1')
    """
    return json.loads(path.read_text())


def recorded_result(name: str, *, say_why: bool = True) -> tuple:
    """(result, label) of the result `name` of `RESULTS` as recorded: the label says when and
    with what it was recorded, and, where libtpu is missing, why it is not computed here and
    how to install it (unless `say_why` is False: the cell has said it already).

    >>> verdict, label = recorded_result("aligned_blocks_verdict", say_why=False)
    >>> print(verdict, label)
    Mosaic compiles it for v5e. Recorded on ... with jax ..., libtpu ... by `python -m ...`.
    """
    record = recorded_results()
    ok, reason = tpu_compile_available()
    why = "" if ok or not say_why else reason
    label = recorded_label(record, COMMAND, not_here=why)
    return record["results"][name], label


def main(argv: list[str]) -> int:
    """`python -m minilib.tpu.recorded [--chips]`: rewrite the recorded results (and chip
    table), or with `--chips` the chip table alone."""
    from minilib.tpu.memory import RECORDED as CHIP_TABLE
    from minilib.tpu.memory import record_chip_table

    chips_here()  # libtpu, where installed, starts with the dump flags the compiles read
    record_chip_table()
    print(f"Recorded JAX's table of chips (jax {jax.__version__}) in {CHIP_TABLE}")
    if "--chips" in argv:
        return 0
    ok, reason = tpu_compile_available()
    if not ok:
        print(f"Cannot compile for a TPU here: {reason}")
        return 1
    record = record_results()
    print(f"Recorded {len(record['results'])} results (libtpu {record['libtpu']}) in {RECORDED}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
