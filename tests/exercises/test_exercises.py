"""Every exercise checker, run three ways:

* against its worked solution in `solutions/`: it must pass;
* against a plausible wrong answer, a mistake learners make: it must fail, and say why;
* against the unfilled stub: it must report "not attempted" and not raise.

And the checkers' own promises: they never raise on a learner's error, they print their report
unless told not to, and every one of them is used by a notebook.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_close, one_case_per_path
from exercise_answers import (
    EXERCISES,
    IDS,
    KERNEL_CHECKERS,
    MORE_EXERCISES,
    ROOT,
    first_and_first_kernel,
    solution,
)

import minilib.exercises as ex


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_solution_passes(checker, module, name, wrong):
    result = checker(solution(module, name), verbose=False)
    assert result.passed, result.report
    assert bool(result) and result.cases_run > 0


@pytest.mark.parametrize("checker, module, name, wrong", first_and_first_kernel(EXERCISES, IDS))
def test_wrong_answer_fails_and_says_why(checker, module, name, wrong):
    result = checker(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert not result
    if checker not in KERNEL_CHECKERS:  # a kernel's DMA problem is no expected/got diff
        assert "expected" in result.report or "raised" in result.report, result.report
    assert "Likely cause:" in result.report, result.report


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_unfilled_stub_is_not_attempted(checker, module, name, wrong):
    def stub(*args, **kwargs):
        raise NotImplementedError("FILL ME IN")

    result = checker(stub, verbose=False)
    assert result.status == "not attempted", result.report
    assert not result


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_learner_errors_are_reported_not_raised(checker, module, name, wrong):
    def broken(*args, **kwargs):
        return 1 / 0

    result = checker(broken, verbose=False)
    assert result.status == "failed"
    assert "ZeroDivisionError" in result.report
    assert "return 1 / 0" in result.report, "the report should show the learner's line"


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_returning_none_is_reported(checker, module, name, wrong):
    if checker is ex.check_validate_page_indices:  # returning None: a validator's "valid"
        pytest.skip("validators return None")
    result = checker(lambda *args, **kwargs: None, verbose=False)
    assert result.status == "failed", result.report


def test_checkers_print_their_report(capsys):
    result = ex.check_live_seq_lens(solution("ex00_tour", "live_seq_lens"))
    assert capsys.readouterr().out.strip() == result.report
    assert result.report.startswith("Passed")


# Each checker on two more seeds: the first checker's seed 1 on every stack (each checker
# passes its default seed there), the rest once, in .venv.
OTHER_SEEDS = one_case_per_path(
    [
        pytest.param(exercise, seed, id=f"{exercise[0].__name__}-seed{seed}")
        for exercise in EXERCISES
        for seed in (1, 2)
    ],
    f"{EXERCISES[0][0].__name__}-seed1",
)


@pytest.mark.parametrize("exercise, seed", OTHER_SEEDS)
def test_other_seeds_pass_too(exercise, seed):
    checker, module, name, _ = exercise
    assert checker(solution(module, name), seed=seed, verbose=False), checker.__name__


def test_every_checker_is_tested_and_used_in_a_notebook():
    checkers = {n for n in ex.__all__ if n.startswith("check_")}
    assert checkers == {checker.__name__ for checker, *_ in EXERCISES + MORE_EXERCISES}
    notebook_code = ""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code":
                notebook_code += "".join(cell["source"])
    unused = [name for name in sorted(checkers) if f"{name}(" not in notebook_code]
    assert not unused, f"checkers no notebook calls: {unused}"


@pytest.mark.parametrize(
    "checker, module, name, wrong, cause",
    MORE_EXERCISES,
    ids=[checker.__name__.removeprefix("check_") for checker, *_ in MORE_EXERCISES],
)
def test_solution_passes_wrong_answer_fails_stub_not_attempted(checker, module, name, wrong, cause):
    passed = checker(solution(module, name), verbose=False)
    assert passed.passed and passed.cases_run > 1, passed.report

    failed = checker(wrong, verbose=False)
    assert failed.status == "failed", failed.report
    assert "Likely cause:" in failed.report and cause in failed.report, failed.report

    def stub(*args, **kwargs):
        raise NotImplementedError("FILL ME IN")

    assert checker(stub, verbose=False).status == "not attempted"


def decode_attention_one_seq(q, kv_pages, kv_len, pages, *, sm_scale):
    # One sequence: q [num_q_heads, head_dim], its kv_len and its row of page_indices.
    num_q_heads, head_dim = q.shape
    combined = kv_pages.shape[2]
    slots = kv_pages[pages].reshape(-1, combined, head_dim)
    live = jnp.arange(slots.shape[0]) < kv_len
    slots = jnp.where(live[:, None, None], slots, 0.0)
    k, v = slots[:, 0::2], slots[:, 1::2]
    scores = jnp.einsum("hgd,khd->hgk", q.reshape(combined // 2, -1, head_dim), k) * sm_scale
    scores = jnp.where(live, scores, -1e30)
    out = jnp.einsum("hgk,khd->hgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(num_q_heads, head_dim)


def decode_attention_loop_over_slots(q, kv_pages, kv_lens, page_indices, *, sm_scale):
    # A Python loop over range(q.shape[0]): it runs under jit, unrolled, one copy per slot.
    out = []
    for i in range(q.shape[0]):
        out.append(decode_attention_one_seq(q[i], kv_pages, kv_lens[i], page_indices[i],
                                            sm_scale=sm_scale))  # fmt: skip
    return jnp.stack(out)


def decode_attention_vmapped(q, kv_pages, kv_lens, page_indices, *, sm_scale):
    one_seq = functools.partial(decode_attention_one_seq, sm_scale=sm_scale)
    return jax.vmap(one_seq, in_axes=(0, None, 0, 0))(q, kv_pages, kv_lens, page_indices)


def test_decode_attention_checker_rejects_a_loop_over_the_slots_not_vmap():
    """A loop over range(q.shape[0]) runs under jit, and its output is right: the checker sees
    it unrolled, as a program that grows with the number of slots. jax.vmap does not unroll."""
    looped = ex.check_decode_attention(decode_attention_loop_over_slots, verbose=False)
    assert looped.status == "failed", looped.report
    assert "one copy of its body per sequence slot" in looped.report, looped.report
    assert "kv_pages[page_indices]" in looped.report, looped.report
    vmapped = ex.check_decode_attention(decode_attention_vmapped, verbose=False)
    assert vmapped.passed, vmapped.report


def test_decode_attention_checker_reference_matches_jax():
    """check_decode_attention compares with a small NumPy reference: it must agree with JAX's
    own reference on a NaN-padded batch."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention as jax_reference,
    )

    from minilib.batch import make_batch
    from minilib.exercises.ex06_vectorized import _reference

    batch = make_batch([(1, 5), (1, 16), (1, 1)], num_q_heads=6, num_kv_heads=2, page_size=4)
    ours = _reference(batch.q, batch.kv_pages, batch.kv_lens, batch.page_indices, sm_scale=0.3)
    theirs = jax_reference(*batch.args(), sm_scale=0.3)
    assert_close(ours, theirs, batch.q.dtype)
