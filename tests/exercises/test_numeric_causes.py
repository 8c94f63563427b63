"""The numerical mistakes of rungs 6 and 7, simulated in numpy (`ragged_mistakes`): each is
named only where the output is the one that mistake makes.

A rule that names a mistake checks its fact by rebuilding the mistake's output and comparing;
these tests feed each rule outputs where its fact is false (the right output, another
mistake's output) and check that it stays silent.
"""

from __future__ import annotations

import numpy as np
import pytest

from minilib.exercises import ex08_ladder, ex08_ragged
from minilib.exercises.decode_mistakes import decode_mistakes
from minilib.exercises.kernel_failures import likely_cause
from minilib.exercises.ragged_mistakes import (
    ROW_NO_FIRST_ROW,
    ROWS_BLOCK_LOCAL,
    ragged,
    ragged_mistakes,
)
from minilib.ladder.scalar_prefetch import paged_decode_reference

CASES = ex08_ragged._ragged_cases(0)
BLOCK_LOCAL = (ROWS_BLOCK_LOCAL, ROW_NO_FIRST_ROW)


def run(variant, case):
    return ragged(variant)(*case.args, **case.kwargs)


@pytest.mark.parametrize("k", range(len(CASES)))
def test_no_rule_names_its_mistake_for_the_right_output(k):
    # Each rule alone, on each case where its mistake changes the output: the right output is
    # not that mistake's, and the rule stays silent.
    case = CASES[k]
    right = run("right", case)
    for explanation, mistaken in ragged_mistakes().items():
        made = mistaken(*case.args, **case.kwargs)
        if made is None or np.allclose(made, right, atol=1e-3, equal_nan=True):
            continue  # not simulated here (no mask_value), or nothing changed (all idle)
        cause = likely_cause(right, case, {explanation: mistaken})
        assert cause.startswith("none of the usual mistakes"), (k, cause)


def test_a_wrong_output_that_is_no_usual_mistake_names_none():
    case = CASES[0]
    out = run("right", case)
    out[9] += 0.5  # one row of sequence 3 wrong, as no simulated mistake makes it
    cause = likely_cause(out, case, ragged_mistakes())
    assert cause.startswith("none of the usual mistakes"), cause


@pytest.mark.parametrize("variant", ["q_pos_no_first_row", "q_pos_from_q_block", "no_row_mask"])
def test_a_block_local_mask_is_not_named_for_another_mistake(variant):
    case = CASES[0]
    out = run(variant, case)
    assert not np.allclose(out, run("right", case), atol=1e-3)  # a failing output
    cause = likely_cause(out, case, ragged_mistakes())
    assert cause not in BLOCK_LOCAL, cause


@pytest.mark.parametrize(
    "variant, text",
    [("rows_block_local", ROWS_BLOCK_LOCAL), ("row_no_first_row", ROW_NO_FIRST_ROW)],
)
def test_a_block_local_mask_is_named_for_its_own_output(variant, text):
    case = CASES[0]
    out = run(variant, case)
    assert not np.allclose(out, run("right", case), atol=1e-3, equal_nan=True)
    assert likely_cause(out, case, ragged_mistakes()) == text


@pytest.mark.parametrize("variant", ["rows_block_local", "row_no_first_row"])
def test_a_block_local_mask_differs_only_past_the_first_q_block(variant):
    # The texts say "in a q block past the first": in q block 0 the row's place in the q block
    # is its place in the batch, and the mistake's output is the right one there.
    for case in CASES:
        block_q = case.kwargs["num_queries_per_block"]
        wrong, right = run(variant, case), run("right", case)
        np.testing.assert_allclose(wrong[:block_q], right[:block_q], atol=1e-12)


DECODE_CASES = ex08_ladder._decode_cases(0)
LENGTH_MASK = ("the length mask is one key too wide", "the length mask hides the token's own key")


@pytest.mark.parametrize("k", range(len(DECODE_CASES)))
def test_no_length_mask_rule_names_its_mistake_for_the_right_output(k):
    case = DECODE_CASES[k]
    right = np.asarray(paged_decode_reference(*case.args, **case.kwargs), np.float64)
    for explanation, mistaken in decode_mistakes().items():
        if not explanation.startswith(LENGTH_MASK):
            continue
        if np.allclose(mistaken(*case.args, **case.kwargs), right, atol=1e-3, equal_nan=True):
            continue  # no sequence this mistake changes (no live sequence)
        cause = likely_cause(right, case, {explanation: mistaken})
        assert cause.startswith("none of the usual mistakes"), (k, cause)


def test_a_hidden_last_key_is_named_and_not_for_a_reset_state():
    case = DECODE_CASES[0]
    mistakes = decode_mistakes()
    hidden = next(fn for why, fn in mistakes.items() if why.startswith(LENGTH_MASK[1]))
    reset = next(fn for why, fn in mistakes.items() if "initialised on every page" in why)
    assert likely_cause(hidden(*case.args, **case.kwargs), case, mistakes).startswith(
        LENGTH_MASK[1]
    )
    assert not likely_cause(reset(*case.args, **case.kwargs), case, mistakes).startswith(
        LENGTH_MASK
    )
