"""A toy decoder-only transformer, and `dense_generate`: the yardstick the engine must match.

One layer, in four named steps that the engine and the dense model share:

  1. `embed_tokens`                     token ids -> vectors        [n, embed_dim]
  2. `attention_inputs`                 RMSNorm, q/k/v projections, rotary positions
  3. attention                          the only step the two differ in
  4. `attention_output_and_mlp`         output projection, residual, RMSNorm, MLP, residual

and at the end `final_logits` (RMSNorm, unembedding). Steps 1, 2 and 4 treat every token row
on its own, so they do not care how rows are batched. Step 3 is where a serving engine
differs from a plain model: `dense_generate` keeps one contiguous K/V buffer per layer and
runs plain causal attention; the engine writes K/V into pages and runs ragged paged
attention over many sequences at once. Both pick tokens with the same `SamplingParams`
(greedy, or seeded sampling whose draws do not depend on the batch), so the comparison is
token for token.

The weights are random (`init_params`), so the text is gibberish; what matters is that both
paths compute the same function of the same weights.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from minilib.engine.sampling import SamplingParams, banned_tokens, request_key, sample_tokens
from minilib.errors import EngineError, RPAInputError
from minilib.heads import check_head_counts
from minilib.kv_cache import bucket_size
from minilib.validation import check_attention_sink

DTYPES = ("float32", "bfloat16")
__all__ = [
    "TINY_CONFIG",
    "EngineError",
    "ModelConfig",
    "attention_inputs",
    "attention_output_and_mlp",
    "check_max_new_tokens",
    "check_request",
    "dense_attention",
    "dense_forward",
    "dense_generate",
    "dense_generate_with_margins",
    "embed_tokens",
    "final_logits",
    "init_params",
    "resolve_sampling_params",
    "rms_norm",
    "rotary",
]

MIN_DENSE_LEN = 64  # dense_generate's shortest cache: short requests share compiled programs


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of the toy transformer. Frozen and hashable: jit takes it as a static arg.

    `num_q_heads` query heads share `num_kv_heads` key/value heads (GQA; MHA and MQA are the
    two ends). `dtype` is the weights', activations' and KV cache's dtype. `attention_sinks`:
    each layer has a learned sink logit per q head (gpt-oss), `layer["attention_sink"]`,
    f32[num_q_heads], which joins every softmax denominator and carries no value.

    >>> ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32)
    ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32, \
embed_dim=64, mlp_dim=128, rope_theta=10000.0, dtype='float32', attention_sinks=False)
    """

    vocab_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    embed_dim: int = 64
    mlp_dim: int = 128
    rope_theta: float = 10000.0
    dtype: str = "float32"
    attention_sinks: bool = False

    def __post_init__(self):
        for name in (
            "vocab_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "embed_dim",
            "mlp_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
                raise EngineError(
                    f"ModelConfig: {name}={value!r} must be a positive int.",
                    "sizes of the model are counts: at least 1.",
                )
        check_head_counts(self.num_q_heads, self.num_kv_heads)
        if self.head_dim % 2:
            raise EngineError(
                f"ModelConfig: head_dim={self.head_dim} must be even.",
                "rotary positions rotate pairs of dimensions; use an even head_dim.",
            )
        if self.dtype not in DTYPES:
            raise EngineError(
                f"ModelConfig: dtype={self.dtype!r} is not one of {DTYPES}.",
                "give the dtype by name, 'float32' or 'bfloat16'.",
            )
        if not isinstance(self.attention_sinks, bool | np.bool_):
            raise EngineError(
                f"ModelConfig: attention_sinks={self.attention_sinks!r} must be True or False.",
                "pass attention_sinks=True for a sink logit per q head in every layer.",
            )

    @property
    def sm_scale(self) -> float:
        """The attention scale, 1 / sqrt(head_dim)."""
        return 1.0 / float(np.sqrt(self.head_dim))

    def attention_args(self, layer: dict) -> dict:
        """The keywords of a layer's attention call: sm_scale, and the layer's attention_sink
        if the model has sinks (`attention_sinks`).

        >>> TINY_CONFIG.attention_args(init_params(TINY_CONFIG)["layers"][0])
        {'sm_scale': 0.35355339059327373}
        """
        sinks = {"attention_sink": layer["attention_sink"]} if self.attention_sinks else {}
        return {"sm_scale": self.sm_scale} | sinks

    def check_attention_sinks(self, params: dict) -> dict:
        """`params`, once checked: raise `EngineError` unless every layer has an
        "attention_sink" that the attention functions take (`check_attention_sink`:
        f32[num_q_heads], finite) when `attention_sinks`, and none otherwise. Checked before
        anything runs, so that a bad sink stops nothing half way: no step taken, no page
        handed out.

        >>> config = dataclasses.replace(TINY_CONFIG, attention_sinks=True)
        >>> params = init_params(config)
        >>> params["layers"][0]["attention_sink"] = jnp.array([0.0, jnp.nan])
        >>> config.check_attention_sinks(params)
        Traceback (most recent call last):
        ...
        minilib.errors.EngineError: layer 0: attention_sink[1]=nan must be finite.
        Hint: ...
        """
        for i, layer in enumerate(params["layers"]):
            if "attention_sink" in layer and not self.attention_sinks:
                raise EngineError(
                    f"layer {i} has an attention_sink, but config.attention_sinks is False.",
                    "build the config with attention_sinks=True, or drop the sinks from the "
                    "params: init_params(config) gives the params of a config.",
                )
            if self.attention_sinks and "attention_sink" not in layer:
                raise EngineError(
                    f"layer {i} has no attention_sink, but config.attention_sinks is True.",
                    "give every layer its sinks, f32[num_q_heads]: init_params(config) does.",
                )
            if not self.attention_sinks:
                continue
            try:
                check_attention_sink(layer["attention_sink"], self.num_q_heads)
            except RPAInputError as err:
                raise EngineError(f"layer {i}: {err.message}", err.hint) from None
        return params


# The smallest model the examples run: one layer, two q heads sharing one KV head, head_dim 8.
TINY_CONFIG = ModelConfig(vocab_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)


def init_params(config: ModelConfig, seed: int = 0) -> dict:
    """Seeded random weights for `config`: a dict of arrays in `config.dtype`.

    Matrices are normal with variance 1 / fan_in, so every layer keeps its activations near
    unit size. The unembedding is scaled up (logits of standard deviation about 4): the top two
    logits are then rarely close, so a last-bit difference in attention does not flip a greedy
    token, and exactness tests compare tokens, not rounding.

    With `config.attention_sinks`, each layer also has "attention_sink", f32[num_q_heads]
    (float32 whatever `config.dtype`, as the attention functions take it), normal with
    standard deviation 2: large enough to change the tokens. They are drawn from a key of their
    own, so the other weights are those of the same config without sinks.

    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> params = init_params(config, seed=0)
    >>> params["layers"][0]["wq"].shape, params["layers"][0]["wk"].shape
    ((64, 4, 32), (64, 2, 32))
    """
    if not isinstance(config, ModelConfig):
        raise EngineError(
            f"config={config!r} must be a ModelConfig.",
            "build one with ModelConfig(vocab_size=..., num_layers=..., ...).",
        )
    d, h, nq, nkv = config.embed_dim, config.head_dim, config.num_q_heads, config.num_kv_heads
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + 6 * config.num_layers))

    def normal(shape, fan_in, scale=1.0):
        return (scale / np.sqrt(fan_in)) * jax.random.normal(next(keys), shape, jnp.float32)

    layers = [
        {
            "attn_norm": jnp.ones(d),
            "wq": normal((d, nq, h), d),  # [embed_dim, num_q_heads, head_dim]
            "wk": normal((d, nkv, h), d),  # [embed_dim, num_kv_heads, head_dim]
            "wv": normal((d, nkv, h), d),
            "wo": normal((nq, h, d), nq * h),  # [num_q_heads, head_dim, embed_dim]
            "mlp_norm": jnp.ones(d),
            "w_in": normal((d, config.mlp_dim), d),
            "w_out": normal((config.mlp_dim, d), config.mlp_dim),
        }
        for _ in range(config.num_layers)
    ]
    params = {
        "embed": normal((config.vocab_size, d), 1),  # [vocab_size, embed_dim]
        "layers": layers,
        "final_norm": jnp.ones(d),
        "unembed": normal((d, config.vocab_size), d, scale=4.0),  # [embed_dim, vocab_size]
    }
    params = jax.tree.map(lambda x: x.astype(config.dtype), params)
    if config.attention_sinks:
        sink_keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), 1), len(layers))
        for layer, key in zip(params["layers"], sink_keys, strict=True):
            layer["attention_sink"] = 2.0 * jax.random.normal(key, (nq,), jnp.float32)
    return params


