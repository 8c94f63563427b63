"""The readable reference: ragged paged attention one sequence at a time.

This is the course's baseline. Each step is one idea, named after it:

  1. find the sequence's q rows in the packed batch  (`cu_q_lens`)
  2. gather its keys and values from the paged cache (`page_indices`, `kv_lens`)
  3. dequantize fp8 K/V                              (`k_scale`, `v_scale`)
  4. share each KV head with its group of q heads   (GQA / MQA)
  5. scores = q . k * sm_scale, soft-capped          (`sm_scale`, `soft_cap`)
  6. causal mask, offset by kv_len - q_len           (`sliding_window`)
  7. softmax, then the weighted sum of values; with an attention sink (`attention_sink`),
     one more logit per q head joins the softmax and carries no value (`softmax_with_sink`)

The Python loop over sequences makes it slow to compile (one trace per mix of lengths), which
is why the later versions exist.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from minilib.kv_cache import gather_kv
from minilib.masking import apply_mask_value, causal_mask
from minilib.options import DEFAULT_MASK_VALUE, AttentionOptions
from minilib.validation import validate_inputs

__all__ = [
    "apply_soft_cap",
    "attend",
    "dequantize",
    "ref_ragged_paged_attention",
    "softmax_with_sink",
]


def ref_ragged_paged_attention(
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
    """Ragged paged attention, one sequence at a time. Same signature as JAX's reference.

    Returns an array shaped like `q`: the attention output of every live row, and zeros in
    the padding rows past `cu_q_lens[num_seqs]`. (JAX's reference returns only the live rows.)

    An fp8 `kv_pages` (such as float8_e4m3fn) needs `k_scale` and `v_scale`, the scales it was
    quantized with: K is read back as stored K * k_scale, V as stored V * v_scale. Without them
    an fp8 cache is taken as scale 1, with no error or warning: the stored values are read as
    they are (JAX's reference and kernel apply no scale either, and every attention function
    of minilib does the same), and a cache quantized as x / scale gives wrong outputs, silently.

    `attention_sink` (f32[num_q_heads], default None: no sink) is a learned logit per q head
    that joins every softmax denominator and carries no value (gpt-oss; the name and shape
    of vLLM's head_dim-64 kernel): out = sum_j exp(s_j - m) v_j / (exp(sink - m) +
    sum_j exp(s_j - m)), m the max of the scores and the sink. JAX's kernels have no sink.

    The inputs are checked first with `validate_inputs`: all of `dynamic_validate_inputs`
    (their values too) on concrete arrays; `validate=False` skips the value checks. This
    function reads the lengths in Python, so it cannot run under `jax.jit` at all.

    >>> from minilib.batch import make_batch
    >>> batch = make_batch([(3, 3), (1, 9)])
    >>> ref_ragged_paged_attention(*batch.args(), sm_scale=0.125).shape
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
    validate_inputs(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options, validate=validate,
        attention_sink=attention_sink,
    )  # fmt: skip
    # The lengths steer a Python loop, so read their values once, on the host.
    kv_lens, page_indices, cu_q_lens = (np.asarray(a) for a in (kv_lens, page_indices, cu_q_lens))
    outputs = []
    for i in range(int(num_seqs[0])):
        # 1. This sequence's q rows.
        q_start, q_end = int(cu_q_lens[i]), int(cu_q_lens[i + 1])
        seq_q = q[q_start:q_end]  # [q_len, num_q_heads, head_dim]
        # 2-3. Its keys and values, in token order.
        k, v = gather_kv(kv_pages, page_indices[i], int(kv_lens[i]))
        k, v = dequantize(k, options.k_scale, q.dtype), dequantize(v, options.v_scale, q.dtype)
        # 4-7.
        outputs.append(
            attend(
                seq_q,
                k,
                v,
                sm_scale=options.sm_scale,
                sliding_window=options.sliding_window,
                soft_cap=options.soft_cap,
                mask_value=options.mask_value,
                attention_sink=attention_sink,
            )
        )
    # The padding rows past the last sequence are zeros.
    padding = jnp.zeros((q.shape[0] - sum(o.shape[0] for o in outputs), *q.shape[1:]), q.dtype)
    return jnp.concatenate([*outputs, padding])


def dequantize(x: jax.Array, scale: float | None, dtype) -> jax.Array:
    """Undo fp8 quantization: x * scale in float32, then cast to the compute dtype. With
    scale None, a plain cast: the values are taken as they are, as with a scale of 1.

    >>> x = jnp.array([1.0, -2.0], jnp.float8_e4m3fn)
    >>> dequantize(x, 0.5, jnp.float32).tolist()
    [0.5, -1.0]
    >>> dequantize(x, None, jnp.bfloat16).dtype
    dtype(bfloat16)
    """
    if scale is None:
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale).astype(dtype)


