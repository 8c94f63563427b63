"""The ladder's checkers against plausible wrong answers, and how they behave.

Every wrong answer of `ladder_wrong_answers` must fail its checker with its named cause: all
of them in .venv's run, those marked fast on the other stacks (the rest are marked `matrix`).
The checks must also behave: a deadlock is reported at once, nothing outlives a check (no thread,
no later output, no fatal error at exit), an out-of-bounds read is one paragraph, a race
report is short with the detector's output on request, and a kernel that never ends is
stopped.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from ladder_wrong_answers import WRONG_ANSWERS, flash_call, rung3, rung4

import minilib.exercises as ex
from minilib.ladder import async_copy

ROOT = Path(__file__).resolve().parents[2]


def ids(w):
    return f"rung{w.rung}-{w.name.replace(' ', '_')}"


@pytest.mark.parametrize(
    "wrong",
    [w if w.fast else pytest.param(w, marks=pytest.mark.matrix) for w in WRONG_ANSWERS],
    ids=ids,
)
def test_wrong_answer_fails_with_its_cause(wrong):
    result = wrong.checker(wrong.make(), verbose=False)
    assert result.status == "failed", result.report
    for words in wrong.expect:
        assert words in result.report, f"{words!r} not in:\n{result.report}"
    assert "Traceback" not in result.report and "CpuCallback" not in result.report


def test_every_rung_keeps_a_wrong_answer_on_every_stack():
    rungs = {w.rung for w in WRONG_ANSWERS}
    assert rungs == {"1a", "1b", "2", "3", "4", "5", "5a", "6", "7"}
    assert {w.rung for w in WRONG_ANSWERS if w.fast} == rungs


def python_threads() -> int:
    """Threads running Python code now (foreign threads JAX called back from do not count)."""
    return len(sys._current_frames())


def test_a_deadlock_is_reported_at_once_and_leaves_nothing_behind(capsys):
    threads = python_threads()
    start = time.perf_counter()
    result = ex.check_paged_decode_async_copy(rung3("wait_before_start"))
    assert time.perf_counter() - start < 20
    assert result.status == "failed" and "deadlock" in result.report
    assert "No copy was ever started on sem" in result.report
    capsys.readouterr()
    assert python_threads() == threads, "a thread outlived the check"
    # The next check prints its own report and nothing else: no leftover from the deadlock.
    passed = ex.check_paged_decode_async_copy(async_copy.paged_decode_attention_async_copy)
    printed = capsys.readouterr().out
    assert passed and printed.strip() == passed.report, printed
    assert "Semaphore" not in printed


def test_no_fatal_error_at_exit_after_a_deadlock(tmp_path):
    """A deadlocked check, then a normal interpreter exit (no os._exit): the process ends
    cleanly, with no thread stuck in the interpreter ("Fatal Python error: PyGILState_Release")."""
    script = tmp_path / "deadlock_then_exit.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            sys.path.insert(0, sys.argv[1])
            import minilib.exercises as ex
            from ladder_wrong_answers import rung4
            result = ex.check_double_buffered_decode(rung4("wait_other_slot"), verbose=False)
            print(result.status)
            """
        )
    )
    run = subprocess.run(
        [sys.executable, str(script), str(ROOT / "tests")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "failed"
    assert "Fatal Python error" not in run.stderr, run.stderr[-2000:]


def test_a_race_report_is_short_and_the_details_are_on_request():
    wrong = rung4("compute_before_wait")
    short = ex.check_double_buffered_decode(wrong, verbose=False)
    assert "DMA race on bufs" in short.report and "details=True" in short.report
    assert "RACE DETECTED" not in short.report and len(short.report.splitlines()) < 12
    full = ex.check_double_buffered_decode(wrong, verbose=False, details=True)
    assert "RACE DETECTED" in full.report


def test_an_out_of_bounds_read_is_one_paragraph():
    result = ex.check_paged_decode_async_copy(rung3("copy_every_step"), verbose=False)
    failure = result.report.splitlines()[1]
    assert failure.strip().startswith("an out-of-bounds read: a copy read kv_pages[")
    assert "Likely cause:" in failure and "garbage" in failure
    assert "IndexError" not in result.report and "jax._src" not in result.report


def test_a_kernel_that_never_ends_is_stopped(monkeypatch):
    from minilib.exercises import kernel_run

    monkeypatch.setattr(kernel_run, "KERNEL_TIMEOUT_SECONDS", 3.0)

    def endless_kernel(kv_lens_ref, page_indices_ref, q_ref, kv_hbm_ref, o_ref, buf, sem, *rest,
                       sm_scale):  # fmt: skip
        steps = lax.while_loop(lambda s: kv_lens_ref[0] >= 0, lambda s: s + 1, 0)  # never ends
        o_ref[...] = jnp.full(o_ref.shape, steps, o_ref.dtype)

    fn = functools.partial(async_copy.paged_decode_attention_async_copy, kernel=endless_kernel)
    threads, start = python_threads(), time.perf_counter()
    result = ex.check_paged_decode_async_copy(fn, verbose=False)
    assert time.perf_counter() - start < 30
    assert result.status == "failed" and "stopped after 3 s" in result.report, result.report
    deadline = time.perf_counter() + 10
    while python_threads() > threads and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert python_threads() == threads, "the stopped kernel's thread should have ended"


def test_the_shared_semaphore_check_sees_what_the_counts_hide():
    """Both slots on one semaphore: the counts balance at exit and no race shows, yet the
    check fails, naming it."""
    result = ex.check_double_buffered_decode(rung4("one_semaphore"), verbose=False)
    assert "two slots share one semaphore" in result.report
    assert "both signalling sems[0]" in result.report


def racy_copy_kernel(x_hbm_ref, o_ref, buf, sem):
    copy = pltpu.make_async_copy(x_hbm_ref, buf, sem)
    copy.start()
    o_ref[...] = buf[...]  # read before the wait
    copy.wait()


def test_the_race_detector_sees_a_compute_before_its_wait():
    """The race checks can fail: the no-race verdict is not vacuous."""
    from minilib.ladder.interpret import strict_interpret_params
    from minilib.ladder.watch import watch_kernel

    with watch_kernel() as watch:
        pl.pallas_call(
            racy_copy_kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
            interpret=strict_interpret_params(),
        )(jnp.ones((8, 128))).block_until_ready()
    assert watch.raced and watch.races()[0].first[0] == "read"
    assert watch.never_waited() == []


def test_every_axis_arbitrary_passes_with_a_note_on_megacore():
    """("arbitrary",) * 3 is correct (minilib's kernel and JAX's mark every axis so): it
    passes, with a note on what "parallel" heads and q blocks give a megacore chip."""
    result = ex.check_flash_pallas_call(flash_call("all_arbitrary"), verbose=False)
    assert result.passed, result.report
    assert "Note: dimension_semantics=('arbitrary', 'arbitrary', 'arbitrary')" in result.report
    assert "megacore" in result.report and "one core idle" in result.report
