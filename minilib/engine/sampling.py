"""Sampling that batching cannot change: `SamplingParams`, and `sample_tokens`.

`SamplingParams` has vLLM's fields, meanings and defaults:

    max_tokens      16     generate at most this many tokens (then finish_reason "length")
    min_tokens      0      generate at least this many tokens: until then no stop token can
                           be drawn (its logit is -inf, as vLLM's min_tokens does it)
    temperature     1.0    divide the logits by it; below 1e-5 (0 included) means greedy
                           (the most likely token), as in vLLM
    top_k           0      keep only the k most likely tokens; 0 (or -1) keeps all
    top_p           1.0    keep the fewest most likely tokens whose probability reaches top_p
    seed            None   the request's random seed (the engine gives it one if None)
    stop_token_ids  []     a token in this list ends the request (finish_reason "stop"); the
                           stop token is the last token of the output, as in vLLM
    logprobs        None   an int k: for each sampled token, its log-probability and the k
                           most likely tokens' (vLLM's raw logprobs: log_softmax of the
                           model's logits, before temperature, top-k, top-p and min_tokens),
                           in `RequestOutput.logprobs`

A draw is a function of the request's seed and of the index of the token it picks, and of
nothing else: the random numbers for output token i of a request with seed s are
`fold_in(key(s), i)`. So a request's tokens do not depend on which requests share its batch,
on where in the batch it sits, or on how often it was preempted and recomputed: that is
*batch invariance*. The rest is arithmetic on the request's own row of logits, so the engine
and `dense_generate` agree whenever their logits do (float32 here: equal up to rounding).

The draw is the Gumbel-max trick: add independent Gumbel noise to the logits / temperature
of the tokens top-k and top-p keep, and take the argmax. That samples exactly from the
softmax over the kept tokens, and it makes a sampled token a greedy choice over perturbed
scores, so the tests can treat a draw whose top two scores are within rounding of each
other as the greedy tests treat a near-tie.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from minilib.errors import EngineError

__all__ = [
    "GREEDY_BELOW",
    "SamplingParams",
    "banned_tokens",
    "processed_logits",
    "request_key",
    "sample_tokens",
    "sampling_scores",
    "step_draws",
    "top_logprobs",
]

SEED_LIMIT = 2**64  # a seed is two 32-bit words of a JAX key
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick a request's tokens: vLLM's fields, meanings and defaults.

    Every field is checked when it is built: a bad one raises `EngineError` naming it.

    >>> SamplingParams()
    SamplingParams(max_tokens=16, min_tokens=0, temperature=1.0, top_k=0, top_p=1.0, \
seed=None, stop_token_ids=(), logprobs=None)
    >>> SamplingParams(temperature=0.0).greedy, SamplingParams(top_k=1).greedy
    (True, True)
    >>> SamplingParams(temperature=1e-6).greedy   # below 1e-5: greedy, as in vLLM
    True
    >>> try:
    ...     SamplingParams(top_p=0.0)
    ... except EngineError as err:
    ...     print(err.message)
    SamplingParams: top_p=0.0 must be in (0, 1].
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def __post_init__(self):
        _check_count("max_tokens", self.max_tokens, minimum=1, hint="at least one token")
        _check_count("min_tokens", self.min_tokens, minimum=0, hint="0 lets a stop token end it")
        if self.min_tokens > self.max_tokens:
            raise EngineError(
                f"SamplingParams: min_tokens={self.min_tokens} must be <= "
                f"max_tokens={self.max_tokens}.",
                "min_tokens is the least a request generates, max_tokens the most: raise "
                "max_tokens or lower min_tokens.",
            )
        if self.logprobs is not None:
            _check_count("logprobs", self.logprobs, minimum=0, hint="or None for none")
        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise EngineError(
                f"SamplingParams: temperature={self.temperature!r} must be >= 0.",
                "0 (or below 1e-5) means greedy; 1.0 samples from the model's own distribution.",
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int | np.integer):
            raise EngineError(
                f"SamplingParams: top_k={self.top_k!r} must be an int.",
                "keep the k most likely tokens; 0 (or -1) keeps all of them.",
            )
        if self.top_k < -1:
            raise EngineError(
                f"SamplingParams: top_k={self.top_k} must be -1, 0 or positive.",
                "0 (or -1) keeps every token; k > 0 keeps the k most likely.",
            )
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise EngineError(
                f"SamplingParams: top_p={self.top_p!r} must be in (0, 1].",
                "1.0 keeps every token; 0.9 keeps the most likely tokens that together "
                "have 90% of the probability.",
            )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int | np.integer)
            or not 0 <= self.seed < SEED_LIMIT
        ):
            raise EngineError(
                f"SamplingParams: seed={self.seed!r} must be None or an int in [0, 2**64).",
                "any non-negative int: the same seed gives the same tokens.",
            )
        stop = self.stop_token_ids
        if stop is None:
            stop = ()
        if isinstance(stop, int | str | bytes) or not hasattr(stop, "__iter__"):
            raise EngineError(
                f"SamplingParams: stop_token_ids={stop!r} must be a list of token ids.",
                f"pass a list, even for one token: stop_token_ids=[{stop!r}].",
            )
        stop = tuple(stop)
        if any(isinstance(t, bool) or not isinstance(t, int | np.integer) or t < 0 for t in stop):
            raise EngineError(
                f"SamplingParams: stop_token_ids={list(stop)!r} must hold non-negative int "
                "token ids.",
                "list the ids of the tokens that end a request, such as an end-of-sequence id.",
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "min_tokens", int(self.min_tokens))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", int(self.logprobs))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        """True when the draw cannot matter: a temperature below 1e-5 (vLLM's rule), or
        only one token kept."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def with_seed(self, seed: int) -> SamplingParams:
        """These parameters with `seed` filled in.

        >>> SamplingParams(max_tokens=4).with_seed(7).seed
        7
        """
        return dataclasses.replace(self, seed=seed)


def request_key(seed: int) -> np.ndarray:
    """The JAX key (raw uint32[2]) of a request's seed: all 64 bits of it.

    (`jax.random.PRNGKey(seed)` would keep only the low 32 bits of a larger seed.)

    >>> request_key(5).tolist(), request_key(2**32 + 5).tolist()
    ([0, 5], [1, 5])
    """
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def processed_logits(
    logits: jax.Array,  # f32[vocab_size], one row
    temperature: jax.Array,  # f32[]
    top_k: jax.Array,  # i32[], 0 or -1: all
    top_p: jax.Array,  # f32[]
) -> jax.Array:  # f32[vocab_size]; -inf for tokens that top-k or top-p drop
    """One row's logits as sampling sees them, in the order vLLM applies them: logits /
    temperature; keep the top_k most likely; of those, keep the most likely whose
    probabilities sum to top_p (always at least one). Their softmax is the distribution a
    draw comes from. At a temperature below 1e-5 (0 included) the logits are not divided.

    >>> logits = jnp.array([2.0, 1.0, 0.5, -1.0])
    >>> processed_logits(logits, 0.5, 2, 1.0).tolist()   # top_k=2, doubled
    [4.0, 2.0, -inf, -inf]
    """
    vocab_size = logits.shape[-1]
    greedy = temperature < GREEDY_BELOW
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    order = jnp.argsort(-scaled)  # most likely first
    rank = jnp.empty_like(order).at[order].set(jnp.arange(vocab_size))  # 0 = most likely
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf))
    sorted_probs = probs[order]
    mass_before = (jnp.cumsum(sorted_probs) - sorted_probs)[rank]  # of the more likely ones
    keep = keep & ((mass_before < top_p) | (top_p >= 1.0) | (rank == 0))  # 1.0: all, exactly
    return jnp.where(keep, scaled, -jnp.inf)


