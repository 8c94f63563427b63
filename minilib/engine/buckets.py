"""Padding buckets: a few fixed shapes per step, each compiled once, before the first request.

JAX compiles a function once per input shape. A step's shape is its token count and its
sequence count, and both change every step: run each step at its exact size and the engine
compiles again and again while it serves. vLLM on TPU (tpu-inference's runner) pads instead:

  * the step's token count up to the next of a short list of *token buckets*: powers of two
    from a minimum (16 there) to the first that covers `max_num_batched_tokens`
    (`get_token_paddings`);
  * its sequence count up to the next *sequence bucket*: powers of two from a minimum (8
    there), the last one `max_num_seqs` itself (`get_req_paddings`);

and compiles every bucket at start-up (`capture_model`), so that nothing compiles while it
serves. The padding is idle: padding tokens write their K/V nowhere and their output is
dropped, padding sequences have q_len 0. What it costs is the padded rows' work, which
`padding_waste` counts.

`Engine(token_buckets=..., seq_buckets=...)` takes the lists; `Engine.warm_up()` compiles
each (token bucket, sequence bucket) pair a step can reach (`reachable_shapes`), and
`CompileCounter` counts XLA's compiles, from JAX's own events, to show that none follow.

>>> power_of_two_buckets(16, 100), power_of_two_buckets(2, 6, cover=False)
([16, 32, 64, 128], [2, 4, 6])
>>> bucket_for(17, [16, 32, 64, 128])
32
"""

from __future__ import annotations

import bisect
import functools
import itertools

import jax
import numpy as np

from minilib.errors import EngineError

__all__ = [
    "CompileCounter",
    "bucket_for",
    "check_buckets",
    "padding_waste",
    "power_of_two_buckets",
    "reachable_shapes",
]


def power_of_two_buckets(minimum: int, limit: int, *, cover: bool = True) -> list[int]:
    """Powers of two from `minimum` (itself a power of two) up to `limit`.

    cover=True (vLLM's token buckets): the last bucket is the first power of two >= limit.
    cover=False (vLLM's sequence buckets): the last bucket is `limit` itself.

    >>> power_of_two_buckets(4, 16), power_of_two_buckets(4, 20), power_of_two_buckets(8, 3)
    ([4, 8, 16], [4, 8, 16, 32], [8])
    >>> power_of_two_buckets(4, 20, cover=False)
    [4, 8, 16, 20]
    """
    if (
        isinstance(minimum, bool)
        or not isinstance(minimum, int)
        or minimum < 1
        or (minimum & (minimum - 1))
    ):
        raise EngineError(
            f"power_of_two_buckets: minimum={minimum!r} must be a power of two.",
            "start the buckets at 1, 2, 4, 8, 16, ...",
        )
    buckets = [minimum]
    while buckets[-1] < limit:
        buckets.append(buckets[-1] * 2)
    if not cover:
        buckets[-1] = limit  # the bucket before it is smaller than limit
    return buckets


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `n` (vLLM: `get_padded_token_len`).

    >>> bucket_for(1, [4, 8]), bucket_for(4, [4, 8]), bucket_for(5, [4, 8])
    (4, 4, 8)
    """
    return buckets[bisect.bisect_left(buckets, n)]


def check_buckets(name: str, buckets, limit_name: str, limit: int) -> list[int]:
    """`buckets` as a list of ints, or `EngineError` for a list that cannot work: not
    positive ints, not increasing, or a last bucket too small for a full step (`limit`).

    >>> check_buckets("token_buckets", [4, 8, 16], "max_num_batched_tokens", 16)
    [4, 8, 16]
    >>> check_buckets("token_buckets", [4, 8], "max_num_batched_tokens", 16)
    Traceback (most recent call last):
    ...
    minilib.errors.EngineError: token_buckets=[4, 8]: its last bucket, 8, is smaller than \
max_num_batched_tokens=16: a full step would fit no bucket.
    Hint: end the list at 16 or more, e.g. power_of_two_buckets(4, 16) = [4, 8, 16].
    """
    try:
        values = list(buckets)
    except TypeError:
        values = None
    if not values or any(
        isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1 for b in values
    ):
        raise EngineError(
            f"{name}={buckets!r} must be a non-empty list of positive ints.",
            f"pass sizes such as power_of_two_buckets(4, {limit}), or None for one bucket, "
            f"{limit_name}={limit}.",
        )
    values = [int(b) for b in values]
    if any(a >= b for a, b in itertools.pairwise(values)):
        raise EngineError(
            f"{name}={values}: the buckets must increase strictly.",
            "sort them and drop repeats: each step takes the smallest bucket that holds it.",
        )
    if values[-1] < limit:
        minimum = 1 << (values[0].bit_length() - 1)
        raise EngineError(
            f"{name}={values}: its last bucket, {values[-1]}, is smaller than {limit_name}="
            f"{limit}: a full step would fit no bucket.",
            f"end the list at {limit} or more, e.g. power_of_two_buckets({minimum}, {limit}) = "
            f"{power_of_two_buckets(minimum, limit)}.",
        )
    return values


def reachable_shapes(
    token_buckets: list[int], seq_buckets: list[int], max_num_seqs: int
) -> list[tuple[int, int]]:
    """Every (token bucket, sequence bucket) a step can be padded to: a step of n sequences
    has at least n tokens, so a sequence bucket is reachable in a token bucket when the
    fewest sequences it holds (one more than the bucket before) fit in it.

    >>> reachable_shapes([2, 4, 8], [2, 4], max_num_seqs=4)
    [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]
    """
    shapes = []
    for t in token_buckets:
        for i, s in enumerate(seq_buckets):
            fewest = seq_buckets[i - 1] + 1 if i else 1
            if fewest <= min(t, max_num_seqs):
                shapes.append((t, s))
    return shapes


def padding_waste(num_tokens: list[int], token_buckets: list[int]) -> float:
    """The padding rows per step, on average, when steps of `num_tokens` tokens are padded
    to `token_buckets`.

    >>> padding_waste([3, 16, 9], [4, 8, 16])   # 1 + 0 + 7 rows of padding
    2.6666666666666665
    """
    if not num_tokens:
        return 0.0
    return float(np.mean([bucket_for(n, token_buckets) - n for n in num_tokens]))


_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = {"count": 0}


def _on_event_duration(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        _compiles["count"] += 1


@functools.cache
def _listen_for_compiles() -> None:
    jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


class CompileCounter:
    """XLA compiles since it was made, every one: jitted functions, eager operations and the
    attention kernel alike (JAX's `backend_compile_duration` event, one per compile).

    >>> counter = CompileCounter()
    >>> f = jax.jit(lambda x: x + 1)
    >>> _ = f(np.ones(3)); _ = f(np.ones(3)); _ = f(np.ones(4))
    >>> counter.count      # one per shape
    2
    """

    def __init__(self):
        _listen_for_compiles()
        self.start = _compiles["count"]

    @property
    def count(self) -> int:
        return _compiles["count"] - self.start