def apply_soft_cap(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """Soft capping: `soft_cap * tanh(scores / soft_cap)`, smoothly bounded by +-soft_cap;
    the scores unchanged when `soft_cap` is None. Applied before the mask.

    >>> [round(float(s), 3) for s in apply_soft_cap(jnp.array([0.0, 1.0, 100.0]), 2.0)]
    [0.0, 0.924, 2.0]
    """
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


# jit compiles the whole step once per (q_len, kv_len) shape instead of op by op.
@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "mask_value")
)
def attend(
    q: jax.Array,  # [q_len, num_q_heads, head_dim]
    k: jax.Array,  # [kv_len, num_kv_heads, head_dim]
    v: jax.Array,  # [kv_len, num_kv_heads, head_dim]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
) -> jax.Array:  # [q_len, num_q_heads, head_dim]
    """Causal attention of one sequence's new q rows over all its keys.

    Two new q rows over four keys: the last q row sees every key, the one before it all but
    the last, so with values equal to the key position the outputs are the mean positions.

    >>> q = jnp.zeros((2, 1, 4))
    >>> k = jnp.zeros((4, 1, 4))
    >>> v = jnp.broadcast_to(jnp.arange(4.0)[:, None, None], (4, 1, 4))
    >>> out = attend(q, k, v, sm_scale=1.0, sliding_window=None, soft_cap=None,
    ...              mask_value=-1e30)
    >>> out.shape, out[:, 0, 0].tolist()
    ((2, 1, 4), [1.0, 1.5])
    """
    q_len, num_q_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    # 4. GQA/MQA: q head h uses KV head h // group; repeating K/V makes that plain MHA.
    group = num_q_heads // num_kv_heads
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    # 5. Scores, accumulated in float32 whatever the input dtype.
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32)
    scores = apply_soft_cap(scores * sm_scale, soft_cap)
    # 6. Mask: mask_value is added to the hidden scores (JAX's rule), 7. softmax, weighted sum.
    scores = apply_mask_value(scores, causal_mask(q_len, kv_len, sliding_window), mask_value)
    sink = None if attention_sink is None else attention_sink[:, None, None]  # [heads, 1, 1]
    probs = softmax_with_sink(scores, sink).astype(v.dtype)
    return jnp.einsum("hqk,khd->qhd", probs, v).astype(q.dtype)


def softmax_with_sink(
    scores: jax.Array,  # f32[..., keys]
    sink: jax.Array | None,  # f32, broadcastable to scores[..., :1]: each row's sink logit
) -> jax.Array:  # f32[..., keys]
    """softmax over the keys, with the sink as one more logit that has no value: the sink
    joins the softmax as an extra column, which is then dropped, so a row's weights sum to
    less than 1. Plain `jax.nn.softmax` when `sink` is None.

    Two equal scores and a sink equal to them: each key weighs a third.

    >>> softmax_with_sink(jnp.zeros((1, 2)), jnp.zeros((1, 1))).tolist()
    [[0.3333333432674408, 0.3333333432674408]]
    """
    if sink is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1)).astype(scores.dtype)
    return jax.nn.softmax(jnp.concatenate([sink, scores], axis=-1), axis=-1)[..., 1:]
