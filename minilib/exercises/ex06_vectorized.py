"""Notebook 06's vectorizing exercise: decode attention over a paged cache, with no Python loop
over sequences, compiled once by `jax.jit` for every batch of the same shapes."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.batch import make_batch
from minilib.exercises.checking import SM_SCALE_IGNORED, Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, compare_arrays
from minilib.kv_cache import pages_needed
from minilib.options import DEFAULT_MASK_VALUE
from minilib.parity import parity_tolerance

__all__ = ["NotVectorizedError", "check_decode_attention"]

SM_SCALE = 0.5
# Errors JAX raises when Python asks a traced value for a concrete number.
TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


class NotVectorizedError(Exception):
    """The learner's function needs concrete values of traced arrays.

    The checker raises it, in place of JAX's tracer error, with the fix in its message:

    >>> def loop_over_seqs(q, kv_pages, kv_lens, page_indices, *, sm_scale):
    ...     for i in range(int(kv_lens[0])):  # a Python loop over a traced length
    ...         pass
    ...     return q
    >>> check_decode_attention(loop_over_seqs)
    FAILED: decode_attention, case 1 of 6: ...
      your function raised NotVectorizedError: under jax.jit, kv_lens and page_indices have no
      values while your function is traced, so Python int(), if, range() or NumPy functions
      on them fail. ...
    CheckResult('decode_attention', status='failed'; result.rerun() reruns the failing case)
    """


def _reference(q, kv_pages, kv_lens, page_indices, *, sm_scale):
    """One decode row per sequence, in float64 NumPy, one sequence at a time (no compile, so
    the checker starts at once); tests check it against JAX's reference."""
    q, kv_pages = np.asarray(q, np.float64), np.asarray(kv_pages, np.float64)
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, combined = kv_pages.shape[1:3]
    group = num_q_heads // (combined // 2)
    out = np.zeros_like(q)
    for i in range(num_seqs):
        kv_len = int(kv_lens[i])
        pages = np.asarray(page_indices[i])[: pages_needed(kv_len, page_size)]
        slots = kv_pages[pages].reshape(-1, combined, head_dim)[:kv_len]
        k = np.repeat(slots[:, 0::2], group, axis=1)  # [kv_len, num_q_heads, head_dim]
        v = np.repeat(slots[:, 1::2], group, axis=1)
        scores = np.einsum("hd,khd->hk", q[i], k) * sm_scale
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[i] = np.einsum("hk,khd->hd", probs / probs.sum(-1, keepdims=True), v)
    return out


def _under_jit(fn: Callable) -> Callable:
    """`fn` compiled by jax.jit, as a server would run it: kv_lens and page_indices are
    traced, so their values are unknown while the function is traced."""
    jitted = jax.jit(fn, static_argnames="sm_scale")

    def run(q, kv_pages, kv_lens, page_indices, *, sm_scale):
        try:
            return jitted(q, kv_pages, kv_lens, page_indices, sm_scale=sm_scale)
        except TRACER_ERRORS as err:
            first_line = str(err).strip().splitlines()[0]
            raise NotVectorizedError(
                "under jax.jit, kv_lens and page_indices have no values while your function is "
                "traced, so Python int(), if, range() or NumPy functions on them fail. Use "
                "jax.numpy, and keep the lengths as arrays: build a mask such as "
                "jnp.arange(max_kv_len)[None, :] < kv_lens[:, None] and use jnp.where.\n"
                f"  (JAX said: {first_line})"
            ).with_traceback(err.__traceback__) from None

    return run