def sampling_scores(
    logits: jax.Array,  # f32[vocab_size], one row
    key: jax.Array,  # u32[2], the request's key
    token_index: jax.Array,  # i32[], which output token this draw picks
    temperature: jax.Array,  # f32[]
    top_k: jax.Array,  # i32[], 0 or -1: all
    top_p: jax.Array,  # f32[]
) -> jax.Array:  # f32[vocab_size]; -inf for tokens that top-k or top-p drop
    """One row's scores, whose argmax is the sampled token (the Gumbel-max trick):
    `processed_logits` plus Gumbel noise drawn from `fold_in(key, token_index)`. At a
    temperature below 1e-5 (0 included) the noise is left out and the scores are the
    logits: greedy, as in vLLM.

    >>> logits = jnp.array([2.0, 1.0, 0.5, -1.0])
    >>> scores = sampling_scores(logits, request_key(0), 0, 1.0, 2, 1.0)  # top_k=2
    >>> bool(jnp.isinf(scores[2:]).all()), int(jnp.argmax(scores)) in (0, 1)
    (True, True)
    """
    greedy = temperature < GREEDY_BELOW
    noise = jax.random.gumbel(jax.random.fold_in(key, token_index), logits.shape)
    return processed_logits(logits, temperature, top_k, top_p) + jnp.where(greedy, 0.0, noise)


