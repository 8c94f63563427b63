"""Notebook 01's exercises: which KV head a q head reads, and repeating KV heads."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from minilib.exercises.checking import (
    Case,
    CheckResult,
    Mismatch,
    as_int,
    compare_arrays,
    diagnose,
    expected_vs_got,
    run_check,
)
from minilib.heads import kv_head_for_q_head, repeat_kv, valid_num_kv_heads

# (num_q_heads, num_kv_heads): GQA first, since MHA and MQA forgive some mistakes.
HEAD_CONFIGS = [(8, 2), (12, 4), (32, 8), (6, 3), (4, 4), (8, 1), (12, 6), (16, 2)]


def _kind(num_q_heads: int, num_kv_heads: int) -> str:
    from minilib.heads import attention_kind

    return attention_kind(num_q_heads, num_kv_heads)


def check_kv_head_for_q_head(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(q_head, num_q_heads, num_kv_heads) -> int`, the KV head that q head reads.

    Every q head of several MHA, GQA and MQA configurations is tried.

    >>> check_kv_head_for_q_head(lambda h, nq, nkv: h // (nq // nkv))
    Passed: kv_head_for_q_head matches the reference on all 10 cases.
    CheckResult('kv_head_for_q_head', status='passed')
    """
    rng = np.random.default_rng(200 + seed)
    configs = list(HEAD_CONFIGS)
    for num_q_heads in rng.choice([10, 24, 20], size=2, replace=False):
        num_q_heads = int(num_q_heads)
        configs.append((num_q_heads, int(rng.choice(valid_num_kv_heads(num_q_heads)[1:-1]))))
    cases = [
        Case(f"num_q_heads={nq}, num_kv_heads={nkv} ({_kind(nq, nkv)}), every q head", (nq, nkv))
        for nq, nkv in configs
    ]

    def table(f):  # the KV head of every q head
        return lambda nq, nkv: [as_int(f(h, nq, nkv)) for h in range(nq)]

    def compare(want, got, case):
        for h, (w, g) in enumerate(zip(want, got, strict=True)):
            if w != g:
                table = expected_vs_got(f"KV head of q heads 0..{len(want) - 1}", want, got)
                raise Mismatch(f"q head {h} -> expected KV head {w}, got {g}\n{table}")

    mistakes = {
        "q_head % num_kv_heads deals the q heads out in turn (0, 1, 0, 1, ...). The groups are "
        "consecutive: q heads 0..group-1 share KV head 0, so divide by the group size.": table(
            lambda h, nq, nkv: h % nkv
        ),
        "q_head // num_kv_heads divides by the number of KV heads; divide by the group size, "
        "num_q_heads // num_kv_heads.": table(lambda h, nq, nkv: h // nkv),
    }
    return run_check(
        "kv_head_for_q_head",
        table(fn),
        table(kv_head_for_q_head),
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )


def check_repeat_kv(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(x, num_q_heads)`: x [num_tokens, num_kv_heads, head_dim] -> the same with
    num_q_heads heads, where q head h holds a copy of the KV head it reads.

    >>> check_repeat_kv(lambda x, nq: jnp.repeat(x, nq // x.shape[1], axis=1))
    Passed: repeat_kv matches the reference on all 6 cases.
    CheckResult('repeat_kv', status='passed')
    """
    rng = np.random.default_rng(210 + seed)
    cases = []
    for nq, nkv in [(8, 2), (12, 4), (6, 3), (4, 4), (8, 1), (16, 2)]:
        num_tokens, head_dim = int(rng.integers(1, 6)), int(rng.choice([4, 8]))
        x = jnp.asarray(rng.standard_normal((num_tokens, nkv, head_dim)), jnp.float32)
        cases.append(Case(f"x.shape={x.shape} (num_kv_heads={nkv}), num_q_heads={nq}", (x, nq)))

    def compare(want, got, case):
        x = np.asarray(case.args[0])
        have = np.asarray(got) if got is not None else None
        if have is not None and have.shape == np.shape(want):
            # Say which KV head each q head got: clearer than a wall of numbers.
            def source(out):
                return [_which_head(x, out[:, h]) for h in range(out.shape[1])]

            if source(have) != source(np.asarray(want)):
                label = f"KV head copied into q heads 0..{have.shape[1] - 1}"
                raise Mismatch(
                    "each q head should hold a copy of the KV head it reads ('?' = none).\n"
                    + expected_vs_got(label, source(np.asarray(want)), source(have))
                )
        compare_arrays(want, got, "repeated x")

    mistakes = {
        "jnp.tile repeats the whole list of heads (0, 1, 0, 1, ...); jnp.repeat repeats each "
        "head in place (0, 0, 1, 1, ...), which is what consecutive groups need.": (
            lambda x, nq: jnp.tile(x, (1, nq // x.shape[1], 1))
        ),
    }
    return run_check(
        "repeat_kv",
        fn,
        lambda x, nq: repeat_kv(x, nq, axis=1),
        cases,
        diagnose(compare, mistakes),
        verbose=verbose,
    )


def _which_head(x: np.ndarray, column: np.ndarray):
    for h in range(x.shape[1]):
        if np.allclose(x[:, h], column, atol=1e-6):
            return h
    return "?"