# --- the shared steps of a layer -------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) * weight, computed in float32.  x: [n, embed_dim].

    >>> rms_norm(jnp.array([[2.0, -2.0]]), jnp.array([1.0, 3.0])).round(4).tolist()  # rms 2
    [[1.0, -3.0]]
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs (x[..., i], x[..., i + head_dim/2]) by angle position / theta^(2i/head_dim).

    x: [n, num_heads, head_dim], positions: i32[n]. Token order enters attention only here:
    a token's K is rotated by its position once, when it is written to the cache.

    >>> x = jnp.array([[[1.0, 0.0]]])                 # one token, one head, head_dim 2
    >>> rotary(x, jnp.array([0]), theta=10000.0).tolist()   # position 0: unchanged
    [[[1.0, 0.0]]]
    >>> print(rotary(x, jnp.array([1]), theta=10000.0).round(4))  # rotated by 1 radian
    [[[0.5403 0.8415]]]
    """
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [half]
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [n, half]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rotated.astype(x.dtype)


@jax.jit
def embed_tokens(params: dict, tokens: jax.Array) -> jax.Array:  # [n, embed_dim]
    """Step 1: one embedding row per token id.  tokens: i32[n].

    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> params = init_params(config)
    >>> embed_tokens(params, jnp.array([5, 6, 7])).shape
    (3, 64)
    """
    return params["embed"][tokens]


@functools.partial(jax.jit, static_argnames="config")
def attention_inputs(layer: dict, config: ModelConfig, x: jax.Array, positions: jax.Array):
    """Step 2: q [n, num_q_heads, head_dim], k and v [n, num_kv_heads, head_dim] of every row.

    x: [n, embed_dim], positions: i32[n] (each row's position in its own sequence).

    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> params = init_params(config)
    >>> x = embed_tokens(params, jnp.array([5, 6, 7]))
    >>> q, k, v = attention_inputs(params["layers"][0], config, x, jnp.arange(3))
    >>> q.shape, k.shape, v.shape
    ((3, 4, 32), (3, 2, 32), (3, 2, 32))
    """
    h = rms_norm(x, layer["attn_norm"])
    q = jnp.einsum("nd,dhk->nhk", h, layer["wq"])
    k = jnp.einsum("nd,dhk->nhk", h, layer["wk"])
    v = jnp.einsum("nd,dhk->nhk", h, layer["wv"])
    return rotary(q, positions, config.rope_theta), rotary(k, positions, config.rope_theta), v


@jax.jit
def attention_output_and_mlp(layer: dict, x: jax.Array, attn: jax.Array) -> jax.Array:
    """Step 4: x + attn @ wo, then x + MLP(RMSNorm(x)).  attn: [n, num_q_heads, head_dim].

    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> params = init_params(config)
    >>> x = embed_tokens(params, jnp.array([5, 6, 7]))
    >>> attention_output_and_mlp(params["layers"][0], x, jnp.zeros((3, 4, 32))).shape
    (3, 64)
    """
    x = x + jnp.einsum("nhk,hkd->nd", attn.astype(x.dtype), layer["wo"])
    h = rms_norm(x, layer["mlp_norm"])
    return x + jax.nn.gelu(h @ layer["w_in"]) @ layer["w_out"]


@jax.jit
def final_logits(params: dict, x: jax.Array) -> jax.Array:  # f32[n, vocab_size]
    """RMSNorm, then the unembedding: one row of logits per token row, accumulated and kept
    in float32 (bf16 logits would tie too often for a greedy argmax).

    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> params = init_params(config)
    >>> logits = final_logits(params, embed_tokens(params, jnp.array([5, 6, 7])))
    >>> logits.shape, logits.dtype
    ((3, 64), dtype('float32'))
    """
    h = rms_norm(x, params["final_norm"])
    return jnp.dot(h, params["unembed"], preferred_element_type=jnp.float32)


# --- the yardstick: one sequence, a contiguous cache, plain attention ------------------------


def dense_attention(
    q: jax.Array,  # [n, num_q_heads, head_dim], the rows at `positions`
    k: jax.Array,  # [max_len, num_kv_heads, head_dim], the whole contiguous cache
    v: jax.Array,  # [max_len, num_kv_heads, head_dim]
    positions: jax.Array,  # i32[n]
    sm_scale: float,
    attention_sink: jax.Array | None = None,  # f32[num_q_heads]
) -> jax.Array:  # [n, num_q_heads, head_dim]
    """Causal attention over a contiguous cache: row at position p sees keys 0..p. With an
    `attention_sink`, each q head's sink is one more logit in its softmax, with no value.

    >>> q, k = jnp.ones((2, 2, 4)), jnp.ones((3, 1, 4))   # equal scores: a plain average
    >>> v = jnp.arange(12.0).reshape(3, 1, 4)
    >>> dense_attention(q, k, v, positions=jnp.array([0, 1]), sm_scale=0.5)[:, 0].tolist()
    [[0.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0]]
    """
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    future = jnp.arange(k.shape[0])[None, :] > positions[:, None]  # [n, max_len]
    scores = jnp.where(future, -jnp.inf, scores)
    if attention_sink is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink as a first column of scores, dropped after the softmax
        sinks = jnp.broadcast_to(attention_sink[:, None, None], (*scores.shape[:2], 1))
        probs = jax.nn.softmax(jnp.concatenate([sinks, scores], axis=-1), axis=-1)[..., 1:]
    return jnp.einsum("hqk,khd->qhd", probs.astype(v.dtype), v)


@functools.partial(jax.jit, static_argnames="config")
def dense_forward(params, config: ModelConfig, tokens, start, k_cache, v_cache):
    """Run `tokens` (i32[n], positions start..start+n-1) through the model with a contiguous
    cache per layer, k_cache and v_cache [num_layers, max_len, num_kv_heads, head_dim].

    Returns (logits f32[n, vocab_size], k_cache, v_cache) with the new K/V written in.

    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> params = init_params(config)
    >>> cache = jnp.zeros((2, 64, 2, 32))      # [num_layers, max_len, num_kv_heads, head_dim]
    >>> prompt = np.zeros(64, np.int32)        # padded to the cache, as dense_generate does
    >>> prompt[:3] = [5, 6, 7]
    >>> logits, k_cache, v_cache = dense_forward(params, config, prompt, 0, cache, cache)
    >>> logits.shape, bool((k_cache != 0).any())   # 64 rows of logits; K written
    ((64, 64), True)
    """
    positions = start + jnp.arange(tokens.shape[0])
    x = embed_tokens(params, tokens)
    for i, layer in enumerate(params["layers"]):
        q, k, v = attention_inputs(layer, config, x, positions)
        k_cache = k_cache.at[i].set(jax.lax.dynamic_update_slice(k_cache[i], k, (start, 0, 0)))
        v_cache = v_cache.at[i].set(jax.lax.dynamic_update_slice(v_cache[i], v, (start, 0, 0)))
        sink = layer.get("attention_sink")  # None unless config.attention_sinks
        attn = dense_attention(q, k_cache[i], v_cache[i], positions, config.sm_scale, sink)
        x = attention_output_and_mlp(layer, x, attn)
    return final_logits(params, x), k_cache, v_cache


def dense_generate(
    params: dict,
    config: ModelConfig,
    prompt,
    max_new_tokens: int | None = None,
    *,
    sampling_params: SamplingParams | None = None,
) -> list[int]:
    """Generation of one sequence: the prompt in one pass, then one token at a time.

    Give either `max_new_tokens` (greedy, that many tokens) or `sampling_params`. Without a
    seed, sampling draws a fresh one: its tokens differ from run to run, as in vLLM.

    The cache is one contiguous buffer per layer, `bucket_size(len(prompt) + max_new_tokens)`
    long (at least `MIN_DENSE_LEN`), so that sequences of similar length share the two
    compiled programs, prefill and decode. The prompt is padded to the cache's length: the
    causal mask hides the padding from the real rows, and its K/V is overwritten by the
    generated tokens before any row could see it.

    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> params = init_params(config)
    >>> tokens = dense_generate(params, config, [1, 2, 3], max_new_tokens=4)
    >>> len(tokens), all(0 <= t < 64 for t in tokens)
    (4, True)
    >>> seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=1)
    >>> dense_generate(params, config, [1, 2, 3], sampling_params=seeded) == dense_generate(
    ...     params, config, [1, 2, 3], sampling_params=seeded)            # seeded: repeatable
    True
    """
    return dense_generate_with_margins(
        params, config, prompt, max_new_tokens, sampling_params=sampling_params
    )[0]


def dense_generate_with_margins(
    params, config: ModelConfig, prompt, max_new_tokens=None, *, sampling_params=None
):
    """`dense_generate`, and for each token the margin it was chosen by (`sample_tokens`):
    where the margin is tiny, a rounding difference may legitimately pick another token.

    >>> config = ModelConfig(vocab_size=64, num_layers=1, num_q_heads=2, num_kv_heads=1,
    ...                      head_dim=8)
    >>> tokens, margins = dense_generate_with_margins(init_params(config), config, [1], 3)
    >>> len(margins), all(m >= 0 for m in margins)
    (3, True)
    """
    max_tokens, sampling = resolve_sampling_params(max_new_tokens, sampling_params, config)
    check_request(prompt, max_tokens, config)
    config.check_attention_sinks(params)
    prompt = [int(t) for t in prompt]
    if max_tokens == 0:
        return [], []
    if sampling.seed is None:
        sampling = sampling.with_seed(int(np.random.default_rng().integers(2**63)))
    max_len = max(MIN_DENSE_LEN, bucket_size(len(prompt) + max_tokens))
    shape = (config.num_layers, max_len, config.num_kv_heads, config.head_dim)
    k_cache, v_cache = jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype)
    padded = np.zeros(max_len, np.int32)  # the prompt, padded to the cache's length
    padded[: len(prompt)] = prompt
    logits, k_cache, v_cache = dense_forward(params, config, padded, 0, k_cache, v_cache)
    tokens, margins = [], []
    last = logits[len(prompt) - 1]
    key = request_key(sampling.seed)[None]
    settings = (
        np.array([sampling.temperature], np.float32),
        np.array([sampling.top_k], np.int32),
        np.array([sampling.top_p], np.float32),
    )
    while True:
        index = np.array([len(tokens)], np.int32)  # which output token this draw picks
        banned = banned_tokens(sampling, len(tokens), config.vocab_size)[None]
        token, margin = sample_tokens(last[None], key, index, *settings, banned)
        tokens.append(int(token[0]))
        margins.append(float(margin[0]))
        if len(tokens) == max_tokens or tokens[-1] in sampling.stop_token_ids:
            return tokens, margins
        position = len(prompt) + len(tokens) - 1  # the newest token, not yet in the cache
        logits, k_cache, v_cache = dense_forward(
            params, config, np.array(tokens[-1:], np.int32), position, k_cache, v_cache
        )
        last = logits[0]


def resolve_sampling_params(
    max_new_tokens, sampling_params, config: ModelConfig
) -> tuple[int, SamplingParams]:
    """(max_tokens, sampling params) of a request given as `max_new_tokens` (greedy) or as
    `sampling_params`: exactly one of the two. Raises `EngineError` otherwise, or for a stop
    token outside the vocabulary.

    >>> config = ModelConfig(vocab_size=64, num_layers=1, num_q_heads=2, num_kv_heads=1,
    ...                      head_dim=8)
    >>> max_tokens, greedy = resolve_sampling_params(5, None, config)
    >>> max_tokens, greedy.temperature
    (5, 0.0)
    >>> resolve_sampling_params(None, SamplingParams(max_tokens=3, seed=1), config)[0]
    3
    """
    if sampling_params is None:
        if max_new_tokens is None:
            raise EngineError(
                "Neither max_new_tokens nor sampling_params was given.",
                "pass max_new_tokens=N for N greedy tokens, or "
                "sampling_params=SamplingParams(max_tokens=N, ...).",
            )
        check_max_new_tokens(max_new_tokens)
        # Greedy: the seed cannot matter, so none is drawn.
        return int(max_new_tokens), SamplingParams(
            max_tokens=int(max_new_tokens), temperature=0.0, seed=0
        )
    if max_new_tokens is not None:
        raise EngineError(
            f"Both max_new_tokens={max_new_tokens!r} and sampling_params were given.",
            "give one: sampling_params.max_tokens is the number of tokens to generate.",
        )
    if not isinstance(sampling_params, SamplingParams):
        raise EngineError(
            f"sampling_params={sampling_params!r} is not a SamplingParams.",
            "build one: SamplingParams(max_tokens=16, temperature=0.8, seed=0).",
        )
    outside = [t for t in sampling_params.stop_token_ids if t >= config.vocab_size]
    if outside:
        raise EngineError(
            f"stop_token_ids={list(sampling_params.stop_token_ids)} holds ids {outside} "
            f"outside the vocabulary [0, vocab_size={config.vocab_size}): the model can "
            "never produce them.",
            "use the ids of tokens in the vocabulary, such as the end-of-sequence id.",
        )
    if (sampling_params.logprobs or 0) > config.vocab_size:
        raise EngineError(
            f"logprobs={sampling_params.logprobs} asks for more tokens than the vocabulary "
            f"has (vocab_size={config.vocab_size}).",
            f"ask for the k most likely tokens with k <= {config.vocab_size}, such as 5.",
        )
    return sampling_params.max_tokens, sampling_params


def check_max_new_tokens(max_new_tokens) -> None:
    """Raise `EngineError` unless `max_new_tokens` is a positive int, as
    `SamplingParams.max_tokens` must be (and vLLM's).

    >>> check_max_new_tokens(1)
    >>> check_max_new_tokens(0)
    Traceback (most recent call last):
    ...
    minilib.errors.EngineError: max_new_tokens=0 must be an int >= 1.
    Hint: it counts the tokens to generate after the prompt: at least one token. A request ...
    """
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int | np.integer)
        or max_new_tokens < 1
    ):
        raise EngineError(
            f"max_new_tokens={max_new_tokens!r} must be an int >= 1.",
            "it counts the tokens to generate after the prompt: at least one token. A "
            "request for none has nothing to do: don't send it.",
        )


def check_request(prompt, max_new_tokens, config: ModelConfig) -> None:
    """Raise `EngineError` unless `prompt` is a non-empty list of token ids in the vocabulary
    and `max_new_tokens` a positive int.

    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> check_request([1, 2, 3], 4, config)               # a good request: nothing happens
    >>> try:
    ...     check_request([1, 99], 4, config)
    ... except EngineError as err:
    ...     print(err)
    prompt=[1, 99] holds token ids [99] outside the vocabulary [0, vocab_size=64).
    Hint: token ids index the embedding table: keep them in 0 .. vocab_size - 1.
    """
    check_max_new_tokens(max_new_tokens)
    try:
        ids = np.asarray(prompt)
    except Exception:
        ids = np.asarray([], object)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
        raise EngineError(
            f"prompt={_short(prompt)} must be a flat list of int token ids.",
            "tokenize the text first; a prompt is a list such as [5, 17, 3].",
        )
    if ids.size == 0:
        raise EngineError(
            "prompt=[] is empty: there is no token to predict the next one from.",
            "give at least one token id (a beginning-of-sequence token, for example).",
        )
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        raise EngineError(
            f"prompt={_short(prompt)} holds token ids {sorted(set(bad.tolist()))[:5]} outside "
            f"the vocabulary [0, vocab_size={config.vocab_size}).",
            "token ids index the embedding table: keep them in 0 .. vocab_size - 1.",
        )


def _short(prompt) -> str:
    text = repr(prompt)
    return text if len(text) <= 60 else text[:57] + "..."
