"""Input validation for ragged paged attention, in two parts, as in JAX's kernel.

* `static_validate_inputs` needs only shapes, dtypes and Python options, so it runs at trace
  time, inside `jax.jit`, and costs nothing at run time.
* `dynamic_validate_inputs` needs the *values* of `kv_lens`, `page_indices`, `cu_q_lens` and
  `num_seqs`, so it runs on concrete arrays, outside `jit` (for example once per batch in a
  serving loop, or while debugging).

Every check that JAX makes raises with JAX's own text, so a learner can search for it (where
JAX's dynamic checks print a value as `Array(5, dtype=int32)`, ours print `5`). Then comes a
`Hint:` line that says how to fix it. Some mistakes JAX lets through, or meets with a bare
`assert`; these get a message of our own. All of them raise `RPAInputError`
(`minilib.errors`), a `ValueError` that carries the hint as `.hint`.

Only the live sequences, the first `num_seqs`, are checked: the padding slots past them may
hold anything.

The optional `attention_sink` (f32[num_q_heads], one learned logit per q head, as in gpt-oss
and vLLM's head_dim-64 kernel) is an array, not an option: `check_attention_sink` checks its
shape and dtype always, and that it is finite when its values are there (not under jit).

Every attention function in minilib starts with `validate_inputs`: the dynamic checks when it
is called eagerly on concrete arrays, only the static ones under `jax.jit` (validate outside
jit, as JAX does), and `validate=False` to skip the value checks. It passes its options as one
`AttentionOptions` (`minilib.options`), which checked each option when it was built; the
validators also take JAX's keywords (`sliding_window=...`) and build the options themselves.
"""

from __future__ import annotations

import jax
import numpy as np

from minilib.errors import RPAInputError
from minilib.heads import check_head_counts
from minilib.kv_cache import cdiv
from minilib.options import AttentionOptions, attention_options

__all__ = [
    "check_attention_sink",
    "check_dtypes",
    "check_new_kv",
    "dynamic_validate_inputs",
    "static_validate_inputs",
    "validate_inputs",
]


SHAPES = (
    "q: [max_num_batched_tokens, num_q_heads, head_dim]; "
    "kv_pages: [total_num_pages, page_size, 2*num_kv_heads, head_dim]; "
    "kv_lens: i32[max_num_seqs]; page_indices: i32[max_num_seqs, pages_per_seq]; "
    "cu_q_lens: i32[max_num_seqs + 1]; num_seqs: i32[1]"
)


def check_dtypes(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
) -> None:
    """Raise unless q has a float dtype of 16 bits or more, and kv_pages a float dtype (fp8
    included, for a quantized cache).

    >>> import jax.numpy as jnp
    >>> check_dtypes(jnp.zeros((8, 4, 64), jnp.bfloat16),
    ...              jnp.zeros((4, 16, 4, 64), jnp.float8_e4m3fn))
    """
    q_dtype, kv_dtype = np.dtype(q.dtype), np.dtype(kv_pages.dtype)
    if not jax.numpy.issubdtype(q_dtype, jax.numpy.floating) or q_dtype.itemsize < 2:
        raise RPAInputError(
            f"{q.dtype=} must be a float dtype of 16 bits or more (float32, bfloat16, float16).",
            "q holds activations: convert it with q.astype(jnp.float32) (or bfloat16). An "
            "integer q would give integer, truncated scores and outputs.",
        )
    if not jax.numpy.issubdtype(kv_dtype, jax.numpy.floating):
        raise RPAInputError(
            f"{kv_pages.dtype=} must be a float dtype (float32, bfloat16, or an fp8 type such "
            "as float8_e4m3fn with k_scale and v_scale).",
            "convert it with kv_pages.astype(jnp.float32); a quantized cache is fp8 with "
            "k_scale and v_scale, not integers.",
        )


