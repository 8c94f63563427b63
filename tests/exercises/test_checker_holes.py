"""Holes of the checkers closed by class (issue 67): each wrong answer that passed now fails
with the cause it makes, a right answer still passes, and a different wrong answer does not
get that cause."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from exercise_answers import solution

import minilib.exercises as ex

# --- exercise 1.1: no copy of K or V per q head ---------------------------------------------


def _causal_mha(q, k, v, sm_scale):
    n = q.shape[0]
    scores = jnp.einsum("qhd,khd->hqk", q, k) * sm_scale
    scores = jnp.where(jnp.arange(n)[None, :] > jnp.arange(n)[:, None], -jnp.inf, scores)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)


def gqa_by_repeat(q, k, v, *, sm_scale):
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    return _causal_mha(q, k, v, sm_scale)


def gqa_by_broadcast_to(q, k, v, *, sm_scale):
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    shape = (n, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    k = jnp.broadcast_to(k[:, :, None], shape).reshape(n, num_q_heads, head_dim)
    v = jnp.broadcast_to(v[:, :, None], shape).reshape(n, num_q_heads, head_dim)
    return _causal_mha(q, k, v, sm_scale)


def gqa_repeating_v_only(q, k, v, *, sm_scale):
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    q_grouped = q.reshape(num_tokens, k.shape[1], group, head_dim)
    scores = jnp.einsum("qhgd,khd->hgqk", q_grouped, k) * sm_scale
    future = jnp.arange(num_tokens)[None, :] > jnp.arange(num_tokens)[:, None]
    probs = jax.nn.softmax(jnp.where(future, -jnp.inf, scores), axis=-1)
    probs = probs.reshape(num_q_heads, num_tokens, num_tokens)
    return jnp.einsum("hqk,khd->qhd", probs, jnp.repeat(v, group, axis=1))


GQA_RULE = "The rule of this exercise: no copy of K or V per q head"


@pytest.mark.parametrize(
    "answer, which",
    [
        (gqa_by_repeat, "K is copied"),
        (gqa_by_broadcast_to, "K is copied"),
        (jax.jit(gqa_by_repeat, static_argnames="sm_scale"), "K is copied"),
        (gqa_repeating_v_only, "V is copied"),
    ],
    ids=["repeat", "broadcast_to", "jitted_repeat", "repeat_v_only"],
)
def test_a_gqa_that_copies_k_or_v_per_q_head_fails_with_the_rule(answer, which):
    result = ex.check_grouped_query_attention(answer, verbose=False)
    assert result.status == "failed", result.report
    assert "the numbers are right" in result.report and which in result.report, result.report
    assert GQA_RULE in result.report, result.report


@pytest.mark.parametrize("jitted", [False, True])
def test_a_grouped_gqa_passes(jitted):
    answer = solution("ex01_heads", "grouped_query_attention")
    if jitted:
        answer = jax.jit(answer, static_argnames="sm_scale")
    result = ex.check_grouped_query_attention(answer, verbose=False)
    assert result.passed, result.report


def test_a_gqa_with_wrong_numbers_is_named_for_its_numbers_not_the_rule():
    def repeat_and_no_scale(q, k, v, *, sm_scale):
        return gqa_by_repeat(q, k, v, sm_scale=1.0)

    result = ex.check_grouped_query_attention(repeat_and_no_scale, verbose=False)
    assert "not multiplied by sm_scale" in result.report, result.report
    assert GQA_RULE not in result.report


# --- exercise 2.2: a gather that ignores the page table --------------------------------------


def gather_in_pool_order(kv_pages, pages, kv_len):
    _, _, combined, head_dim = kv_pages.shape
    tokens = kv_pages.reshape(-1, combined, head_dim)[:kv_len]
    return tokens[:, 0::2], tokens[:, 1::2]


def gather_first_pages_of_the_pool(kv_pages, pages, kv_len):
    _, _, combined, head_dim = kv_pages.shape
    tokens = kv_pages[: len(pages)].reshape(-1, combined, head_dim)[:kv_len]
    return tokens[:, 0::2], tokens[:, 1::2]


def gather_pages_reversed(kv_pages, pages, kv_len):
    # Another wrong order: the page table read backwards. It reads the page table, so the
    # cause "ignores the page table" must not be named.
    _, page_size, combined, head_dim = kv_pages.shape
    used = jnp.asarray(pages)[: -(-kv_len // page_size)][::-1]
    tokens = kv_pages[used].reshape(-1, combined, head_dim)[:kv_len]
    return tokens[:, 0::2], tokens[:, 1::2]


IGNORES_TABLE = "the gather ignores the page table"


@pytest.mark.parametrize("answer", [gather_in_pool_order, gather_first_pages_of_the_pool])
def test_a_gather_that_ignores_the_page_table_is_named(answer):
    result = ex.check_gather_kv(answer, verbose=False)
    assert result.status == "failed", result.report
    assert f"Likely cause: {IGNORES_TABLE}" in result.report, result.report


def test_another_wrong_gather_is_not_said_to_ignore_the_page_table():
    result = ex.check_gather_kv(gather_pages_reversed, verbose=False)
    assert result.status == "failed", result.report
    assert IGNORES_TABLE not in result.report, result.report


def test_the_right_gather_passes():
    result = ex.check_gather_kv(solution("ex02_paged_cache", "gather_kv"), verbose=False)
    assert result.passed, result.report


# --- rung 4: a single-buffered kernel ---------------------------------------------------------


def test_a_single_buffered_kernel_with_a_wrong_output_is_not_said_to_be_right():
    """The rung's requirement is said only when the output was checked right: with a wrong
    sm_scale as well, the report says the output is wrong too."""
    from ladder_wrong_answers import rung4

    single = rung4("single_buffered")

    def single_and_wrong_scale(*args, sm_scale, **kwargs):
        return single(*args, sm_scale=2 * sm_scale, **kwargs)

    result = ex.check_double_buffered_decode(single_and_wrong_scale, verbose=False)
    assert "no copy was in flight when it started" in result.report, result.report
    assert "The output is wrong too" in result.report, result.report
    assert "requires double buffering" not in result.report, result.report
