"""Ragged paged attention in plain jax.numpy, with no Python loop over sequences.

The reference traces one small program per sequence, so every new mix of lengths means a new
compile. Here every array has a shape fixed by the *maxima* (max_num_batched_tokens,
max_num_seqs, pages_per_seq), and the lengths are only values. One compile serves every batch
of the same shapes, and `num_seqs` may even be a traced array.

The plan, one function per step:

  1. `gather_all_kv`: read every page of every sequence slot into dense
     K, V [max_num_seqs, pages_per_seq * page_size, num_kv_heads, head_dim], and zero the slots
     past each kv_len (they may hold NaN or another sequence's data).
  2. `q_tiles`: cut the packed q rows into tiles of `TILE` rows that never cross a sequence
     boundary, so each tile attends over exactly one sequence's K/V.
  3. `attend_tile`: masked softmax attention of one tile over its sequence, mapped over all
     tiles with `jax.lax.map`; tiles past the last live row are skipped with `lax.cond`.
  4. scatter the tiles' rows back to their places; padding rows stay zero.

The price of static shapes is padding: every tile attends over pages_per_seq * page_size keys,
however short its sequence, and a decode's tile computes TILE rows for its one live row. The
blockwise version and the Pallas kernel skip that work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from minilib.kv_cache import cdiv
from minilib.masking import apply_mask_value, is_masked, q_position
from minilib.options import DEFAULT_MASK_VALUE, AttentionOptions
from minilib.reference import apply_soft_cap, dequantize, softmax_with_sink
from minilib.validation import validate_inputs

__all__ = ["TILE", "attend_tile", "gather_all_kv", "q_tiles", "ragged_paged_attention_jnp"]

TILE = 16  # q rows per tile: bigger tiles waste more rows on decodes, smaller ones re-read K/V


def ragged_paged_attention_jnp(
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
    validate: bool = True,
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
) -> jax.Array:  # [max_num_batched_tokens, num_q_heads, head_dim]
    """Vectorized ragged paged attention: compiled once per array shape.

    Same signature and result as `ref_ragged_paged_attention`; padding rows come out zero.
    An fp8 `kv_pages` without `k_scale` and `v_scale` is taken as scale 1, with no error or
    warning (as in JAX's kernel): pass the scales the cache was quantized with.
    `attention_sink` (f32[num_q_heads], or None): one more softmax logit per q head, with no
    value, as in `ref_ragged_paged_attention`.

    Called eagerly, it first checks the values of the inputs (`dynamic_validate_inputs`);
    `validate=False` skips that. Under `jax.jit` the values do not exist yet and only the
    static checks run: validate the batch outside jit, as JAX does.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> ragged_paged_attention_jnp(*batch.args()).shape
    (4, 4, 64)
    """
    options = AttentionOptions(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    args = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    validate_inputs(*args, options, validate=validate, attention_sink=attention_sink)
    return _rpa_jnp(*args, options, attention_sink)


@functools.partial(jax.jit, static_argnames="options")
def _rpa_jnp(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options: AttentionOptions,
    attention_sink=None,
):  # fmt: skip
    max_num_batched_tokens = q.shape[0]
    max_num_seqs = page_indices.shape[0]
    # Padding sequence slots may hold garbage: give them no q rows and no keys.
    live = jnp.arange(max_num_seqs) < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(live, kv_lens, 0)
    q_starts = jnp.where(live, cu_q_lens[:-1], 0)

    k, v = gather_all_kv(kv_pages, page_indices, kv_lens)
    k = dequantize(k, options.k_scale, q.dtype)
    v = dequantize(v, options.v_scale, q.dtype)

    tile_seq, tile_rows = q_tiles(q_starts, q_lens, max_num_batched_tokens)

    def one_tile(tile):
        seq, rows = tile
        return jax.lax.cond(
            rows[0] < max_num_batched_tokens,  # a dead tile (past the last live row) ...
            lambda: attend_tile(
                q[jnp.clip(rows, 0, max_num_batched_tokens - 1)],
                k[seq],
                v[seq],
                q_position(rows, q_starts[seq] + q_lens[seq], kv_lens[seq]),
                kv_lens[seq],
                sm_scale=options.sm_scale,
                sliding_window=options.sliding_window,
                soft_cap=options.soft_cap,
                mask_value=options.mask_value,
                attention_sink=attention_sink,
            ),
            lambda: jnp.zeros((TILE, *q.shape[1:]), jnp.float32),  # ... costs nothing
        )

    out_tiles = jax.lax.map(one_tile, (tile_seq, tile_rows))  # [num_tiles, TILE, heads, dim]
    # Rows outside the batch (tile padding, dead tiles) carry index max_num_batched_tokens,
    # which mode="drop" throws away; live rows land where they came from.
    out = jnp.zeros_like(q)
    return out.at[tile_rows.reshape(-1)].set(
        out_tiles.reshape(-1, *q.shape[1:]).astype(q.dtype), mode="drop"
    )


def gather_all_kv(
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    kv_lens: jax.Array,  # i32[max_num_seqs], 0 for padding slots
) -> tuple[jax.Array, jax.Array]:  # k, v: [max_num_seqs, max_kv_len, num_kv_heads, head_dim]
    """Every page of every sequence slot, as dense K and V, with slots past kv_len zeroed.

    Zeroing matters: an unused slot may hold NaN, and 0 * NaN is NaN, so masking the *scores*
    alone would still let NaN values leak into the output.

    >>> from minilib.batch import make_batch
    >>> b = make_batch([(2, 2), (1, 5)], page_size=4)   # unused page slots hold NaN
    >>> k, v = gather_all_kv(b.kv_pages, b.page_indices, b.kv_lens)
    >>> k.shape[:2], bool(jnp.isnan(k).any()), bool((k[0, 2:] == 0).all())
    ((2, 8), False, True)
    """
    total_num_pages, page_size, combined, head_dim = kv_pages.shape
    max_num_seqs, pages_per_seq = page_indices.shape
    max_kv_len = pages_per_seq * page_size
    # Clip so that garbage page numbers of unused columns stay in range; what they read is
    # zeroed below.
    pages = jnp.clip(page_indices, 0, total_num_pages - 1)
    kv = kv_pages[pages].reshape(max_num_seqs, max_kv_len, combined, head_dim)
    in_seq = jnp.arange(max_kv_len)[None, :] < kv_lens[:, None]  # [max_num_seqs, max_kv_len]
    kv = jnp.where(in_seq[:, :, None, None], kv, jnp.zeros((), kv.dtype))
    return kv[:, :, 0::2], kv[:, :, 1::2]


def q_tiles(
    q_starts: jax.Array,  # i32[max_num_seqs], first q row of each sequence
    q_lens: jax.Array,  # i32[max_num_seqs], 0 for padding slots
    max_num_batched_tokens: int,
) -> tuple[jax.Array, jax.Array]:  # tile_seq: i32[num_tiles], tile_rows: i32[num_tiles, TILE]
    """Cut each sequence's q rows into tiles of TILE rows.

    Sequence i gets ceil(q_lens[i] / TILE) tiles. The tile count must be static, so it is the
    most any batch can need: max_num_batched_tokens // TILE full tiles plus one partial tile
    per sequence. A row that is not a live q row (past its sequence's end, or in a dead tile)
    gets index `max_num_batched_tokens`, one past the end.

    Two sequences of 3 and 20 q rows packed into 32 rows: one tile for the first, two for the
    second, and a dead tile after them.

    >>> tile_seq, rows = q_tiles(jnp.array([0, 3]), jnp.array([3, 20]), 32)
    >>> tile_seq.tolist()
    [0, 1, 1, 1]
    >>> rows[0, :4].tolist(), rows[2, :5].tolist(), bool((rows[3:] == 32).all())
    ([0, 1, 2, 32], [19, 20, 21, 22, 32], True)
    """
    max_num_seqs = q_lens.shape[0]
    num_tiles = max_num_batched_tokens // TILE + max_num_seqs
    tiles_per_seq = cdiv(q_lens, TILE)
    first_tile = jnp.cumsum(tiles_per_seq) - tiles_per_seq  # exclusive prefix sum
    tile = jnp.arange(num_tiles)
    # The sequence owning tile j: the last one whose first tile is <= j (searchsorted).
    tile_seq = jnp.searchsorted(first_tile + tiles_per_seq, tile, side="right")
    tile_seq = jnp.minimum(tile_seq, max_num_seqs - 1)
    local = tile - first_tile[tile_seq]
    rows = q_starts[tile_seq, None] + local[:, None] * TILE + jnp.arange(TILE)[None, :]
    live = (local[:, None] * TILE + jnp.arange(TILE)[None, :]) < q_lens[tile_seq, None]
    live &= (tile < jnp.sum(tiles_per_seq))[:, None]
    return tile_seq, jnp.where(live, rows, max_num_batched_tokens)


def attend_tile(
    q: jax.Array,  # [TILE, num_q_heads, head_dim]
    k: jax.Array,  # [max_kv_len, num_kv_heads, head_dim]
    v: jax.Array,  # [max_kv_len, num_kv_heads, head_dim]
    q_pos: jax.Array,  # i32[TILE], each row's position in its sequence
    kv_len: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
) -> jax.Array:  # [TILE, num_q_heads, head_dim], float32
    """Masked attention of a tile of q rows over one sequence's (padded) K and V.

    GQA without repeating K/V: the q heads are viewed as [num_kv_heads, group] so that each
    group meets its own KV head in one einsum.

    Two q rows at positions 0 and 1 over keys whose values are their positions: row 0 sees
    key 0, row 1 keys 0 and 1; keys past position 1 are masked.

    >>> q = jnp.zeros((2, 2, 4))   # 2 q heads sharing 1 KV head
    >>> k = jnp.zeros((8, 1, 4))
    >>> v = jnp.broadcast_to(jnp.arange(8.0)[:, None, None], (8, 1, 4))
    >>> out = attend_tile(q, k, v, jnp.array([0, 1]), jnp.array(2), sm_scale=1.0,
    ...                   sliding_window=None, soft_cap=None, mask_value=-1e30)
    >>> out.shape, out[:, 0, 0].tolist()
    ((2, 2, 4), [0.0, 0.5])
    """
    tile, num_q_heads, head_dim = q.shape
    max_kv_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(tile, num_kv_heads, group, head_dim)
    scores = jnp.einsum("qkgd,lkd->kgql", qg, k, preferred_element_type=jnp.float32)
    scores = apply_soft_cap(scores * sm_scale, soft_cap)
    # Keys past kv_len (zeroed slots) are no keys at all: as JAX's reference slices them off.
    k_pos = jnp.arange(max_kv_len)[None, :]
    masked = is_masked(q_pos[:, None], k_pos, sliding_window)
    scores = apply_mask_value(scores, masked, mask_value, past_kv_len=k_pos >= kv_len)
    sink = None if attention_sink is None else attention_sink.reshape(num_kv_heads, group, 1, 1)
    probs = softmax_with_sink(scores, sink).astype(v.dtype)
    out = jnp.einsum("kgql,lkd->qkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(tile, num_q_heads, head_dim)
