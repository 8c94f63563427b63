"""minilib.jax_patches.literal_keys: on jax 0.7, a program's scalar constants are keyed by value
when it is lowered, so that lowering takes time linear in their number; elsewhere nothing
changes.

The tests of the key need a jax whose own key needed the fix (jax 0.7.2: `.venv-oldest`), and
are skipped elsewhere with the reason. Every parity test of that stack lowers through it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minilib.jax_patches import literal_keys

try:
    from jax._src import core
    from jax._src.interpreters.mlir import HashableLiteral
    from jax._src.literals import LiteralArray
except ImportError:
    HashableLiteral = None

FIXED = HashableLiteral is not None and hasattr(HashableLiteral.__init__, "__wrapped__")
needs_the_fix = pytest.mark.skipif(
    not FIXED, reason=f"jax {jax.__version__} keys no literal by None: nothing to fix"
)


def literal(value, dtype=np.int32, weak_type=False):
    """A typed scalar of a jaxpr, as jax 0.7.2 makes it (`1:i32[]`)."""
    val = LiteralArray(np.asarray(value, dtype), weak_type)
    return core.Literal(val, core.ShapedArray((), dtype, weak_type=weak_type))


def key(value, dtype=np.int32, weak_type=False):
    return HashableLiteral(literal(value, dtype, weak_type))


def test_nothing_is_left_to_apply():
    assert literal_keys.keyless_literal_class() is None  # minilib applied it when imported
    assert literal_keys.apply() is False


@needs_the_fix
def test_the_fix_is_still_needed():
    """jax's own key gives a LiteralArray no value (if a jax fixes that, drop the module)."""
    bare = object.__new__(HashableLiteral)
    HashableLiteral.__init__.__wrapped__(bare, literal(1))
    assert bare.data is None


@needs_the_fix
def test_equal_scalars_share_a_key_and_others_do_not():
    assert key(1) == key(1) and hash(key(1)) == hash(key(1))
    assert key(1) != key(2)
    assert key(1) != key(1, np.uint32)  # the same bytes, another dtype
    assert key(1) != key(1, weak_type=True)
    assert key(1.0, np.float32) != key(1.0, jnp.bfloat16)


@needs_the_fix
def test_lowering_compares_each_scalar_with_its_equals_only(monkeypatch):
    """A program of 600 distinct scalar constants: a handful of key comparisons, where jax's
    own key made about 600 * 600 / 2 (each with every one before it, in one hash bucket)."""
    compared = []
    jax_eq = HashableLiteral.__eq__

    def counting_eq(self, other):
        compared.append(1)
        return jax_eq(self, other)

    monkeypatch.setattr(HashableLiteral, "__eq__", counting_eq)

    def program(x):
        for i in range(600):
            x = x + np.int32(i)
        return x

    lowered = jax.jit(program).lower(jnp.int32(0))
    assert len(compared) < 600, len(compared)
    assert int(lowered.compile()(jnp.int32(1))) == 1 + sum(range(600))
