"""Head grouping: how q heads share KV heads (MHA, GQA, MQA), and the combined K/V page layout.

With `num_q_heads` query heads and `num_kv_heads` key/value heads, each KV head serves a
*group* of `num_q_heads // num_kv_heads` consecutive q heads:

    MHA  num_kv_heads == num_q_heads     groups of 1
    GQA  1 < num_kv_heads < num_q_heads  groups of num_q_heads // num_kv_heads
    MQA  num_kv_heads == 1               one group holding every q head

The paged KV cache stores K and V together on one "combined" head axis of size
`2 * num_kv_heads`: K of KV head h in slot 2*h (even), V of KV head h in slot 2*h + 1 (odd).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minilib.errors import RPAInputError

__all__ = [
    "attention_kind",
    "check_head_counts",
    "combined_head_slots",
    "head_groups",
    "kv_head_for_q_head",
    "merge_kv_pages",
    "nearest_valid_num_kv_heads",
    "repeat_kv",
    "split_kv_pages",
    "valid_num_kv_heads",
]


def valid_num_kv_heads(num_q_heads: int) -> list[int]:
    """Every `num_kv_heads` that works with `num_q_heads`: the divisors of `num_q_heads`.

    >>> valid_num_kv_heads(12)
    [1, 2, 3, 4, 6, 12]
    """
    if num_q_heads < 1:
        raise RPAInputError(
            f"{num_q_heads=} must be positive.",
            "q needs at least one head: num_q_heads is its axis 1, e.g. 12.",
        )
    return [n for n in range(1, num_q_heads + 1) if num_q_heads % n == 0]


def nearest_valid_num_kv_heads(num_q_heads: int, num_kv_heads: int) -> list[int]:
    """The valid `num_kv_heads` closest to `num_kv_heads` (one or two values, smallest first).

    >>> nearest_valid_num_kv_heads(12, 8)
    [6]
    >>> nearest_valid_num_kv_heads(12, 9)
    [6, 12]
    """
    valid = valid_num_kv_heads(num_q_heads)
    best = min(abs(n - num_kv_heads) for n in valid)
    return [n for n in valid if abs(n - num_kv_heads) == best]


def check_head_counts(num_q_heads: int, num_kv_heads: int) -> None:
    """Raise unless every KV head serves the same number of q heads.

    >>> check_head_counts(32, 8)   # GQA, 4 q heads per KV head: fine
    """
    if num_kv_heads < 1:
        raise RPAInputError(
            f"{num_kv_heads=} must be positive.",
            "kv_pages needs at least one K and one V head: its head axis is 2*num_kv_heads.",
        )
    if num_q_heads % num_kv_heads != 0:
        valid = valid_num_kv_heads(num_q_heads)
        nearest = " or ".join(map(str, nearest_valid_num_kv_heads(num_q_heads, num_kv_heads)))
        raise RPAInputError(
            f"{num_q_heads=} must be divisible by {num_kv_heads=}",
            f"each KV head must serve the same number of q heads. "
            f"Valid num_kv_heads for num_q_heads={num_q_heads}: {valid} "
            f"(nearest to {num_kv_heads}: {nearest}).\n"
            f"  - To run shared KV heads as one KV head per q head (MHA), repeat them: "
            f"jnp.repeat(k, num_q_heads // num_kv_heads, axis=head_axis) "
            f"(minilib.repeat_kv), starting from a valid num_kv_heads.\n"
            f"  - Check that q/k/v were not transposed: num_q_heads is q.shape[1] of "
            f"q[max_num_batched_tokens, num_q_heads, head_dim], and num_kv_heads is "
            f"kv_pages.shape[2] // 2.",
        )


def attention_kind(num_q_heads: int, num_kv_heads: int) -> str:
    """'MHA', 'GQA' or 'MQA' for a valid head configuration.

    >>> attention_kind(32, 8)
    'GQA'
    """
    check_head_counts(num_q_heads, num_kv_heads)
    if num_kv_heads == num_q_heads:
        return "MHA"
    if num_kv_heads == 1:
        return "MQA"
    return "GQA"


def kv_head_for_q_head(q_head: int, num_q_heads: int, num_kv_heads: int) -> int:
    """The KV head that q head `q_head` attends with.

    >>> kv_head_for_q_head(5, num_q_heads=8, num_kv_heads=2)
    1
    """
    check_head_counts(num_q_heads, num_kv_heads)
    if not 0 <= q_head < num_q_heads:
        raise ValueError(f"{q_head=} must be in [0, {num_q_heads}) for {num_q_heads=}.")
    return q_head // (num_q_heads // num_kv_heads)


def head_groups(num_q_heads: int, num_kv_heads: int) -> list[list[int]]:
    """For each KV head, the q heads that share it.

    >>> head_groups(8, 2)
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    check_head_counts(num_q_heads, num_kv_heads)
    group = num_q_heads // num_kv_heads
    return [list(range(h * group, (h + 1) * group)) for h in range(num_kv_heads)]


def combined_head_slots(num_kv_heads: int) -> list[tuple[str, int]]:
    """What each slot of the combined `kv_pages` head axis holds, as ('K' or 'V', kv head).

    >>> combined_head_slots(2)
    [('K', 0), ('V', 0), ('K', 1), ('V', 1)]
    """
    return [(kind, h) for h in range(num_kv_heads) for kind in ("K", "V")]


def repeat_kv(x: jax.Array, num_q_heads: int, *, axis: int = -2) -> jax.Array:
    """Repeat KV heads so that each q head has its own copy (GQA/MQA written as MHA).

    `x` holds `num_kv_heads` heads on `axis`; the result holds `num_q_heads`, where q head i
    reads the copy of KV head `i // (num_q_heads // num_kv_heads)`.

    >>> repeat_kv(jnp.zeros((5, 2, 64)), num_q_heads=8).shape
    (5, 8, 64)
    """
    num_kv_heads = x.shape[axis]
    check_head_counts(num_q_heads, num_kv_heads)
    return jnp.repeat(x, num_q_heads // num_kv_heads, axis=axis)


def split_kv_pages(kv_pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Split combined pages into K and V pages.

    kv_pages: [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    returns:  (k_pages, v_pages), each [total_num_pages, page_size, num_kv_heads, head_dim]

    >>> k, v = split_kv_pages(jnp.zeros((4, 16, 6, 128)))
    >>> k.shape
    (4, 16, 3, 128)
    """
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2:
        raise ValueError(
            f"{kv_pages.shape=} must be [total_num_pages, page_size, 2*num_kv_heads, head_dim] "
            "with an even combined head axis (K in even slots, V in odd slots)."
        )
    return kv_pages[:, :, 0::2, :], kv_pages[:, :, 1::2, :]


def merge_kv_pages(k_pages: jax.Array, v_pages: jax.Array) -> jax.Array:
    """Interleave K and V pages into the combined layout (inverse of `split_kv_pages`).

    >>> merge_kv_pages(jnp.zeros((4, 16, 3, 128)), jnp.ones((4, 16, 3, 128))).shape
    (4, 16, 6, 128)
    """
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4:
        raise ValueError(
            f"{k_pages.shape=} and {v_pages.shape=} must be equal and 4-D "
            "[total_num_pages, page_size, num_kv_heads, head_dim]."
        )
    # stack on a new last-but-one axis, then fold (kv_head, K/V) into one axis: K0 V0 K1 V1 ...
    total, page_size, num_kv_heads, head_dim = k_pages.shape
    both = jnp.stack([k_pages, v_pages], axis=3)
    return both.reshape(total, page_size, 2 * num_kv_heads, head_dim)
