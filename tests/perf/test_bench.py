"""minilib.perf.bench, minilib.perf.timing, minilib.perf.workloads and benchmarks/check_targets.py:
a smoke run of the harness on tiny sizes. No timing assertions: only that every row is there,
that the numbers are positive, and that the outputs agree."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import math
import sys
from pathlib import Path

import jax
import pytest

from minilib.__main__ import main
from minilib.perf import bench, implementations, memory_sweep, workloads
from minilib.perf.roofline import Chip, roofline
from minilib.perf.timing import Timing
from minilib.perf.workloads import BenchCase

TINY = BenchCase("mixed", 3, (4, 2, 64), page_size=8, pages_per_seq=4, max_num_batched_tokens=16)
TOY_CHIP = Chip("toy chip", hbm_bytes_per_s=1e10, peak_flops_per_s=1e11)
ON_TPU = jax.default_backend() == "tpu"


def quiet(*args, **kwargs):
    pass


def bench_main(argv: list[str]) -> int:
    """`python -m minilib bench ARGV`, in this process."""
    return main(["bench", *argv])


@functools.cache
def load_check_targets():
    """benchmarks/check_targets.py, a script outside the package."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "check_targets.py"
    spec = importlib.util.spec_from_file_location("check_targets", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# Workloads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", list(workloads.WORKLOADS))
@pytest.mark.parametrize("num_seqs", [1, 8, 128])
def test_workloads_fit_the_token_budget(workload, num_seqs):
    pairs = workloads.workload_seq_lens(
        workload, num_seqs, max_kv_len=1024, max_num_batched_tokens=1024, seed=3
    )
    assert len(pairs) == num_seqs
    assert sum(q for q, _ in pairs) <= 1024
    assert all(1 <= q <= kv <= 1024 for q, kv in pairs)


def test_fit_token_budget_keeps_decodes_and_kv_lens():
    pairs = [(1, 50), (40, 40), (30, 100), (1, 7)]
    fitted = workloads.fit_token_budget(pairs, 20)
    assert sum(q for q, _ in fitted) <= 20
    assert [kv for _, kv in fitted] == [50, 40, 100, 7]
    assert fitted[0] == (1, 50) and fitted[3] == (1, 7)
    assert workloads.fit_token_budget(pairs, 1000) == pairs  # fits already: unchanged


def test_fit_token_budget_refuses_too_many_sequences():
    with pytest.raises(ValueError, match="cannot fit"):
        workloads.fit_token_budget([(1, 5)] * 5, 4)


def test_case_batches_share_shapes_but_not_lengths():
    batch, new_batch = workloads.case_batches(TINY)
    for a, b in zip(batch.args(), new_batch.args(), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert batch.seq_lens != new_batch.seq_lens


def test_case_specs_match_its_batches():
    batch, _ = workloads.case_batches(TINY)
    specs = TINY.specs()
    # The batches carry 3 spare pages; every other shape and every dtype is the same.
    assert [s.shape for s in specs][2:] == [a.shape for a in batch.args()][2:]
    assert specs[0].shape == batch.q.shape
    assert specs[1].shape[1:] == batch.kv_pages.shape[1:]
    assert [s.dtype for s in specs] == [a.dtype for a in batch.args()]


def test_decode_heavy_is_mostly_decodes():
    pairs = workloads.workload_seq_lens(
        "decode-heavy", 128, max_kv_len=512, max_num_batched_tokens=1024
    )
    assert sum(q == 1 for q, _ in pairs) > 0.75 * 128


# Implementations ------------------------------------------------------------------------------


def test_implementations_are_functions_with_jax_signature():
    for impl in implementations.IMPLEMENTATIONS:
        parameters = list(inspect.signature(impl.fn).parameters)
        assert parameters[:6] == [
            "queries" if "queries" in parameters else "q",
            "kv_pages",
            "kv_lens",
            "page_indices",
            "cu_q_lens",
            "num_seqs",
        ], (impl.name, parameters)


def test_jax_kernel_needs_a_tpu():
    (jax_kernel,) = [i for i in implementations.IMPLEMENTATIONS if i.name == "jax-kernel"]
    fn, note = implementations.prepare_implementation(jax_kernel, "cpu")
    assert fn is None and "needs a TPU" in note


def test_bench_times_minilib_without_value_checks():
    jnp_impl = next(i for i in implementations.IMPLEMENTATIONS if i.name == "jnp")
    fn, _ = implementations.prepare_implementation(jnp_impl, "cpu")
    assert fn.keywords == {"validate": False}


# The run --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_rows():
    # jnp and blockwise compiled, and the kernel and JAX's kernel, which off a TPU must come
    # back as rows with a note rather than as timings beside compiled code.
    names = ["jnp", "blockwise", "kernel", "jax-kernel"]
    return bench.run_bench([TINY], names, reps=2, chip=TOY_CHIP, log=quiet)


def rows_named(rows, *names):
    by_name = {r.impl: r for r in rows}
    return [by_name[name] for name in names]


def test_every_requested_implementation_has_a_row(tiny_rows):
    assert [r.impl for r in tiny_rows] == ["jnp", "blockwise", "kernel", "jax-kernel"]
    jnp_row, blockwise, kernel, jax_kernel = tiny_rows
    assert jnp_row.ok and blockwise.ok, (jnp_row.note, blockwise.note)
    if ON_TPU:
        assert kernel.ok and jax_kernel.ok, (kernel.note, jax_kernel.note)
    else:
        # Off TPU the Pallas kernel is interpreted: not timed unless asked for.
        assert not kernel.ok and kernel.note.startswith("not timed: TPU interpret mode")
        assert not jax_kernel.ok and "needs a TPU" in jax_kernel.note


def test_timings_and_rates_are_positive(tiny_rows):
    for r in rows_named(tiny_rows, "jnp", "blockwise"):
        assert r.ok, r.note
        t = r.timing
        assert t.first_s > 0 and t.warm_s > 0 and t.new_s > 0 and t.new_warm_s > 0
        assert t.warm_calls == 2
        assert t.first_compiles >= 1  # caches are cleared before each first call
        assert t.new_compiles == 0  # compiled once per shape: new lengths reuse it
        assert r.tokens_per_s > 0 and r.achieved_bytes_per_s > 0
        assert 0 < r.roofline_fraction and r.flop_bound_multiple > 0


def test_outputs_agree(tiny_rows):
    baseline, blockwise = rows_named(tiny_rows, "jnp", "blockwise")
    assert baseline.ok and math.isnan(baseline.max_err)  # the first timed row is the baseline
    assert blockwise.ok, blockwise.note
    assert blockwise.max_err < 1e-4 and blockwise.note == "err vs jnp"


def test_a_failing_implementation_is_a_row(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("this implementation is broken\nsecond line")

    monkeypatch.setattr(bench, "prepare_implementation", lambda impl, backend: (broken, ""))
    (row,) = bench.run_bench([TINY], ["jnp"], reps=1, chip=TOY_CHIP, log=quiet)
    assert not row.ok and row.note == "failed: RuntimeError: this implementation is broken"


def test_table_has_a_line_per_row(tiny_rows):
    table = bench.format_table(tiny_rows)
    lines = table.splitlines()
    assert lines[0].split() == [name for name, _, _ in bench.COLUMNS] + ["note"]
    for r in tiny_rows:
        (line,) = [line for line in lines if f" {r.impl} " in line]
        assert line.startswith(TINY.label()) and line.endswith(r.note)
    assert "needs a TPU" in table or ON_TPU


def test_table_columns_line_up_with_the_header(tiny_rows):
    header, rule, _, line = bench.format_table(tiny_rows).splitlines()[:4]
    assert set(rule) == {"-"} and len(rule) == len(header)
    assert " blockwise " in line and line.endswith("err vs jnp")
    start = 0
    for name, spec, _ in bench.COLUMNS:
        end = start + int(spec[1:])
        assert header[start:end].strip() == name and line[start:end].strip(), name
        assert header[end] == line[end] == " ", (name, header, line)
        start = end + 1


def test_interpreted_rows_are_listed_apart(tiny_rows):
    # A made-up interpret-mode row: it must land in its own, labelled section.
    jnp_row = tiny_rows[0]
    fake = dataclasses.replace(
        jnp_row, impl="kernel", note="TPU interpret mode on cpu: correctness only"
    )
    table = bench.format_table([jnp_row, fake])
    compiled_part, interpreted_part = table.split("TPU INTERPRET MODE")
    assert " kernel " not in compiled_part and " kernel " in interpreted_part
    assert "NOT a speed target" in interpreted_part


@pytest.mark.matrix  # once, in .venv: an interpret-mode kernel compiles
@pytest.mark.skipif(ON_TPU, reason="on a TPU the kernel is compiled, not interpreted")
def test_interpreted_kernel_runs_apart():
    rows = bench.run_bench([TINY], ["jnp", "kernel"], reps=1, interpret=True, chip=TOY_CHIP,
                           log=quiet)  # fmt: skip
    kernel = rows[1]
    assert kernel.ok, kernel.note
    assert kernel.interpreted
    assert kernel.max_err < 1e-4


def test_times_plot_is_saved(tiny_rows, tmp_path):
    path = bench.save_times_plot(tiny_rows, tmp_path / "bench.png")
    assert path.exists() and path.stat().st_size > 0


def test_memory_sweep_grows_for_gather_all_only(tmp_path):
    points, notes = memory_sweep.memory_sweep([32, 128], ("jnp", "blockwise"), base=TINY, log=quiet)
    temp = {(p.impl, p.max_kv_len): p.temp_bytes for p in points}
    assert sorted(temp) == [("blockwise", 32), ("blockwise", 128), ("jnp", 32), ("jnp", 128)]
    assert temp[("jnp", 128)] > temp[("jnp", 32)] > 0
    assert temp[("blockwise", 128)] < temp[("jnp", 128)]
    assert memory_sweep.save_memory_plot(points, tmp_path / "memory.png").exists()
    assert "jnp" in memory_sweep.format_memory_table(points, notes)


# The speed targets (benchmarks/check_targets.py) ---------------------------------------------


@pytest.mark.matrix  # once, in .venv: it times every implementation
def test_check_targets_reports_every_target():
    results = load_check_targets().check_targets(TINY, reps=1, log=quiet)
    # 5 judged here, the blockwise FLOP bound, 2 TPU targets, then the static targets
    assert len(results) >= 9
    assert all(r.line().split()[0] in ("PASS", "FAIL", "INFO") for r in results)


def test_tpu_targets_are_not_judged_off_a_tpu():
    results = load_check_targets().check_tpu_targets(TINY, reps=1, log=quiet, backend="cpu")
    assert [r.passed for r in results] == [None, None]
    assert all("not measured: needs a TPU (backend here: cpu)" in r.detail for r in results)
    assert "90% of JAX's kernel" in results[0].name and "70% of the HBM" in results[1].name


def test_targets_judge_made_up_rows(tiny_rows):
    targets = load_check_targets()
    base = tiny_rows[0]

    def row(warm_s, new_s=None, impl="x"):
        new_s = warm_s if new_s is None else new_s
        timing = Timing(1.0, 1, 0.5, warm_s, 3, new_s, 0, warm_s)
        return dataclasses.replace(base, impl=impl, timing=timing, note="")

    assert targets.speedup("t", row(3.0), row(1.0), "warm_s", at_least=3).passed is True
    assert targets.speedup("t", row(2.9), row(1.0), "warm_s", at_least=3).passed is False
    missing = targets.speedup("t", tiny_rows[3], row(1.0), "warm_s", at_least=3)
    assert missing.passed is False and "could not measure (jax-kernel:" in missing.detail
    assert targets.no_retrace(row(1.0, new_s=3.0)).passed is True
    assert targets.no_retrace(row(1.0, new_s=3.1)).passed is False
    assert targets.throughput_against("t", row(1.0), row(0.95)).passed is True
    assert targets.throughput_against("t", row(1.2), row(1.0)).passed is False
    floor_s = roofline(base.cost, base.chip).time_s
    assert targets.share_of_roofline("t", row(floor_s / 0.75)).passed is True
    assert targets.share_of_roofline("t", row(floor_s / 0.65)).passed is False
    (reported,) = targets.flop_bound(row(1.0, impl="blockwise"))
    assert reported.passed is None and "x the bound" in reported.detail


def test_check_targets_rejects_a_bad_flag(capsys):
    with pytest.raises(SystemExit) as info:
        load_check_targets().main(["--reps", "0"])
    assert info.value.code == 2 and "--reps" in capsys.readouterr().err


# The command line -----------------------------------------------------------------------------


def test_main_prints_the_table_and_saves_the_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "device_chip", lambda dtype: TOY_CHIP)  # skip measuring the CPU
    argv = ["--workload", "decode-heavy", "--num-seqs", "2", "--heads", "4/2/64",
            "--pages-per-seq", "2", "--max-num-batched-tokens", "8", "--impls", "jnp,jax-kernel",
            "--reps", "1", "--no-memory", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "decode-heavy 2 seqs 4/2/64" in out and " jnp " in out
    assert "needs a TPU" in out or ON_TPU
    assert (tmp_path / f"bench_{jax.devices()[0].platform}.png").exists()


def test_main_rejects_unknown_names(capsys):
    for argv, expected in (
        (["--impls", "nope"], "choose from"),
        (["--heads", "gpa"], "give one of"),
    ):
        with pytest.raises(SystemExit) as info:
            bench_main(argv)
        assert info.value.code == 2
        assert expected in capsys.readouterr().err


# Command line: a bad flag value is a one-line error naming the flag, exit code 2 -------------

BAD_FLAGS = [
    ["--page-size", "0"],
    ["--page-size", "-3"],
    ["--page-size", "x"],
    ["--num-seqs", "0"],
    ["--num-seqs", "4,0"],
    ["--num-seqs", ","],
    ["--pages-per-seq", "0"],
    ["--max-num-batched-tokens", "0"],
    ["--max-num-batched-tokens", "1.5"],
    ["--dtype", "foo"],
    ["--dtype", "int32"],
    ["--reps", "0"],
    ["--reps", "-1"],
    ["--workload", "nope"],
    ["--heads", "32-8"],
    ["--heads", "12/8/64"],
    ["--heads", "0/0/64"],
    ["--max-kv-lens", "0"],
]


@pytest.mark.parametrize("argv", BAD_FLAGS, ids=[" ".join(a) for a in BAD_FLAGS])
def test_bad_flag_values_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"argument {argv[0]}" in err and "Traceback" not in err


def test_more_sequences_than_tokens_is_a_flag_error(capsys):
    with pytest.raises(SystemExit) as info:
        bench_main(["--num-seqs", "64", "--max-num-batched-tokens", "16"])
    assert info.value.code == 2
    assert "--num-seqs 64 is more than --max-num-batched-tokens 16" in capsys.readouterr().err


def test_a_huge_kv_cache_is_a_flag_error(capsys):
    with pytest.raises(SystemExit) as info:
        bench_main(["--pages-per-seq", "1000000000", "--num-seqs", "8"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--pages-per-seq 1000000000" in err


def test_a_failed_row_makes_the_run_fail(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "device_chip", lambda dtype: TOY_CHIP)

    def broken(*args, **kwargs):
        raise RuntimeError("this implementation is broken")

    monkeypatch.setattr(bench, "prepare_implementation", lambda impl, backend: (broken, ""))
    argv = ["--workload", "mixed", "--num-seqs", "2", "--heads", "4/2/64", "--pages-per-seq",
            "2", "--max-num-batched-tokens", "8", "--impls", "jnp", "--reps", "1",
            "--no-memory", "--no-plot", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bench_main(argv) == 1
    captured = capsys.readouterr()
    assert "failed: RuntimeError" in captured.out
    assert "1 row(s) failed: mixed 2 seqs 4/2/64: jnp" in captured.err


@pytest.mark.parametrize(
    "argv", [[], ["nope"], ["doctor", "--fast"], ["bench", "--reps", "0"], ["compile", "--chip"]]
)
def test_command_line_errors_are_one_line_with_exit_code_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus"], "unrecognized argument --bogus: a command comes first"),
        (["compile", "--num-q-heads", "12", "--num-kv-heads", "8"],
         "num_q_heads=12 must be divisible by num_kv_heads=8"),
        (["compile", "--num-kv-pages-per-block", "0"], "num_kv_pages_per_block=0 must be in"),
        (["compile", "--soft-cap", "nan"], "soft_cap=nan must be finite"),
        (["compile", "--page-size", "0"], "--page-size=0 must be at least 1"),
        (["compile", "--kv-dtype", "fp8", "--k-scale", "0"], "k_scale=0.0 must be positive"),
    ],
)  # fmt: skip
def test_a_bad_flag_is_named_with_exit_code_2_libtpu_or_not(argv, message, capsys):
    """The compile command checks its flags with the validator before it looks for libtpu."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err and message in err, err


@pytest.mark.parametrize("command", [[], ["bench"], ["compile"], ["doctor"]])
def test_help_exits_0(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(
        f"usage: python -m minilib {' '.join(command)}".rstrip()
    )
