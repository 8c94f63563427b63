"""Notebook 01's exercises: GQA attention without copying K and V, and repeating the KV heads
of a combined `kv_pages` (fix 2) without breaking its K/V interleave."""

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
from minilib.exercises.comparisons import Mismatch, compare_arrays, expected_vs_got
from minilib.heads import attention_kind, merge_kv_pages, repeat_kv, split_kv_pages
from minilib.options import DEFAULT_MASK_VALUE
from minilib.parity import parity_tolerance
from minilib.reference import attend

__all__ = ["check_grouped_query_attention", "check_repeat_kv_pages"]

# (num_tokens, num_q_heads, num_kv_heads, head_dim): GQA first, since MHA and MQA forgive
# the grouping mistakes. Few shapes: every new shape costs a learner's eager code compiles.
ATTENTION_CONFIGS = [(5, 8, 2, 8), (5, 6, 3, 8), (5, 4, 4, 8), (5, 8, 1, 8)]


def _gqa_attention(q, k, v, *, sm_scale):
    """Causal GQA self-attention, from minilib's tested `attend`."""
    return attend(q, k, v, sm_scale=sm_scale, sliding_window=None, soft_cap=None,
                  mask_value=DEFAULT_MASK_VALUE)  # fmt: skip


def _mha(q, k, v, *, sm_scale, causal=True):
    # q, k, v: [num_tokens, num_heads, head_dim] with as many K/V heads as q heads
    scores = jnp.einsum("qhd,khd->hqk", q, k) * sm_scale
    if causal:
        n = q.shape[0]
        scores = jnp.where(jnp.arange(n)[None, :] > jnp.arange(n)[:, None], -jnp.inf, scores)
    probs = jnp.exp(scores - scores.max(-1, keepdims=True))
    return jnp.einsum("hqk,khd->qhd", probs / probs.sum(-1, keepdims=True), v)


def check_grouped_query_attention(
    fn: Callable, *, seed: int = 0, verbose: bool = True
) -> CheckResult:
    """Check `fn(q, k, v, *, sm_scale) -> out`: causal self-attention with grouped query heads.

      q:   [num_tokens, num_q_heads, head_dim]
      k,v: [num_tokens, num_kv_heads, head_dim]   num_kv_heads divides num_q_heads
      out: [num_tokens, num_q_heads, head_dim]    q head h reads KV head h // group

    Token i sees keys 0..i. Group the q heads (reshape) rather than repeat K and V: besides
    the numbers, the checker reads your function's jaxpr, and an array made from k alone (or
    v alone) with num_q_heads heads' worth of elements, a copy of K or V per q head
    (`jnp.repeat`, `jnp.tile`, `broadcast_to`, ...), fails it. (NumPy code, which has no
    jaxpr, is checked on its numbers only.) minilib's reference repeats K and V, so it fails:

    >>> result = check_grouped_query_attention(_gqa_attention)
    FAILED: grouped_query_attention, case 1 of 4: 5 tokens, num_q_heads=8, num_kv_heads=2 ...
      the numbers are right, but K is copied for every q head: ...
    """
    rng = np.random.default_rng(200 + seed)
    cases = []
    for num_tokens, nq, nkv, head_dim in ATTENTION_CONFIGS:
        description = (
            f"{num_tokens} tokens, num_q_heads={nq}, num_kv_heads={nkv} "
            f"({attention_kind(nq, nkv)}), head_dim={head_dim}"
        )
        cases.append(random_attention_case(rng, description, q_len=num_tokens,
                                           kv_len=num_tokens, num_q_heads=nq,
                                           num_kv_heads=nkv, head_dim=head_dim,
                                           sm_scales=[0.25, 0.5, 2.0]))  # fmt: skip

    def interleaved_groups(q, k, v, *, sm_scale):  # q head h reads KV head h % num_kv_heads
        reps = q.shape[1] // k.shape[1]
        return _mha(q, jnp.tile(k, (1, reps, 1)), jnp.tile(v, (1, reps, 1)), sm_scale=sm_scale)

    def not_causal(q, k, v, *, sm_scale):
        nq = q.shape[1]
        k, v = repeat_kv(k, nq, axis=1), repeat_kv(v, nq, axis=1)
        return _mha(q, k, v, sm_scale=sm_scale, causal=False)

    def not_scaled(q, k, v, *, sm_scale):
        return _gqa_attention(q, k, v, sm_scale=1.0)

    mistakes = {
        "q head h reads KV head h % num_kv_heads: the groups are dealt out in turn. They are "
        "consecutive: view q as [tokens, num_kv_heads, group, head_dim] (KV head first), not "
        "[tokens, group, num_kv_heads, head_dim].": interleaved_groups,
        "no causal mask: token i may see only keys 0..i. Set the scores of keys j > i to a "
        "very negative value before the softmax.": not_causal,
        "the scores are not multiplied by sm_scale.": not_scaled,
        SM_SCALE_IGNORED: lambda q, k, v, *, sm_scale: _gqa_attention(
            q, k, v, sm_scale=q.shape[-1] ** -0.5
        ),
    }
    # Where float32 matmuls run as one bfloat16 pass (a TPU), a right answer that rounds other
    # intermediates (say, normalises after P·V) is off the reference by about 0.005.
    tol = parity_tolerance()
    numbers = diagnose(
        lambda want, got, case: compare_arrays(want, got, "out", atol=tol, rtol=tol), mistakes
    )

    def compare(want, got, case):
        numbers(want, got, case)
        problem = _kv_copied_per_q_head(fn, case)
        if problem is not None:
            raise Mismatch(problem)

    return run_check("grouped_query_attention", fn, _gqa_attention, cases, compare, verbose=verbose)


