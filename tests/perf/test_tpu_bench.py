"""minilib.perf.tpu_bench, `python -m minilib bench --tpu`, as far as a CPU allows.

Tested here: the median and the warm-up with a fake clock; the whole harness in TPU interpret
mode on two small workloads (ours and ours fused run, each cell's median comes from the clock's
own readings, the table has a row per workload and the interpret-mode warning); the message
without a TPU; that the bench calls the functions `python -m minilib compile --workloads`
compiles, with its shapes; and, where libtpu is installed (.venv-tpu, marker `tpu_compile`),
that those calls of a full-size workload compile for a compile-only v5e.
Not tested here: a run on a TPU, JAX's kernel or v3 running, any time. No timing assertions.
"""

from __future__ import annotations

import statistics
import time

import jax
import pytest

from minilib.__main__ import main
from minilib.doctor import BENCH_TPU_COMMAND
from minilib.perf import tpu_bench
from minilib.tpu import at_defaults
from minilib.tpu.compile import compile_for_tpu, tpu_compile_available
from minilib.tpu.suite import SUITE
from minilib.tpu.v3 import v3_available, v3_specs

ON_TPU = jax.default_backend() == "tpu"
COMPILE_AVAILABLE, COMPILE_REASON = tpu_compile_available()
TINY = {name: tpu_bench.small_workload(SUITE[name]) for name in ("mixed", "gpt-oss fp8")}


def quiet(*args, **kwargs):
    pass


# The median of repeats, after warm-up: a fake clock, no timing. ---------------------------------


def test_warm_up_calls_are_not_timed_and_the_median_is_of_the_timed_ones():
    events = []
    readings = iter([1.0, 1.5, 2.0, 2.25, 3.0, 4.0, 5.0, 5.125])

    def clock():
        events.append("clock")
        return next(readings)

    samples = tpu_bench.time_repeats(lambda: events.append("call"), warmup=2, reps=4, clock=clock)
    assert events == ["call"] * 2 + ["clock", "call", "clock"] * 4
    assert samples.warmup == 2
    assert samples.seconds == (0.5, 0.25, 1.0, 0.125)
    assert samples.median_s == statistics.median([0.5, 0.25, 1.0, 0.125])


def test_no_warm_up_times_every_call():
    readings = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])
    samples = tpu_bench.time_repeats(lambda: None, warmup=0, reps=3, clock=lambda: next(readings))
    assert samples.seconds == (3.0, 1.0, 2.0) and samples.median_s == 2.0


# The harness, end to end, in TPU interpret mode on a CPU. ----------------------------------------


@pytest.fixture(scope="module")
def interpreted():
    """(cells, every clock reading in order) of the harness on TINY in interpret mode."""
    readings = []

    def clock():
        readings.append(time.perf_counter())
        return readings[-1]

    cells = tpu_bench.run_suite_bench(
        TINY, interpret=True, reps=2, warmup=1, clock=clock, log=quiet
    )
    return cells, readings


@pytest.mark.skipif(ON_TPU, reason="interpret mode is for a machine without a TPU")
def test_every_kernel_that_runs_in_interpret_mode_ran(interpreted):
    cells, _ = interpreted
    assert [(c.workload, c.kernel) for c in cells] == [
        (name, kernel) for name in TINY for kernel in tpu_bench.KERNELS
    ]
    for cell in cells:
        if cell.kernel in ("ours", "ours fused"):
            assert cell.ran, cell.note
            assert cell.samples.warmup == 1 and len(cell.samples.seconds) == 2
        else:  # JAX's kernel and v3 take no interpret flag
            assert not cell.ran and tpu_bench.TPU_ONLY in cell.note


@pytest.mark.skipif(ON_TPU, reason="interpret mode is for a machine without a TPU")
def test_medians_come_from_the_clock_readings(interpreted):
    cells, readings = interpreted
    timed = [c for c in cells if c.ran]
    assert len(readings) == 2 * sum(len(c.samples.seconds) for c in timed)
    pairs = iter(zip(readings[::2], readings[1::2], strict=True))
    for cell in timed:
        expected = tuple(end - start for start, end in (next(pairs) for _ in cell.samples.seconds))
        assert cell.samples.seconds == expected
        assert cell.samples.median_s == statistics.median(expected)


@pytest.mark.skipif(ON_TPU, reason="interpret mode is for a machine without a TPU")
def test_the_table_has_a_row_per_workload_with_each_kernels_median(interpreted):
    cells, _ = interpreted
    report = tpu_bench.format_report(cells, TINY, interpret=True, reps=2, warmup=1)
    lines = report.splitlines()
    header_line = next(line for line in lines if line.startswith("| workload"))
    header = [c.strip() for c in header_line.strip("|").split("|")]
    kernel_columns = [f"{k} ms" for k in tpu_bench.KERNELS]
    assert header == ["workload", "model", *kernel_columns, "ours/JAX", "ours/v3"]
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert set(rows) == {"workload", *TINY}
    for name, workload in TINY.items():
        row = [c.strip() for c in rows[name].strip("|").split("|")]
        assert len(row) == len(header) and row[1] == workload.model.name
        for kernel, text in zip(tpu_bench.KERNELS, row[2:], strict=False):
            (cell,) = [c for c in cells if (c.workload, c.kernel) == (name, kernel)]
            assert text == (f"{cell.samples.median_s * 1e3:.3f}" if cell.ran else "-")
        assert row[-2:] == ["-", "-"]  # no JAX, no v3 in interpret mode
    assert "they mean nothing for a TPU" in report
    assert "median ms of 2 timed calls per kernel, after 1 untimed calls" in report
    assert f"JAX ({', '.join(TINY)}): JAX's kernel is {tpu_bench.TPU_ONLY}" in report


