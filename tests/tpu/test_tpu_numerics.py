"""minilib.tpu.numerics: a TPU's float32 matmuls (one bfloat16 pass) on the CPU, and the
checkers under them: each passes its own solution and still rejects a wrong answer.

The error of each solution against the float32 reference under the emulation, which
`BF16_PASS_TOLERANCE` is set from, is printed by

    PYTHONPATH=$PWD:$PWD/tests JAX_PLATFORMS=cpu python tests/tpu/test_tpu_numerics.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exercise_answers import (
    attend_cap_after_mask,
    decode_attention_masks_scores_only,
    grouped_query_attention_interleaved,
    online_softmax_no_rescale,
    solution,
)
from ladder_wrong_answers import WRONG_ANSWERS
from once_passed import ONCE_PASSED

import minilib.exercises as ex
from minilib.doctor import parity_passes, parity_smoke_check
from minilib.exercises import checking
from minilib.ladder.async_copy import paged_decode_attention_async_copy
from minilib.ladder.double_buffer import paged_decode_attention_double_buffered
from minilib.ladder.flash import flash_attention
from minilib.ladder.prefetch import paged_decode_attention_prefetch
from minilib.ladder.scalar_prefetch import paged_decode_attention
from minilib.tpu.numerics import (
    BF16_PASS_TOLERANCE,
    ENV_VAR,
    emulate_tpu_matmul_precision,
    emulating,
    one_bf16_pass,
)
from solutions.ex06_online_softmax import online_softmax_update
from solutions.ex06_vectorized import decode_attention

HIGHEST = jax.lax.Precision.HIGHEST


@pytest.fixture
def tpu_numerics(monkeypatch):
    """The emulation on. Switching it clears JAX's caches, so every case of a checker compiles
    afresh, which on a busy CI machine can pass the checkers' 30 s per case (a limit for
    endless loops, compiles included): these tests judge numbers, so a case gets a minute."""
    monkeypatch.setattr(checking, "TIME_LIMIT_SECONDS", 60.0)
    with emulate_tpu_matmul_precision():
        yield


def to_bf16_and_back(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def test_a_default_precision_matmul_is_one_bf16_pass():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b)
    exact = np.asarray(jnp.dot(x, y, precision=HIGHEST))
    one_pass = np.asarray(jnp.dot(to_bf16_and_back(x), to_bf16_and_back(y), precision=HIGHEST))
    assert not emulating() and not one_bf16_pass()
    np.testing.assert_array_equal(matmul(x, y), exact)
    with emulate_tpu_matmul_precision():
        assert emulating() and one_bf16_pass()
        np.testing.assert_array_equal(matmul(x, y), one_pass)  # compiled before: recompiled
        np.testing.assert_array_equal(jnp.einsum("ij,jk->ik", x, y), one_pass)
        assert np.abs(one_pass - exact).max() > 1e-3
        np.testing.assert_array_equal(jnp.dot(x, y, precision=HIGHEST), exact)
        bf16 = jnp.dot(x.astype(jnp.bfloat16), y.astype(jnp.bfloat16))  # not float32: as is
        assert bf16.dtype == jnp.bfloat16
    assert not emulating()
    np.testing.assert_array_equal(matmul(x, y), exact)


def test_the_environment_variable_switches_it_on_when_minilib_is_imported():
    code = "import minilib; from minilib.tpu.numerics import emulating; print(emulating())"
    for value, expected in [("1", "True"), ("", "False")]:
        env = {**os.environ, ENV_VAR: value}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert run.stdout.strip() == expected, run.stderr


def test_the_emulation_reaches_a_pallas_kernel_in_interpret_mode(tpu_numerics):
    # The doctor's parity check also shows it: its kernel is off JAX's reference by the bf16
    # pass (about 0.006) under the emulation, by 1e-6 without; it passes either way.
    errors, _ = parity_smoke_check()
    assert errors["kernel"] > 1e-3, errors
    assert parity_passes(errors), errors


def error_in(report: str) -> tuple[float, float]:
    """(max abs error, tolerance) of a failed comparison's report."""
    found = re.search(r"max abs error ([\d.e+-]+) \(tolerance ([\d.e+-]+)\)", report)
    assert found, report
    return float(found[1]), float(found[2])


