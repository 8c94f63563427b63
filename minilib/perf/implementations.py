"""The ragged paged attention implementations `python -m minilib bench` times, and how each
runs on this backend: data, and one function that prepares an implementation to run here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_rpa

from minilib.blockwise import ragged_paged_attention_blockwise
from minilib.kernel import ragged_paged_attention
from minilib.reference import ref_ragged_paged_attention
from minilib.vectorized import ragged_paged_attention_jnp

__all__ = ["IMPLEMENTATIONS", "Implementation", "prepare_implementation"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One ragged paged attention implementation, with JAX's signature.

    >>> [impl.name for impl in IMPLEMENTATIONS if impl.default]
    ['jax-ref', 'jnp', 'blockwise', 'kernel', 'jax-kernel']
    >>> IMPLEMENTATIONS[2].mode, IMPLEMENTATIONS[-1].needs_tpu
    ('jit', True)
    """

    name: str  # the name on the command line and in the table
    fn: Callable
    mode: str  # "eager": Python loop over sequences; "jit": compiled once per shape; "pallas"
    needs_tpu: bool = False
    default: bool = True  # run unless --impls names it


IMPLEMENTATIONS: tuple[Implementation, ...] = (
    Implementation("jax-ref", jax_rpa.ref_ragged_paged_attention, "eager"),
    # Same algorithm and cost as JAX's reference: left out by default, not to time that loop twice.
    Implementation("minilib-ref", ref_ragged_paged_attention, "eager", default=False),
    Implementation("jnp", ragged_paged_attention_jnp, "jit"),
    Implementation("blockwise", ragged_paged_attention_blockwise, "jit"),
    Implementation("kernel", ragged_paged_attention, "pallas"),
    Implementation("jax-kernel", jax_rpa.ragged_paged_attention, "pallas", needs_tpu=True),
)


def prepare_implementation(impl: Implementation, backend: str):
    """(function, note). The function is None, and the note says why, when it cannot run here.

    On a CPU, a Pallas implementation is returned in TPU interpret mode, with a note saying so.

    >>> jnp_impl = IMPLEMENTATIONS[2]
    >>> prepare_implementation(jnp_impl, "cpu")[0].keywords
    {'validate': False}
    """
    if impl.needs_tpu and backend != "tpu":
        return None, f"unavailable: needs a TPU (this is {backend})"
    fn = impl.fn
    if "validate" in inspect.signature(fn).parameters:
        # The bench's batches are valid by construction: time the attention, not the checks
        # of the values (minilib's functions run them on every eager call by default).
        fn = functools.partial(fn, validate=False)
    if impl.mode == "pallas" and backend != "tpu":
        if "interpret" in inspect.signature(fn).parameters:
            fn = functools.partial(fn, interpret=True)
        return fn, f"TPU interpret mode on {backend}: correctness only, NOT a speed target"
    return fn, ""
