"""A first Pallas kernel: the step between jax.numpy and the TPU kernel.

Pallas writes a kernel as a Python function over *refs*, views of memory, and runs it once per
point of a *grid*. Each run is a *program*; `pl.program_id(axis)` says which one it is. A
`BlockSpec(block_shape, index_map)` says which block of each array a program sees: the
index_map turns the program's grid indices into the block's indices. Pallas copies each block
in before the program runs and the output block out after it, so the kernel body only ever
sees small, dense, rectangular arrays.

Two kernels, the second built like the first:

  `add_vectors`   one program per block of a vector: x + y.
  `ragged_paged_attention_pallas_basic`
                  one program per (sequence, q block, KV head). Plain jnp first rearranges
                  the ragged batch into dense per-sequence arrays (q rows by sequence, K and V
                  gathered from the pages), so that every block a program needs is a plain
                  BlockSpec block; the kernel body is masked softmax attention of one q block
                  over all of its sequence's keys.

The price of that jnp rearranging is the gather-all version's: memory that grows with
max_num_seqs * pages_per_seq. The TPU kernel (`minilib.kernel`) removes it by reading the
pages in place: it prefetches the page table into scalar memory and copies pages itself.

Both run anywhere with `interpret=True` (the default here): Pallas then runs the kernel as
ordinary JAX operations, one program after another, which is slow but exact and needs no TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from minilib.blockwise import clamp_lengths
from minilib.masking import apply_mask_value, is_masked, q_position
from minilib.options import DEFAULT_MASK_VALUE, AttentionOptions
from minilib.reference import apply_soft_cap, dequantize, softmax_with_sink
from minilib.validation import validate_inputs
from minilib.vectorized import gather_all_kv

# The public names; the kernel bodies (`add_vectors_kernel`, `attention_kernel`) are shown in
# notebook 07 and run only inside `pl.pallas_call`.
__all__ = [
    "DEFAULT_NUM_QUERIES_PER_BLOCK",
    "add_vectors",
    "attention_pallas_call",
    "pack_rows",
    "q_by_sequence",
    "ragged_paged_attention_pallas_basic",
]

DEFAULT_NUM_QUERIES_PER_BLOCK = 8


# ---------------------------------------------------------------------------------------------
# Warm-up: adding two vectors, one block per program.
# ---------------------------------------------------------------------------------------------


def add_vectors_kernel(
    x_ref,  # [block_size], this program's block of x
    y_ref,  # [block_size]
    o_ref,  # [block_size], this program's block of the output
):
    """The body of one program: read two blocks, write one. `[...]` reads or writes all of it."""
    o_ref[...] = x_ref[...] + y_ref[...]


def add_vectors(
    x: jax.Array,  # [n]
    y: jax.Array,  # [n]
    *,
    block_size: int = 128,
    interpret=True,
) -> jax.Array:  # [n]
    """x + y as a Pallas kernel: program i adds elements [i * block_size, (i+1) * block_size).

    The grid has n // block_size programs, and every BlockSpec maps program i to block i.

    >>> add_vectors(jnp.arange(8.0), jnp.ones(8), block_size=4).tolist()
    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    """
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(
            f"x.shape={x.shape} and y.shape={y.shape} must be the same 1-D shape.\n"
            "Hint: this kernel adds two vectors of equal length; flatten with .reshape(-1)."
        )
    (n,) = x.shape
    if n % block_size != 0:
        raise ValueError(
            f"n={n} must be a multiple of {block_size=}.\n"
            f"Hint: pad the vectors to {pl.cdiv(n, block_size) * block_size} elements, or pick "
            f"a block_size that divides {n}."
        )
    block = pl.BlockSpec((block_size,), lambda i: (i,))  # program i sees block i
    return pl.pallas_call(
        add_vectors_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(n // block_size,),
        in_specs=[block, block],
        out_specs=block,
        interpret=interpret,
    )(x, y)


# ---------------------------------------------------------------------------------------------
# Ragged paged attention: one program per (sequence, q block, KV head).
# ---------------------------------------------------------------------------------------------


def ragged_paged_attention_pallas_basic(
    q: jax.Array,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_queries_per_block: int = DEFAULT_NUM_QUERIES_PER_BLOCK,
    interpret=True,
    validate: bool = True,
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
) -> jax.Array:  # [max_num_batched_tokens, num_q_heads, head_dim]
    """Ragged paged attention as a first Pallas kernel, over K/V gathered by jnp.

    Same signature and result as `ref_ragged_paged_attention` (padding rows come out zero),
    plus `num_queries_per_block` (q rows per program) and `interpret` (passed to
    `pl.pallas_call`; True runs on any backend). Compiled once per shape; `num_seqs` may be
    traced. Called eagerly, it first checks the values of the inputs
    (`dynamic_validate_inputs`); `validate=False` skips that. Under `jax.jit` only the static
    checks can run: validate outside jit, as JAX does.

    An fp8 `kv_pages` without `k_scale` and `v_scale` is taken as scale 1, with no error or
    warning (as in JAX's kernel): pass the scales the cache was quantized with.
    `attention_sink` (f32[num_q_heads], or None): one more softmax logit per q head, with no
    value, as in `ref_ragged_paged_attention`; each program gets its KV head's group of sinks.

    It runs in interpret mode only: Mosaic, the TPU compiler, rejects it by design. Its
    BlockSpecs cut one KV head and `group` q heads out of the head axis, so the last two
    dimensions of a block, (group, head_dim) or (1, head_dim), are not whole (8, 128) tiles.
    `interpret=False` fails at lowering with "The Pallas TPU lowering currently requires that
    the last two dimensions of your block shape are divisible by 8 and 128 respectively, or be
    equal to the respective dimensions of the overall array." `minilib.kernel` keeps whole
    tiles (`num_kv_heads_per_block`); `tests/tpu/test_tpu_compile.py` checks both.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> ragged_paged_attention_pallas_basic(*batch.args()).shape
    (4, 4, 64)
    """
    options = AttentionOptions(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
        num_queries_per_block=num_queries_per_block,
    )
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    validate_inputs(*args, options, validate=validate, attention_sink=attention_sink)
    return _rpa_pallas_basic(*args, options, attention_sink, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("options", "interpret"))
def _rpa_pallas_basic(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options: AttentionOptions,
    attention_sink=None, *, interpret,
):  # fmt: skip
    """jnp rearranges the batch into dense blocks, the kernel attends, jnp packs the rows back."""
    max_num_seqs, pages_per_seq = page_indices.shape
    # Unchecked values (under jit) are clamped into the ranges the shapes allow ...
    num_seqs, kv_lens, q_starts, q_ends = clamp_lengths(
        num_seqs, kv_lens, cu_q_lens, max_num_seqs, q.shape[0], pages_per_seq * kv_pages.shape[1]
    )
    # ... and padding sequence slots may hold garbage: give them no q rows and no keys.
    live = jnp.arange(max_num_seqs) < num_seqs
    q_lens = jnp.where(live, q_ends - q_starts, 0)
    kv_lens = jnp.where(live, kv_lens, 0)
    q_starts = jnp.where(live, q_starts, 0)

    # A sequence has at most min(max_num_batched_tokens, max kv_len) q rows (q_len <= kv_len),
    # rounded up to whole q blocks.
    num_queries_per_block = options.num_queries_per_block or DEFAULT_NUM_QUERIES_PER_BLOCK
    max_q_len = min(q.shape[0], pages_per_seq * kv_pages.shape[1])
    max_q_len = pl.cdiv(max_q_len, num_queries_per_block) * num_queries_per_block
    q_seq = q_by_sequence(q, q_starts, q_lens, max_q_len)
    k, v = gather_all_kv(kv_pages, page_indices, kv_lens)
    k, v = dequantize(k, options.k_scale, q.dtype), dequantize(v, options.v_scale, q.dtype)

    out_seq = attention_pallas_call(
        q_seq,
        k,
        v,
        q_lens,
        kv_lens,
        sm_scale=options.sm_scale,
        sliding_window=options.sliding_window,
        soft_cap=options.soft_cap,
        mask_value=options.mask_value,
        num_queries_per_block=num_queries_per_block,
        interpret=interpret,
        attention_sink=attention_sink,
    )
    return pack_rows(out_seq, q_starts, q_lens, q.shape[0])


def q_by_sequence(
    q: jax.Array,  # [max_num_batched_tokens, num_q_heads, head_dim]
    q_starts: jax.Array,  # i32[max_num_seqs]
    q_lens: jax.Array,  # i32[max_num_seqs], 0 for padding slots
    max_q_len: int,
) -> jax.Array:  # [max_num_seqs, max_q_len, num_q_heads, head_dim]
    """Unpack the ragged q rows: row j of sequence s is q[q_starts[s] + j], zero past q_len.

    Now the rows of q block i of sequence s are one rectangular block, [s, i*Q:(i+1)*Q], which
    a BlockSpec can hand to a program. (Zero, not the padding rows' NaN, so that nothing NaN
    enters the kernel.)

    >>> q = jnp.arange(5.0).reshape(5, 1, 1)                 # rows 0-1: seq 0, rows 2-4: seq 1
    >>> q_seq = q_by_sequence(q, jnp.array([0, 2]), jnp.array([2, 3]), max_q_len=4)
    >>> q_seq[..., 0, 0].tolist()
    [[0.0, 1.0, 0.0, 0.0], [2.0, 3.0, 4.0, 0.0]]
    """
    j = jnp.arange(max_q_len)[None, :]  # [1, max_q_len]
    rows = jnp.clip(q_starts[:, None] + j, 0, q.shape[0] - 1)
    in_seq = (j < q_lens[:, None])[:, :, None, None]
    return jnp.where(in_seq, q[rows], jnp.zeros((), q.dtype))


def pack_rows(
    out_seq: jax.Array,  # [max_num_seqs, max_q_len, num_q_heads, head_dim]
    q_starts: jax.Array,  # i32[max_num_seqs]
    q_lens: jax.Array,  # i32[max_num_seqs]
    max_num_batched_tokens: int,
) -> jax.Array:  # [max_num_batched_tokens, num_q_heads, head_dim]
    """The inverse of `q_by_sequence`: put each sequence's rows back in the packed batch.

    Rows past a sequence's q_len are sent to index max_num_batched_tokens, out of range, and
    `mode="drop"` throws them away; padding rows of the batch stay zero.

    >>> q = jnp.arange(1.0, 6.0).reshape(5, 1, 1)
    >>> q_starts, q_lens = jnp.array([0, 2]), jnp.array([2, 2])
    >>> pack_rows(q_by_sequence(q, q_starts, q_lens, 4), q_starts, q_lens, 5)[:, 0, 0].tolist()
    [1.0, 2.0, 3.0, 4.0, 0.0]
    """
    max_num_seqs, max_q_len, num_q_heads, head_dim = out_seq.shape
    j = jnp.arange(max_q_len)[None, :]
    rows = jnp.where(j < q_lens[:, None], q_starts[:, None] + j, max_num_batched_tokens)
    out = jnp.zeros((max_num_batched_tokens, num_q_heads, head_dim), out_seq.dtype)
    return out.at[rows.reshape(-1)].set(out_seq.reshape(-1, num_q_heads, head_dim), mode="drop")


def attention_pallas_call(
    q_seq: jax.Array,  # [max_num_seqs, max_q_len, num_q_heads, head_dim]
    k: jax.Array,  # [max_num_seqs, max_kv_len, num_kv_heads, head_dim]
    v: jax.Array,  # [max_num_seqs, max_kv_len, num_kv_heads, head_dim]
    q_lens: jax.Array,  # i32[max_num_seqs]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    *,
    num_queries_per_block: int,
    interpret,
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
    **attention_options,
) -> jax.Array:  # [max_num_seqs, max_q_len, num_q_heads, head_dim]
    """The grid and the BlockSpecs: which block of each array program (s, i, h) sees.

    Program (s, i, h) attends the rows [i*Q, (i+1)*Q) of sequence s, for the `group` q heads
    that share KV head h, over all of sequence s's keys of KV head h. `pl.squeezed` drops an
    axis of size 1 from the block, so the kernel sees q as [Q, group, head_dim] and K as
    [max_kv_len, head_dim]. With an `attention_sink`, program (s, i, h) also sees the group
    of sinks of KV head h, [1, group] (a block as wide as the array, which Mosaic allows).

    >>> q_seq = jnp.ones((2, 8, 4, 16))                      # 2 sequences, 4 q heads
    >>> k = v = jnp.ones((2, 32, 2, 16))                     # 2 KV heads: groups of 2
    >>> lens = jnp.array([8, 3], jnp.int32)
    >>> out = attention_pallas_call(
    ...     q_seq, k, v, lens, jnp.array([32, 3], jnp.int32), num_queries_per_block=8,
    ...     interpret=True, sm_scale=0.25, sliding_window=None, soft_cap=None,
    ...     mask_value=DEFAULT_MASK_VALUE)
    >>> out.shape, round(float(out[0, 0, 0, 0]), 4)          # every value is 1: so is the mean
    ((2, 8, 4, 16), 1.0)
    """
    max_num_seqs, max_q_len, num_q_heads, head_dim = q_seq.shape
    max_kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    rows = num_queries_per_block
    # Along the head axis, a q block is `group` heads wide, so block index h starts at q head
    # h * group: exactly the q heads of KV head h.
    q_spec = pl.BlockSpec((pl.squeezed, rows, group, head_dim), lambda s, i, h: (s, i, h, 0))
    kv_spec = pl.BlockSpec(
        (pl.squeezed, max_kv_len, pl.squeezed, head_dim), lambda s, i, h: (s, 0, h, 0)
    )
    len_spec = pl.BlockSpec((1,), lambda s, i, h: (s,))  # this sequence's length, [1]
    in_specs = [q_spec, kv_spec, kv_spec, len_spec, len_spec]
    inputs = [q_seq, k, v, q_lens, kv_lens]
    kernel = functools.partial(attention_kernel, **attention_options)
    if attention_sink is None:  # no sink input: the kernel gets sink_ref=None
        kernel = functools.partial(_without_sink, kernel)
    else:  # [num_kv_heads, group]: program (s, i, h) sees row h, its q heads' sinks
        in_specs.append(pl.BlockSpec((1, group), lambda s, i, h: (h, 0)))
        inputs.append(attention_sink.reshape(num_kv_heads, group))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_seq.shape, q_seq.dtype),
        grid=(max_num_seqs, max_q_len // rows, num_kv_heads),
        in_specs=in_specs,
        out_specs=q_spec,
        interpret=interpret,
    )(*inputs)


def _without_sink(kernel, q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, o_ref):
    kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, None, o_ref)


def attention_kernel(
    q_ref,  # [num_queries_per_block, group, head_dim]
    k_ref,  # [max_kv_len, head_dim], zero past kv_len
    v_ref,  # [max_kv_len, head_dim], zero past kv_len
    q_len_ref,  # i32[1]
    kv_len_ref,  # i32[1]
    sink_ref,  # f32[1, group]: the group's attention sinks; None without them
    o_ref,  # [num_queries_per_block, group, head_dim]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
):
    """One program: masked softmax attention of a q block over its sequence's keys.

    A q block that starts past the sequence's q_len has no rows to compute: `pl.when` skips
    the work, and the block is written as zeros.
    """
    rows, group, head_dim = q_ref.shape
    q_len, kv_len = q_len_ref[0], kv_len_ref[0]
    first_row = pl.program_id(1) * rows
    has_rows = first_row < q_len

    @pl.when(jnp.logical_not(has_rows))
    def _write_zeros():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(has_rows)
    def _attend():
        # Fold the group's q heads into the rows: one [rows * group, head_dim] matrix meets
        # the one KV head they share in one matmul. Row r is q row r // group.
        q = q_ref[...].astype(jnp.float32).reshape(rows * group, head_dim)
        k = k_ref[...].astype(jnp.float32)
        v = v_ref[...].astype(jnp.float32)
        scores = apply_soft_cap(jnp.dot(q, k.T) * sm_scale, soft_cap)  # [rows * group, keys]
        # Folded row r is q row first_row + r // group of the sequence; key c is token c.
        row = first_row + jnp.arange(rows * group)[:, None] // group
        q_pos = q_position(row, q_len, kv_len)  # [rows * group, 1]
        k_pos = jnp.arange(k.shape[0])[None, :]
        masked = is_masked(q_pos, k_pos, sliding_window)
        scores = apply_mask_value(scores, masked, mask_value, past_kv_len=k_pos >= kv_len)
        # The sink of folded row r is that of q head r % group.
        sink = None if sink_ref is None else jnp.tile(sink_ref[...], (rows, 1)).reshape(-1, 1)
        probs = softmax_with_sink(scores, sink)
        out = jnp.dot(probs, v)  # [rows * group, head_dim]
        o_ref[...] = out.reshape(rows, group, head_dim).astype(o_ref.dtype)
