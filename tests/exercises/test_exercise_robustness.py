"""Every exercise checker's robustness: NumPy answers, wrong types, any exception, endless
loops, and how its result shows in a notebook."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exercise_answers import (
    ALL_EXERCISES,
    ALL_IDS,
    KERNEL_CHECKERS,
    ROOT,
    first_and_first_kernel,
    live_seq_lens_every_slot,
    solution,
)

import minilib.exercises as ex

# These tests run over EXERCISES and MORE_EXERCISES, so a checker added there is covered too.
# Two tables say where an exercise differs from the usual "a function that returns arrays or
# numbers":
#   NUMPY_NOT_APPLICABLE: why the exercise cannot be solved in NumPy;
#   WRONG_TYPE: a wrong-type answer, for exercises whose answer is not a returned value.
# The checking they test is shared by every checker: every exercise runs in .venv; on the other
# stacks the first exercise and the first kernel exercise.
EXERCISE_CASES = first_and_first_kernel(ALL_EXERCISES, ALL_IDS)


NUMPY_NOT_APPLICABLE = {
    ex.check_softmax_kernel: "a Pallas kernel body computes with jnp on refs",
    **{checker: "a Pallas kernel computes with jnp on refs" for checker in KERNEL_CHECKERS},
    ex.check_decode_attention: "the exercise is to vectorize in jnp: the checker runs it in jit",
}


def write_new_tokens_numpy(kv_pages, pages, kv_len, new_k, new_v):
    # A NumPy learner writes into a copy where the jnp solution uses .at[].set.
    kv_pages = np.array(kv_pages)
    n, page_size = len(new_k), kv_pages.shape[1]
    positions = kv_len - n + np.arange(n)
    page, slot = np.asarray(pages)[positions // page_size], positions % page_size
    kv_pages[page, slot, 0::2] = new_k
    kv_pages[page, slot, 1::2] = new_v
    return kv_pages


# Exercises whose jnp solution uses jnp-only functions: their NumPy solution, written apart.
NUMPY_SOLUTIONS = {ex.check_write_new_tokens: write_new_tokens_numpy}


def validator_returning_false(kv_pages, kv_lens, page_indices, num_seqs):
    return False  # a verdict returned instead of a ValueError raised


def kernel_returning_instead_of_writing(x_ref, o_ref):
    x = x_ref[...]
    e = jnp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)  # o_ref is never written


def preempt_counting_in_a_string(request, allocator):
    allocator.free(request.pages)
    request.pages, request.num_computed = [], "0"  # a string where a count belongs


def cache_full_pages_with_text_hashes(request, pool, page_size):
    from minilib.engine.prefix_cache import hash_block_tokens

    for i in range(len(request.cached_hashes), request.num_computed // page_size):
        parent = bytes.fromhex(request.cached_hashes[-1]) if request.cached_hashes else None
        block_hash = hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
        pool.cache_page(request.pages[i], block_hash.hex())  # a str where the hash belongs
        request.cached_hashes.append(block_hash.hex())


WRONG_TYPE = {
    ex.check_validate_page_indices: validator_returning_false,
    ex.check_preempt: preempt_counting_in_a_string,
    ex.check_cache_full_pages: cache_full_pages_with_text_hashes,
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


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISE_CASES)
def test_numpy_solution_passes(checker, module, name, wrong):
    if checker in NUMPY_NOT_APPLICABLE:
        pytest.skip(NUMPY_NOT_APPLICABLE[checker])
    in_numpy = NUMPY_SOLUTIONS.get(checker) or numpy_version(solution(module, name))
    result = checker(in_numpy, verbose=False)
    assert result.passed, result.report


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISE_CASES)
def test_wrong_type_answers_fail_with_a_message(checker, module, name, wrong):
    for answer in wrong_type_answers(checker, module, name):
        result = checker(answer, verbose=False)
        assert result.status == "failed", result.report
        assert "could not be compared" not in result.report, result.report  # a clear message
        assert any(w in result.report for w in ("expected", "got", "returned", "raised"))


@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt, RecursionError, MemoryError])
@pytest.mark.parametrize("checker, module, name, wrong", EXERCISE_CASES)
def test_any_exception_is_reported_not_raised(checker, module, name, wrong, error):
    def raising(*args, **kwargs):
        raise error("from the learner")

    result = checker(raising, verbose=False)
    assert result.status == "failed", result.report
    assert f"your function raised {error.__name__}: from the learner" in result.report
    assert 'raise error("from the learner")' in result.report  # the learner's line


@pytest.mark.parametrize("checker, module, name, wrong", EXERCISE_CASES)
def test_endless_loop_is_stopped_in_time(checker, module, name, wrong, monkeypatch):
    from minilib.exercises import checking, kernel_run

    monkeypatch.setattr(checking, "TIME_LIMIT_SECONDS", 1.0)
    monkeypatch.setattr(checking, "SLOWER_THAN_REFERENCE", 2)
    monkeypatch.setattr(kernel_run, "KERNEL_TIMEOUT_SECONDS", 1.0)  # the kernel checkers'
    # A kernel checker gives a stopped run time to wind down: no kernel runs here to do so.
    monkeypatch.setattr(checking, "STOP_GRACE_SECONDS", 0.2)

    def endless(*args, **kwargs):
        while True:
            pass

    threads_before = threading.active_count()
    start = time.perf_counter()
    result = checker(endless, verbose=False)
    assert time.perf_counter() - start < 30  # the reference's compiles plus 1-2 s waits
    assert result.status == "failed"
    if checker in KERNEL_CHECKERS:  # the kernel run's own limit
        assert "expected the kernel to finish; it was stopped after 1 s" in result.report
        assert "an endless loop" in result.report
    else:
        assert "took too long: stopped after" in result.report
        assert "s (the time limit of a case)" in result.report
    # and the looping thread was stopped, not left spinning behind the check
    deadline = time.perf_counter() + 5
    while threading.active_count() > threads_before and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == threads_before


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


def test_strings_and_object_arrays_do_not_crash_repeat_kv_pages():
    repeat = solution("ex01_heads", "repeat_kv_pages")
    for answer in (
        lambda kv_pages, nq: np.full(np.shape(repeat(kv_pages, nq)), "a"),
        lambda kv_pages, nq: np.asarray(repeat(kv_pages, nq)).astype(object),
        lambda kv_pages, nq: "repeated",
    ):
        result = ex.check_repeat_kv_pages(answer, verbose=False)
        assert result.status == "failed" and "numbers" in result.report, result.report
        assert "could not be compared" not in result.report


def test_check_result_shows_nothing_more_in_a_notebook():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    code = (
        "from minilib.exercises import check_live_seq_lens\n"
        "def live_seq_lens(kv_lens, cu_q_lens, num_seqs):\n"
        "    raise NotImplementedError('FILL ME IN')\n"
        "check_live_seq_lens(live_seq_lens)"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbclient.NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = nb.cells[0].outputs
    assert [o["output_type"] for o in outputs] == ["stream"], outputs
    assert outputs[0]["text"].startswith("Not attempted yet") and "CheckResult" not in str(outputs)


def test_check_result_still_tells_its_status():
    result = ex.check_live_seq_lens(live_seq_lens_every_slot, verbose=False)
    assert repr(result) == (
        "CheckResult('live_seq_lens', status='failed'; result.rerun() reruns the failing case)"
    )
    assert result.status == "failed" and not result