def online_softmax_update_exact(m, l, acc, scores, v):
    # Right too, with P·V exact (on a TPU: six bfloat16 passes).
    with jax.default_matmul_precision("highest"):
        return online_softmax_update(m, l, acc, scores, v)


def test_exercise_6_passes_its_solution_and_rejects_no_rescale(tpu_numerics):
    for right in (online_softmax_update, online_softmax_update_exact):
        result = ex.check_online_softmax_update(right, verbose=False)
        assert result.passed, result.report
    wrong = ex.check_online_softmax_update(online_softmax_no_rescale, verbose=False)
    assert not wrong.passed and "acc is not rescaled" in wrong.report, wrong.report
    error, tolerance = error_in(wrong.report)
    assert tolerance == BF16_PASS_TOLERANCE and error > 20 * tolerance, wrong.report


def test_exercise_6_decode_attention_passes_its_solution_and_rejects_a_wrong_answer(
    tpu_numerics,
):
    right = ex.check_decode_attention(decode_attention, verbose=False)
    assert right.passed, right.report
    wrong = ex.check_decode_attention(decode_attention_masks_scores_only, verbose=False)
    assert not wrong.passed and "0 * NaN" in wrong.report, wrong.report


def normalised_after_pv(q, k, v, *, sm_scale, soft_cap=None):
    """Causal GQA attention of one sequence, right, but in flash attention's order: the
    unnormalised weights meet V, and the sum divides the result. On a TPU that rounds other
    numbers to bfloat16 than the reference does."""
    q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads, _ = k.shape
    q_grouped = q.reshape(q_len, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("qhgd,khd->hgqk", q_grouped, k) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    future = jnp.arange(kv_len)[None, :] > kv_len - q_len + jnp.arange(q_len)[:, None]
    scores = jnp.where(future, -1e30, scores)
    p = jnp.exp(scores - scores.max(-1, keepdims=True))
    out = jnp.einsum("hgqk,khd->qhgd", p, v) / jnp.moveaxis(p.sum(-1), -1, 0)[..., None]
    return out.reshape(q_len, num_q_heads, head_dim)


@pytest.mark.parametrize(
    "checker, wrong, cause",
    [
        (ex.check_grouped_query_attention, grouped_query_attention_interleaved, "h % num_kv"),
        (ex.check_attend_soft_cap, attend_cap_after_mask, "after masking"),
    ],
)
def test_exercises_1_and_4_pass_a_right_answer_in_another_order_and_reject_a_wrong_one(
    tpu_numerics, checker, wrong, cause
):
    right = checker(normalised_after_pv, verbose=False)
    assert right.passed, right.report
    result = checker(wrong, verbose=False)
    assert not result.passed and cause in result.report, result.report


def wrong_answer(rung: str, name: str):
    (found,) = [w for w in WRONG_ANSWERS if w.rung == rung and w.name == name]
    return found


@pytest.mark.parametrize(
    "checker, solution, wrong",
    [
        (ex.check_flash_attention, flash_attention, ("1a", "no alpha rescale")),
        # The bf16 accumulator: a wrong answer about precision, judged under the TPU's.
        pytest.param(ex.check_flash_pallas_call, flash_attention,
                     ("1b", "acc in bf16"), marks=pytest.mark.matrix, id="rung1b"),
        (ex.check_paged_decode_attention, paged_decode_attention, ("2", "init every page")),
        pytest.param(ex.check_paged_decode_async_copy, paged_decode_attention_async_copy,
                     ("3", "compute before wait"), marks=pytest.mark.matrix, id="rung3"),
        (ex.check_double_buffered_decode, paged_decode_attention_double_buffered,
         ("4", "one slot")),
        (ex.check_prefetching_decode, paged_decode_attention_prefetch,
         ("5", "first page started every step")),
    ],
    ids=["rung1", "rung1b", "rung2", "rung3", "rung4", "rung5"],
)  # fmt: skip
def test_a_kernel_checker_passes_its_solution_and_rejects_a_wrong_answer(
    tpu_numerics, checker, solution, wrong
):
    right = checker(solution, verbose=False)
    assert right.passed, right.report
    w = wrong_answer(*wrong)
    result = checker(w.make(), verbose=False)
    assert not result.passed
    for words in w.expect:
        assert words in result.report, f"{words!r} not in:\n{result.report}"
    if "max abs error" in result.report:  # a wrong output, not a wrong copy
        error, tolerance = error_in(result.report)
        assert tolerance == BF16_PASS_TOLERANCE and error > 10 * tolerance, result.report


# Exercise 10's checkers run the engine and compare its tokens with `dense_generate`: under a
# TPU's matmuls both sides round, in different orders. The solutions must still pass and the
# answers learners found must still fail, with their cause.
ENGINE_CHECKS = [c for c in ONCE_PASSED if c[0].__module__ == "minilib.exercises.ex10_engine"]


@pytest.mark.parametrize(
    "checker, wrong, cause", ENGINE_CHECKS, ids=[c[0].__name__ for c in ENGINE_CHECKS]
)
def test_an_engine_checker_passes_its_solution_and_rejects_a_wrong_answer(
    tpu_numerics, checker, wrong, cause
):
    right = checker(solution("ex10_engine", checker.__name__.removeprefix("check_")),
                    verbose=False)  # fmt: skip
    assert right.passed, right.report
    result = checker(wrong, verbose=False)
    assert result.status == "failed" and cause in result.report, result.report


def measure() -> None:
    """Print the max abs error of each solution under the emulation against the float32
    reference (the checkers' reference, exact at HIGHEST)."""
    from minilib.exercises import ex06_online_softmax as ex06
    from minilib.exercises import ex06_vectorized, ex07_flash, ex08_ladder
    from minilib.ladder.async_copy import paged_decode_attention_async_copy
    from minilib.ladder.flash import flash_attention_reference
    from minilib.ladder.scalar_prefetch import paged_decode_reference

    def error(got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        return float(np.nanmax(np.abs(got - want)))

    def ex06_states(fn, case):
        return np.concatenate([np.ravel(x) for s in ex06._run_blocks(fn)(*case.args) for x in s])

    with emulate_tpu_matmul_precision():
        cases = ex06._cases(0)
        worst = max(
            error(ex06_states(online_softmax_update, c), ex06_states(ex06._update, c))
            for c in cases
        )
        print(f"exercise 6, online_softmax_update: {worst:.2g}")
        worst = max(
            error(
                decode_attention(*c.args, **c.kwargs),
                ex06_vectorized._reference(*c.args, **c.kwargs),
            )
            for c in ex06_vectorized._cases(0)
        )
        print(f"exercise 6, decode_attention: {worst:.2g}")
        kernels = [
            ("rung 1, flash_attention", flash_attention, flash_attention_reference,
             ex07_flash._cases(0)),
            *[(f"rung {r}, {fn.__name__}", fn, paged_decode_reference, ex08_ladder._decode_cases(0))
              for r, fn in [(2, paged_decode_attention), (3, paged_decode_attention_async_copy),
                            (4, paged_decode_attention_double_buffered),
                            (5, paged_decode_attention_prefetch)]],
        ]  # fmt: skip
        for label, fn, reference, cases in kernels:
            worst = max(
                error(fn(*c.args, **c.kwargs, interpret=True), reference(*c.args, **c.kwargs))
                for c in cases
            )
            print(f"{label}: {worst:.2g}")


if __name__ == "__main__":
    measure()