@jax.jit
def sample_tokens(logits, keys, token_indices, temperature, top_k, top_p, banned=None):
    """The next token of each row, `sampling_scores`' argmax, and the margin it won by.

    Rows are vmapped: no row's draw can depend on another row.

      logits:        f32[num_rows, vocab_size]
      keys:          u32[num_rows, 2]     each row's request key (`request_key`)
      token_indices: i32[num_rows]        each row's output token index
      temperature, top_p: f32[num_rows];  top_k: i32[num_rows]
      banned:        bool[num_rows, vocab_size] or None: tokens that cannot be drawn (the
                     stop tokens of a request short of its min_tokens), logit -inf
      returns        (i32[num_rows] tokens, f32[num_rows] margins)

    A margin is the gap between the two best scores, in units of logits (times the
    temperature): how far rounding would have to move the logits to pick another token. For
    greedy rows it is the gap between the top two logits. (It does not see a token that
    rounding would move across the top-k or top-p boundary.)

    >>> logits = jnp.array([[0.0, 3.0, 1.0]] * 2)
    >>> keys = jnp.stack([request_key(1), request_key(2)])
    >>> tokens, margins = sample_tokens(logits, keys, jnp.zeros(2, jnp.int32), jnp.zeros(2),
    ...                                 jnp.zeros(2, jnp.int32), jnp.ones(2))
    >>> tokens.tolist(), margins.tolist()          # temperature 0: greedy, won by 3 - 1
    ([1, 1], [2.0, 2.0])
    """
    if banned is not None:
        logits = jnp.where(banned, -jnp.inf, logits)
    scores = jax.vmap(sampling_scores)(logits, keys, token_indices, temperature, top_k, top_p)
    if scores.shape[-1] < 2:  # a vocabulary of one token: nothing to win against
        return jnp.zeros(scores.shape[0], jnp.int32), jnp.full(scores.shape[0], jnp.inf)
    top2 = jax.lax.top_k(scores, 2)[0]  # [num_rows, 2]
    margins = (top2[:, 0] - top2[:, 1]) * jnp.where(temperature < GREEDY_BELOW, 1.0, temperature)
    return jnp.argmax(scores, axis=-1), margins


def banned_tokens(params: SamplingParams, num_generated: int, vocab_size: int) -> np.ndarray:
    """bool[vocab_size]: the tokens this draw may not pick. A request with fewer than
    `min_tokens` tokens generated may not draw a stop token (vLLM's min_tokens).

    >>> params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[1])
    >>> banned_tokens(params, 1, 3).tolist(), banned_tokens(params, 2, 3).tolist()
    ([False, True, False], [False, False, False])
    """
    banned = np.zeros(vocab_size, bool)
    if num_generated < params.min_tokens:
        banned[list(params.stop_token_ids)] = True
    return banned


def top_logprobs(logprobs: np.ndarray, token: int, k: int) -> dict[int, float]:
    """One sampled token's entry of `RequestOutput.logprobs`, from its row of log-probabilities
    (log_softmax of the logits): {token id: log-probability} of the sampled token, then of
    the k most likely tokens, most likely first (k or k + 1 entries, as in vLLM).

    >>> row = np.log(np.array([0.1, 0.6, 0.3]))
    >>> {t: round(p, 3) for t, p in top_logprobs(row, 0, 1).items()}  # 0 sampled, 1 top
    {0: -2.303, 1: -0.511}
    """
    top = np.argsort(-logprobs, kind="stable")[:k]
    return {int(token): float(logprobs[token])} | {int(t): float(logprobs[t]) for t in top}


def _check_count(name: str, value, *, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise EngineError(
            f"SamplingParams: {name}={value!r} must be an int >= {minimum}.",
            f"{name} counts tokens: {hint}.",
        )


def _check_real(name: str, value) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float | np.integer | np.floating)
        or not math.isfinite(value)
    ):
        raise EngineError(
            f"SamplingParams: {name}={value!r} must be a finite number.",
            f"give {name} as a float, such as {1.0 if name != 'temperature' else 0.7}.",
        )


def step_draws(plan, shape: tuple[int, int], vocab_size: int) -> tuple[np.ndarray, ...]:
    """What a step's sampling needs, per sequence slot of its `shape` (S slots, k + 1 sample
    rows) for the sequences of `plan` (a `StepPlan`): its key, the index of the output token
    its row 0 picks, its temperature, top_k and top_p, and bool[S, k + 1, vocab_size], the
    tokens each row may not pick. Padding slots: greedy, none banned.

    >>> from minilib.engine.scheduler import Request, StepPlan, schedule_tokens
    >>> params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[1], seed=5)
    >>> r = Request(0, prompt=[3], max_new_tokens=4, output=[2], num_computed=1,
    ...             sampling_params=params)
    >>> keys, indices, temperature, top_k, top_p, banned = step_draws(
    ...     StepPlan((schedule_tokens(r, 1),), (), ()), (2, 1), vocab_size=3)
    >>> keys.tolist(), indices.tolist(), banned[:, 0].tolist()   # 1 is banned: 1 token so far
    ([[0, 5], [0, 0]], [1, 0], [[False, True, False], [False, False, False]])
    """
    s, rows = shape
    keys, indices = np.zeros((s, 2), np.uint32), np.zeros(s, np.int32)
    temperature, top_k, top_p = np.zeros(s, np.float32), np.zeros(s, np.int32), np.ones(s)
    banned = np.zeros((s, rows, vocab_size), bool)
    for i, seq in enumerate(plan.seqs):
        params, num_generated = seq.request.sampling_params, len(seq.request.output)
        keys[i] = request_key(params.seed)
        indices[i] = num_generated  # the index of the token row 0 picks
        temperature[i], top_k[i], top_p[i] = params.temperature, params.top_k, params.top_p
        for j in range(rows):
            banned[i, j] = banned_tokens(params, num_generated + j, vocab_size)
    return keys, indices, temperature, top_k, top_p.astype(np.float32), banned
