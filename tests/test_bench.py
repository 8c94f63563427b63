"""minilib.bench: a smoke run of the harness on tiny sizes. No timing assertions: only that
every row is there, that the numbers are positive, and that the outputs agree."""

from __future__ import annotations

import dataclasses
import math

import pytest

from minilib import bench
from minilib.bench import BenchCase, Implementation
from minilib.roofline import Chip

TINY = BenchCase("mixed", 3, (4, 2, 64), page_size=8, pages_per_seq=4, max_num_batched_tokens=16)
TOY_CHIP = Chip("toy chip", hbm_bytes_per_s=1e10, peak_flops_per_s=1e11)


def quiet(*args, **kwargs):
    pass


# Workloads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", list(bench.WORKLOADS))
@pytest.mark.parametrize("num_seqs", [1, 8, 128])
def test_workloads_fit_the_token_budget(workload, num_seqs):
    pairs = bench.workload_seq_lens(
        workload, num_seqs, max_kv_len=1024, max_num_batched_tokens=1024, seed=3
    )
    assert len(pairs) == num_seqs
    assert sum(q for q, _ in pairs) <= 1024
    assert all(1 <= q <= kv <= 1024 for q, kv in pairs)


def test_fit_token_budget_keeps_decodes_and_kv_lens():
    pairs = [(1, 50), (40, 40), (30, 100), (1, 7)]
    fitted = bench.fit_token_budget(pairs, 20)
    assert sum(q for q, _ in fitted) <= 20
    assert [kv for _, kv in fitted] == [50, 40, 100, 7]
    assert fitted[0] == (1, 50) and fitted[3] == (1, 7)
    assert bench.fit_token_budget(pairs, 1000) == pairs  # fits already: unchanged


def test_fit_token_budget_refuses_too_many_sequences():
    with pytest.raises(ValueError, match="cannot fit"):
        bench.fit_token_budget([(1, 5)] * 5, 4)


def test_case_batches_share_shapes_but_not_lengths():
    batch, new_batch = bench.case_batches(TINY)
    for a, b in zip(batch.args(), new_batch.args(), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert batch.seq_lens != new_batch.seq_lens


def test_decode_heavy_is_mostly_decodes():
    pairs = bench.workload_seq_lens(
        "decode-heavy", 128, max_kv_len=512, max_num_batched_tokens=1024
    )
    assert sum(q == 1 for q, _ in pairs) > 0.75 * 128


# Implementations ------------------------------------------------------------------------------


def test_missing_implementation_is_reported_not_raised():
    ghost = Implementation("ghost", "minilib.does_not_exist", "attention", "jit")
    fn, note = bench.load_implementation(ghost, "cpu")
    assert fn is None and note.startswith("unavailable: ModuleNotFoundError")


def test_jax_kernel_needs_a_tpu():
    (jax_kernel,) = [i for i in bench.IMPLEMENTATIONS if i.name == "jax-kernel"]
    fn, note = bench.load_implementation(jax_kernel, "cpu")
    assert fn is None and "needs a TPU" in note


# The run --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_rows():
    # jnp and blockwise (when it exists) compiled, and the kernel and JAX's kernel, which must
    # come back as rows with a note rather than as timings beside compiled code.
    names = ["jnp", "blockwise", "kernel", "jax-kernel"]
    return bench.run_bench([TINY], names, reps=2, chip=TOY_CHIP, log=quiet)


def test_every_requested_implementation_has_a_row(tiny_rows):
    assert [r.impl for r in tiny_rows] == ["jnp", "blockwise", "kernel", "jax-kernel"]
    by_name = {r.impl: r for r in tiny_rows}
    assert by_name["jnp"].ok
    assert not by_name["jax-kernel"].ok and "TPU" in by_name["jax-kernel"].note
    # Off TPU the Pallas kernel is interpreted: not timed unless asked for.
    if not by_name["kernel"].ok:
        assert "not timed" in by_name["kernel"].note or "unavailable" in by_name["kernel"].note


def test_timings_and_rates_are_positive(tiny_rows):
    for r in tiny_rows:
        if not r.ok:
            continue
        t = r.timing
        assert t.first_s > 0 and t.warm_s > 0 and t.new_s > 0 and t.new_warm_s > 0
        assert t.warm_calls == 2
        assert t.first_compiles >= 1  # caches are cleared before each first call
        assert t.new_compiles == 0  # compiled once per shape: new lengths reuse it
        assert r.tokens_per_s > 0 and r.achieved_bytes_per_s > 0
        assert 0 < r.roofline_fraction and r.flop_bound_multiple > 0


def test_outputs_agree(tiny_rows):
    compared = [r for r in tiny_rows if r.ok and not math.isnan(r.max_err)]
    for r in compared:
        assert r.max_err < 1e-4, (r.impl, r.max_err)


def test_table_has_a_line_per_row(tiny_rows):
    table = bench.format_table(tiny_rows)
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["case", "impl", "first_s", "xla_s"]
    for r in tiny_rows:
        assert any(line.startswith(TINY.label()) and f" {r.impl} " in line for line in lines)
    assert "needs a TPU" in table


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


@pytest.mark.slow
def test_interpreted_kernel_runs_apart():
    rows = bench.run_bench([TINY], ["jnp", "kernel"], reps=1, interpret=True, chip=TOY_CHIP,
                           log=quiet)  # fmt: skip
    kernel = rows[1]
    if not kernel.ok:
        pytest.skip(f"kernel did not run: {kernel.note}")
    assert bench.is_interpreted(kernel)
    assert kernel.max_err < 1e-4


def test_plots_are_saved(tiny_rows, tmp_path):
    path = bench.plot_times(tiny_rows, tmp_path / "bench.png")
    assert path.exists() and path.stat().st_size > 0


def test_memory_sweep_grows_for_gather_all_only(tmp_path):
    points, notes = bench.memory_sweep([32, 128], ("jnp", "blockwise"), base=TINY, log=quiet)
    temp = {(p.impl, p.max_kv_len): p.temp_bytes for p in points}
    assert temp[("jnp", 128)] > temp[("jnp", 32)] > 0
    if ("blockwise", 128) in temp:
        assert temp[("blockwise", 128)] < temp[("jnp", 128)]
    assert bench.plot_memory(points, tmp_path / "memory.png").exists()
    assert "jnp" in bench.format_memory_table(points, notes)


# The command line -----------------------------------------------------------------------------


def test_main_prints_the_table_and_saves_the_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "device_chip", lambda dtype: TOY_CHIP)  # skip measuring the CPU
    argv = ["--workload", "decode-heavy", "--num-seqs", "2", "--heads", "4/2/64",
            "--pages-per-seq", "2", "--max-num-batched-tokens", "8", "--impls", "jnp,jax-kernel",
            "--reps", "1", "--no-memory", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "decode-heavy 2 seqs 4/2/64" in out and " jnp " in out and "needs a TPU" in out
    assert (tmp_path / "bench_cpu.png").exists() or "tpu" in out


def test_main_rejects_unknown_names(capsys):
    assert bench.main(["--impls", "nope"]) == 2
    assert "choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--heads", "32-8"])


