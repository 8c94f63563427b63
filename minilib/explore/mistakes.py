"""Common mistakes in the inputs of ragged paged attention, each as the code that makes it.

A mistake is a function: it gets a correct batch `b` (`base_batch()`: the sequences of
`SEQ_LENS`, 4 q heads, 2 KV heads, head_dim 8, page_size 8) and returns the positional
arguments and the options it breaks them into. `MISTAKES` names them all, in four groups:
shapes, dtypes and options, which the static checks catch, and values, which only the dynamic
checks can, except one: a stale kv_len that still covers its q rows passes every check, and
gives a wrong answer. `run_mistake` passes a mistake to a validator and returns the error it
raised.

This is the one catalogue: the validation playground (`minilib.explore.playground`) shows it,
notebook 05 runs it through both validators, and the tests check the message of each mistake.

    >>> args, options = MISTAKES["sliding_window=0 to turn it off"](base_batch())
    >>> options
    {'sliding_window': 0}
    >>> print(run_mistake("sliding_window=0 to turn it off").message)
    sliding_window=0 must be positive.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from minilib.batch import RaggedBatch, make_batch
from minilib.errors import RPAInputError
from minilib.heads import split_kv_pages
from minilib.validation import dynamic_validate_inputs

__all__ = ["MISTAKES", "SEQ_LENS", "base_batch", "run_mistake"]

SEQ_LENS = [(5, 5), (1, 20), (3, 12)]  # a prefill, a decode, a prefill chunk


def base_batch() -> RaggedBatch:
    """The correct batch that every mistake breaks.

    >>> b = base_batch()
    >>> b.q.shape  # [max_num_batched_tokens, num_q_heads, head_dim]
    (9, 4, 8)
    >>> b.kv_pages.shape  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    (9, 8, 4, 8)
    """
    return make_batch(SEQ_LENS, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=8)


def run_mistake(name: str, validator: Callable = dynamic_validate_inputs) -> RPAInputError | None:
    """Build the batch of mistake `name` and run `validator` (by default
    `dynamic_validate_inputs`) on it. Returns the error it raised, or None if the inputs are
    valid.

    >>> print(run_mistake("12 q heads with 8 KV heads").message)
    num_q_heads=12 must be divisible by num_kv_heads=8
    >>> run_mistake("correct: a valid mixed batch") is None
    True
    """
    args, options = MISTAKES[name](base_batch())
    try:
        validator(*args, **options)
    except RPAInputError as err:
        return err
    return None


def correct(b):
    """Nothing wrong: the batch make_batch built."""
    return b.args(), {}


# --- shapes -----------------------------------------------------------------------------------


def twelve_q_heads_eight_kv_heads(b):
    """A model config with 12 q heads and 8 KV heads: 8 does not divide 12."""
    b = make_batch(SEQ_LENS, num_q_heads=12, num_kv_heads=8, head_dim=8, page_size=8)
    return b.args(), {}


def q_transposed(b):
    """q as [num_q_heads, tokens, head_dim], the layout of many attention codes."""
    q = jnp.swapaxes(b.q, 0, 1)
    return (q, *b.args()[1:]), {}


def q_without_head_axis(b):
    """q as [tokens, num_q_heads * head_dim], the output of the q projection, not split."""
    q = b.q.reshape(b.q.shape[0], -1)
    return (q, *b.args()[1:]), {}


def q_head_dim_differs(b):
    """q of head_dim 16 against pages of head_dim 8: q from another model's config."""
    q = jnp.zeros((b.q.shape[0], b.q.shape[1], 16), b.q.dtype)
    return (q, *b.args()[1:]), {}


def k_pages_instead_of_kv_pages(b):
    """Only the K pages, not K and V merged into kv_pages (an MQA model: one KV head)."""
    b = make_batch(SEQ_LENS, num_q_heads=4, num_kv_heads=1, head_dim=8, page_size=8)
    k_pages, v_pages = split_kv_pages(b.kv_pages)
    return (b.q, k_pages, *b.args()[2:]), {}


def k_and_v_stacked(b):
    """K and V stacked on an axis of their own, [pages, page_size, 2, num_kv_heads, head_dim],
    not interleaved on the head axis."""
    kv_pages = jnp.stack(split_kv_pages(b.kv_pages), axis=2)
    return (b.q, kv_pages, *b.args()[2:]), {}


