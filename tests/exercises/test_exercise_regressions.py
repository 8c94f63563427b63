"""Wrong answers that once passed a checker, and right answers that once failed: each gets its
verdict now, with its cause."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exercise_answers import solution
from once_passed import ONCE_PASSED, cache_full_pages_skipping_cached_hashes

import minilib.exercises as ex


def next_work_numpy_ints(seq, page, kv_lens, num_seqs, page_size):
    kv_lens = np.asarray(kv_lens)
    if (page + 1) * page_size < kv_lens[seq]:
        return np.int64(seq), np.int64(page + 1)
    later = np.nonzero(kv_lens[seq + 1 : num_seqs] > 0)[0]
    return (np.int32(seq + 1 + later[0]), np.int32(0)) if len(later) else None


def next_work_zero_d_arrays(seq, page, kv_lens, num_seqs, page_size):
    nxt = solution("ex08_ladder", "next_work")(seq, page, kv_lens, num_seqs, page_size)
    return None if nxt is None else (np.array(nxt[0]), jnp.asarray(nxt[1]))


def next_work_as_an_array(seq, page, kv_lens, num_seqs, page_size):
    nxt = solution("ex08_ladder", "next_work")(seq, page, kv_lens, num_seqs, page_size)
    return None if nxt is None else np.array(nxt)


@pytest.mark.parametrize(
    "answer", [next_work_numpy_ints, next_work_zero_d_arrays, next_work_as_an_array]
)
def test_next_work_takes_numpy_and_jax_integers(answer):
    result = ex.check_next_work(answer, verbose=False)
    assert result.passed, result.report


def mask_as_floats(q_len, kv_len):
    return solution("ex03_ragged", "causal_mask")(q_len, kv_len).astype(jnp.float32)


def mask_as_list(q_len, kv_len):
    return np.asarray(solution("ex03_ragged", "causal_mask")(q_len, kv_len)).tolist()


def window_mask_as_ints(q_len, kv_len, sliding_window):
    mask = solution("ex04_reference", "sliding_window_mask")(q_len, kv_len, sliding_window)
    return np.asarray(mask).astype(np.int32)


def window_mask_as_list(q_len, kv_len, sliding_window):
    mask = solution("ex04_reference", "sliding_window_mask")(q_len, kv_len, sliding_window)
    return np.asarray(mask).tolist()


@pytest.mark.parametrize(
    "checker, wrong, cause", ONCE_PASSED, ids=[w.__name__ for _, w, _ in ONCE_PASSED]
)
def test_wrong_answers_that_once_passed_fail_with_their_cause(checker, wrong, cause):
    result = checker(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert "Likely cause:" in result.report and cause in result.report, result.report


# (checker, a mask of the wrong type, words its report must hold): a type, not a cause.
MASKS_OF_THE_WRONG_TYPE = [
    (ex.check_causal_mask, mask_as_floats, "got an array of dtype float32"),
    (ex.check_causal_mask, mask_as_list, "got a list"),
    (ex.check_sliding_window_mask, window_mask_as_ints, "got an array of dtype int32"),
    (ex.check_sliding_window_mask, window_mask_as_list, "got a list"),
]


@pytest.mark.parametrize(
    "checker, wrong, words",
    MASKS_OF_THE_WRONG_TYPE,
    ids=[w.__name__ for _, w, _ in MASKS_OF_THE_WRONG_TYPE],
)
def test_masks_of_the_wrong_type_fail_saying_so(checker, wrong, words):
    result = checker(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert words in result.report, result.report
    assert "expected a boolean jax or NumPy array" in result.report, result.report
    assert "jnp.asarray(mask, dtype=bool)" in result.report, result.report


def test_an_engine_with_skipped_hashes_differs_from_dense_generate():
    """The engine run of check_cache_full_pages, where two requests compute the same first
    page in one step, rejects the skipping answer by itself: later requests hit a page
    computed after another prefix, and their tokens are not dense_generate's."""
    from minilib.exercises.ex10_engine import run_caching_engine

    differ = "requests whose tokens differ from dense_generate's"
    right = solution("ex10_engine", "cache_full_pages")
    assert run_caching_engine(right, scenario="same prefix in one step")[differ] == []
    wrong = run_caching_engine(
        cache_full_pages_skipping_cached_hashes, scenario="same prefix in one step"
    )
    assert wrong[differ], wrong


def preempt_freeing_the_last_page_first(request, allocator):
    # Right: the order pages go back to the pool in is the function's choice.
    for page in reversed(request.pages):
        allocator.free([page])
    request.pages, request.num_computed = [], 0


def test_preempt_may_free_pages_in_any_order():
    result = ex.check_preempt(preempt_freeing_the_last_page_first, verbose=False)
    assert result.passed, result.report


# --- issue 43: wrong answers the checkers' cases let through, and one right answer they refused


