"""Notebook 07's kernel exercise: flash attention over dense K/V (rung 1 of the ladder)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minilib.exercises.checking import Case, CheckResult
from minilib.exercises.kernel_checking import check_kernel
from minilib.ladder.flash import flash_attention, flash_attention_reference


def _cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(700 + seed)
    cases = []
    # (num_heads, q_len, max_kv_len, kv_len, head_dim, block_q, block_kv)
    specs = [
        (2, 16, 32, 21, 128, 8, 8),  # NaN past key 21; two q blocks, three KV blocks
        (1, 8, 32, int(rng.integers(9, 32)), 64, 8, 16),
    ]
    for num_heads, q_len, max_kv_len, kv_len, head_dim, block_q, block_kv in specs:
        q, k, v = (
            jnp.asarray(rng.standard_normal((num_heads, n, head_dim)), jnp.float32)
            for n in (q_len, max_kv_len, max_kv_len)
        )
        k, v = k.at[:, kv_len:].set(jnp.nan), v.at[:, kv_len:].set(jnp.nan)
        what = (
            f"num_heads={num_heads}, q_len={q_len}, kv_len={kv_len} (NaN up to "
            f"max_kv_len={max_kv_len}), head_dim={head_dim}, block_q={block_q}, "
            f"block_kv={block_kv}"
        )
        options = dict(kv_len=kv_len, sm_scale=float(head_dim) ** -0.5, block_q=block_q,
                       block_kv=block_kv)  # fmt: skip
        cases.append(Case(what, (q, k, v), options))
    return cases


def _mistakes() -> dict[str, Callable]:
    def no_causal_mask(q, k, v, *, kv_len, sm_scale, **_):
        scores = jnp.einsum("hqd,hkd->hqk", q, k[:, :kv_len]) * sm_scale
        return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(scores, axis=-1), v[:, :kv_len])

    def no_sm_scale(q, k, v, *, kv_len, sm_scale, **_):
        return flash_attention_reference(q, k, v, kv_len=kv_len, sm_scale=1.0)

    return {
        "no causal mask: row i of q sits at position kv_len - q_len + i, and sees only the keys "
        "at positions <= its own.": no_causal_mask,
        "sm_scale is not applied to the scores (q @ k.T * sm_scale).": no_sm_scale,
    }


def check_flash_attention(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(q, k, v, *, kv_len, sm_scale, block_q, block_kv, interpret)`: causal flash
    attention as a Pallas kernel, q: [num_heads, q_len, head_dim], k and v:
    [num_heads, max_kv_len, head_dim] with NaN past kv_len.

    Runs it in TPU interpret mode (race detector on, scratch starting as NaN) against plain jnp
    attention, then, when libtpu is installed, compiles it for v5e with Mosaic.

    >>> from minilib.ladder.flash import flash_attention
    >>> check_flash_attention(flash_attention).status
    Passed: flash_attention matches the reference on all 2 cases...
    'passed'
    """
    num_heads, q_len, max_kv_len, head_dim = 2, 128, 256, 128
    compile_case = Case(
        f"bf16, num_heads={num_heads}, q_len={q_len}, kv_len=200, head_dim={head_dim}, "
        "block_q=32, block_kv=128",
        (
            jax.ShapeDtypeStruct((num_heads, q_len, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((num_heads, max_kv_len, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((num_heads, max_kv_len, head_dim), jnp.bfloat16),
        ),
        dict(kv_len=200, sm_scale=head_dim**-0.5, block_q=32, block_kv=128),
    )
    return check_kernel(
        "flash_attention",
        fn,
        flash_attention_reference,
        _cases(seed),
        compile_case=compile_case,
        mistakes=_mistakes(),
        verbose=verbose,
    )


__all__ = ["check_flash_attention", "flash_attention"]