def kv_lens_longer_than_page_indices(b):
    """kv_lens padded to 4 slots while page_indices has rows for 3 (max_num_seqs=3)."""
    kv_lens = jnp.append(b.kv_lens, 0)
    return (b.q, b.kv_pages, kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs), {}


def kv_lens_as_a_column(b):
    """kv_lens as a column, [max_num_seqs, 1], as sliced from a table of lengths."""
    kv_lens = b.kv_lens[:, None]
    return (b.q, b.kv_pages, kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs), {}


def page_indices_flattened(b):
    """page_indices flattened to one list of pages, without a row per sequence."""
    page_indices = b.page_indices.reshape(-1)
    return (b.q, b.kv_pages, b.kv_lens, page_indices, b.cu_q_lens, b.num_seqs), {}


def cu_q_lens_one_entry_short(b):
    """cu_q_lens as the end of each sequence's rows: one entry per sequence, where there must
    be max_num_seqs + 1 (the starts, then the end of the last)."""
    cu_q_lens = b.cu_q_lens[1:]
    return (b.q, b.kv_pages, b.kv_lens, b.page_indices, cu_q_lens, b.num_seqs), {}


def cu_q_lens_as_a_column(b):
    """cu_q_lens as a column, [max_num_seqs + 1, 1]."""
    cu_q_lens = b.cu_q_lens[:, None]
    return (b.q, b.kv_pages, b.kv_lens, b.page_indices, cu_q_lens, b.num_seqs), {}


def num_seqs_scalar(b):
    """num_seqs as a plain scalar instead of a one-element array."""
    num_seqs = jnp.int32(3)
    return (*b.args()[:5], num_seqs), {}


def num_seqs_two_entries(b):
    """num_seqs with two entries, the live count and the slot count."""
    num_seqs = jnp.array([3, 3], jnp.int32)
    return (*b.args()[:5], num_seqs), {}


# --- dtypes -----------------------------------------------------------------------------------


def int64_lengths(b):
    """kv_lens built with NumPy, whose integers are int64 by default."""
    kv_lens = np.array([5, 20, 12])
    return (b.q, b.kv_pages, kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs), {}


def int64_page_indices(b):
    """page_indices built with NumPy, whose integers are int64 by default."""
    page_indices = np.asarray(b.page_indices, np.int64)
    return (b.q, b.kv_pages, b.kv_lens, page_indices, b.cu_q_lens, b.num_seqs), {}


def float_lengths(b):
    """kv_lens computed with a division, so it came out as floats."""
    kv_lens = b.kv_lens.astype(jnp.float32)
    return (b.q, b.kv_pages, kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs), {}


def q_as_integers(b):
    """q cast to integers, as the token ids it was computed from."""
    return (b.q.astype(jnp.int32), *b.args()[1:]), {}


def q_in_fp8(b):
    """q in fp8, like the cache: q must keep 16 bits or more."""
    return (b.q.astype(jnp.float8_e4m3fn), *b.args()[1:]), {}


def kv_pages_as_int8(b):
    """kv_pages quantized to int8 by hand: the cache must hold floats (fp8 is fine)."""
    return (b.q, b.kv_pages.astype(jnp.int8), *b.args()[2:]), {}


def kv_pages_as_bool(b):
    """kv_pages as a boolean array, e.g. a mask passed in its place."""
    return (b.q, b.kv_pages.astype(jnp.bool_), *b.args()[2:]), {}


# --- options: the arrays are right, an option is wrong --------------------------------------

