"""The paged KV cache: a pool of fixed-size pages, handed out to sequences as they grow.

A server cannot give each sequence one contiguous K/V buffer of the longest possible length:
most of it would sit empty. Instead all K/V lives in one array of small pages,

    kv_pages: [total_num_pages, page_size, 2*num_kv_heads, head_dim]

(K of KV head h in combined slot 2*h, V in slot 2*h + 1, as in `minilib.merge_kv_pages`), and
each sequence owns a *list* of pages, in token order. Token t of a sequence lives in its page
`t // page_size`, slot `t % page_size`. The pages of one sequence need not be neighbours.

Two classes, one idea each:

* `PageAllocator` (`minilib.page_allocator`) only counts: which pages are free, and who owns
  each used one.
* `PagedKVCache` holds the data. `append` takes pages from the allocator as a sequence grows
  and writes the new tokens with one jitted scatter; `batch_metadata` turns the page lists into
  the `kv_lens`, `page_indices`, `cu_q_lens` and `num_seqs` that ragged paged attention reads.

And two functions on the pages themselves: `write_tokens` scatters new tokens in, and
`gather_kv` reads one sequence's K and V back out, in token order.

Every mistake (out of pages, a double free, an unknown sequence, a wrong shape) raises
`KVCacheError` (`minilib.errors`), a `ValueError` with the values and a hint, *before* anything
changes: a failed call leaves the cache as it was.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minilib.errors import KVCacheError
from minilib.page_allocator import (
    PageAllocator,
    _check_positive_int,
    _is_int,
    check_can_allocate,
    check_page_number,
)

__all__ = [
    "FILL_ORDERS",
    "PageAllocator",
    "PagedKVCache",
    "bucket_size",
    "cdiv",
    "check_can_allocate",
    "combine_kv",
    "check_page_number",
    "fill_cache",
    "gather_kv",
    "pages_needed",
    "pool_pages_needed",
    "write_tokens",
]


def cdiv(a, b):
    """ceil(a / b) for whole numbers a >= 0 and b > 0, Python ints or JAX integer arrays: how
    many blocks of b things hold a things. Pages first (`pages_needed`), then q blocks of
    rows and KV blocks of pages in the kernels.

    >>> cdiv(17, 16), cdiv(16, 16), cdiv(0, 16)
    (2, 1, 0)
    """
    return -(-a // b)


def pages_needed(seq_len: int, page_size: int) -> int:
    """How many pages hold `seq_len` tokens: ceil(seq_len / page_size).

    >>> pages_needed(17, page_size=16)
    2
    """
    _check_int("seq_len", seq_len, minimum=0)
    _check_positive_int("page_size", page_size)
    return cdiv(seq_len, page_size)


def bucket_size(n: int) -> int:
    """The padded length that `n` new tokens are written with: the next power of two.

    The scatter is compiled once per bucket, not once per length: appends of 5, 6, 7 or 8
    tokens all reuse the program compiled for 8.

    >>> [bucket_size(n) for n in (1, 2, 3, 5, 8, 9)]
    [1, 2, 4, 8, 8, 16]
    """
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@jax.jit
def write_tokens(
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    page_ids: jax.Array,  # i32[n], the page each new token goes to
    slot_ids: jax.Array,  # i32[n], its slot in that page
    k: jax.Array,  # [n, num_kv_heads, head_dim]
    v: jax.Array,  # [n, num_kv_heads, head_dim]
) -> jax.Array:  # the new kv_pages
    """Scatter n tokens' K and V into the cache: token i goes to page_ids[i], slot_ids[i].

    Rows whose page id is out of range (`total_num_pages`) are dropped: that is how padding
    rows are thrown away. The whole write is one compiled scatter, traced once per shape.

    >>> pages = write_tokens(jnp.zeros((2, 4, 2, 1)), jnp.array([1]), jnp.array([3]),
    ...                      jnp.ones((1, 1, 1)), 2 * jnp.ones((1, 1, 1)))
    >>> pages[1, 3, :, 0].tolist()   # [K, V] of KV head 0
    [1.0, 2.0]
    """
    kv = combine_kv(k, v, kv_pages.dtype)
    return kv_pages.at[page_ids, slot_ids].set(kv, mode="drop")


def combine_kv(
    k: jax.Array,  # [n, num_kv_heads, head_dim]
    v: jax.Array,  # [n, num_kv_heads, head_dim]
    dtype,  # the cache's
) -> jax.Array:  # [n, 2*num_kv_heads, head_dim]
    """n tokens' K and V in the cache's layout, K0 V0 K1 V1 ... (as `merge_kv_pages`), cast to
    the cache's dtype (an fp8 cache: a plain cast, the values already scaled). Each row picks
    K or V, each repeated twice: XLA casts the picked rows once, where `jnp.stack([k, v],
    axis=2)` cast and then copied them (static estimate, 272 tokens of 8 KV heads on v6e, the
    programs XLA compiles for it summed: fp8 14,629 -> 9,973 bundles; bf16 3,600 -> 3,830, the
    repeats copied first). Counted at 272 tokens: at 544 XLA turns some of these programs into
    loops, which a listing shows once, and the sums no longer compare.

    >>> combine_kv(jnp.ones((1, 2, 1)), 2 * jnp.ones((1, 2, 1)), jnp.float32)[0, :, 0].tolist()
    [1.0, 2.0, 1.0, 2.0]
    """
    n, num_kv_heads, head_dim = k.shape
    shape = (n, 2 * num_kv_heads, head_dim)
    is_k = jax.lax.broadcasted_iota(jnp.int32, shape, 1) % 2 == 0
    return jnp.where(is_k, jnp.repeat(k, 2, axis=1), jnp.repeat(v, 2, axis=1)).astype(dtype)


def gather_kv(
    kv_pages: jax.Array,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    pages,  # i32[pages_per_seq], this sequence's row of page_indices
    kv_len: int,
) -> tuple[jax.Array, jax.Array]:  # k, v: [kv_len, num_kv_heads, head_dim]
    """Read one sequence's K and V out of the paged cache, token by token.

    Token t of the sequence lives in page `pages[t // page_size]`, slot `t % page_size`. Only
    the first `ceil(kv_len / page_size)` pages are read, and the slots past `kv_len` in the last
    page are cut off: they hold whatever was there before (NaN in our tests).

    >>> kv_pages = jnp.arange(4 * 2 * 2.0).reshape(4, 2, 2, 1)  # K and V of 1 KV head
    >>> k, v = gather_kv(kv_pages, jnp.array([3, 1]), kv_len=3)  # pages 3, then 1
    >>> k.ravel().tolist(), v.ravel().tolist()
    ([12.0, 14.0, 4.0], [13.0, 15.0, 5.0])
    """
    _, page_size, combined, head_dim = kv_pages.shape
    num_pages = pages_needed(kv_len, page_size)
    seq_pages = kv_pages[pages[:num_pages]]  # [num_pages, page_size, 2*num_kv_heads, head_dim]
    tokens = seq_pages.reshape(num_pages * page_size, combined, head_dim)[:kv_len]
    return tokens[:, 0::2], tokens[:, 1::2]  # K in even head slots, V in odd ones


class PagedKVCache:
    """A paged KV cache: `kv_pages` plus, for each live sequence, its pages and its length.

    Sizes use JAX's names: `total_num_pages` pages of `page_size` tokens, each token holding
    K and V of `num_kv_heads` heads of size `head_dim`; at most `max_num_seqs` live sequences
    of at most `pages_per_seq` pages each.

    >>> cache = PagedKVCache(total_num_pages=8, page_size=4, num_kv_heads=1, head_dim=2,
    ...                      max_num_seqs=2, pages_per_seq=3)
    >>> cache.add_sequence("a")
    >>> cache.append("a", jnp.ones((5, 1, 2)), jnp.zeros((5, 1, 2)))   # 5 tokens: 2 pages
    >>> cache.seq_len("a"), cache.pages("a"), cache.allocator.num_free
    (5, (0, 1), 6)
    >>> kv_lens, page_indices, cu_q_lens, num_seqs = cache.batch_metadata([("a", 5)])
    >>> kv_lens.tolist(), page_indices.tolist(), cu_q_lens.tolist(), num_seqs.tolist()
    ([5, 0], [[0, 1, 0], [0, 0, 0]], [0, 5, 0], [1])
    """

    def __init__(
        self,
        *,
        total_num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_num_seqs: int,
        pages_per_seq: int,
        dtype=jnp.float32,
    ):
        for name, value in (
            ("total_num_pages", total_num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_num_seqs", max_num_seqs),
            ("pages_per_seq", pages_per_seq),
        ):
            _check_positive_int(name, value)
        self.dtype = _cache_dtype(dtype)
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_num_seqs = max_num_seqs
        self.pages_per_seq = pages_per_seq
        # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
        self.kv_pages = jnp.zeros(
            (total_num_pages, page_size, 2 * num_kv_heads, head_dim), self.dtype
        )
        self._allocator = PageAllocator(total_num_pages)
        self._pages: dict[Hashable, list[int]] = {}  # seq_id -> its pages, in token order
        self._lens: dict[Hashable, int] = {}  # seq_id -> tokens stored

    # --- what is in the cache -------------------------------------------------------------

    @property
    def total_num_pages(self) -> int:
        """Pages in the pool, `kv_pages.shape[0]`."""
        return self._allocator.total_num_pages

    @property
    def allocator(self) -> PageAllocator:
        """The page pool. Read it; let the cache do the allocating and freeing."""
        return self._allocator

    @property
    def seq_ids(self) -> tuple[Hashable, ...]:
        """The live sequences, oldest first."""
        return tuple(self._pages)

    def seq_len(self, seq_id: Hashable) -> int:
        """How many tokens of `seq_id` are stored."""
        self._check_known(seq_id)
        return self._lens[seq_id]

    def pages(self, seq_id: Hashable) -> tuple[int, ...]:
        """The pages of `seq_id`, in token order: its row of `page_indices`."""
        self._check_known(seq_id)
        return tuple(self._pages[seq_id])

    def gather_kv(self, seq_id: Hashable) -> tuple[jax.Array, jax.Array]:
        """Read back the K and V of `seq_id`, each [seq_len, num_kv_heads, head_dim].

        >>> cache = PagedKVCache(total_num_pages=4, page_size=2, num_kv_heads=1, head_dim=1,
        ...                      max_num_seqs=1, pages_per_seq=2)
        >>> cache.add_sequence(0)
        >>> cache.append(0, jnp.arange(3.0).reshape(3, 1, 1), jnp.zeros((3, 1, 1)))
        >>> cache.gather_kv(0)[0].ravel().tolist()
        [0.0, 1.0, 2.0]
        """
        self._check_known(seq_id)
        pages = jnp.asarray(self._pages[seq_id], jnp.int32)
        return gather_kv(self.kv_pages, pages, self._lens[seq_id])

    # --- changing it ----------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable) -> None:
        """Start a new, empty sequence. It gets pages when tokens are appended."""
        if seq_id in self._pages:
            raise KVCacheError(
                f"seq_id={seq_id!r} is already in the cache "
                f"(seq_len={self._lens[seq_id]}, pages={self._pages[seq_id]}).",
                "use a new id for a new sequence, or free(seq_id) the old one first.",
            )
        if len(self._pages) >= self.max_num_seqs:
            raise KVCacheError(
                f"Cannot add seq_id={seq_id!r}: all max_num_seqs={self.max_num_seqs} sequence "
                f"slots are live ({list(self._pages)}).",
                "free a finished sequence first, or build the cache with a larger max_num_seqs.",
            )
        self._pages[seq_id] = []
        self._lens[seq_id] = 0

    def append(self, seq_id: Hashable, k: jax.Array, v: jax.Array) -> None:
        """Append new tokens' K and V, each [n_new, num_kv_heads, head_dim], to `seq_id`.

        Takes as many new pages as the longer sequence needs, then writes all n_new tokens with
        one jitted scatter (`write_tokens`). The tokens are padded to `bucket_size(n_new)` on
        the host, so appends of different lengths reuse a few compiled programs rather than
        compiling one per length.

        `kv_pages` is replaced by a new array, not updated in place (no buffer donation), so an
        old `cache.kv_pages` you kept stays readable; a server would donate it to save the copy.
        """
        self._check_known(seq_id)
        k, v = self._check_new_kv(k, v)
        n_new = k.shape[0]
        old_len = self._lens[seq_id]
        new_len = old_len + n_new
        pages_for_seq = pages_needed(new_len, self.page_size)
        num_new_pages = pages_for_seq - len(self._pages[seq_id])
        # Every check comes before any change, so a failed append changes nothing.
        if pages_for_seq > self.pages_per_seq:
            raise KVCacheError(
                f"Appending n_new={n_new} tokens to seq_id={seq_id!r} (seq_len={old_len}) "
                f"needs {pages_for_seq} pages, more than "
                f"pages_per_seq={self.pages_per_seq} (at most "
                f"{self.pages_per_seq * self.page_size} tokens of page_size={self.page_size}).",
                "stop or truncate this sequence, or build the cache with a larger pages_per_seq.",
            )
        if num_new_pages > self._allocator.num_free:
            raise KVCacheError(
                f"Out of pages: appending n_new={n_new} tokens to seq_id={seq_id!r} "
                f"(seq_len={old_len}) needs {num_new_pages} new pages, but only "
                f"num_free={self._allocator.num_free} of "
                f"total_num_pages={self.total_num_pages} are free.",
                "free finished sequences first (free(seq_id)), or build the cache with more "
                "total_num_pages.",
            )
        if n_new == 0:
            return
        new_pages = self._allocator.allocate(num_new_pages, owner=seq_id)
        pages = self._pages[seq_id] + new_pages
        page_ids, slot_ids, k_padded, v_padded = self._scatter_plan(pages, old_len, k, v)
        self.kv_pages = write_tokens(self.kv_pages, page_ids, slot_ids, k_padded, v_padded)
        self._pages[seq_id] = pages
        self._lens[seq_id] = new_len

    def free(self, seq_id: Hashable) -> None:
        """End `seq_id`: its pages go back to the pool. Their old K/V stays in `kv_pages`
        until overwritten, which is why attention must only read the first kv_len slots."""
        self._check_known(seq_id)
        self._allocator.free(self._pages[seq_id])
        del self._pages[seq_id], self._lens[seq_id]

    # --- the inputs of ragged paged attention ---------------------------------------------

    def batch_metadata(
        self, steps: Sequence[tuple[Hashable, int]]
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The four index arrays of ragged paged attention for one step.

        `steps` lists `(seq_id, q_len)` in the order of the packed q rows: each sequence's
        q_len newest tokens (already appended) are this step's queries. A prefill chunk has
        q_len > 1, a decode q_len == 1.

        Returns, padded with 0 to `max_num_seqs` slots and `pages_per_seq` columns:
          kv_lens:      i32[max_num_seqs]          seq_len of each sequence, new tokens included
          page_indices: i32[max_num_seqs, pages_per_seq]  its pages, in token order
          cu_q_lens:    i32[max_num_seqs + 1]      [0, q_len_0, q_len_0 + q_len_1, ...]
          num_seqs:     i32[1]                     len(steps)
        """
        steps = [(seq_id, q_len) for seq_id, q_len in steps]
        if len(steps) > self.max_num_seqs:
            raise KVCacheError(
                f"len(steps)={len(steps)} sequences in one step, more than "
                f"max_num_seqs={self.max_num_seqs}.",
                "split the step into batches of at most max_num_seqs sequences.",
            )
        seen = set()
        for seq_id, q_len in steps:
            self._check_known(seq_id)
            if seq_id in seen:
                raise KVCacheError(
                    f"seq_id={seq_id!r} appears twice in steps={steps}.",
                    "list each sequence once per step, with all its new tokens in one q_len.",
                )
            seen.add(seq_id)
            seq_len = self._lens[seq_id]
            if not _is_int(q_len) or not 0 <= q_len <= seq_len:
                raise KVCacheError(
                    f"q_len={q_len!r} for seq_id={seq_id!r} must be in [0, seq_len={seq_len}].",
                    "append the step's new K/V first: q_len counts new tokens that are already "
                    "in the cache, so q_len <= seq_len.",
                )
        kv_lens = np.zeros(self.max_num_seqs, np.int32)
        page_indices = np.zeros((self.max_num_seqs, self.pages_per_seq), np.int32)
        cu_q_lens = np.zeros(self.max_num_seqs + 1, np.int32)
        for i, (seq_id, q_len) in enumerate(steps):
            pages = self._pages[seq_id]
            kv_lens[i] = self._lens[seq_id]
            page_indices[i, : len(pages)] = pages
            cu_q_lens[i + 1] = cu_q_lens[i] + q_len
        num_seqs = np.array([len(steps)], np.int32)
        return tuple(jnp.asarray(a) for a in (kv_lens, page_indices, cu_q_lens, num_seqs))

    def __repr__(self) -> str:
        lines = [
            f"PagedKVCache: {len(self._pages)} of max_num_seqs={self.max_num_seqs} sequences, "
            f"{self._allocator.num_used} of total_num_pages={self.total_num_pages} pages used "
            f"(page_size={self.page_size}, pages_per_seq={self.pages_per_seq}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype})"
        ]
        for seq_id in self._pages:
            lines.append(
                f"  seq {seq_id!r}: seq_len={self._lens[seq_id]} pages={self._pages[seq_id]}"
            )
        return "\n".join(lines)

    # --- helpers --------------------------------------------------------------------------

    def _check_known(self, seq_id: Hashable) -> None:
        if seq_id not in self._pages:
            raise KVCacheError(
                f"Unknown seq_id={seq_id!r}; live sequences: {list(self._pages)}.",
                "add_sequence(seq_id) first; a freed sequence is gone and cannot be used again "
                "until it is added anew.",
            )

    def _check_new_kv(self, k, v) -> tuple[np.ndarray, np.ndarray]:
        try:  # to the cache's dtype, on the host, before anything changes
            k, v = np.asarray(k), np.asarray(v)
            for name, x in (("k", k), ("v", v)):
                if x.dtype.kind not in "biuf" and x.dtype != self.dtype:
                    raise TypeError(f"{name}.dtype={x.dtype} is not a real number type")
            k, v = k.astype(self.dtype), v.astype(self.dtype)
        except (TypeError, ValueError) as err:
            raise KVCacheError(
                f"k and v must be numeric arrays convertible to dtype={self.dtype}: {err}",
                "pass jax or NumPy arrays of floats, shaped [n_new, num_kv_heads, head_dim].",
            ) from None
        want = ("n_new", self.num_kv_heads, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 3 or x.shape[1:] != want[1:]:
                raise KVCacheError(
                    f"{name}.shape={x.shape} must be [n_new, num_kv_heads={self.num_kv_heads}, "
                    f"head_dim={self.head_dim}].",
                    "pass the new tokens' K and V one row per token; for a single decode token "
                    "use shape (1, num_kv_heads, head_dim).",
                )
        if k.shape != v.shape:
            raise KVCacheError(
                f"k.shape={k.shape} and v.shape={v.shape} must be equal.",
                "every new token needs both its K and its V.",
            )
        return k, v

    def _scatter_plan(self, pages: list[int], old_len: int, k: np.ndarray, v: np.ndarray):
        """Where each new token goes, padded to its bucket with rows that will be dropped."""
        n_new = k.shape[0]
        size = bucket_size(n_new)
        positions = np.arange(old_len, old_len + n_new)
        page_ids = np.full(size, self.total_num_pages, np.int32)  # out of range: dropped
        slot_ids = np.zeros(size, np.int32)
        page_ids[:n_new] = np.asarray(pages, np.int32)[positions // self.page_size]
        slot_ids[:n_new] = positions % self.page_size
        k_padded = np.zeros((size, self.num_kv_heads, self.head_dim), self.dtype)
        v_padded = np.zeros((size, self.num_kv_heads, self.head_dim), self.dtype)
        k_padded[:n_new], v_padded[:n_new] = k, v
        return page_ids, slot_ids, k_padded, v_padded


def _check_int(name: str, value, *, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise KVCacheError(
            f"{name}={value!r} must be an int >= {minimum}.",
            f"{name} counts tokens or pages: a whole number, at least {minimum}.",
        )


def _cache_dtype(dtype) -> np.dtype:
    """The cache's dtype: a float type JAX can hold as it is (fp8 included)."""
    requested = dtype
    try:
        dtype = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise KVCacheError(
            f"PagedKVCache(dtype={requested!r}): the cache's dtype must be a float type.",
            "K and V are floats: use jnp.float32, jnp.bfloat16 or an fp8 type such as "
            "jnp.float8_e4m3fn. An integer cache would silently round 0.7 to 0.",
        )
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise KVCacheError(
            f"PagedKVCache(dtype={dtype}): JAX would store the pages as "
            f"{jax.dtypes.canonicalize_dtype(dtype)}, not {dtype}.",
            "use jnp.float32 (64-bit floats need jax.config.update('jax_enable_x64', True)).",
        )
    return dtype


# --- a cache filled for a picture ---------------------------------------------------------

# How the pool was used before and while the sequences were written (see `fill_cache`).
FILL_ORDERS = ("in order", "shuffled", "after some frees")


def pool_pages_needed(kv_lens, page_size: int) -> int:
    """Pages of the pool that sequences of `kv_lens` tokens take.

    >>> pool_pages_needed([37, 5, 120], page_size=16)
    12
    """
    return sum(pages_needed(n, page_size) for n in kv_lens)


def fill_cache(
    kv_lens, *, page_size: int, total_num_pages: int, order: str = "in order", seed: int = 0
) -> tuple[PagedKVCache, list[int]]:
    """A `PagedKVCache` holding sequences 0, 1, ... of `kv_lens` tokens, written in `order`.

    `order` is how the pool was used before and while they were written:
      "in order":         each sequence written whole, one after another: neighbouring pages;
      "shuffled":         the sequences grow together, a page at a time in random turns (as
                          in a server decoding them all): their pages interleave;
      "after some frees": the pool was full of one-page sequences and every other one has
                          finished: ours get the scattered holes, among pages still in use.

    Returns the cache and our sequence ids. Raises `KVCacheError` (for instance, out of pages)
    as the cache does. (K and V are zeros of head_dim=1: only where they go matters here.)

    >>> cache, ids = fill_cache([37, 5], page_size=16, total_num_pages=8)
    >>> [cache.pages(s) for s in ids]
    [(0, 1, 2), (3,)]
    """
    if order not in FILL_ORDERS:
        raise ValueError(f"order={order!r} must be one of {FILL_ORDERS}.")
    kv_lens = [int(n) for n in kv_lens]
    earlier = total_num_pages if order == "after some frees" else 0
    longest = max([pages_needed(n, page_size) for n in kv_lens] + [1]) if page_size > 0 else 1
    cache = PagedKVCache(  # checks the sizes itself: a bad page_size gets the cache's message
        total_num_pages=total_num_pages,
        page_size=page_size,
        num_kv_heads=1,
        head_dim=1,
        max_num_seqs=max(len(kv_lens) + max(earlier, 0), 1),
        pages_per_seq=longest,
    )

    def write(seq_id, n: int) -> None:
        cache.append(seq_id, np.zeros((n, 1, 1), np.float32), np.zeros((n, 1, 1), np.float32))

    if order == "after some frees":
        for k in range(earlier):  # fill the pool with one-page sequences ...
            cache.add_sequence(f"earlier {k}")
            write(f"earlier {k}", 1)
        need = pool_pages_needed(kv_lens, page_size)
        for k in [*range(0, earlier, 2), *range(1, earlier, 2)]:  # ... and free every other
            if cache.allocator.num_free >= need:
                break
            cache.free(f"earlier {k}")
    ids = list(range(len(kv_lens)))
    for s in ids:
        cache.add_sequence(s)
    if order == "shuffled":
        rng = np.random.default_rng(seed)
        left = list(kv_lens)
        while any(left):  # a round: each unfinished sequence, in random order, fills a page
            for s in rng.permutation([i for i in ids if left[i]]).tolist():
                n = min(page_size, left[s])
                write(s, n)
                left[s] -= n
    else:
        for s, n in zip(ids, kv_lens, strict=True):
            if n:
                write(s, n)
    return cache, ids
