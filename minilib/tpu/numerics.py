"""A TPU's float32 matmuls on the CPU: one bfloat16 pass.

On a TPU, a float32 matmul at JAX's default precision runs as ONE bfloat16 pass of the MXU
(see the docstring of `jax.lax.Precision`): both float32 operands are rounded to bfloat16 (8
bits of mantissa, a relative error up to 2**-9), and the products are summed in float32. On the
CPU the same matmul is exact float32. So a check that passes on a laptop with a tolerance of
1e-4 can fail on a chip, with a right answer, by about 1e-3.

`emulate_tpu_matmul_precision()` shows that on the CPU. While it is on, every `dot_general`
(`@`, `jnp.dot`, `jnp.einsum`, `jax.lax.dot_general`, and the dots in a Pallas kernel run in
interpret mode) whose precision is the default (None or DEFAULT) and whose operands are float32
rounds both operands to bfloat16 and back before the dot; the sum stays float32. A dot with an
explicit `precision=jax.lax.Precision.HIGHEST` (or HIGH) is left exact, as on a TPU, where
HIGHEST runs six bfloat16 passes that together give float32 accuracy.

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.asarray([[1.0 + 2**-12]]); one = jnp.ones((1, 1))
    >>> with emulate_tpu_matmul_precision():
    ...     float((x @ one)[0, 0]), float(jnp.dot(x, one, precision="highest")[0, 0])
    (1.0, 1.000244140625)

It works by replacing JAX's CPU lowering rule for `jax.lax.dot_general_p` (how the primitive
becomes XLA's HLO) with one that adds the two roundings, then calls JAX's own rule. A lowering
rule runs when a function is compiled, and `jax.jit` keeps what it compiled: switch it on before
the first compile, or clear JAX's caches (`jax.clear_caches()`, which the context manager does
on entry and on exit). `MINILIB_TPU_NUMERICS=1` in the environment switches it on for good when
minilib is imported (a test run, a notebook kernel).

The rule is registered through `jax._src.interpreters.mlir`, JAX's internals; the same calls
work on jax 0.7.2 and 0.10.2.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir

__all__ = [
    "BF16_PASS_TOLERANCE",
    "ENV_VAR",
    "emulate_tpu_matmul_precision",
    "emulating",
    "one_bf16_pass",
    "switch",
]

ENV_VAR = "MINILIB_TPU_NUMERICS"
# What one bfloat16 pass costs a checker's attention output (values of size about 1), against
# float32: at most 0.0089 and 0.0082 (exercise 6's online softmax and decode attention), 0.0067
# (rung 1, flash attention) and 0.0083 (rungs 2 to 5, paged decode) on the checkers' cases
# under the emulation (printed by `python tests/tpu/test_tpu_numerics.py`). The checkers take this,
# twice that, as atol and rtol where matmuls run as one bfloat16 pass; every usual mistake is
# far above.
BF16_PASS_TOLERANCE = 2e-2

_DOT = jax.lax.dot_general_p
_CPU_RULES = mlir._platform_specific_lowerings["cpu"]  # primitive -> LoweringRuleEntry
_EXACT_RULE = _CPU_RULES[_DOT]  # JAX's own CPU rule, kept to call and to restore


def _is_default(precision) -> bool:
    """dot_general's precision parameter: None, or a pair (lhs, rhs) of Precision values."""
    if precision is None:
        return True
    pair = precision if isinstance(precision, tuple) else (precision, precision)
    return all(p is None or p == jax.lax.Precision.DEFAULT for p in pair)


def _one_bf16_pass(ctx, lhs, rhs, *, precision, **params):
    """Lower a dot as a TPU runs it at the default precision: float32 operands rounded to
    bfloat16 (and back to float32), summed in float32. Any other dot: JAX's own rule."""
    lhs_aval, rhs_aval = ctx.avals_in[:2]
    if _is_default(precision) and lhs_aval.dtype == rhs_aval.dtype == jnp.float32:

        def to_bf16_and_back(x, aval):
            bf16 = aval.update(dtype=jnp.bfloat16)
            return mlir.convert_hlo(ctx, mlir.convert_hlo(ctx, x, aval, bf16), bf16, aval)

        lhs, rhs = to_bf16_and_back(lhs, lhs_aval), to_bf16_and_back(rhs, rhs_aval)
    return _EXACT_RULE.rule(ctx, lhs, rhs, precision=precision, **params)


def emulating() -> bool:
    """Is the TPU's one-pass bfloat16 matmul emulated right now?

    >>> with emulate_tpu_matmul_precision():
    ...     emulating()
    True
    """
    return _CPU_RULES[_DOT].rule is _one_bf16_pass


def one_bf16_pass() -> bool:
    """Do float32 matmuls at the default precision run as one bfloat16 pass here: on a TPU,
    or on the CPU under the emulation? The checkers' tolerances follow it.

    >>> one_bf16_pass() == (emulating() or jax.default_backend() == "tpu")
    True
    """
    return emulating() or jax.default_backend() == "tpu"


def switch(on: bool) -> None:
    """Switch the emulation on or off for the whole process, and clear JAX's caches so that
    no program compiled the other way is reused.

    >>> was_on = emulating()
    >>> switch(True); emulating()
    True
    >>> switch(was_on)
    """
    if on == emulating():
        return
    if on:
        mlir.register_lowering(_DOT, _one_bf16_pass, platform="cpu")
    else:
        _CPU_RULES[_DOT] = _EXACT_RULE
    jax.clear_caches()


@contextlib.contextmanager
def emulate_tpu_matmul_precision():
    """Inside the `with`, float32 matmuls at the default precision run as on a TPU (one
    bfloat16 pass); on leaving it, as they were before.

    >>> x = jnp.full((1, 3), 1 / 3)
    >>> with emulate_tpu_matmul_precision():
    ...     float((x @ x.T)[0, 0])  # (1/3 rounded to bf16, 0.333984375)**2 * 3
    0.33463...
    >>> float((x @ x.T)[0, 0])
    0.33333...
    """
    was_on = emulating()
    switch(True)
    try:
        yield
    finally:
        switch(was_on)


def apply_from_environment() -> None:
    """Switch the emulation on if MINILIB_TPU_NUMERICS=1 (run when minilib is imported)."""
    if os.environ.get(ENV_VAR, "") == "1":
        switch(True)