# Each mistake is the options passed with a correct batch, and why someone passed them:
# `wrong_options` makes it.
OPTION_MISTAKES: dict[str, tuple[str, dict]] = {
    "soft_cap=0.0 to turn it off": (
        "soft_cap=0.0, meant as 'no soft capping'.",
        {"soft_cap": 0.0},
    ),
    "soft_cap=inf to turn it off": (
        "soft_cap=inf, meant as 'no soft capping'.",
        {"soft_cap": float("inf")},
    ),
    "sliding_window=0 to turn it off": (
        "sliding_window=0, meant as 'no window'.",
        {"sliding_window": 0},
    ),
    "sliding_window negative": (
        "sliding_window=-3, a window counted backwards.",
        {"sliding_window": -3},
    ),
    "sliding_window as a float": (
        "A sliding window computed as a fraction of the context, so it came out a float.",
        {"sliding_window": 20 / 8},
    ),
    "sliding_window=True": (
        "sliding_window=True, meant as 'use the model's window'.",
        {"sliding_window": True},
    ),
    "mask_value=-inf": (
        "mask_value=-inf, the textbook mask: NaN wherever a row sees no key in a block.",
        {"mask_value": float("-inf")},
    ),
    "mask_value=nan": (
        "mask_value=nan, from a computation that went wrong.",
        {"mask_value": float("nan")},
    ),
    "mask_value=0.0": (
        "mask_value=0.0, as in a 0/1 mask: masked keys would still get weight.",
        {"mask_value": 0.0},
    ),
    "mask_value positive": (
        "mask_value=1e30, the sign dropped: masked keys would take all the weight.",
        {"mask_value": 1e30},
    ),
    "mask_value as a string": (
        "mask_value as a string, read from a config file.",
        {"mask_value": "-1e9"},
    ),
    "sm_scale=nan": (
        "sm_scale=nan, from 1 / sqrt of a head_dim that was never set.",
        {"sm_scale": float("nan")},
    ),
    "sm_scale as an array": (
        "sm_scale as an array of two scales, one per something.",
        {"sm_scale": jnp.ones(2)},
    ),
    "sm_scale as a string": (
        "sm_scale as a string, read from a config file.",
        {"sm_scale": "0.125"},
    ),
    "k_scale as an array": (
        "k_scale passed as a JAX scalar instead of a Python float.",
        {"k_scale": jnp.float32(0.5), "v_scale": 0.5},
    ),
    "k_scale as an int": (
        "k_scale=2, an int where a Python float is needed.",
        {"k_scale": 2},
    ),
    "k_scale=0.0": (
        "k_scale=0.0, meant as 'no scaling': it would zero every key.",
        {"k_scale": 0.0},
    ),
    "v_scale negative": (
        "v_scale=-0.5: a scale flips no signs.",
        {"v_scale": -0.5},
    ),
    "v_scale=inf": (
        "v_scale=inf, from a division by an amax of 0.",
        {"v_scale": float("inf")},
    ),
    "num_kv_pages_per_block > pages_per_seq": (
        "num_kv_pages_per_block=4 when each sequence has only pages_per_seq=3 columns.",
        {"num_kv_pages_per_block": 4},
    ),
    "num_kv_pages_per_block=0": (
        "num_kv_pages_per_block=0, meant as 'the default' (that is None).",
        {"num_kv_pages_per_block": 0},
    ),
    "num_queries_per_block=-1": (
        "num_queries_per_block=-1, meant as 'the default' (that is None).",
        {"num_queries_per_block": -1},
    ),
    "vmem_limit_bytes=0": (
        "vmem_limit_bytes=0, meant as 'no limit' (that is None).",
        {"vmem_limit_bytes": 0},
    ),
}


def wrong_options(reason: str, options: dict) -> Callable:
    """The mistake of passing `options` with the correct batch `b`; `reason` is why someone
    did. Its `code` is what the playground shows: the call, with the reason as docstring."""

    def pass_wrong_options(b):
        return b.args(), options

    pass_wrong_options.__doc__ = reason
    pass_wrong_options.code = (
        f'def pass_wrong_options(b):\n    """{reason}"""\n    return b.args(), {options!r}\n'
    )
    return pass_wrong_options


# --- values: only the dynamic checks see them ----------------------------------------------------


def q_len_greater_than_kv_len(b):
    """kv_lens taken before this step's tokens were written to the cache. For sequence 0, a
    fresh prefill of 5 tokens, that is 0: its 5 q rows have no key at all."""
    kv_lens = b.kv_lens.at[0].set(0)
    return (b.q, b.kv_pages, kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs), {}


def stale_kv_len(b):
    """kv_lens taken before this step's tokens were written to the cache. For sequence 2, a
    prefill chunk of 3 new tokens in 12, that is 9: q_len=3 <= kv_len=9 still holds, so no
    check fires, and the answer is wrong: the new tokens' keys are not attended."""
    kv_lens = b.kv_lens.at[2].set(9)
    return (b.q, b.kv_pages, kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs), {}


def pages_per_seq_too_small(b):
    """A page table with one column, too few for the 20-token sequence (3 pages of 8)."""
    page_indices = b.page_indices[:, :1]
    return (b.q, b.kv_pages, b.kv_lens, page_indices, b.cu_q_lens, b.num_seqs), {}


