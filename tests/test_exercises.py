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
import threading
import time
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


# --- robustness: every checker, NumPy answers, wrong types, errors, endless loops -------------
#
# These tests run over EXERCISES, so a checker added there is covered too. Two tables say
# where an exercise differs from the usual "a function that returns arrays or numbers":
#   NUMPY_NOT_APPLICABLE: why the exercise cannot be solved in NumPy;
#   WRONG_TYPE: a wrong-type answer, for exercises whose answer is not a returned value.

NUMPY_NOT_APPLICABLE = {
    ex.check_softmax_kernel: "a Pallas kernel body computes with jnp on refs",
}


def validator_returning_false(kv_lens, cu_q_lens, num_seqs):
    return False  # a verdict returned instead of a ValueError raised


def kernel_returning_instead_of_writing(x_ref, o_ref):
    x = x_ref[...]
    e = jnp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)  # o_ref is never written


WRONG_TYPE = {
    ex.check_validate_q_lens: validator_returning_false,
    ex.check_softmax_kernel: kernel_returning_instead_of_writing,
}


def to_numpy(x):
    """jax arrays to NumPy, through tuples, lists and dicts; anything else as it is."""
    if isinstance(x, jax.Array):
        return np.asarray(x)
    if isinstance(x, tuple | list):
        return type(x)(to_numpy(v) for v in x)
    if isinstance(x, dict):
        return {k: to_numpy(v) for k, v in x.items()}
    return x


def numpy_version(fn):
    """fn as a NumPy learner would hand it in: NumPy in, NumPy out."""

    def in_numpy(*args, **kwargs):
        return to_numpy(fn(*to_numpy(args), **to_numpy(kwargs)))

    return in_numpy


def map_leaves(x, leaf):
    if isinstance(x, tuple | list):
        return type(x)(map_leaves(v, leaf) for v in x)
    if x is None:
        return x
    return leaf(x)


def as_strings(fn):
    """The right values, as strings: '3' for 3, an array of '0.5' for an array of 0.5."""
    return lambda *a, **k: map_leaves(fn(*a, **k), lambda v: np.asarray(v).astype(str))


def as_one_element_arrays(fn):
    """Every number wrapped in a 1-element array, every array made an object array."""

    def leaf(v):
        v = np.asarray(v)
        return v.reshape(1) if v.ndim == 0 else v.astype(object)

    return lambda *a, **k: map_leaves(fn(*a, **k), leaf)


def returns_a_string(*args, **kwargs):
    return "42"


def wrong_type_answers(checker, module, name):
    if checker in WRONG_TYPE:
        return [WRONG_TYPE[checker]]
    good = solution(module, name)
    return [returns_a_string, as_strings(good), as_one_element_arrays(good)]


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_numpy_solution_passes(checker, module, name, wrong):
    if checker in NUMPY_NOT_APPLICABLE:
        pytest.skip(NUMPY_NOT_APPLICABLE[checker])
    result = checker(numpy_version(solution(module, name)), verbose=False)
    assert result.passed, result.report


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_wrong_type_answers_fail_with_a_message(checker, module, name, wrong):
    for answer in wrong_type_answers(checker, module, name):
        result = checker(answer, verbose=False)
        assert result.status == "failed", result.report
        assert "could not be compared" not in result.report, result.report  # a clear message
        assert any(w in result.report for w in ("expected", "got", "returned", "raised"))


@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt, RecursionError, MemoryError])
@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_any_exception_is_reported_not_raised(checker, module, name, wrong, error):
    def raising(*args, **kwargs):
        raise error("from the learner")

    result = checker(raising, verbose=False)
    assert result.status == "failed", result.report
    assert f"your function raised {error.__name__}: from the learner" in result.report
    assert 'raise error("from the learner")' in result.report  # the learner's line


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISES, ids=IDS)
def test_endless_loop_is_stopped_in_time(checker, module, name, wrong, monkeypatch):
    from minilib.exercises import checking

    monkeypatch.setattr(checking, "TIME_LIMIT_SECONDS", 1.0)
    monkeypatch.setattr(checking, "SLOWER_THAN_REFERENCE", 2)

    def endless(*args, **kwargs):
        while True:
            pass

    start = time.perf_counter()
    result = checker(endless, verbose=False)
    assert time.perf_counter() - start < 30  # the reference's compiles plus 1-2 s waits
    assert result.status == "failed"
    assert "took too long: stopped after" in result.report
    assert "s (the time limit of a case)" in result.report


def test_endless_loop_thread_is_stopped():
    from minilib.exercises import checking

    def endless():
        while True:
            pass

    before = threading.active_count()
    finished, _, _ = checking.call_with_time_limit(endless, (), {}, 0.2)
    assert not finished
    deadline = time.perf_counter() + 5
    while threading.active_count() > before and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before, "the looping thread should have been stopped"


def test_a_sleeping_function_does_not_hold_the_check():
    start = time.perf_counter()
    from minilib.exercises import checking

    finished, _, _ = checking.call_with_time_limit(time.sleep, (60,), {}, 0.3)
    assert not finished and time.perf_counter() - start < 2


def online_softmax_update_numpy(m, l, acc, scores, v):  # noqa: E741
    # A correct NumPy answer, as a learner writes it: the inputs may be jax arrays.
    m, l, acc, scores, v = (np.asarray(a) for a in (m, l, acc, scores, v))
    m_new = np.maximum(m, scores.max(axis=-1))
    alpha = np.exp(m - m_new)
    p = np.exp(scores - m_new[:, None])
    return m_new, alpha * l + p.sum(axis=-1), alpha[:, None] * acc + p @ v


def test_numpy_online_softmax_passes():
    result = ex.check_online_softmax_update(online_softmax_update_numpy, verbose=False)
    assert result.passed, result.report


def test_strings_and_object_arrays_do_not_crash_repeat_kv():
    for answer in (
        lambda x, nq: np.full((x.shape[0], nq, x.shape[2]), "a"),
        lambda x, nq: np.asarray(jnp.repeat(x, nq // x.shape[1], axis=1)).astype(object),
        lambda x, nq: "repeated",
    ):
        result = ex.check_repeat_kv(answer, verbose=False)
        assert result.status == "failed" and "numbers" in result.report, result.report
        assert "could not be compared" not in result.report


def test_check_result_shows_nothing_more_in_a_notebook():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    code = (
        "from minilib.exercises import check_pages_needed\n"
        "def pages_needed(kv_len, page_size):\n"
        "    raise NotImplementedError('FILL ME IN')\n"
        "check_pages_needed(pages_needed)"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbclient.NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = nb.cells[0].outputs
    assert [o["output_type"] for o in outputs] == ["stream"], outputs
    assert outputs[0]["text"].startswith("Not attempted yet") and "CheckResult" not in str(outputs)


def test_check_result_still_tells_its_status():
    result = ex.check_pages_needed(pages_round_up_wrong, verbose=False)
    assert repr(result) == "CheckResult('pages_needed', status='failed')"
    assert result.status == "failed" and not result
