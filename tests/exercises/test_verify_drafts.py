"""Exercise 10.4's checker, `check_verify_drafts`: the classic mistakes of a rejection sampler
fail with their cause, its greedy cases are the engine's, and its distribution test has the
power to see a wrong sampler."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from exercise_answers import solution

import minilib.exercises as ex
from minilib.engine.spec_decode import rejection_sample
from minilib.exercises import ex10_rejection
from minilib.exercises.comparisons import Mismatch


def verify(probs, drafts, uniforms, sample, *, keep, remove=True, stop=True, bonus_row=0):
    """A learner's answer with one thing changed."""
    tokens = []
    for i, draft in enumerate(drafts):
        if keep(uniforms[i], probs[i], int(draft)):
            tokens.append(int(draft))
            continue
        residual = probs[i].copy()
        if remove:
            residual[draft] = 0.0
        tokens.append(sample(residual / residual.sum()))
        if stop:
            return tokens
    tokens.append(sample(probs[len(drafts) + bonus_row]))
    return tokens


def right(u, p, x):
    return u < p[x]


def threshold(probs, drafts, uniforms, sample):
    return verify(probs, drafts, uniforms, sample, keep=lambda u, p, x: p[x] > 0.5)


def argmax_probability(probs, drafts, uniforms, sample):
    return verify(probs, drafts, uniforms, sample, keep=lambda u, p, x: u < p.max())


def mass_kept(probs, drafts, uniforms, sample):
    return verify(probs, drafts, uniforms, sample, keep=right, remove=False)


def goes_on(probs, drafts, uniforms, sample):
    return verify(probs, drafts, uniforms, sample, keep=right, stop=False)


def bonus_from_row_k_minus_1(probs, drafts, uniforms, sample):
    return verify(probs, drafts, uniforms, sample, keep=right, bonus_row=-1)


def no_bonus(probs, drafts, uniforms, sample):
    tokens = verify(probs, drafts, uniforms, sample, keep=right)
    return tokens[: len(drafts)]  # all kept: the bonus cut off; a rejection: shorter anyway


WRONG = [
    (threshold, "A fixed threshold (p_i(x_i) > 0.5)"),
    (argmax_probability, "not u_i < max(p_i)"),
    (mass_kept, "the rejected draft's mass taken out"),
    (goes_on, "the first rejection ends the output"),
    (no_bonus, "one more token follows: the bonus token"),
    (bonus_from_row_k_minus_1, "not from probs[k - 1]"),
]


@pytest.mark.parametrize("wrong, cause", WRONG, ids=[w.__name__ for w, _ in WRONG])
def test_a_classic_mistake_fails_with_its_cause_and_no_other(wrong, cause):
    result = ex.check_verify_drafts(wrong, verbose=False)
    assert result.status == "failed", result.report
    assert "Likely cause:" in result.report, result.report
    assert cause in result.report, result.report
    named = [c for c in ex10_rejection._rejection_mistakes() if c in result.report]
    assert len(named) == 1, result.report


def test_an_inverted_comparison_is_told_that_a_certain_draft_is_always_kept():
    def inverted(probs, drafts, uniforms, sample):  # u > p: keeps unlikely drafts
        return verify(probs, drafts, uniforms, sample, keep=lambda u, p, x: u > p[x])

    result = ex.check_verify_drafts(inverted, verbose=False)
    assert result.status == "failed", result.report
    assert "a draft with p_i(x_i) = 1\n  is always kept (u_i < 1)" in result.report


def test_a_replacement_not_renormalised_is_told_to_renormalise():
    def unnormalised(probs, drafts, uniforms, sample):
        tokens = []
        for i, draft in enumerate(drafts):
            if uniforms[i] < probs[i, draft]:
                tokens.append(int(draft))
                continue
            residual = probs[i].copy()
            residual[draft] = 0.0
            return [*tokens, sample(residual)]  # sums to 1 - p_i(x_i)
        return [*tokens, sample(probs[len(drafts)])]

    result = ex.check_verify_drafts(unnormalised, verbose=False)
    assert result.status == "failed", result.report
    assert "renormalise: p / p.sum()" in result.report, result.report


def test_the_greedy_cases_expect_the_engines_tokens():
    """The checker's greedy answers (the argmax path) are what the engine's rejection sampler
    gives at temperature 0, its logits the log of the one-hot rows."""
    for seed in (0, 1):
        for case in ex10_rejection._cases(seed):
            kind, probs, drafts, _, _ = case.args
            if kind != "greedy":
                continue
            with np.errstate(divide="ignore"):
                logits = jnp.asarray(np.log(probs)[None].clip(-1e9), jnp.float32)
            tokens, accepted = rejection_sample(
                logits,
                jnp.asarray([drafts], jnp.int32),
                jnp.asarray([len(drafts)]),
                jnp.zeros((1, 2), jnp.uint32),
                jnp.zeros(1, jnp.int32),
                jnp.zeros(1),
                jnp.zeros(1, jnp.int32),
                jnp.ones(1),
            )
            engine = tokens[0, : int(accepted[0]) + 1].tolist()
            assert engine == ex10_rejection._argmax_path(probs, drafts), case.description


def test_the_distribution_test_passes_the_reference_and_fails_a_sampler_keeping_the_mass():
    probs, drafts = ex10_rejection.ROWS[:3], [0, 2]
    exact = ex10_rejection.exact_output_distribution(probs, drafts)
    assert abs(sum(exact.values()) - 1) < 1e-12
    case = ex10_rejection._cases(0)[-1]
    for seed in (1040, 1041, 1042):
        counts = ex10_rejection._draw_outputs(ex10_rejection.verify_drafts, probs, drafts, seed)
        ex10_rejection._compare_distribution(exact, counts, case)  # no Mismatch
    counts = ex10_rejection._draw_outputs(mass_kept, probs, drafts, 1040)
    with pytest.raises(Mismatch, match="never gives"):  # a rejected draft, emitted
        ex10_rejection._compare_distribution(exact, counts, case)


def test_an_answer_with_its_own_random_numbers_fails():
    rng = np.random.default_rng(0)

    def own_uniforms(probs, drafts, uniforms, sample):
        return solution("ex10_engine", "verify_drafts")(
            probs, drafts, rng.random(len(drafts)), sample
        )

    result = ex.check_verify_drafts(own_uniforms, verbose=False)
    assert result.status == "failed", result.report


def test_the_chi_square_sees_a_distribution_that_is_only_a_little_off():
    """Every output possible, but the replacement drawn half the time from p_i unchanged and
    redrawn if it is the draft: the frequencies are off, not the outputs."""
    probs, drafts = ex10_rejection.ROWS[:3], [0, 2]
    exact = ex10_rejection.exact_output_distribution(probs, drafts)

    def skewed(probs, drafts, uniforms, sample):
        tokens = []
        for i, draft in enumerate(drafts):
            if uniforms[i] < probs[i, draft]:
                tokens.append(int(draft))
                continue
            flat = np.where(np.arange(probs.shape[1]) == draft, 0.0, 1.0)  # uniform, not p_i
            return [*tokens, sample(flat / flat.sum())]
        return [*tokens, sample(probs[len(drafts)])]

    counts = ex10_rejection._draw_outputs(skewed, probs, drafts, 1040)
    case = ex10_rejection._cases(0)[-1]
    with pytest.raises(Mismatch, match="do not follow the target model's distribution"):
        ex10_rejection._compare_distribution(exact, counts, case)
