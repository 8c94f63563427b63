"""Every exercise checker, run three ways:

* against its worked solution in `solutions/`: it must pass;
* against a plausible wrong answer, a mistake learners make: it must fail, and say why;
* against the unfilled stub: it must report "not attempted" and not raise.

And the checkers' own promises: they never raise on a learner's error, they print their report
unless told not to, and every one of them is used by a notebook.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minilib.exercises as ex

ROOT = Path(__file__).resolve().parents[1]


def solution(module: str, name: str):
    """Function `name` of solutions/<module>.py (a folder, not a package, kept apart from
    minilib so that learners do not import it by accident)."""
    path = ROOT / "solutions" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"solutions_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


# --- plausible wrong answers, one per exercise ------------------------------------------------


def pages_round_up_wrong(kv_len, page_size):
    return kv_len // page_size + 1  # one page too many when page_size divides kv_len


def kv_head_interleaved(q_head, num_q_heads, num_kv_heads):
    return q_head % num_kv_heads  # deals q heads out in turn instead of consecutive groups


def repeat_kv_tiled(x, num_q_heads):
    return jnp.tile(x, (1, num_q_heads // x.shape[1], 1))  # 0 1 0 1 instead of 0 0 1 1


def token_location_no_page_table(t, pages, page_size):
    return t // page_size, t % page_size  # the page column, not the page


def gather_kv_halves(kv_pages, pages, kv_len):
    # K taken as the first half of the combined head axis, V as the second: not interleaved.
    _, page_size, combined, head_dim = kv_pages.shape
    tokens = kv_pages[pages].reshape(-1, combined, head_dim)[:kv_len]
    return tokens[:, : combined // 2], tokens[:, combined // 2 :]


def causal_mask_no_offset(q_len, kv_len):
    # Treats the new rows as the first q_len tokens instead of the last.
    return jnp.arange(kv_len)[None, :] > jnp.arange(q_len)[:, None]


def seq_for_row_left(cu_q_lens, num_seqs, row):
    # side="left": a row at a sequence boundary goes to the sequence that ends there.
    n = int(num_seqs[0])
    return int(np.searchsorted(np.asarray(cu_q_lens)[1 : n + 1], row, side="left"))


def attend_cap_after_mask(q, k, v, *, sm_scale, soft_cap):
    # Soft-caps after masking, so masked keys get the score -soft_cap instead of ~-inf.
    q_len, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k) * sm_scale
    q_pos = (k.shape[0] - q_len) + jnp.arange(q_len)[:, None]
    scores = jnp.where(jnp.arange(k.shape[0])[None, :] > q_pos, -1e30, scores)
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)


def sliding_window_off_by_one(q_len, kv_len, sliding_window):
    # Lets each row see sliding_window + 1 keys.
    q_pos = (kv_len - q_len) + jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(kv_len)[None, :]
    return (k_pos > q_pos) | (k_pos < q_pos - sliding_window)


def validate_every_slot(kv_lens, cu_q_lens, num_seqs):
    # Checks the padding slots too, which may hold anything.
    for i in range(len(kv_lens)):
        if cu_q_lens[i + 1] - cu_q_lens[i] > kv_lens[i]:
            raise ValueError(f"sequence {i}: q_len > kv_len")


def online_softmax_no_rescale(m, l, acc, scores, v):
    # Rescales l but forgets acc when the max rises.
    m_new = jnp.maximum(m, scores.max(-1))
    alpha, p = jnp.exp(m - m_new), jnp.exp(scores - m_new[:, None])
    return m_new, alpha * l + p.sum(-1), acc + p @ v


def softmax_kernel_without_max(x_ref, o_ref):
    # exp overflows for large scores without subtracting the row's max.
    e = jnp.exp(x_ref[...])
    o_ref[...] = e / e.sum(axis=-1, keepdims=True)


def kv_blocks_ignoring_causality(first_q_pos, last_q_pos, kv_len, block_len, sliding_window):
    # Visits every block up to kv_len: right answers, but copies blocks no row can see.
    first = 0 if sliding_window is None else max(first_q_pos - sliding_window + 1, 0) // block_len
    return first, -(-kv_len // block_len)


def decode_kv_bytes_tokens_not_pages(kv_lens, page_size, num_kv_heads, head_dim, itemsize):
    # Counts tokens, but the cache is read in whole pages.
    return sum(kv_lens) * 2 * num_kv_heads * head_dim * itemsize


def can_admit_whole_prompt(num_prompt_tokens, *, token_budget_left, num_free_pages, page_size,
                           num_running, max_num_seqs):  # fmt: skip
    # Asks for the pages of the whole prompt, not just of this step's first chunk.
    return (num_running < max_num_seqs and token_budget_left > 0
            and -(-num_prompt_tokens // page_size) <= num_free_pages)  # fmt: skip


def preempt_keeps_num_computed(request, allocator):
    # Frees the pages but still believes their K/V is cached.
    allocator.free(request.pages)
    request.pages = []


# (checker, solutions module, function name, wrong answer)
EXERCISES = [
    (ex.check_pages_needed, "ex00_tour", "pages_needed", pages_round_up_wrong),
    (ex.check_kv_head_for_q_head, "ex01_heads", "kv_head_for_q_head", kv_head_interleaved),
    (ex.check_repeat_kv, "ex01_heads", "repeat_kv", repeat_kv_tiled),
    (ex.check_token_location, "ex02_paged_cache", "token_location", token_location_no_page_table),
    (ex.check_gather_kv, "ex02_paged_cache", "gather_kv", gather_kv_halves),
    (ex.check_causal_mask, "ex03_ragged", "causal_mask", causal_mask_no_offset),
    (ex.check_seq_for_row, "ex03_ragged", "seq_for_row", seq_for_row_left),
    (ex.check_attend_soft_cap, "ex04_reference", "attend_soft_cap", attend_cap_after_mask),
    (
        ex.check_sliding_window_mask,
        "ex04_reference",
        "sliding_window_mask",
        sliding_window_off_by_one,
    ),
    (ex.check_validate_q_lens, "ex05_validation", "validate_q_lens", validate_every_slot),
    (
        ex.check_online_softmax_update,
        "ex06_online_softmax",
        "online_softmax_update",
        online_softmax_no_rescale,
    ),
    (ex.check_softmax_kernel, "ex07_pallas", "softmax_kernel", softmax_kernel_without_max),
    (
        ex.check_kv_blocks_to_visit,
        "ex08_kernel",
        "kv_blocks_to_visit",
        kv_blocks_ignoring_causality,
    ),
    (
        ex.check_decode_kv_bytes,
        "ex09_performance",
        "decode_kv_bytes",
        decode_kv_bytes_tokens_not_pages,
    ),
    (ex.check_can_admit, "ex10_engine", "can_admit", can_admit_whole_prompt),
    (ex.check_preempt, "ex10_engine", "preempt", preempt_keeps_num_computed),
]
IDS = [checker.__name__.removeprefix("check_") for checker, *_ in EXERCISES]


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_solution_passes(checker, module, name, wrong):
    result = checker(solution(module, name), verbose=False)
    assert result.passed, result.report
    assert bool(result) and result.cases_run > 0


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_wrong_answer_fails_and_says_why(checker, module, name, wrong):
    result = checker(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert not result
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
    if checker is ex.check_validate_q_lens:  # returning None is how a validator says "valid"
        pytest.skip("validators return None")
    result = checker(lambda *args, **kwargs: None, verbose=False)
    assert result.status == "failed", result.report


def test_checkers_print_their_report(capsys):
    result = ex.check_pages_needed(solution("ex00_tour", "pages_needed"))
    assert capsys.readouterr().out.strip() == result.report
    assert result.report.startswith("Passed")


def test_other_seeds_pass_too():
    for seed in (1, 2):
        for checker, module, name, _ in EXERCISES:
            assert checker(solution(module, name), seed=seed, verbose=False), checker.__name__


def test_every_checker_is_tested_and_used_in_a_notebook():
    checkers = {n for n in ex.__all__ if n.startswith("check_")}
    assert checkers == {checker.__name__ for checker, *_ in EXERCISES}
    notebook_code = ""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code":
                notebook_code += "".join(cell["source"])
    unused = [name for name in sorted(checkers) if f"{name}(" not in notebook_code]
    assert not unused, f"checkers no notebook calls: {unused}"
