"""Notebook 06's exercise: one step of the online softmax."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.blockwise import OnlineSoftmax, online_softmax_update
from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, compare_arrays
from minilib.options import DEFAULT_MASK_VALUE
from minilib.parity import parity_tolerance

__all__ = ["check_online_softmax_update"]

VISIBLE_ABOVE = DEFAULT_MASK_VALUE / 2  # a score above this is a visible key's


def _update(m, l, acc, scores, v):
    """minilib's update, for one KV head and one q head: [rows] state, [rows, block] scores."""
    state = OnlineSoftmax(m=m[None], l=l[None], acc=acc[None])  # one KV head
    # The float32 answer, even where a float32 matmul at the default precision is one bfloat16
    # pass (a TPU; minilib.tpu.numerics): the check's tolerance allows for that pass.
    with jax.default_matmul_precision("highest"):
        new = online_softmax_update(state, scores[None], v[:, None, :])
    return new.m[0], new.l[0], new.acc[0]


def _run_blocks(update: Callable) -> Callable:
    """Feed the blocks one by one from the empty state; the state after each block."""

    def run(blocks_of_scores, blocks_of_v):
        rows, head_dim = blocks_of_scores[0].shape[0], blocks_of_v[0].shape[1]
        m = jnp.full((rows,), -jnp.inf, jnp.float32)
        l = jnp.zeros((rows,), jnp.float32)
        acc = jnp.zeros((rows, head_dim), jnp.float32)
        states = []
        for scores, v in zip(blocks_of_scores, blocks_of_v, strict=True):
            out = update(m, l, acc, scores, v)
            if not isinstance(out, tuple | list) or len(out) != 3:
                return [("not a triple", type(out).__name__)]
            m, l, acc = out
            states.append((m, l, acc))
        return states

    return run


def _cases(seed: int) -> list[Case]:
    """Blocks of scores and values, fed one by one; the max rises, a block is fully masked."""
    rng = np.random.default_rng(700 + seed)
    cases = []
    # (rows, number of blocks, kv_tokens_per_block, score scale, mask the first block of row 0)
    for rows, num_blocks, kv_tokens_per_block, scale, mask_first in [
        (2, 3, 4, 1.0, False),
        (3, 4, 2, 30.0, False),
        (1, 1, 5, 1.0, False),
        (4, 3, 3, 300.0, False),
        (2, 3, 4, 1.0, True),
        (3, 2, 6, 5.0, True),
    ]:
        head_dim = 4
        scores = scale * rng.standard_normal((num_blocks, rows, kv_tokens_per_block))
        if scale > 100:  # rising maxima: each block forces a rescale of the old sums
            scores += 50.0 * np.arange(num_blocks)[:, None, None]
        if mask_first:
            scores[0, 0, :] = DEFAULT_MASK_VALUE  # row 0 sees nothing in the first block
            scores[-1, -1, -1] = DEFAULT_MASK_VALUE
        v = rng.standard_normal((num_blocks, kv_tokens_per_block, head_dim))
        what = f"{rows} rows, {num_blocks} blocks of {kv_tokens_per_block} keys, {head_dim=}"
        if scale > 20:
            what += f", scores up to {np.abs(scores).max():.0f} (exp overflows without the max)"
        if mask_first:
            what += ", row 0's first block fully masked"
        cases.append(
            Case(
                what,
                (
                    [jnp.asarray(s, jnp.float32) for s in scores],
                    [jnp.asarray(b, jnp.float32) for b in v],
                ),
            )
        )
    return cases


def check_online_softmax_update(
    fn: Callable, *, seed: int = 0, verbose: bool = True
) -> CheckResult:
    """Check `fn(m, l, acc, scores, v) -> (m, l, acc)`, one block of the online softmax.

      m, l:   f32[rows]            running max of the scores, running sum of exp(score - m)
      acc:    f32[rows, head_dim]  running sum of exp(score - m) * v
      scores: f32[rows, kv_tokens_per_block]  this block's scores (masked keys hold a very
                                              negative value)
      v:      [kv_tokens_per_block, head_dim]

    The state starts at m = -inf, l = 0, acc = 0; the blocks are fed one by one, and the state
    after each is compared with minilib's `online_softmax_update`, on the rows that have seen
    a visible key so far. On a row that has seen only masked keys the state is not unique,
    and any is accepted: minilib's leaves m = the mask value, l = the number of masked keys
    and acc = the sum of their v (each weighs exp(mask - mask) = 1, until the first visible
    key's alpha = exp(mask - m) = 0 wipes them out); an update that zeroes masked keys
    (`jnp.where(scores > -1e30, jnp.exp(...), 0)`) leaves l = 0 and acc = 0, and is right too.
    The blocks after it show whether that state led to the right one.

    >>> check_online_softmax_update(_update)
    Passed: online_softmax_update matches the reference on all 6 cases.
    CheckResult('online_softmax_update', status='passed')
    """
    cases = _cases(seed)
    # Where float32 matmuls run as one bfloat16 pass (a TPU), a right answer's `p @ v` is off
    # the float32 reference by up to 0.0089 here; the usual mistakes by more than 1.
    tolerance = parity_tolerance()

    def compare(want, got, case):
        if got and isinstance(got[0][0], str) and got[0][0] == "not a triple":
            raise Mismatch(f"expected a tuple (m, l, acc), got {got[0][1]}")
        blocks_of_scores, _ = case.args
        seen = np.zeros(np.shape(blocks_of_scores[0])[0], bool)  # a visible key so far
        for b, (w, g) in enumerate(zip(want, got, strict=True)):
            seen |= (np.asarray(blocks_of_scores[b]) > VISIBLE_ABOVE).any(axis=-1)
            rows = np.flatnonzero(seen)
            for name, w_x, g_x in zip(("m", "l", "acc"), w, g, strict=True):
                try:
                    if np.shape(g_x)[:1] == np.shape(w_x)[:1] and len(rows) < len(seen):
                        w_x, g_x = np.asarray(w_x)[rows], np.asarray(g_x)[rows]
                    compare_arrays(w_x, g_x, name, atol=tolerance, rtol=tolerance)
                except Mismatch as diff:
                    raise Mismatch(f"after block {b + 1} of {len(want)}:\n{diff}") from None

    def no_rescale_acc(m, l, acc, scores, v):
        m_new = jnp.maximum(m, scores.max(-1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(scores - m_new[:, None])
        return m_new, alpha * l + p.sum(-1), acc + p @ v

    def no_rescale(m, l, acc, scores, v):
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.exp(scores - m_new[:, None])
        return m_new, l + p.sum(-1), acc + p @ v

    def no_max(m, l, acc, scores, v):
        p = jnp.exp(scores)
        return jnp.maximum(m, scores.max(-1)), l + p.sum(-1), acc + p @ v

    mistakes = {
        "acc is not rescaled: when the max rises, the old acc was computed relative to the old "
        "max, so multiply it by alpha = exp(m - m_new) too, as l.": _run_blocks(no_rescale_acc),
        "the old sums are not rescaled: l and acc were computed relative to the old max; "
        "multiply both by alpha = exp(m - m_new) before adding the block.": _run_blocks(no_rescale),
        "exp(scores) without subtracting the max: l and acc must hold exp(score - m), which "
        "never overflows; exp(score) does above about 88.": _run_blocks(no_max),
    }
    return run_check(
        "online_softmax_update",
        _run_blocks(fn),
        _run_blocks(_update),
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )
