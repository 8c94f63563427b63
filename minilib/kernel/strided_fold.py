"""Lever: q folded by strided loads of 32-bit words, in place of the plain fold
(`plain.fold_q_heads`, which moves q between (16, 128) tiles of bf16 row by row), and the
output unfolded the same way (`plain.write_output`), in the mixed kernel at head_dim 128, and
above it for a group of two q heads a KV head (benchmarks/LEVERS.md). Not in TPU interpret mode.

q's block is [q rows, q heads, 128]: seen flat as words, a bf16 word holds two neighbouring q
heads of one row, and a row's heads are heads / 2 words in a row. The fold wants, for each KV
head, row r * group + g to be q row r, head g: seen as words, group / 2 words per q row, the
same neighbours paired. So word k of KV head h's group is one strided load from the flat q
(start h * group / 2 + k, a stride of one q row's words), stored with a stride of group / 2
words into the folded q: no value is unpacked, no row moves within a word. The output goes
back the same way: each KV head's rows normalized into the folded q's buffer (free by then),
then each word strided from there into the output block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from minilib.chips import packing_of_size
from minilib.kernel.config import LANES, KernelConfig

__all__: list[str] = []  # the kernel body's own: see `fold_q_heads`


def folds_q_strided(config: KernelConfig) -> bool:
    """Whether `fold_q_heads` fits q's shapes (`levers.levers_that_apply` checks the rest: refs
    can be viewed, the mixed kernel): q's heads pair into whole words and whole tiles of words, and
    head_dim is one 128-lane row (the strided load reads rows of exactly 128 lanes) or whole
    rows of 128 lanes with a group of one word (Gemma's 2 q heads a KV head in bf16): then the
    word of each q row is indexed on the q block's axis of words, and stored whole.

    >>> import dataclasses
    >>> from minilib.batch import make_batch
    >>> from minilib.kernel import kernel_config
    >>> b = make_batch([(3, 3)], num_q_heads=32, num_kv_heads=8, head_dim=128)
    >>> config = kernel_config(b.q, b.kv_pages, b.page_indices, num_queries_per_block=8)
    >>> folds_q_strided(config), folds_q_strided(dataclasses.replace(config, head_dim=64))
    (True, False)
    """
    c = config
    per_word = packing_of_size(c.q_itemsize)
    whole_tiles = c.num_q_heads_per_block % (8 * per_word) == 0
    group_words = c.num_q_heads_per_kv_head % per_word == 0
    folded_tiles = c.rows_per_kv_head % (8 * per_word) == 0
    one_word = c.num_q_heads_per_kv_head == per_word
    rows_fit = c.head_dim == LANES or (c.head_dim % LANES == 0 and one_word)
    return rows_fit and whole_tiles and group_words and folded_tiles


def fold_q_heads(q_ref, q_fold_ref, config: KernelConfig):
    """`plain.fold_q_heads`, a word at a time: row r * group + g of q_fold_ref[kv_head] is q
    row r, head g (see the module docstring)."""
    for _, _, block, block_rows, folded, folded_rows in each_word(q_ref, q_fold_ref, config):
        folded[folded_rows] = block[block_rows]


def write_output(softmax, o_ref, q_fold_ref):
    """`plain.write_output`, a word at a time: each KV head's normalized rows into its folded
    q's buffer, then into the output block as `fold_q_heads` took q out of it."""
    words = each_word(o_ref, q_fold_ref, softmax.config)
    for kv_head, k, block, block_rows, folded, folded_rows in words:
        if k == 0:
            q_fold_ref[kv_head] = softmax.normalized(kv_head).astype(q_fold_ref.dtype)
        block[block_rows] = folded[folded_rows]


def each_word(block_ref, q_fold_ref, config: KernelConfig):
    """For word k of each KV head's group of q heads: (kv_head, k, the q or output block seen
    as words, word k's rows there, the KV head's folded rows seen as words, its rows there)."""
    c = config
    rows, heads, head_dim = block_ref.shape
    per_word = packing_of_size(c.q_itemsize)
    row_words = heads // per_word
    group_words = c.num_q_heads_per_kv_head // per_word
    flat = head_dim == LANES
    if flat:  # [rows * row_words, 128], through a leading axis of 1: JAX reshapes a ref whose
        # array has a sharding (an input's, under an abstract mesh) only to as many axes
        block = block_ref.reshape(1, rows * heads, head_dim).bitcast(jnp.uint32).at[0]
    else:  # [rows, row_words, head_dim]: wider rows are indexed, a word of each q row
        block = block_ref.bitcast(jnp.uint32)
    for kv_head in range(c.num_kv_heads_per_block):
        folded = q_fold_ref.at[kv_head].bitcast(jnp.uint32)  # [rows * group_words, head_dim]
        for k in range(group_words):
            word = kv_head * group_words + k
            words = (pl.ds(word, rows, stride=row_words),) if flat else (slice(None), word)
            folded_rows = pl.ds(k, rows, stride=group_words) if group_words > 1 else slice(None)
            yield kv_head, k, block, (*words, slice(None)), folded, (folded_rows, slice(None))


@functools.cache
def interpret_stores_through_views() -> bool:
    """Whether plain interpret mode stores through a bitcast view of a ref, as the fold does
    (jax 0.7.2 cannot: "Unsupported transform: RefBitcaster"). Tried once, on a tiny kernel."""

    def kernel(words_ref, out_ref):
        out_ref.bitcast(jnp.uint32)[...] = words_ref[...]

    call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), jnp.bfloat16), interpret=True)
    try:  # lowered, not run: called while a kernel is traced, a run would only be traced too
        jax.jit(call).lower(jax.ShapeDtypeStruct((8, 128), jnp.uint32))
    except NotImplementedError:
        return False
    return True
