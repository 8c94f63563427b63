"""The causal mask: which keys a query row may see, per key and per KV block.

A sequence's q rows are its *last* q_len tokens: its last q row (packed row q_end - 1) is its
last token (position kv_len - 1), so packed row r sits at position `q_position(r, q_end,
kv_len)`. A query at position q_pos sees the keys at positions 0..q_pos (causal), and with a
sliding window w only the last w of them, q_pos - w + 1..q_pos. A key at or past kv_len is
past every row's position, so the rule hides it too.

Every implementation (reference, vectorized, blockwise, pallas_basics, the kernel) and the
figures use these functions, so the rule is written once:

    is_masked(q_pos, k_pos, sliding_window)        the rule, on positions (broadcasting)
    q_position(row, q_end, kv_len)                 a packed q row's position in its sequence
    causal_mask(q_len, kv_len, sliding_window)     the rule as a [q_len, kv_len] array
    kv_blocks_to_visit(first_q_pos, last_q_pos,    the rule per KV block: the blocks holding a
                       kv_tokens_per_block,        key that some row of a q block can see
                       sliding_window)

They are plain arithmetic and comparisons, so they run on Python ints, NumPy arrays, jnp
arrays under `jit`, and values inside a Pallas kernel alike.

What a masked score becomes is JAX's rule, `apply_mask_value`: `mask_value` is *added* to it
(JAX's reference: `attn += jnp.where(mask, mask_value, 0.0)`), and a key at or past kv_len is no
key at all (JAX's reference slices it off). With a small mask_value a masked key still has a
weight, so the KV blocks that hold only masked keys count too; with a mask_value at or below
`NEGLIGIBLE_MASK_VALUE` (the default, -0.7 * float32 max, is far below) every masked weight is
exactly 0 in float32, and those blocks may be skipped: `mask_value_vanishes`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "NEGLIGIBLE_MASK_VALUE",
    "apply_mask_value",
    "causal_mask",
    "is_masked",
    "kv_blocks_to_visit",
    "mask_value_vanishes",
    "open_kv_blocks_end",
    "q_position",
]

# At or below this, score + mask_value rounds to mask_value itself in float32 for any score of
# size < 1e22 (half its ulp), and exp(mask_value - m) is 0: masked keys weigh exactly nothing.
NEGLIGIBLE_MASK_VALUE = -1e30


def is_masked(q_pos, k_pos, sliding_window: int | None = None):
    """True where the key at position `k_pos` is hidden from the query at `q_pos`.

    q_pos and k_pos broadcast against each other (e.g. q_pos [rows, 1] and k_pos [1, keys]);
    the result has their broadcast shape. Hidden: a future key (k_pos > q_pos), or, with a
    sliding window, one `sliding_window` or more positions back.

    >>> is_masked(jnp.arange(4)[:, None], jnp.arange(4)[None, :], 2).astype(int).tolist()
    [[0, 1, 1, 1], [0, 0, 1, 1], [1, 0, 0, 1], [1, 1, 0, 0]]
    """
    masked = k_pos > q_pos
    if sliding_window is not None:
        masked = masked | (k_pos <= q_pos - sliding_window)
    return masked


def q_position(row, q_end, kv_len):
    """The position in its sequence of packed q row `row` (any shape, broadcasting).

    The sequence's rows end at q_end (exclusive) and are its last tokens, so row q_end - 1 is
    token kv_len - 1.

    >>> q_position(jnp.arange(5, 8), 8, 10).tolist()   # rows 5..7: the last 3 of 10 tokens
    [7, 8, 9]
    """
    return (kv_len - q_end) + row


def causal_mask(q_len: int, kv_len: int, sliding_window: int | None = None) -> jax.Array:
    """True where query row i may NOT see key j.  [q_len, kv_len] bool.

    The q rows are the *last* q_len tokens of the sequence, so row i sits at position
    `kv_len - q_len + i` and sees keys 0..that position (and, with a sliding window, only the
    last `sliding_window` of them).

    >>> causal_mask(2, 4).astype(int).tolist()   # a prefill chunk of 2 after 2 cached tokens
    [[0, 0, 0, 1], [0, 0, 0, 0]]
    """
    q_pos = q_position(jnp.arange(q_len)[:, None], q_len, kv_len)  # [q_len, 1]
    k_pos = jnp.arange(kv_len)[None, :]  # [1, kv_len]
    return is_masked(q_pos, k_pos, sliding_window)


def kv_blocks_to_visit(
    first_q_pos,  # i32[] or int: position of the q block's first row in its sequence
    last_q_pos,  # i32[] or int: ... of its last row
    kv_tokens_per_block: int,  # keys per KV block: num_kv_pages_per_block * page_size
    sliding_window: int | None = None,
):  # -> (first, end): the KV blocks [first, end)
    """The KV blocks [first, end) that hold a key some row of a q block can see.

    KV block b holds the keys [b * kv_tokens_per_block, (b + 1) * kv_tokens_per_block).
    Causal: no row sees past last_q_pos, so the block holding it is the last one. With a
    sliding window, no row sees before first_q_pos - sliding_window + 1, so the blocks before
    the one holding that key are skipped too. Inside the range, `is_masked` hides keys row by
    row. (last_q_pos < kv_len for the rows of a sequence, so no block past kv_len is visited.)

    >>> [int(b) for b in kv_blocks_to_visit(40, 40, 16, sliding_window=8)]  # keys 33..40
    [2, 3]
    >>> kv_blocks_to_visit(40, 47, 16)  # keys 0..47
    (0, 3)
    """
    end = last_q_pos // kv_tokens_per_block + 1
    if sliding_window is None:
        return 0, end
    first_key = jnp.maximum(first_q_pos - sliding_window + 1, 0)
    return first_key // kv_tokens_per_block, end


def open_kv_blocks_end(
    rows,  # (first, end): the q block's rows, in the kernel's q
    seq_rows,  # (q_start, q_end): the sequence's rows there
    kv_len,
    kv_tokens_per_block: int,
    sliding_window: int | None = None,
):  # -> the KV blocks [0, end) that no row of the q block needs masked
    """The KV blocks in which every row of a q block sees every key: all rows are the
    sequence's, and the block ends at or before the first row's position (so before kv_len
    too). With a sliding window none: it hides keys at a block's start as well.

    >>> int(open_kv_blocks_end((0, 8), (0, 8), 40, 16))   # rows at 32..39: keys 0..31 open
    2
    >>> int(open_kv_blocks_end((0, 8), (2, 8), 40, 16))   # rows 0, 1 are another sequence's
    0
    """
    if sliding_window is not None:
        return 0
    whole = (seq_rows[0] <= rows[0]) & (seq_rows[1] >= rows[1])
    first_pos = q_position(rows[0], seq_rows[1], kv_len)
    return jnp.where(whole, (first_pos + 1) // kv_tokens_per_block, 0)


def mask_value_vanishes(mask_value: float) -> bool:
    """True when masked keys weigh exactly 0 in float32 (mask_value <= NEGLIGIBLE_MASK_VALUE):
    then adding mask_value or replacing the score with it give the same answer, and a KV block
    whose keys are all masked for every row may be skipped. A static Python check: every
    implementation takes mask_value as a Python float.

    >>> mask_value_vanishes(-0.7 * 3.4028235e38), mask_value_vanishes(-1e4)
    (True, False)
    """
    return mask_value <= NEGLIGIBLE_MASK_VALUE


def apply_mask_value(scores, masked, mask_value: float, past_kv_len=None):
    """JAX's rule for masked scores: `scores + mask_value` where `masked`; and where
    `past_kv_len` (a padding slot, no key at all) -inf, so that it weighs nothing and a NaN
    computed from it is dropped. masked and past_kv_len broadcast against scores.

    When the mask value vanishes (`mask_value_vanishes`) both are simply replaced by
    mask_value: one select, the same answer in float32 for finite scores. (A NaN score of a
    hidden key is dropped here, where JAX's reference, which adds, keeps it.)

    >>> s = jnp.array([[1.0, 2.0, 3.0]])
    >>> masked, past = jnp.array([[False, True, True]]), jnp.array([[False, False, True]])
    >>> apply_mask_value(s, masked, -5.0, past).tolist()
    [[1.0, -3.0, -inf]]
    >>> apply_mask_value(s, masked, -1e30, past).tolist()
    [[1.0, -1.0000000150474662e+30, -1.0000000150474662e+30]]
    """
    if mask_value_vanishes(mask_value):
        hidden = masked if past_kv_len is None else masked | past_kv_len
        return jnp.where(hidden, mask_value, scores)
    scores = jnp.where(masked, scores + mask_value, scores)
    return scores if past_kv_len is None else jnp.where(past_kv_len, -jnp.inf, scores)
