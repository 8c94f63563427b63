"""Notebook 04's exercises: two options of the reference, soft capping and a sliding window."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.exercises.checking import (
    SM_SCALE_IGNORED,
    Case,
    CheckResult,
    diagnose,
    random_attention_case,
    run_check,
)
from minilib.exercises.comparisons import compare_arrays, compare_masks
from minilib.exercises.ex03_ragged import describe_seq
from minilib.masking import causal_mask
from minilib.options import DEFAULT_MASK_VALUE
from minilib.parity import parity_tolerance
from minilib.reference import attend

__all__ = ["check_attend_soft_cap", "check_sliding_window_mask"]


def _attend_soft_cap(q, k, v, *, sm_scale, soft_cap):
    return attend(
        q, k, v, sm_scale=sm_scale, sliding_window=None, soft_cap=soft_cap,
        mask_value=DEFAULT_MASK_VALUE,
    )  # fmt: skip


def _attend_by_hand(
    q, k, v, *, sm_scale, soft_cap, mistake: str | None = None
):  # -> [q_len, num_q_heads, head_dim]
    """Soft-capped causal attention, written out; `mistake` makes one of the classic ones:

    "cap after mask"    the mask value goes through tanh too, and becomes -soft_cap
    "cap before scale"  soft_cap * tanh(q·k / soft_cap), then * sm_scale
    "q from position 0" q row i at position i, not kv_len - q_len + i (the causal offset)
    """
    q_len, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32)
    capped = soft_cap is not None
    if capped and mistake == "cap before scale":
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = scores * sm_scale
    if capped and mistake not in ("cap before scale", "cap after mask"):
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    kv_len = k.shape[0]
    mask = causal_mask(q_len, kv_len if mistake != "q from position 0" else q_len)
    mask = jnp.pad(mask, ((0, 0), (0, kv_len - mask.shape[1])), constant_values=True)
    scores = jnp.where(mask, DEFAULT_MASK_VALUE, scores)
    if capped and mistake == "cap after mask":
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)


def check_attend_soft_cap(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(q, k, v, *, sm_scale, soft_cap) -> out`, causal attention of one sequence
    with Gemma-2-style soft capping of the scores: soft_cap * tanh(scores / soft_cap).

      q:   [q_len, num_q_heads, head_dim]   the sequence's new rows
      k,v: [kv_len, num_kv_heads, head_dim]  all its keys and values
      out: [q_len, num_q_heads, head_dim]
    soft_cap=None means no capping.

    >>> check_attend_soft_cap(_attend_soft_cap)
    Passed: attend_soft_cap matches the reference on all 6 cases.
    CheckResult('attend_soft_cap', status='passed')
    """
    rng = np.random.default_rng(500 + seed)
    cases = []
    # (q_len, kv_len, num_q_heads, num_kv_heads, soft_cap): small caps make mistakes visible.
    for q_len, kv_len, nq, nkv, cap in [
        (3, 7, 4, 2, 2.0),
        (1, 9, 4, 1, 5.0),
        (5, 5, 2, 2, 1.0),
        (4, 6, 6, 3, None),
        (2, 8, 8, 2, 30.0),
        (6, 6, 4, 2, 3.0),
    ]:
        description = (
            f"{describe_seq(q_len, kv_len)}; num_q_heads={nq}, num_kv_heads={nkv}, head_dim=8"
        )
        cases.append(random_attention_case(rng, description, q_len=q_len, kv_len=kv_len,
                                           num_q_heads=nq, num_kv_heads=nkv, head_dim=8,
                                           sm_scales=[0.5, 1.0, 2.0], soft_cap=cap))  # fmt: skip
    mistakes = {
        SM_SCALE_IGNORED: lambda q, k, v, *, sm_scale, soft_cap: _attend_soft_cap(
            q, k, v, sm_scale=q.shape[-1] ** -0.5, soft_cap=soft_cap
        ),
        "the q rows are not the *last* q_len positions (the causal offset): q row i sits at "
        "position kv_len - q_len + i, after the cached keys, and sees keys 0..kv_len - q_len + "
        "i; yours puts it at position i.": functools.partial(
            _attend_by_hand, mistake="q from position 0"
        ),
        "the soft cap is applied before sm_scale: scale first, then cap, soft_cap * "
        "tanh(q·k * sm_scale / soft_cap); capping q·k and then scaling bounds the scores by "
        "soft_cap * sm_scale, not soft_cap.": functools.partial(
            _attend_by_hand, mistake="cap before scale"
        ),
        "soft capping after masking turns the mask value into -soft_cap, so masked keys get "
        "some weight. Cap the scores first, then mask (as JAX's reference does).": (
            functools.partial(_attend_by_hand, mistake="cap after mask")
        ),
        "the scores are not capped at all: apply soft_cap * tanh(scores / soft_cap) after "
        "scaling by sm_scale, when soft_cap is not None.": (
            lambda q, k, v, *, sm_scale, soft_cap: _attend_soft_cap(
                q, k, v, sm_scale=sm_scale, soft_cap=None
            )
        ),
    }
    # Where float32 matmuls run as one bfloat16 pass (a TPU), a right answer that rounds other
    # intermediates (say, normalises after P·V) is off the reference by about 0.005.
    tol = parity_tolerance()
    compare = diagnose(
        lambda want, got, case: compare_arrays(want, got, "out", atol=tol, rtol=tol), mistakes
    )
    return run_check("attend_soft_cap", fn, _attend_soft_cap, cases, compare, verbose=verbose)


def check_sliding_window_mask(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(q_len, kv_len, sliding_window) -> bool[q_len, kv_len]`: the causal mask of
    notebook 03, where in addition each row sees only its last `sliding_window` keys, its own
    included. True = masked.

    >>> from minilib.masking import causal_mask
    >>> check_sliding_window_mask(causal_mask)
    Passed: sliding_window_mask matches the reference on all 7 cases.
    CheckResult('sliding_window_mask', status='passed')
    """
    rng = np.random.default_rng(510 + seed)
    triples = [(3, 9, 4), (1, 8, 3), (6, 6, 2), (4, 7, 1), (2, 5, 10)]
    for _ in range(2):
        kv_len = int(rng.integers(3, 11))
        triples.append((int(rng.integers(1, kv_len + 1)), kv_len, int(rng.integers(1, 6))))
    cases = [Case(f"{describe_seq(q, kv)}; sliding_window={w}", (q, kv, w)) for q, kv, w in triples]

    def window_off_by_one(q_len, kv_len, w):  # sees w + 1 keys
        q_pos = kv_len - q_len + jnp.arange(q_len)[:, None]
        k_pos = jnp.arange(kv_len)[None, :]
        return (k_pos > q_pos) | (k_pos < q_pos - w)

    def window_only(q_len, kv_len, w):  # forgot the causal part
        q_pos = kv_len - q_len + jnp.arange(q_len)[:, None]
        return jnp.arange(kv_len)[None, :] <= q_pos - w

    mistakes = {
        "off by one: the window holds sliding_window keys *including* the row's own, so key j "
        "is masked when j <= q_pos - sliding_window.": window_off_by_one,
        "the window adds to the causal mask; keys after the row stay masked too.": window_only,
    }
    compare = diagnose(lambda want, got, case: compare_masks(want, got, "mask"), mistakes)
    return run_check("sliding_window_mask", fn, causal_mask, cases, compare, verbose=verbose)