def negative_kv_len(b):
    """-1 as 'no sequence here', in a slot that num_seqs still counts."""
    kv_lens = b.kv_lens.at[1].set(-1)
    return (b.q, b.kv_pages, kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs), {}


def page_index_out_of_range(b):
    """A page number past the end of kv_pages, e.g. from another cache."""
    total_num_pages = b.kv_pages.shape[0]
    page_indices = b.page_indices.at[1, 0].set(total_num_pages)
    return (b.q, b.kv_pages, b.kv_lens, page_indices, b.cu_q_lens, b.num_seqs), {}


def negative_page_index(b):
    """-1 as 'no page yet', in a column the sequence uses."""
    page_indices = b.page_indices.at[0, 0].set(-1)
    return (b.q, b.kv_pages, b.kv_lens, page_indices, b.cu_q_lens, b.num_seqs), {}


def cu_q_lens_decreasing(b):
    """cu_q_lens of two sequences swapped by hand: [0, 5, 4, 9]."""
    cu_q_lens = b.cu_q_lens.at[2].set(4)
    return (b.q, b.kv_pages, b.kv_lens, b.page_indices, cu_q_lens, b.num_seqs), {}


def cu_q_lens_without_leading_zero(b):
    """cu_q_lens as np.cumsum(q_lens), without the leading 0."""
    cu_q_lens = jnp.array([5, 6, 9, 9], jnp.int32)
    return (b.q, b.kv_pages, b.kv_lens, b.page_indices, cu_q_lens, b.num_seqs), {}


def q_too_short(b):
    """q cut to 8 rows while cu_q_lens packs 9 tokens."""
    return (b.q[:8], *b.args()[1:]), {}


def num_seqs_too_big(b):
    """num_seqs counting one more sequence than there are slots."""
    num_seqs = jnp.array([4], jnp.int32)
    return (*b.args()[:5], num_seqs), {}


def negative_num_seqs(b):
    """num_seqs=-1, meant as 'unknown'."""
    num_seqs = jnp.array([-1], jnp.int32)
    return (*b.args()[:5], num_seqs), {}


MISTAKES: dict[str, Callable] = {
    "correct: a valid mixed batch": correct,
    # shapes
    "12 q heads with 8 KV heads": twelve_q_heads_eight_kv_heads,
    "q transposed to [num_q_heads, tokens, head_dim]": q_transposed,
    "q without its head axis": q_without_head_axis,
    "q's head_dim differs from kv_pages'": q_head_dim_differs,
    "K pages only, not kv_pages": k_pages_instead_of_kv_pages,
    "K and V stacked on an axis of their own": k_and_v_stacked,
    "kv_lens longer than page_indices": kv_lens_longer_than_page_indices,
    "kv_lens as a column": kv_lens_as_a_column,
    "page_indices flattened": page_indices_flattened,
    "cu_q_lens one entry short": cu_q_lens_one_entry_short,
    "cu_q_lens as a column": cu_q_lens_as_a_column,
    "num_seqs as a scalar": num_seqs_scalar,
    "num_seqs with two entries": num_seqs_two_entries,
    # dtypes
    "kv_lens as int64 (NumPy's default)": int64_lengths,
    "page_indices as int64 (NumPy's default)": int64_page_indices,
    "kv_lens as floats": float_lengths,
    "q as integers": q_as_integers,
    "q in fp8": q_in_fp8,
    "kv_pages as int8": kv_pages_as_int8,
    "kv_pages as bool": kv_pages_as_bool,
    # options
    **{name: wrong_options(*mistake) for name, mistake in OPTION_MISTAKES.items()},
    # values
    "q_len > kv_len": q_len_greater_than_kv_len,
    "a stale kv_len, which no check can catch": stale_kv_len,
    "pages_per_seq too small": pages_per_seq_too_small,
    "a negative kv_len": negative_kv_len,
    "a page index out of range": page_index_out_of_range,
    "a negative page index": negative_page_index,
    "cu_q_lens decreasing": cu_q_lens_decreasing,
    "cu_q_lens without its leading 0": cu_q_lens_without_leading_zero,
    "q shorter than the packed tokens": q_too_short,
    "num_seqs > max_num_seqs": num_seqs_too_big,
    "num_seqs negative": negative_num_seqs,
}