def with_head_dim_scale(fn):
    """`fn` scaling by 1/sqrt(head_dim) whatever sm_scale it is given."""

    def ignoring_sm_scale(q, *args, sm_scale, **kwargs):
        return fn(q, *args, sm_scale=q.shape[-1] ** -0.5, **kwargs)

    return ignoring_sm_scale


def attend_soft_cap_by_hand(q, k, v, *, sm_scale, soft_cap, q_from_zero=False,
                            cap_before_scale=False):  # fmt: skip
    q_len, num_q_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    k, v = (jnp.repeat(x, num_q_heads // num_kv_heads, axis=1) for x in (k, v))
    scores = jnp.einsum("qhd,khd->hqk", q, k)
    if soft_cap is not None and cap_before_scale:  # caps q·k, then scales
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = scores * sm_scale
    if soft_cap is not None and not cap_before_scale:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    # q_from_zero: q row i at position i, not kv_len - q_len + i
    q_pos = (0 if q_from_zero else kv_len - q_len) + jnp.arange(q_len)[:, None]
    scores = jnp.where(jnp.arange(kv_len)[None, :] > q_pos, -1e30, scores)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)


def can_admit_sampled_token_in_the_chunk(num_prompt_tokens, *, token_budget_left,
                                         num_free_pages, page_size, num_running,
                                         max_num_seqs):  # fmt: skip
    # The token sampled after the prompt counted in the first chunk, when the budget has room.
    first_chunk = min(num_prompt_tokens + 1, token_budget_left)
    return (num_running < max_num_seqs and token_budget_left > 0
            and -(-first_chunk // page_size) <= num_free_pages)  # fmt: skip


def preempt_resetting_the_count(request, allocator):
    # Resets the count: right after a first preemption, wrong after a second.
    allocator.free(request.pages)
    request.pages, request.num_computed, request.num_preemptions = [], 0, 0


ONCE_PASSED_43 = [
    (ex.check_grouped_query_attention,
     with_head_dim_scale(solution("ex01_heads", "grouped_query_attention")), "1 / sqrt(head_dim)"),
    (ex.check_attend_soft_cap, with_head_dim_scale(solution("ex04_reference", "attend_soft_cap")),
     "1 / sqrt(head_dim)"),
    (ex.check_decode_attention,
     with_head_dim_scale(solution("ex06_vectorized", "decode_attention")), "1 / sqrt(head_dim)"),
    (ex.check_attend_soft_cap,
     functools.partial(attend_soft_cap_by_hand, q_from_zero=True), "the *last* q_len positions"),
    (ex.check_attend_soft_cap,
     functools.partial(attend_soft_cap_by_hand, cap_before_scale=True),
     "the soft cap is applied before sm_scale"),
    (ex.check_can_admit, can_admit_sampled_token_in_the_chunk, "the token sampled"),
    (ex.check_preempt, preempt_resetting_the_count, "setting it to 0 forgets them"),
]  # fmt: skip


@pytest.mark.parametrize(
    "checker, wrong, cause",
    ONCE_PASSED_43,
    ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(ONCE_PASSED_43)],
)
def test_wrong_answers_of_issue_43_fail_with_their_cause(checker, wrong, cause):
    result = checker(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert "Likely cause:" in result.report and cause in result.report, result.report


def test_the_right_answer_never_sees_sm_scale_equal_to_its_usual_value():
    """Every checker of a function taking sm_scale draws values other than head_dim ** -0.5."""
    from minilib.exercises import ex07_flash, ex08_ladder

    for case in [*ex07_flash._cases(0), *ex08_ladder._decode_cases(0)]:
        head_dim = case.args[0].shape[-1]
        assert abs(case.kwargs["sm_scale"] - head_dim**-0.5) > 0.01, case.description


def online_softmax_zeroing_masked_keys(m, l, acc, scores, v):  # noqa: E741
    # Right, defensively: a masked key weighs 0, so a fully masked first block leaves l = 0,
    # acc = 0 (minilib's leaves l = the block's size: each masked key weighs exp(0) there).
    m_new = jnp.maximum(m, scores.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(scores > -1e30, jnp.exp(scores - m_new[:, None]), 0.0)
    return m_new, alpha * l + p.sum(-1), alpha[:, None] * acc + p @ v


def online_softmax_masked_keys_out_of_the_max(m, l, acc, scores, v):  # noqa: E741
    # Right too: masked keys out of the max as well, so m stays -inf on a fully masked block.
    visible = scores > -1e30
    m_new = jnp.maximum(m, jnp.where(visible, scores, -jnp.inf).max(axis=-1))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - shift), 0.0)
    p = jnp.where(visible, jnp.exp(scores - shift[:, None]), 0.0)
    return m_new, alpha * l + p.sum(-1), alpha[:, None] * acc + p @ v


@pytest.mark.parametrize(
    "answer", [online_softmax_zeroing_masked_keys, online_softmax_masked_keys_out_of_the_max]
)
def test_online_softmax_accepts_any_state_of_a_row_that_saw_only_masked_keys(answer):
    result = ex.check_online_softmax_update(answer, verbose=False)
    assert result.passed, result.report
