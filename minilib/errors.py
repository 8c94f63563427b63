"""The errors minilib raises for bad input: each a `ValueError` that says what is wrong and how
to fix it.

    HintedError        a ValueError with `.message` (what is wrong, with the values) and
                       `.hint` (how to fix it); `str(err)` is the message, then "Hint: ...".
      RPAInputError    a bad input to ragged paged attention (minilib.validation).
      KVCacheError     a bad use of the paged KV cache (minilib.kv_cache).
      EngineError      a bad model config, engine setting or request (minilib.engine).
    ScheduleTooBig     a schedule with more work than the caller can handle (minilib.schedule).
    InputProblem       typed input an explorer cannot use (minilib.widgets).

Each module raises only its own kind, so `except RPAInputError` around an attention call
catches the attention call's mistakes and nothing else. Every one leaves the state unchanged.
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "HintedError",
    "InputProblem",
    "KVCacheError",
    "RPAInputError",
    "ScheduleTooBig",
]


class HintedError(ValueError):
    """A bad value, with what is wrong and how to fix it. `str(err)` is the message, then the
    hint.

    Attributes:
      message: what is wrong, with the values.
      hint: how to fix it.

    >>> err = HintedError("page_size=0 must be positive.", "use a page_size such as 16.")
    >>> print(err)
    page_size=0 must be positive.
    Hint: use a page_size such as 16.
    """

    def __init__(self, message: str, hint: str):
        self.message = message
        self.hint = hint
        super().__init__(f"{message}\nHint: {hint}")


class RPAInputError(HintedError):
    """A bad input to ragged paged attention. The message is JAX's own text where JAX makes
    the same check."""


class KVCacheError(HintedError):
    """A bad use of `PageAllocator` or `PagedKVCache`. The state was left unchanged."""


class EngineError(HintedError):
    """A bad model config, engine setting or request. Nothing was changed."""


class ScheduleTooBig(ValueError):
    """The schedule has more work than the caller asked to handle (`max_computes`)."""


class InputProblem(ValueError):
    """Typed input the explorer cannot use (not a number, too big to draw, ...)."""