def _kv_copied_per_q_head(fn: Callable, case: Case) -> str | None:
    """The rule of exercise 1.1, read from `fn`'s jaxpr on `case`: no array made from k
    alone (or v alone) holds group times as many elements as k, as a copy per q head does.
    None when there is none, when the case has groups of 1 (MHA), or when `fn` cannot be
    traced (NumPy code: not checked)."""
    q, k, v = case.args
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return None
    try:
        closed = jax.make_jaxpr(functools.partial(fn, **case.kwargs))(q, k, v)
    except Exception:
        return None
    q_var, k_var, v_var = closed.jaxpr.invars
    start = {q_var: frozenset("q"), k_var: frozenset("k"), v_var: frozenset("v")}
    found = _copy_from_one_input(closed.jaxpr, start, group * k.size)
    if found is None:
        return None
    name, primitive, shape = found
    return (
        f"the numbers are right, but {name.upper()} is copied for every q head: your "
        f"function makes an array of shape {shape} from {name} alone (`{primitive}` in its "
        f"jaxpr), group={group} times the size of {name} {tuple(k.shape)}. The rule of this "
        "exercise: "
        "no copy of K or V per q head (no `jnp.repeat`, `jnp.tile` or `broadcast_to` of k or "
        "v). View q as [num_tokens, num_kv_heads, group, head_dim] and let the einsum read "
        "each KV head once for its whole group."
    )


def _copy_from_one_input(jaxpr, sources: dict, size: int) -> tuple | None:
    """The first value in `jaxpr` (or a jaxpr inside it: a jit, a custom_jvp) that comes from
    k alone or v alone and has at least `size` elements: (its input, primitive, shape).
    `sources` maps a variable to the inputs it comes from ("q", "k", "v")."""
    env = dict(sources)
    for eqn in jaxpr.eqns:
        came_from = frozenset().union(*(_sources_of(env, x) for x in eqn.invars))
        for inner in _inner_jaxprs(eqn):
            inner_sources = {
                var: _sources_of(env, x) for var, x in zip(inner.invars, eqn.invars, strict=True)
            }
            found = _copy_from_one_input(inner, inner_sources, size)
            if found is not None:
                return found
        for out in eqn.outvars:
            env[out] = came_from
            shape = tuple(getattr(out.aval, "shape", ()))
            if len(came_from) == 1 and "q" not in came_from and np.prod(shape) >= size:
                return next(iter(came_from)), eqn.primitive.name, shape
    return None


def _sources_of(env: dict, x) -> frozenset:
    try:
        return env.get(x, frozenset())
    except TypeError:  # a literal: no input
        return frozenset()


def _inner_jaxprs(eqn) -> list:
    """The jaxprs an equation calls with its own inputs (jit, custom_jvp, ...)."""
    inner = []
    for param in eqn.params.values():
        jaxpr = getattr(param, "jaxpr", param)
        if hasattr(jaxpr, "eqns") and len(jaxpr.invars) == len(eqn.invars):
            inner.append(jaxpr)
    return inner


def _repeat_kv_pages(kv_pages, num_q_heads: int):
    k, v = split_kv_pages(kv_pages)
    return merge_kv_pages(repeat_kv(k, num_q_heads, axis=2), repeat_kv(v, num_q_heads, axis=2))


