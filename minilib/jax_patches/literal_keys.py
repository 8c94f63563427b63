"""Lower jax 0.7's scalar constants in linear time, not quadratic.

jax 0.7's lowering to MLIR (`jaxpr_subcomp` in `jax._src.interpreters.mlir`) looks up each
literal of a jaxpr in a dict keyed by `HashableLiteral`, to emit one IR constant per value.
That key hashes a numpy array or a Python scalar by its bytes, but a `LiteralArray` by None,
and a `LiteralArray` is what jax 0.7.2 makes of every typed scalar (the `1:i32[]` of a
jaxpr). So all of a program's scalars land in one bucket of that dict, and each is compared
with every one before it. A kernel run in interpret mode is thousands of them (its ref
indexing becomes slices at scalar offsets): lowering the course's kernel at head_dim 256
took 15.0 s on jax 0.7.2, against 2.2 s on jax 0.12, which keeps no such dict.

`apply()`, run when minilib is imported, has that key hash a `LiteralArray` by its bytes, as
it hashes a numpy array, and compare it as it compares one: the same constants are emitted,
found in one step. The same lowering then took 4.1 s. On a jax whose key already does so, or
that has none, it changes nothing.
"""

from __future__ import annotations

import numpy as np

__all__ = ["apply", "keyless_literal_class"]


def keyless_literal_class() -> type | None:
    """jax's `HashableLiteral` if it keys a `LiteralArray` by None (as jax 0.7.2's does),
    else None: on a jax without one, or whose key is already the literal's value.

    >>> import jax
    >>> jax.__version__ != "0.7.2" or keyless_literal_class() is None  # minilib applied it
    True
    """
    try:
        from jax._src import core
        from jax._src.interpreters.mlir import HashableLiteral
        from jax._src.literals import LiteralArray
    except ImportError:
        return None
    one = core.Literal(LiteralArray(np.ones((), np.int32), False), core.ShapedArray((), np.int32))
    return HashableLiteral if HashableLiteral(one).data is None else None


def apply() -> bool:
    """Key each `LiteralArray` by its bytes, if this jax keys it by None; return whether it
    did. Idempotent.

    >>> apply()  # minilib applied it when imported (or this jax needs nothing)
    False
    """
    key_class = keyless_literal_class()
    if key_class is None:
        return False
    from jax._src.literals import LiteralArray

    jax_init = key_class.__init__

    def __init__(self, value):
        jax_init(self, value)
        if self.data is None and isinstance(value.val, LiteralArray):
            self.data = value.val.val.tobytes()  # compared after the type and the aval

    __init__.__wrapped__ = jax_init
    key_class.__init__ = __init__
    return True
