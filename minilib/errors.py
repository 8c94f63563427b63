"""The errors minilib raises for bad input: each a `ValueError` that says what is wrong and how
to fix it.

    HintedError        a ValueError with `.message` (what is wrong, with the values) and
                       `.hint` (how to fix it); `str(err)` is the message, then "Hint: ...".
      RPAInputError    a bad input to ragged paged attention (minilib.validation).
      KVCacheError     a bad use of the paged KV cache (minilib.kv_cache).
      EngineError      a bad model config, engine setting or request (minilib.engine).
    ScheduleTooBig     a schedule with more work than the caller can handle (minilib.schedule).
    InputProblem       typed input an explorer cannot use (minilib.explore.explorer).

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
    the same check.

    >>> from minilib.heads import check_head_counts
    >>> try:
    ...     check_head_counts(12, 8)
    ... except RPAInputError as err:
    ...     print(err.message)
    num_q_heads=12 must be divisible by num_kv_heads=8
    """


class KVCacheError(HintedError):
    """A bad use of `PageAllocator` or `PagedKVCache`. The state was left unchanged.

    >>> from minilib.kv_cache import PageAllocator
    >>> pool = PageAllocator(total_num_pages=1)
    >>> try:
    ...     pool.allocate(2)
    ... except KVCacheError as err:
    ...     print(type(err).__name__, isinstance(err, ValueError), pool.num_free)
    KVCacheError True 1
    """


class EngineError(HintedError):
    """A bad model config, engine setting or request. Nothing was changed.

    >>> from minilib.engine import ModelConfig
    >>> try:
    ...     ModelConfig(vocab_size=64, num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=7)
    ... except EngineError as err:
    ...     print(err)
    ModelConfig: head_dim=7 must be even.
    Hint: rotary positions rotate pairs of dimensions; use an even head_dim.
    """


class ScheduleTooBig(ValueError):
    """The schedule has more work than the caller asked to handle (`max_computes`).

    >>> from minilib.batch import make_batch
    >>> from minilib.schedule import plan_schedule
    >>> try:
    ...     plan_schedule(*make_batch([(1, 64)]).args(), num_kv_pages_per_block=1,
    ...                   max_computes=2)
    ... except ScheduleTooBig as err:
    ...     print(type(err).__name__)
    ScheduleTooBig
    """


class InputProblem(ValueError):
    """Typed input the explorer cannot use (not a number, too big to draw, ...). `title` is
    what the explorer shows above the message: what kind of problem it is. The default is for
    text that cannot be read; a number that reads well but is out of range gets a title that
    says so (`check_at_most`, `check_at_least` in minilib.explore.explorer).

    >>> from minilib.explore.explorer import parse_ints
    >>> try:
    ...     parse_ints("3, x", "kv_lens")
    ... except InputProblem as err:
    ...     print(type(err).__name__, isinstance(err, ValueError), err.title)
    InputProblem True Cannot read this input
    """

    def __init__(self, message: str, title: str = "Cannot read this input"):
        self.title = title
        super().__init__(message)