def validate_inputs(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    options: AttentionOptions | None = None,
    *,
    validate: bool = True,
    attention_sink=None,  # f32[num_q_heads] or None
    **option_values,
) -> None:
    """What every attention function runs first: all the checks the inputs allow.

    Called eagerly, on concrete arrays, it runs `dynamic_validate_inputs`, which reads the
    values of kv_lens, page_indices, cu_q_lens and num_seqs. Under `jax.jit` those are
    tracers with no values yet, so only `static_validate_inputs` can run; validate outside
    jit, as JAX does. `validate=False` skips the value checks even on concrete arrays (for
    benchmarks and serving loops that validated the batch once already). An `attention_sink`
    is checked by `check_attention_sink`, its values too unless they are traced or `validate`
    is False.

    >>> import jax, jax.numpy as jnp
    >>> from minilib.batch import make_batch
    >>> args = list(make_batch([(3, 3)]).args())
    >>> args[2] = jnp.array([2], jnp.int32)             # kv_len 2 < q_len 3
    >>> validate_inputs(*args)
    Traceback (most recent call last):
    ...
    minilib.errors.RPAInputError: q_len=3 must be less or equal to kv_len=2 at sequence 0.
    Hint: ...
    >>> jax.jit(lambda *a: validate_inputs(*a))(*args)  # traced: static checks only
    """
    options = attention_options(options, **option_values)
    arrays = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if validate and not any(isinstance(a, jax.core.Tracer) for a in arrays[2:]):
        dynamic_validate_inputs(*arrays, options)
    else:
        static_validate_inputs(*arrays, options)
    if attention_sink is not None:
        check_attention_sink(attention_sink, q.shape[1], values=validate)


def check_attention_sink(
    attention_sink,  # f32[num_q_heads]
    num_q_heads: int,
    *,
    values: bool = True,
) -> None:
    """Raise unless `attention_sink` is a float32 array of shape [num_q_heads] (JAX's kernels
    take no sink; vLLM's head_dim-64 kernel takes this shape and dtype) and, when `values` is
    True and its values are concrete, finite.

    A sink is one learned logit per q head that joins every softmax denominator and carries
    no value: a NaN would make every output of its head NaN, and +inf every output 0.

    >>> import jax.numpy as jnp
    >>> check_attention_sink(jnp.zeros(4, jnp.float32), 4)
    >>> check_attention_sink(jnp.zeros(4), 8)
    Traceback (most recent call last):
    ...
    minilib.errors.RPAInputError: attention_sink.shape=(4,) must be (num_q_heads,) = (8,).
    Hint: ...
    """
    shape, dtype = getattr(attention_sink, "shape", None), getattr(attention_sink, "dtype", None)
    fix = (
        "attention_sink holds one logit per q head, in float32: build it with "
        "jnp.asarray(sinks, jnp.float32), shape [num_q_heads] (q.shape[1]); or pass None for "
        "no sink."
    )
    if shape is None or dtype is None:
        raise RPAInputError(
            f"attention_sink must be an array, got {type(attention_sink).__name__}.", fix
        )
    if tuple(shape) != (num_q_heads,):
        raise RPAInputError(
            f"attention_sink.shape={tuple(shape)} must be (num_q_heads,) = ({num_q_heads},).", fix
        )
    if np.dtype(dtype) != np.float32:
        raise RPAInputError(f"attention_sink.dtype={np.dtype(dtype)} must be float32.", fix)
    if not values or isinstance(attention_sink, jax.core.Tracer):
        return
    bad = ~np.isfinite(np.asarray(attention_sink))
    if bad.any():
        h = int(np.argmax(bad))
        raise RPAInputError(
            f"attention_sink[{h}]={float(np.asarray(attention_sink)[h])} must be finite.",
            "a NaN sink makes every output of its head NaN, an infinite one every output 0 "
            "or NaN. A very negative finite sink (such as -1e30) is the same as no sink.",
        )