def _operations(jaxpr) -> int:
    """How many operations a jaxpr holds, those of the jaxprs inside it included (the body of
    a nested `jax.jit`, of `jax.nn.softmax`'s custom derivative rule...)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += 1
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(inner, "eqns"):
                    count += _operations(inner)
    return count


def _unrolled(fn: Callable, case: Case) -> str | None:
    """The problem if `fn`'s traced program grows with the number of sequence slots: a Python
    loop over them (say `for i in range(q.shape[0])`) runs while jax.jit traces, and leaves
    one copy of its body per slot. Traced for the case's batch and for one twice as wide,
    shapes only: such a loop adds at least one operation per added slot, where a vectorized
    program (jax.vmap included) has as many for both, or nearly (an einsum of three arrays
    may pick another order of contractions for other sizes)."""
    q, kv_pages, kv_lens, page_indices = case.args
    num_seqs = q.shape[0]

    def with_slots(x, n):  # x's shape and dtype, with n sequence slots
        return jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype)

    sizes = {}
    for n in (num_seqs, 2 * num_seqs):
        args = (with_slots(q, n), with_slots(kv_pages, kv_pages.shape[0]),
                with_slots(kv_lens, n), with_slots(page_indices, n))  # fmt: skip
        try:
            sizes[n] = _operations(jax.make_jaxpr(functools.partial(fn, **case.kwargs))(*args))
        except Exception:  # it ran on the case already: no verdict on a batch it cannot trace
            return None
    if sizes[2 * num_seqs] - sizes[num_seqs] < num_seqs:
        return None
    return (
        f"your function's program grows with the batch: traced for {num_seqs} sequence slots "
        f"it has {sizes[num_seqs]} operations, for {2 * num_seqs} slots "
        f"{sizes[2 * num_seqs]}. A Python loop over the sequences (for i in "
        "range(q.shape[0])) runs while jax.jit traces, and unrolls into one copy of its body "
        "per sequence slot: the program and its compile time grow with the batch. Write it as "
        "one array program over all the slots: gather every page of every sequence at once "
        "(kv_pages[page_indices]), mask each slot by position (jnp.arange(max_kv_len)[None, :] "
        "< kv_lens[:, None]) and compute every sequence's scores in one einsum, or jax.vmap a "
        "one-sequence function."
    )


def _decode_attention(q, kv_pages, kv_lens, page_indices, *, sm_scale, mistake=None):
    """Vectorized decode attention; `mistake` makes one of the errors the checker names."""
    num_seqs, num_q_heads, head_dim = q.shape
    _, page_size, combined, _ = kv_pages.shape
    num_kv_heads = combined // 2
    group = num_q_heads // num_kv_heads
    slots = kv_pages[page_indices].reshape(num_seqs, -1, combined, head_dim)
    positions = jnp.arange(slots.shape[1])[None, :]  # [1, pages_per_seq * page_size]
    live = positions < kv_lens[:, None]  # [num_seqs, max_kv_len]
    if mistake != "nan":
        slots = jnp.where(live[:, :, None, None], slots, 0.0)
    if mistake == "halves":
        k, v = slots[:, :, :num_kv_heads], slots[:, :, num_kv_heads:]
    else:
        k, v = slots[:, :, 0::2], slots[:, :, 1::2]
    if mistake == "tiled":
        qg = q.reshape(num_seqs, group, num_kv_heads, head_dim).swapaxes(1, 2)
    else:
        qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = jnp.einsum("shgd,skhd->shgk", qg, k) * sm_scale
    visible = positions <= kv_lens[:, None] if mistake == "off_by_one" else live
    scores = jnp.where(visible[:, None, None, :], scores, DEFAULT_MASK_VALUE)
    out = jnp.einsum("shgk,skhd->shgd", jax.nn.softmax(scores, axis=-1), v)
    if mistake == "tiled":
        out = out.swapaxes(1, 2)
    return out.reshape(num_seqs, num_q_heads, head_dim)


def _cases(seed: int) -> list[Case]:
    """Batches of 4 sequences: partial and full pages, one-token sequences, full rows."""
    rng = np.random.default_rng(750 + seed)
    shapes = [  # (num_q_heads, num_kv_heads, page_size, pages_per_seq); 4 sequences each
        (4, 2, 4, 4),
        (6, 3, 8, 2),
    ]
    lens = [  # kv_lens: partial and full pages, one-token sequences, full rows
        [(5, 1, 8, 16), (3, 12, 1, 9), None],
        [(9, 16, 1, 4), None, (15, 2, 8, 11)],
    ]
    cases = []
    for (nq, nkv, page_size, pages_per_seq), kv_lens_list in zip(shapes, lens, strict=True):
        capacity = page_size * pages_per_seq
        for kv_lens in kv_lens_list:
            if kv_lens is None:
                kv_lens = tuple(int(x) for x in rng.integers(1, capacity + 1, size=4))
            batch = make_batch([(1, kv) for kv in kv_lens], num_q_heads=nq, num_kv_heads=nkv,
                               head_dim=8, page_size=page_size, pages_per_seq=pages_per_seq,
                               total_num_pages=4 * pages_per_seq + 2,
                               seed=760 + seed + len(cases))  # fmt: skip
            cases.append(
                Case(
                    f"num_q_heads={nq}, num_kv_heads={nkv}, page_size={page_size}, "
                    f"pages_per_seq={pages_per_seq}, kv_lens={list(kv_lens)}, "
                    f"sm_scale={SM_SCALE}",
                    (batch.q, batch.kv_pages, batch.kv_lens, batch.page_indices),
                    {"sm_scale": SM_SCALE},
                )
            )
    return cases


def check_decode_attention(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(q, kv_pages, kv_lens, page_indices, *, sm_scale) -> out`: one decode step,
    one new token per sequence slot, over the paged cache, as one array program.

      q:            [num_seqs, num_q_heads, head_dim]   row i is sequence i's new token
      kv_pages:     [total_num_pages, page_size, 2*num_kv_heads, head_dim]
      kv_lens:      i32[num_seqs]   every one >= 1; the new token is the last of them
      page_indices: i32[num_seqs, pages_per_seq]
      out:          [num_seqs, num_q_heads, head_dim]

    The checker runs `jax.jit(fn)`, so kv_lens and page_indices have no values while `fn` is
    traced, and one compile serves all the cases of the same shapes. Unused slots and pages
    of the cache hold NaN. It also traces `fn` for two numbers of sequence slots: a program
    that grows with them is a Python loop over the sequences, unrolled, and fails.

    >>> check_decode_attention(_decode_attention)
    Passed: decode_attention matches the reference on all 6 cases.
    CheckResult('decode_attention', status='passed')
    """
    cases = _cases(seed)

    def making(mistake):
        return lambda *args, **kwargs: _decode_attention(*args, **kwargs, mistake=mistake)

    mistakes = {
        "NaN: the cache holds NaN past each kv_len, and a masked score only makes its weight "
        "0, while 0 * NaN is still NaN. Zero the K/V slots past kv_len with jnp.where too.": (
            making("nan")
        ),
        "key j is live when j < kv_len (positions 0..kv_len-1); your mask lets key kv_len "
        "through.": making("off_by_one"),
        "q head h reads KV head h // group: view q as [num_seqs, num_kv_heads, group, "
        "head_dim], KV head first.": making("tiled"),
        SM_SCALE_IGNORED: lambda q, *args, sm_scale: _decode_attention(
            q, *args, sm_scale=q.shape[-1] ** -0.5
        ),
        "K and V are interleaved on the combined axis: K of KV head h in slot 2*h, V in "
        "2*h + 1 ([:, :, 0::2] and [:, :, 1::2]), not two halves.": making("halves"),
    }
    # The reference is float64; where float32 matmuls run as one bfloat16 pass (a TPU), the
    # solution is off it by up to 0.0082 here (measured under minilib.tpu.numerics' emulation).
    tol = parity_tolerance()
    compare_values = diagnose(
        lambda want, got, case: compare_arrays(want, got, "out", atol=tol, rtol=tol), mistakes
    )

    def compare(want, got, case):
        compare_values(want, got, case)
        problem = _unrolled(fn, case) if case is cases[0] else None
        if problem:
            raise Mismatch(problem)

    return run_check(
        "decode_attention", _under_jit(fn), _reference, cases, compare, verbose=verbose
    )