@pytest.mark.slow
def test_check_targets_reports_every_target():
    results = bench.check_targets(TINY, reps=1, log=quiet)
    assert len(results) == 8  # 5 judged here, the blockwise FLOP bound, 2 TPU targets
    assert all(r.line().split()[0] in ("PASS", "FAIL", "INFO") for r in results)


def test_tpu_targets_are_not_judged_off_a_tpu():
    results = bench.check_tpu_targets(TINY, reps=1, log=quiet, backend="cpu")
    assert [r.passed for r in results] == [None, None]
    assert all("not measured: needs a TPU (backend here: cpu)" in r.detail for r in results)
    assert "90% of JAX's kernel" in results[0].name and "70% of the HBM" in results[1].name


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
        bench.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"argument {argv[0]}" in err and "Traceback" not in err


def test_more_sequences_than_tokens_is_a_flag_error(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--num-seqs", "64", "--max-num-batched-tokens", "16"])
    assert info.value.code == 2
    assert "--num-seqs 64 is more than --max-num-batched-tokens 16" in capsys.readouterr().err


def test_a_huge_kv_cache_is_a_flag_error(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--pages-per-seq", "1000000000", "--num-seqs", "8"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--pages-per-seq 1000000000" in err


def test_a_failed_row_makes_the_run_fail(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "device_chip", lambda dtype: TOY_CHIP)

    def broken(*args, **kwargs):
        raise RuntimeError("this implementation is broken")

    monkeypatch.setattr(bench, "load_implementation", lambda impl, backend: (broken, ""))
    argv = ["--workload", "mixed", "--num-seqs", "2", "--heads", "4/2/64", "--pages-per-seq",
            "2", "--max-num-batched-tokens", "8", "--impls", "jnp", "--reps", "1",
            "--no-memory", "--no-plot", "--out-dir", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 1
    captured = capsys.readouterr()
    assert "failed: RuntimeError" in captured.out
    assert "1 row(s) failed: mixed 2 seqs 4/2/64: jnp" in captured.err


def test_bench_times_minilib_without_value_checks():
    jnp_impl = next(i for i in bench.IMPLEMENTATIONS if i.name == "jnp")
    fn, _ = bench.load_implementation(jnp_impl, "cpu")
    assert fn.keywords == {"validate": False}


@pytest.mark.parametrize("argv", [["nope"], ["doctor", "--fast"], ["bench", "--reps", "0"]])
def test_command_line_errors_are_one_line_with_exit_code_2(argv, capsys):
    from minilib.__main__ import main

    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err, err