def check_new_kv(
    new_keys,  # [max_num_batched_tokens, num_kv_heads, head_dim]
    new_values,  # [max_num_batched_tokens, num_kv_heads, head_dim]
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]; shape
    kv_pages,  # [total_num_pages, page_size, 2*num_kv_heads, head_dim]; shape
) -> None:
    """Raise unless the new tokens' K and V, to be written into the cache by the kernel, are
    both given, float arrays of one dtype, each [max_num_batched_tokens, num_kv_heads,
    head_dim]: row i holds the K (or V) of q row i.

    >>> import jax.numpy as jnp
    >>> q, kv_pages = jnp.zeros((8, 4, 64)), jnp.zeros((4, 16, 4, 64))
    >>> check_new_kv(jnp.zeros((8, 2, 64)), jnp.zeros((8, 2, 64)), q, kv_pages)
    >>> check_new_kv(jnp.zeros((8, 4, 64)), jnp.zeros((8, 4, 64)), q, kv_pages)
    Traceback (most recent call last):
    ...
    minilib.errors.RPAInputError: new_keys.shape=(8, 4, 64) must be (max_num_batched_tokens, ...
    Hint: ...
    """
    if (new_keys is None) != (new_values is None):
        given, missing = (
            ("new_keys", "new_values") if new_values is None else ("new_values", "new_keys")
        )
        raise RPAInputError(
            f"{given} was given without {missing}.",
            "pass both, the new tokens' K and V, to have the kernel write them into the "
            "cache; or neither, and write them first (minilib.kv_cache.write_tokens).",
        )
    expected = (q.shape[0], kv_pages.shape[2] // 2, q.shape[2])
    fix = (
        "row i of new_keys and new_values holds the K and V of q row i, of every KV head: "
        "shape [max_num_batched_tokens, num_kv_heads, head_dim] (q.shape[0], "
        "kv_pages.shape[2] // 2, q.shape[2]), a float dtype, the same for both."
    )
    for name, x in (("new_keys", new_keys), ("new_values", new_values)):
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or dtype is None:
            raise RPAInputError(f"{name} must be an array, got {type(x).__name__}.", fix)
        if tuple(shape) != expected:
            raise RPAInputError(
                f"{name}.shape={tuple(shape)} must be (max_num_batched_tokens, num_kv_heads, "
                f"head_dim) = {expected}.",
                fix,
            )
        if not jax.numpy.issubdtype(np.dtype(dtype), jax.numpy.floating):
            raise RPAInputError(f"{name}.dtype={np.dtype(dtype)} must be a float dtype.", fix)
    if np.dtype(new_keys.dtype) != np.dtype(new_values.dtype):
        raise RPAInputError(
            f"new_keys.dtype={np.dtype(new_keys.dtype)} and new_values.dtype="
            f"{np.dtype(new_values.dtype)} must be the same.",
            fix,
        )


def static_validate_inputs(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages,  # [total_num_pages, page_size, num_combined_kv_heads, head_dim]
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    options: AttentionOptions | None = None,
    **option_values,
) -> None:
    """Check shapes, dtypes and options. Works on tracers, so it is safe inside `jax.jit`.

    The options come as one `AttentionOptions`, or as JAX's keywords (`sliding_window=...`),
    from which one is built; building it checks the options that need no array.

    Raises `RPAInputError` (a `ValueError`) with JAX's text and a hint.

    >>> import jax.numpy as jnp
    >>> static_validate_inputs(jnp.zeros((8, 12, 64)), jnp.zeros((4, 16, 16, 64)),
    ...     jnp.zeros(2, jnp.int32), jnp.zeros((2, 4), jnp.int32), jnp.zeros(3, jnp.int32),
    ...     jnp.zeros(1, jnp.int32))
    Traceback (most recent call last):
    ...
    minilib.errors.RPAInputError: num_q_heads=12 must be divisible by num_kv_heads=8
    Hint: ...
    """
    options = attention_options(options, **option_values)
    _check_ranks(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    _, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_kv_heads, head_dim_k = kv_pages.shape
    if num_combined_kv_heads % 2 != 0:
        raise RPAInputError(
            f"{num_combined_kv_heads=} (kv_pages.shape[2]) must be even.",
            "kv_pages interleaves K and V on one axis: K of KV head h in slot 2*h, V in slot "
            "2*h+1. Build it with minilib.merge_kv_pages(k_pages, v_pages).",
        )
    check_dtypes(q, kv_pages)
    num_kv_heads = num_combined_kv_heads // 2
    max_num_seqs, pages_per_seq = page_indices.shape
    if num_seqs.shape != (1,):
        raise RPAInputError(
            f"{num_seqs.shape=} must be (1,)",
            "num_seqs is a one-element int32 array, e.g. jnp.array([3], jnp.int32).",
        )
    if head_dim_k != head_dim:
        raise RPAInputError(
            f"Q head_dim {head_dim} must be the same as that of K/V {head_dim_k}.",
            f"expected {SHAPES}. A different last axis often means a transposed array.",
        )
    if kv_lens.shape != (max_num_seqs,):
        raise RPAInputError(
            f"Expected {kv_lens.shape=} to be ({max_num_seqs},) where"
            " `max_num_seqs` is `page_indices.shape[0]`.",
            "kv_lens has one entry per sequence slot, the same count as the rows of "
            "page_indices; pad both to max_num_seqs.",
        )
    if cu_q_lens.shape != (max_num_seqs + 1,):
        raise RPAInputError(
            f"Expected {cu_q_lens.shape=} to be ({max_num_seqs + 1},)  where"
            " `max_num_seqs` is `page_indices.shape[0]`.",
            "cu_q_lens is the cumulative sum of q lengths with a leading 0: "
            "max_num_seqs + 1 entries.",
        )
    if any(a.dtype != np.int32 for a in (kv_lens, page_indices, cu_q_lens)):
        raise RPAInputError(
            "The dtype of `kv_lens`, `page_indices`, and `cu_q_lens` must be"
            f" int32. Got {kv_lens.dtype=}, {page_indices.dtype=},"
            f" {cu_q_lens.dtype=}.",
            "convert with .astype(jnp.int32). jnp arrays are int32 unless x64 is on, "
            "but NumPy makes int64 by default.",
        )
    if num_seqs.dtype != np.int32:
        raise RPAInputError(
            f"{num_seqs.dtype=} must be int32.",
            "build it with jnp.array([n], dtype=jnp.int32).",
        )
    check_head_counts(num_q_heads, num_kv_heads)
    _check_sizes(q, kv_pages, page_indices)
    # The options were checked when they were built; the block size must also fit the pages.
    num_kv_pages_per_block = options.num_kv_pages_per_block
    if num_kv_pages_per_block is not None and not 0 < num_kv_pages_per_block <= pages_per_seq:
        raise RPAInputError(
            f"{num_kv_pages_per_block=} must be in range (0, {pages_per_seq}].",
            f"a KV block is a number of whole pages, at least 1 and at most "
            f"pages_per_seq={pages_per_seq}; or pass None for the default.",
        )


def dynamic_validate_inputs(*args, **options) -> None:
    """All of `static_validate_inputs`, on the same arguments (the six arrays, then the options
    as one `AttentionOptions` or as JAX's keywords), then the checks that need the values of
    the arrays.

    Call it on concrete arrays, outside `jax.jit`. Only the first `num_seqs` sequences are
    checked; padding slots may hold anything.

    >>> import jax.numpy as jnp
    >>> dynamic_validate_inputs(jnp.zeros((8, 4, 64)), jnp.zeros((4, 16, 4, 64)),
    ...     jnp.array([3, 0], jnp.int32), jnp.zeros((2, 4), jnp.int32),
    ...     jnp.array([0, 5, 5], jnp.int32), jnp.array([1], jnp.int32))
    Traceback (most recent call last):
    ...
    minilib.errors.RPAInputError: q_len=5 must be less or equal to kv_len=3 at sequence 0.
    Hint: ...
    """
    static_validate_inputs(*args, **options)
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = args[:6]
    kv_lens, page_indices, cu_q_lens, num_seqs = _concrete(
        kv_lens, page_indices, cu_q_lens, num_seqs
    )
    max_num_batched_tokens = q.shape[0]
    total_num_pages, page_size = kv_pages.shape[:2]
    max_num_seqs, pages_per_seq = page_indices.shape
    n = int(num_seqs[0])
    if n < 0:
        raise RPAInputError(
            f"num_seqs[0]={n} must be non-negative.",
            "num_seqs counts the live sequences in this batch; 0 is a valid empty batch.",
        )
    if n > max_num_seqs:
        raise RPAInputError(
            f"num_seqs[0]={n} must be less or equal to max_num_seqs={max_num_seqs}",
            "max_num_seqs is page_indices.shape[0]; build the batch with more sequence slots "
            "or split it in two.",
        )
    live_kv_lens = kv_lens[:n]
    if (live_kv_lens < 0).any():
        i = int(np.argmax(live_kv_lens < 0))
        raise RPAInputError(
            f"kv_lens[{i}]={int(live_kv_lens[i])} must be non-negative.",
            "kv_lens[i] is how many tokens sequence i has in the KV cache, the new ones included.",
        )
    live_cu = cu_q_lens[: n + 1]
    if int(live_cu[0]) != 0:
        raise RPAInputError(
            f"cu_q_lens[0]={int(live_cu[0])} must be 0.",
            "cu_q_lens is the cumulative sum of q lengths starting at 0: "
            "[0, q_len_0, q_len_0 + q_len_1, ...].",
        )
    steps = np.diff(live_cu)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise RPAInputError(
            f"cu_q_lens must not decrease: cu_q_lens[{i + 1}]={int(live_cu[i + 1])} < "
            f"cu_q_lens[{i}]={int(live_cu[i])}.",
            "q tokens are packed sequence after sequence, so cu_q_lens[i+1] - cu_q_lens[i] "
            "is q_len of sequence i and can't be negative. Build it with "
            "np.concatenate([[0], np.cumsum(q_lens)]).",
        )
    max_kv_len = int(live_kv_lens.max()) if n else 0
    min_pages_per_seq = cdiv(max_kv_len, page_size)
    if pages_per_seq < min_pages_per_seq:
        raise RPAInputError(
            f"{pages_per_seq=} must be greater or equal to"
            f" {min_pages_per_seq=} given {max_kv_len=} and {page_size=}.",
            f"page_indices needs one column per page of the longest sequence: "
            f"ceil({max_kv_len} / {page_size}) = {min_pages_per_seq}. Pad page_indices "
            f"to more columns, or use bigger pages.",
        )
    if int(live_cu[-1]) > max_num_batched_tokens:
        raise RPAInputError(
            f"Total q tokens {int(live_cu[-1])} must be less or equal to"
            f" {max_num_batched_tokens=}.",
            "q.shape[0] is max_num_batched_tokens: make q bigger, or schedule fewer tokens "
            "in this step.",
        )
    for i in range(n):
        q_len = int(live_cu[i + 1] - live_cu[i])
        kv_len = int(live_kv_lens[i])
        if q_len > kv_len:
            raise RPAInputError(
                f"{q_len=} must be less or equal to {kv_len=} at sequence {i}.",
                "kv_len counts every token in the cache *including* this step's new ones, so "
                "write the new K/V into the cache before attention; q_len <= kv_len always.",
            )
    for i in range(n):
        used = page_indices[i, : cdiv(int(live_kv_lens[i]), page_size)]
        bad = (used < 0) | (used >= total_num_pages)
        if bad.any():
            j = int(np.argmax(bad))
            raise RPAInputError(
                f"page_indices[{i}, {j}]={int(used[j])} is outside [0, {total_num_pages}), "
                f"the pages of kv_pages, for sequence {i} with kv_len={int(live_kv_lens[i])}.",
                "every page a live sequence uses must be a real page: "
                "0 <= page < kv_pages.shape[0]. Out-of-range indices read another sequence's "
                "memory or garbage instead of failing.",
            )


def _check_ranks(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> None:
    arrays = {
        "q": (q, 3),
        "kv_pages": (kv_pages, 4),
        "kv_lens": (kv_lens, 1),
        "page_indices": (page_indices, 2),
        "cu_q_lens": (cu_q_lens, 1),
        "num_seqs": (num_seqs, 1),
    }
    for name, (array, rank) in arrays.items():
        shape = getattr(array, "shape", None)
        if shape is None:
            raise RPAInputError(
                f"{name} must be an array, got {type(array).__name__}.",
                f"convert it with jnp.asarray(...). Expected {SHAPES}.",
            )
        if len(shape) != rank:
            raise RPAInputError(
                f"{name}.shape={tuple(shape)} must have {rank} dimensions.",
                f"expected {SHAPES}.",
            )


def _check_sizes(q, kv_pages, page_indices) -> None:
    """Raise if an axis has size 0. Such a batch holds nothing to attend, but the loops and
    block sizes divide by these sizes, and would crash each in its own way. An empty step is
    num_seqs=[0] with real shapes, not a zero-size array."""
    empty_step = "for a step with nothing to attend, keep the shapes and pass num_seqs=[0]."
    sizes = [
        ("max_num_batched_tokens", "q.shape[0]", q.shape[0],
         f"q needs at least one row, even when no token is scheduled: {empty_step}"),
        ("num_q_heads", "q.shape[1]", q.shape[1],
         "q needs at least one head, a multiple of num_kv_heads. Check that q was not sliced "
         "or transposed."),
        ("head_dim", "q.shape[2]", q.shape[2],
         "each head needs at least one dimension (64 and 128 are usual). Check that q and "
         "kv_pages were not sliced or transposed."),
        ("total_num_pages", "kv_pages.shape[0]", kv_pages.shape[0],
         "the cache needs at least one page; size it for the longest sequences you serve."),
        ("page_size", "kv_pages.shape[1]", kv_pages.shape[1],
         "a page holds page_size tokens (16 is usual): every kv_len is split into pages of it."),
        ("max_num_seqs", "page_indices.shape[0]", page_indices.shape[0],
         f"kv_lens, page_indices and cu_q_lens need at least one sequence slot: {empty_step}"),
        ("pages_per_seq", "page_indices.shape[1]", page_indices.shape[1],
         "page_indices needs at least one column, the pages of the longest sequence: "
         f"ceil(max kv_len / page_size). {empty_step}"),
    ]  # fmt: skip
    for name, where, size, hint in sizes:
        if size == 0:
            raise RPAInputError(f"{name}=0 ({where}) must be positive.", hint)


def _concrete(*arrays):
    try:
        # int64, so that differences of garbage int32 values cannot wrap around.
        return [np.asarray(a).astype(np.int64) for a in arrays]
    except Exception as err:  # a tracer: the values do not exist yet
        raise RPAInputError(
            "dynamic_validate_inputs needs concrete kv_lens, page_indices, cu_q_lens and "
            f"num_seqs, but got traced values ({type(err).__name__}).",
            "call it outside jax.jit, on the arrays you are about to pass in; inside jit use "
            "static_validate_inputs, which needs only shapes.",
        ) from None