def check_repeat_kv_pages(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(kv_pages, num_q_heads) -> kv_pages`: the same cache with every KV head
    repeated `num_q_heads // num_kv_heads` times, so that q head h has its own copy, and K and
    V still interleaved (K of head h in slot 2*h, V in 2*h + 1).

      kv_pages: [total_num_pages, page_size, 2*num_kv_heads, head_dim]
      returns:  [total_num_pages, page_size, 2*num_q_heads, head_dim]

    >>> check_repeat_kv_pages(_repeat_kv_pages)
    Passed: repeat_kv_pages matches the reference on all 6 cases.
    CheckResult('repeat_kv_pages', status='passed')
    """
    rng = np.random.default_rng(210 + seed)
    cases = []
    for nq, nkv in [(8, 2), (12, 4), (6, 3), (4, 4), (8, 1), (6, 2)]:
        pages, page_size, head_dim = int(rng.integers(1, 4)), int(rng.choice([2, 4])), 4
        kv_pages = jnp.asarray(
            rng.standard_normal((pages, page_size, 2 * nkv, head_dim)), jnp.float32
        )
        cases.append(
            Case(
                f"kv_pages.shape={kv_pages.shape} (num_kv_heads={nkv}), num_q_heads={nq}",
                (kv_pages, nq),
            )
        )

    def compare(want, got, case):
        # Say what each slot holds: clearer than a wall of numbers.
        want_slots, got_slots = _slots(case.args[0], want), _slots(case.args[0], got)
        if got_slots is not None and want_slots != got_slots:
            raise Mismatch(
                "slot 2*h must hold K of the KV head that q head h reads, slot 2*h + 1 its V "
                "('?' = neither).\n"
                + expected_vs_got(
                    f"what slots 0..{len(want_slots) - 1} hold", want_slots, got_slots
                )
            )
        compare_arrays(want, got, "kv_pages")

    def repeat_combined_axis(kv_pages, num_q_heads):  # K0 K0 V0 V0 ...
        return jnp.repeat(kv_pages, num_q_heads // (kv_pages.shape[2] // 2), axis=2)

    def tiled(kv_pages, num_q_heads):  # heads 0 1 0 1 ...
        reps = num_q_heads // (kv_pages.shape[2] // 2)
        k, v = split_kv_pages(kv_pages)
        return merge_kv_pages(jnp.tile(k, (1, 1, reps, 1)), jnp.tile(v, (1, 1, reps, 1)))

    def halves(kv_pages, num_q_heads):  # K K K ... V V V ...
        k, v = split_kv_pages(kv_pages)
        return jnp.concatenate(
            [repeat_kv(k, num_q_heads, axis=2), repeat_kv(v, num_q_heads, axis=2)], axis=2
        )

    mistakes = {
        "jnp.repeat on the combined axis repeats each *slot* (K0 K0 V0 V0 ...) and breaks the "
        "interleave. Split K (slots 0::2) and V (1::2), repeat each, then interleave again "
        "(stack on a new axis after the heads, and reshape).": repeat_combined_axis,
        "jnp.tile repeats the whole list of heads (0, 1, 0, 1, ...); the groups are "
        "consecutive (0, 0, 1, 1, ...): use jnp.repeat on K and on V.": tiled,
        "K and V are concatenated in two halves; the layout interleaves them: K of head h in "
        "slot 2*h, V in 2*h + 1. Stack them on a new axis after the heads, then reshape.": halves,
    }
    return run_check(
        "repeat_kv_pages",
        fn,
        _repeat_kv_pages,
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )


def _slots(kv_pages, out) -> list[str] | None:
    """What each slot of `out`'s combined axis holds ('K0', 'V0', ...), or None when `out`
    is not an array of the expected shape."""
    try:
        kv_pages, out = np.asarray(kv_pages, np.float64), np.asarray(out, np.float64)
        if out.ndim != 4 or out.shape[:2] != kv_pages.shape[:2]:
            return None
        return [_which_slot(kv_pages, out[:, :, s]) for s in range(out.shape[2])]
    except Exception:
        return None


def _which_slot(kv_pages: np.ndarray, column: np.ndarray) -> str:
    """'K1' if `column` equals K of KV head 1 (slot 2), 'V1' for slot 3, ...; '?' if none."""
    for s in range(kv_pages.shape[2]):
        if np.allclose(kv_pages[:, :, s], column, atol=1e-6):
            return f"{'KV'[s % 2]}{s // 2}"
    return "?"
