"""Build a ragged batch, the six arrays ragged paged attention takes, from (q_len, kv_len) pairs.

A serving step mixes sequences in different phases:

    prefill   q_len == kv_len        the whole prompt is new
    chunk     1 < q_len < kv_len     a prefill chunk after earlier chunks
    decode    q_len == 1 < kv_len    one new token
    idle      q_len == 0             nothing new this step (legal, and computes nothing)

All of them are packed into fixed-size arrays so that one compiled program serves every step.
`make_batch` does that packing and fills it with random data, and marks every slot that must
*not* be read: unused page slots and unused pages hold NaN, and the padding sequence slots past
`num_seqs` hold garbage. An implementation that reads them shows it at once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from minilib.errors import RPAInputError
from minilib.kv_cache import pages_needed

__all__ = ["RaggedBatch", "check_seq_lens", "make_batch", "random_seq_lens", "seq_kind"]


@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """The inputs of one ragged paged attention call, and how they were made.

    >>> b = make_batch([(2, 2), (1, 5)], page_size=4)
    >>> b.seq_lens, b.cu_q_lens.tolist(), b.kv_lens.tolist()[:2]
    (((2, 2), (1, 5)), [0, 2, 3], [2, 5])
    >>> len(b.args())   # q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs
    6
    """

    q: jax.Array  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens: jax.Array  # i32[max_num_seqs]
    page_indices: jax.Array  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array  # i32[max_num_seqs + 1]
    num_seqs: jax.Array  # i32[1]
    seq_lens: tuple[tuple[int, int], ...]  # the live (q_len, kv_len) pairs

    def args(self) -> tuple[jax.Array, ...]:
        """The six positional arguments, in JAX's order: `f(*batch.args(), sm_scale=...)`."""
        return (
            self.q,
            self.kv_pages,
            self.kv_lens,
            self.page_indices,
            self.cu_q_lens,
            self.num_seqs,
        )

    @property
    def num_tokens(self) -> int:
        """The live q rows, `cu_q_lens[num_seqs]`; rows past it are padding."""
        return sum(q_len for q_len, _ in self.seq_lens)

    def describe(self) -> str:
        """A readable table of the batch: one line per sequence, then the index arrays."""
        max_tokens, num_q_heads, head_dim = self.q.shape
        total_pages, page_size, combined, _ = self.kv_pages.shape
        max_num_seqs, pages_per_seq = self.page_indices.shape
        n = len(self.seq_lens)
        kinds = [seq_kind(q_len, kv_len) for q_len, kv_len in self.seq_lens]
        counts = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
        lines = [
            f"RaggedBatch: {n} of {max_num_seqs} sequence slots live ({counts or 'empty'}); "
            f"{self.num_tokens} of {max_tokens} q rows used",
            f"  num_q_heads={num_q_heads} num_kv_heads={combined // 2} head_dim={head_dim} "
            f"page_size={page_size} pages_per_seq={pages_per_seq} "
            f"total_num_pages={total_pages} q.dtype={self.q.dtype} "
            f"kv_pages.dtype={self.kv_pages.dtype}",
            "  seq  q_len  kv_len  kind     q rows        pages",
        ]
        cu = np.asarray(self.cu_q_lens)
        table = np.asarray(self.page_indices)
        for i, ((q_len, kv_len), kind) in enumerate(zip(self.seq_lens, kinds, strict=True)):
            pages = table[i, : pages_needed(kv_len, page_size)].tolist()
            rows = f"[{cu[i]}, {cu[i + 1]})"
            lines.append(f"  {i:3d}  {q_len:5d}  {kv_len:6d}  {kind:7s}  {rows:12s}  {pages}")
        lines += [
            f"  kv_lens      = {np.asarray(self.kv_lens).tolist()}",
            f"  cu_q_lens    = {cu.tolist()}",
            f"  num_seqs     = {np.asarray(self.num_seqs).tolist()}",
            "  (entries past num_seqs are padding and may hold anything)",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()


def seq_kind(q_len: int, kv_len: int) -> str:
    """'prefill', 'chunk', 'decode' or 'idle' for one sequence of a step.

    >>> [seq_kind(q, kv) for q, kv in [(5, 5), (3, 8), (1, 8), (0, 8)]]
    ['prefill', 'chunk', 'decode', 'idle']
    """
    if q_len == 0:
        return "idle"
    if q_len == kv_len:
        return "prefill"
    if q_len == 1:
        return "decode"
    return "chunk"


def make_batch(
    seq_lens,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    pages_per_seq: int | None = None,
    total_num_pages: int | None = None,
    dtype=jnp.float32,
    kv_dtype=None,
    seed: int = 0,
    shuffle_pages: bool = True,
) -> RaggedBatch:
    """Pack sequences given as `(q_len, kv_len)` pairs into a random ragged batch.

    Sizes left as None are the smallest that fit; give them to pad to fixed maxima (as a
    server does, so that every step has the same shapes):
      max_num_batched_tokens: q rows (default: the live tokens, at least 1);
      max_num_seqs: sequence slots (default: the live sequences, at least 1);
      pages_per_seq: columns of the page table (default: pages of the longest sequence);
      total_num_pages: pages in the pool (default: the pages used plus 3 spare ones).

    q and the used K/V slots are random normal; every unused page slot, unused page and q
    padding row is NaN; sequence slots past `num_seqs` hold garbage (huge kv_lens,
    out-of-range pages). `kv_dtype` (default: `dtype`) may be an fp8 type such as
    `jnp.float8_e4m3fn`: the values are rounded to it with no scale, so attention reads them
    back as they are without `k_scale`/`v_scale` (scale 1), and multiplied by them with.

    >>> b = make_batch([(5, 5), (1, 20)], page_size=8)
    >>> b.q.shape, b.kv_pages.shape, b.page_indices.shape
    ((6, 4, 64), (7, 8, 4, 64), (2, 3))
    """
    seq_lens = check_seq_lens(seq_lens)
    for name, value in (
        ("num_q_heads", num_q_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("page_size", page_size),
    ):
        _count(name, value, minimum=1)
    _count("seed", seed, minimum=0)
    for name, value in (("dtype", dtype), ("kv_dtype", kv_dtype)):
        _check_float_dtype(name, value)
    seq_pages = [pages_needed(kv, page_size) for _, kv in seq_lens]  # pages of each sequence
    num_tokens = sum(q for q, _ in seq_lens)
    max_num_batched_tokens = _size(
        "max_num_batched_tokens", max_num_batched_tokens, max(num_tokens, 1)
    )
    max_num_seqs = _size("max_num_seqs", max_num_seqs, max(len(seq_lens), 1))
    pages_per_seq = _size("pages_per_seq", pages_per_seq, max(seq_pages, default=0) or 1)
    total_num_pages = _size("total_num_pages", total_num_pages, sum(seq_pages) + 3)

    rng = np.random.default_rng(seed)
    kv_dtype = dtype if kv_dtype is None else kv_dtype

    # q: live rows random, padding rows NaN.
    q = np.full((max_num_batched_tokens, num_q_heads, head_dim), np.nan, np.float32)
    q[:num_tokens] = rng.standard_normal((num_tokens, num_q_heads, head_dim))

    # Page table: hand out pool pages (shuffled, as after many allocs and frees). The unused
    # columns of a live sequence point at unused pages, which hold NaN.
    pool = rng.permutation(total_num_pages) if shuffle_pages else np.arange(total_num_pages)
    used, spare = pool[: sum(seq_pages)], pool[sum(seq_pages) :]
    page_indices = np.empty((max_num_seqs, pages_per_seq), np.int32)
    kv = np.full((total_num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
    start = 0
    for i, (need, (_, kv_len)) in enumerate(zip(seq_pages, seq_lens, strict=True)):
        mine = used[start : start + need]
        start += need
        filler = spare if len(spare) else mine
        page_indices[i] = rng.choice(filler, pages_per_seq) if len(filler) else 0
        page_indices[i, :need] = mine
        tokens = rng.standard_normal((kv_len, 2 * num_kv_heads, head_dim))
        slots = kv[mine].reshape(need * page_size, 2 * num_kv_heads, head_dim)
        slots[:kv_len] = tokens
        kv[mine] = slots.reshape(need, page_size, 2 * num_kv_heads, head_dim)

    # Padding sequence slots: garbage that a correct implementation never reads.
    n = len(seq_lens)
    page_indices[n:] = total_num_pages + 1000
    kv_lens = np.full(max_num_seqs, pages_per_seq * page_size * 7 + 3, np.int32)
    kv_lens[:n] = [kv for _, kv in seq_lens]
    cu_q_lens = np.full(max_num_seqs + 1, 10 * max_num_batched_tokens + 1, np.int32)
    cu_q_lens[: n + 1] = np.concatenate([[0], np.cumsum([q for q, _ in seq_lens])])

    return RaggedBatch(
        q=jnp.asarray(q, dtype),
        kv_pages=jnp.asarray(kv, kv_dtype),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(page_indices),
        cu_q_lens=jnp.asarray(cu_q_lens),
        num_seqs=jnp.asarray([n], jnp.int32),
        seq_lens=seq_lens,
    )


def random_seq_lens(
    num_seqs: int,
    *,
    max_kv_len: int,
    max_q_len: int | None = None,
    decode_fraction: float = 0.5,
    seed: int = 0,
) -> list[tuple[int, int]]:
    """Random (q_len, kv_len) pairs for a mixed batch: about `decode_fraction` decodes, the
    rest prefills or prefill chunks with q_len up to `max_q_len` (default: `max_kv_len`).

    >>> pairs = random_seq_lens(6, max_kv_len=32, max_q_len=8, seed=1)
    >>> len(pairs), all(1 <= q <= min(kv, 8) and kv <= 32 for q, kv in pairs)
    (6, True)
    """
    rng = np.random.default_rng(seed)
    max_q_len = max_kv_len if max_q_len is None else max_q_len
    pairs = []
    for _ in range(num_seqs):
        kv_len = int(rng.integers(1, max_kv_len + 1))
        if rng.random() < decode_fraction:
            pairs.append((1, kv_len))
        else:
            pairs.append((int(rng.integers(1, min(kv_len, max_q_len) + 1)), kv_len))
    return pairs


def check_seq_lens(seq_lens) -> tuple[tuple[int, int], ...]:
    """`seq_lens` as a tuple of `(q_len, kv_len)` pairs of ints, or raise `RPAInputError`:
    a pair is two whole numbers with 0 <= q_len <= kv_len.

    >>> check_seq_lens([(3, 5), [1, 9]])
    ((3, 5), (1, 9))
    >>> check_seq_lens([(2.7, 5.9)])
    Traceback (most recent call last):
    ...
    minilib.errors.RPAInputError: seq_lens[0] = (2.7, 5.9): q_len=2.7 must be a whole number.
    Hint: ...
    """
    hint = "pass a list of (q_len, kv_len) pairs of ints, e.g. [(5, 5), (1, 20)]."
    try:
        seq_lens = list(seq_lens)
    except TypeError:
        raise RPAInputError(f"seq_lens={seq_lens!r} must be a list of pairs.", hint) from None
    pairs = []
    for i, pair in enumerate(seq_lens):
        if isinstance(pair, str | bytes) or np.ndim(pair) != 1 or len(pair) != 2:
            raise RPAInputError(f"seq_lens[{i}] = {pair!r} must be a (q_len, kv_len) pair.", hint)
        q_len, kv_len = pair
        for name, value in (("q_len", q_len), ("kv_len", kv_len)):
            if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
                raise RPAInputError(
                    f"seq_lens[{i}] = {tuple(pair)!r}: {name}={value!r} must be a whole number.",
                    f"lengths count tokens: pass ints ({name}={value!r} is not rounded for you).",
                )
        q_len, kv_len = int(q_len), int(kv_len)
        if not 0 <= q_len <= kv_len:
            raise RPAInputError(
                f"sequence {i}: (q_len={q_len}, kv_len={kv_len}) needs 0 <= q_len <= kv_len.",
                "kv_len counts every token in the cache, the q_len new ones included.",
            )
        pairs.append((q_len, kv_len))
    return tuple(pairs)


def _count(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise RPAInputError(
            f"{name}={value!r} must be a whole number (an int).",
            f"pass an int, e.g. {name}={max(minimum, 1)}.",
        )
    if value < minimum:
        raise RPAInputError(
            f"{name}={value} must be at least {minimum}.",
            f"{name} is a count or a seed: pass {minimum} or more.",
        )
    return int(value)


def _check_float_dtype(name: str, dtype) -> None:
    if dtype is None and name == "kv_dtype":  # None: the same as dtype
        return
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating) and dtype is not None
    except TypeError:
        ok = False
    if not ok:
        raise RPAInputError(
            f"{name}={dtype!r} must be a float dtype (jnp.float32, jnp.bfloat16, ...).",
            "q, K and V are random normal values: an integer dtype would round them to "
            "integers. kv_dtype may also be an fp8 type such as jnp.float8_e4m3fn.",
        )


def _size(name: str, given: int | None, needed: int) -> int:
    if given is None:
        return needed
    _count(name, given, minimum=1)
    if given < needed:
        raise RPAInputError(
            f"{name}={given} is too small for these sequences: they need {needed}.",
            f"pass {name}={needed} or more, or None for the smallest that fits.",
        )
    return given