def test_a_failing_kernel_is_a_cell_with_its_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("this kernel is broken\nsecond line")

    call = tpu_bench.KernelCall("ours", broken, tpu_bench.jax_arguments)
    workload = TINY["mixed"]
    timing = dict(warmup=0, reps=1, clock=time.perf_counter)
    cell = tpu_bench.bench_cell("mixed", workload, call, True, timing, quiet)
    assert not cell.ran and cell.note == "failed: RuntimeError: this kernel is broken"


# The command line. ------------------------------------------------------------------------------


@pytest.mark.skipif(ON_TPU, reason="this is a TPU")
def test_without_a_tpu_it_says_so_and_fails(capsys):
    assert main(["bench", "--tpu"]) == 1
    captured = capsys.readouterr()
    assert "python -m minilib bench --tpu needs a TPU" in captured.err
    assert "python -m minilib bench --tpu --interpret" in captured.err
    assert "Traceback" not in captured.err + captured.out and captured.out == ""


@pytest.mark.skipif(ON_TPU, reason="interpret mode is for a machine without a TPU")
def test_interpret_flag_prints_the_table(capsys):
    argv = ["bench", "--tpu", "--interpret", "--suite-workloads", "decode", "--reps", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| decode | Llama-3-8B | " in out and "INTERPRET MODE on a CPU" in out


def test_an_unknown_suite_workload_is_a_flag_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--tpu", "--suite-workloads", "nope"])
    assert info.value.code == 2 and "argument --suite-workloads" in capsys.readouterr().err


def test_doctor_names_the_command():
    assert BENCH_TPU_COMMAND == tpu_bench.COMMAND


# The calls are `compile --workloads`' calls, on its shapes. -------------------------------------


def argument_specs(call, workload):
    """The shapes and dtypes of `call`'s arguments on `workload`, nothing allocated."""
    return jax.eval_shape(lambda: call.arguments(tpu_bench.workload_arrays(workload)))


def same_specs(a, b) -> bool:
    return [(s.shape, s.dtype) for s in a] == [(s.shape, s.dtype) for s in b]


@pytest.mark.parametrize("name", ["mixed", "gpt-oss"])
def test_ours_are_the_suites_calls_on_its_shapes(name):
    workload = SUITE[name]
    specs, model = workload.specs(), workload.model
    ours, fused, jax_call, v3 = tpu_bench.kernel_calls(workload)
    assert ours.fn.func is at_defaults.ours_whole_call
    assert fused.fn.func is at_defaults.ours_fused_call and fused.donate == 1
    for call in (ours, fused):
        assert call.fn.keywords == dict(sm_scale=model.head_dim**-0.5, **model.options())
    sink = (jax.ShapeDtypeStruct((model.num_q_heads,), jax.numpy.float32),) * model.sinks
    assert same_specs(argument_specs(ours, workload), (*specs, *sink))
    new = at_defaults.new_kv_specs(specs)
    assert same_specs(argument_specs(fused, workload), (*specs, *new, *sink))
    assert (jax_call.fn is None) == model.sinks


@pytest.mark.skipif(not v3_available()[0], reason=f"no v3 here: {v3_available()[1]}")
def test_v3_is_the_suites_call_on_its_shapes():
    workload = SUITE["mixed"]
    v3 = tpu_bench.kernel_calls(workload)[3]
    assert v3.fn.func is at_defaults.v3_whole_call and v3.donate == 3
    q, k, v, *rest = v3_specs(workload.specs())
    model_kv = jax.ShapeDtypeStruct(k.shape, q.dtype)  # as at_defaults.v3_kernels gives it
    assert same_specs(argument_specs(v3, workload), (q, model_kv, model_kv, *rest))


@pytest.mark.tpu_compile
@pytest.mark.skipif(not COMPILE_AVAILABLE, reason=f"no TPU compile here: {COMPILE_REASON}")
@pytest.mark.parametrize("kernel", ["ours fused", "v3"])
def test_the_bench_calls_compile_for_a_chip(kernel):
    workload = SUITE["decode"]
    (call,) = [c for c in tpu_bench.kernel_calls(workload) if c.kernel == kernel]
    if call.fn is None:
        pytest.skip(call.note)
    report = compile_for_tpu(call.fn, *argument_specs(call, workload), chip="v5e")
    assert report.compiled, report.error
