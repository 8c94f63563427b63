"""The attention options: the compile-time constants of ragged paged attention, checked once.

JAX's attention functions take their options as keywords: `sm_scale`, `sliding_window`,
`soft_cap`, `mask_value`, `k_scale`, `v_scale`, and the kernel's `num_kv_pages_per_block`,
`num_queries_per_block` and `vmem_limit_bytes`. Each minilib entry point keeps that signature,
and gathers the keywords into one frozen `AttentionOptions`. Building it checks every option
(the checks that need no array) and turns each into a plain Python number, so the object is
hashable: the validators read it, and the jitted body takes it as one static argument.

`DEFAULT_MASK_VALUE` is what is added to a masked key's score, as JAX does; `mask_value=None`
means it. (vLLM's RPA v3 *replaces* the score instead: the same answer only for a mask value
this large.)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator

import jax
import numpy as np

from minilib.errors import RPAInputError

__all__ = ["DEFAULT_MASK_VALUE", "AttentionOptions", "attention_options"]

# The value a masked score is set to: very negative, but finite, so exp() gives 0, not NaN.
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionOptions:
    """The options of one attention call, checked, as plain Python numbers.

    Each must be a concrete scalar (a Python, NumPy or concrete JAX number), as jit needs:
      sm_scale, soft_cap: finite real numbers; soft_cap not 0 (None turns soft capping off);
      mask_value: finite and negative: added to every masked score, as JAX does (None means
        DEFAULT_MASK_VALUE, whose masked keys weigh exactly 0);
      k_scale, v_scale: positive, finite Python floats (JAX's kernel asserts the float); None
        (the default) means scale 1, even for an fp8 cache, with no warning, as in JAX;
      sliding_window and the kernel's num_kv_pages_per_block, num_queries_per_block and
        vmem_limit_bytes: positive whole numbers, or None for the default.
    Whether the block sizes fit the arrays is for `static_validate_inputs` to say.

    Raises `RPAInputError` (JAX's text where JAX makes the same check, and a hint).

    >>> import jax.numpy as jnp
    >>> options = AttentionOptions(sm_scale=1 / jnp.sqrt(4.0), mask_value=None)
    >>> options.sm_scale, options.mask_value == DEFAULT_MASK_VALUE, hash(options) is not None
    (0.5, True, True)
    >>> AttentionOptions(sliding_window=0)
    Traceback (most recent call last):
    ...
    minilib.errors.RPAInputError: sliding_window=0 must be positive.
    Hint: ...
    """

    sm_scale: float = 1.0
    sliding_window: int | None = None
    soft_cap: float | None = None
    mask_value: float | None = DEFAULT_MASK_VALUE
    k_scale: float | None = None
    v_scale: float | None = None
    num_kv_pages_per_block: int | None = None
    num_queries_per_block: int | None = None
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        checked = dict(
            sm_scale=_finite("sm_scale", self.sm_scale),
            soft_cap=_soft_cap(self.soft_cap),
            mask_value=_mask_value(self.mask_value),
            k_scale=_scale("k_scale", self.k_scale),
            v_scale=_scale("v_scale", self.v_scale),
            sliding_window=_positive(
                "sliding_window",
                self.sliding_window,
                "sliding_window=w lets each query see its last w keys, itself included; "
                "use None for no window.",
            ),
            # Its range, 1 to pages_per_seq, needs the arrays: static_validate_inputs checks it.
            num_kv_pages_per_block=_whole_number(
                "num_kv_pages_per_block", self.num_kv_pages_per_block
            ),
            num_queries_per_block=_positive(
                "num_queries_per_block",
                self.num_queries_per_block,
                "use a positive number of q rows per block, or None for the default.",
            ),
            vmem_limit_bytes=_positive(
                "vmem_limit_bytes",
                self.vmem_limit_bytes,
                "pass a byte count (e.g. 32 * 1024 * 1024), or None for the compiler's default.",
            ),
        )
        for name, value in checked.items():  # frozen: set as dataclasses' own __init__ does
            object.__setattr__(self, name, value)


def attention_options(options: AttentionOptions | None = None, **values) -> AttentionOptions:
    """`options` as given, or the options built from keywords: the two ways to call a
    validator, `validate_inputs(*arrays, options)` and `validate_inputs(*arrays, sm_scale=...)`.

    >>> attention_options(sliding_window=8).sliding_window
    8
    """
    if options is None:
        return AttentionOptions(**values)
    if values:
        raise TypeError(f"pass options or keyword options, not both: got options and {values}")
    return options


def _finite(name: str, value) -> float:
    if not math.isfinite(_real(name, value)):
        raise RPAInputError(
            f"{name}={value!r} must be finite.",
            f"{name} scales or caps the scores; an infinite or NaN value makes the outputs "
            "NaN. Use a finite float (soft_cap=None turns soft capping off).",
        )
    return float(value)


def _soft_cap(soft_cap) -> float | None:
    if soft_cap is None:
        return None
    soft_cap = _finite("soft_cap", soft_cap)
    if soft_cap == 0.0:
        raise RPAInputError(
            f"{soft_cap=} must not be 0.0.",
            "soft capping computes soft_cap * tanh(scores / soft_cap); use None to turn it "
            "off (Gemma 2 uses 50.0).",
        )
    return soft_cap


def _mask_value(mask_value) -> float:
    if mask_value is None:
        return DEFAULT_MASK_VALUE
    if not -math.inf < _real("mask_value", mask_value) < 0:
        raise RPAInputError(
            f"mask_value={mask_value!r} must be a finite negative number.",
            "mask_value is added to every masked score before the softmax (JAX's rule): it must "
            "be negative, and very negative for masked keys to weigh nothing; finite (-inf "
            "gives NaN on a fully masked block). Use None for the default, -0.7 * float32 max.",
        )
    return float(mask_value)


def _scale(name: str, scale) -> float | None:
    if scale is None:
        return None
    if not isinstance(scale, float):
        raise RPAInputError(
            f"{name}={scale!r} must be a Python float or None.",
            f"pass {name}=float(...); the scale is a compile-time constant, not an array.",
        )
    if not (math.isfinite(scale) and scale > 0):
        raise RPAInputError(
            f"{name}={scale!r} must be positive and finite.",
            f"{name} multiplies the fp8 cache values back to their real size: the scale "
            "the cache was quantized with, such as 0.5. Use None for an unquantized cache.",
        )
    return float(scale)


def _positive(name: str, value, hint: str) -> int | None:
    """`value` as a positive Python int (None stays None), in JAX's words where JAX checks.
    The kernels compute with it in int32, so it must fit there.

    >>> _positive("sliding_window", 2**40, "use None for no window.")
    Traceback (most recent call last):
    ...
    minilib.errors.RPAInputError: sliding_window=1099511627776 is too large: the kernels compute \
with it in int32, whose largest value is 2147483647.
    Hint: use None for no window.
    """
    value = _whole_number(name, value)
    if value is not None and value <= 0:
        raise RPAInputError(f"{name}={value} must be positive.", hint)
    if value is not None and value > INT32_MAX:
        raise RPAInputError(
            f"{name}={value} is too large: the kernels compute with it in int32, whose "
            f"largest value is {INT32_MAX}.",
            hint,
        )
    return value


INT32_MAX = 2**31 - 1


def _real(name: str, value) -> float:
    """`value` as a Python float, or raise: it must be a concrete real scalar."""
    _concrete(name, value)
    is_real_array = np.ndim(value) == 0 and np.dtype(getattr(value, "dtype", object)).kind in "iuf"
    if isinstance(value, bool | np.bool_) or not (isinstance(value, numbers.Real) or is_real_array):
        raise RPAInputError(
            f"{name}={value!r} must be a real number.",
            f"pass a Python float such as {name}=0.125 (a NumPy or JAX scalar works too).",
        )
    return float(value)


def _whole_number(name: str, value) -> int | None:
    """`value` as a Python int (None stays None), or raise: 2.5 and True are not window or
    block sizes."""
    if value is None:
        return None
    _concrete(name, value)
    try:
        if isinstance(value, bool | np.bool_):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise RPAInputError(
            f"{name}={value!r} must be a whole number (an int).",
            f"{name} counts tokens, pages or bytes: pass an int such as int(...), or None "
            "for the default.",
        ) from None


def _concrete(name: str, value) -> None:
    """Raise for a traced value: every option is a compile-time constant."""
    if isinstance(value, jax.core.Tracer):
        raise RPAInputError(
            f"{name} is a traced value ({type(value).__name__}); it must be a concrete number.",
            f"{name} is a compile-time constant: pass a Python number computed outside jit, "
            "or mark it static (jax.jit(..., static_argnames=...)).",
        )
