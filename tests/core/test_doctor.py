from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import pytest

from minilib.batch import make_batch
from minilib.doctor import (
    expected_output,
    kernel_mode,
    ladder_checks,
    ladder_rungs,
    max_abs_error,
    parity_passes,
)
from minilib.parity import parity_tolerance
from minilib.tpu.compile import LIBTPU_FOR_JAX, install_hint
from minilib.vectorized import ragged_paged_attention_jnp


def run_minilib(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "minilib", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_doctor_command_reports_and_passes():
    result = run_minilib("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    expected = ("backend:", "jax:", "jaxlib:", "libtpu:", "Pallas kernel:", "precision:",
                "parity check: PASS")  # fmt: skip
    for line in (*expected, "TPU compile:"):
        assert line in out
    # The precision line says which tolerance applies here, as notebooks 00 and 04 say.
    assert f"parity tolerance {parity_tolerance():.0e}" in out
    if "libtpu:       not installed" in out:
        assert install_hint() in out


def test_install_hint_names_the_pair_of_each_tpu_environment():
    """doctor's advice for Colab's jax 0.7.2 is Colab's libtpu and .venv-tpu-oldest, for the
    newest jax its jax[tpu] and .venv-tpu: the pins of constraints/, as in docs/testing.md."""
    constraints = pathlib.Path(__file__).parents[2] / "constraints"
    for jax_version, (_, libtpu, _, venv) in LIBTPU_FOR_JAX.items():
        pins = (constraints / f"{venv.removeprefix('.venv-')}.txt").read_text().splitlines()
        assert f"jax=={jax_version}" in pins and f"libtpu=={libtpu}" in pins, venv
        advice = install_hint(jax_version)
        assert f"libtpu {libtpu}" in advice and f"makes {venv} with that pair" in advice
    assert "0.0.23" in install_hint("0.7.2") and ".venv-tpu " not in install_hint("0.7.2")


def test_kernel_mode():
    assert kernel_mode("tpu").startswith("compiled")
    assert kernel_mode("cpu").startswith("interpreted")


def test_unknown_command_fails():
    result = run_minilib("frobnicate")
    assert result.returncode == 2 and "unknown command" in result.stderr


# --- python -m minilib doctor --tpu: the self-check for a real TPU -----------------------------

needs_no_tpu = pytest.mark.skipif(jax.default_backend() == "tpu", reason="this is a TPU")


@needs_no_tpu
def test_tpu_self_check_in_interpret_mode_reports_every_section():
    # The ladder's checkers are left out here (a minute); test_ladder_checks_run_a_rung runs one.
    result = run_minilib("doctor", "--tpu", "--interpret", "--no-ladder")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    sections = ("versions:", "v3:", "chip:", "kernels:", "precision:", "implementations:",
                "ladder solutions: not checked", "timings:", "result: PASS")  # fmt: skip
    for section in sections:
        assert section in out, f"{section!r} missing from:\n{out}"
    for name in ("reference", "jnp", "blockwise", "pallas_basics", "kernel", "add_vectors"):
        assert f"PASS  {name} " in out, f"{name} did not pass:\n{out}"
    for step in ("decode", "mixed", "prefill"):
        assert f"\n  {step} " in out  # one timing row per step
    assert "TPU interpret mode" in out and "jax-kernel: unavailable: needs a TPU" in out
    assert "v3: not timed: it runs only on a TPU" in out
    assert "python -m minilib bench --tpu" in out  # where the whole suite is timed


@needs_no_tpu
def test_tpu_self_check_without_a_tpu_says_so():
    result = run_minilib("doctor", "--tpu")
    assert result.returncode == 1
    assert "No TPU found" in result.stdout
    assert "python -m minilib doctor --tpu --interpret" in result.stdout


def test_interpret_without_tpu_is_a_usage_error():
    result = run_minilib("doctor", "--interpret")
    assert result.returncode == 2 and "go with --tpu" in result.stderr


def test_parity_judge_fails_a_wrong_output():
    batch = make_batch([(3, 3), (1, 9)], num_q_heads=4, num_kv_heads=2, max_num_batched_tokens=8)
    expected = expected_output(batch, sm_scale=0.125)
    out = ragged_paged_attention_jnp(*batch.args(), sm_scale=0.125)
    assert parity_passes({"jnp": max_abs_error(out, expected)})
    # One value of one live row off by 0.1: above the tolerance even of a TPU's bfloat16 pass.
    assert not parity_passes({"jnp": max_abs_error(out.at[3, 1, 5].add(0.1), expected)})
    assert not parity_passes({"jnp": max_abs_error(out.at[0, 0, 0].set(float("nan")), expected)})
    # A padding row (past the 4 live ones) is not judged.
    assert parity_passes({"jnp": max_abs_error(out.at[6].add(1.0), expected)})


def test_ladder_checks_run_a_rung(capsys):
    results = ladder_checks(ladder_rungs()[4:5])
    assert results == [("rung 5 (paged_decode_attention_prefetch)", True)]
    assert "PASS  rung 5 paged_decode_attention_prefetch: Passed" in capsys.readouterr().out


def test_ladder_rungs_cover_every_rung():
    # Every module of minilib/ladder is a rung with a solution, but the strict interpret mode,
    # its ledger and the deadlock guard (tools of the checkers and tests) and aligned_blocks
    # (notebook 07's step to whole tiles, which has no checker).
    folder = pathlib.Path(__file__).parents[2] / "minilib" / "ladder"
    not_rungs = {"__init__", "interpret", "watch", "deadlock", "aligned_blocks"}
    rungs = {f"minilib.ladder.{p.stem}" for p in folder.glob("*.py") if p.stem not in not_rungs}
    assert {solution.__module__ for _, _, solution in ladder_rungs()} == rungs
