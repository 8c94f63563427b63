"""Speculative decoding with an n-gram proposer: several tokens per step, same output.

A decode step runs the whole model for one token per sequence. Speculative decoding guesses
the next k tokens cheaply (the *drafts*), and runs the model once on the last sampled token
and the k drafts: k + 1 q rows of one sequence in the ragged batch, exactly a prefill chunk
to ragged paged attention. Row j's logits say what the model wants after draft j, so one step
checks every draft, keeps the longest prefix the model agrees with, and adds one token of the
model's own: between 1 and k + 1 tokens per step for the price of one.

The proposer here is vLLM's n-gram proposer ("prompt lookup", `NgramProposer`): find the
longest n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that ends the sequence and also
occurs earlier in it, its earliest occurrence, and propose the (up to k) tokens that followed
it there. It costs no model at all, and pays off on text that repeats its context (code edits,
summaries, extraction).

Verification (`rejection_sample`) is vLLM's rejection sampler, for a draft distribution that
is a point mass (an n-gram proposer has no probabilities: its draft is certain):

  greedy    keep draft j while it equals the model's argmax at row j; at the first mismatch
            emit the argmax: the tokens are exactly those of the engine without speculation;
  sampled   keep draft x with probability p(x) (min(1, p(x) / q(x)) with q(x) = 1), p the
            model's distribution after temperature, top-k and top-p; at the first rejection
            emit a token drawn from p with x taken out and renormalised (max(p - q, 0)). So
            every token is drawn from p, exactly as without speculation: the *distribution*
            of the output is unchanged (not the tokens: the random numbers are used otherwise).

When every draft is kept, the last row gives one more token (the *bonus* token), drawn as
without speculation. A row's random numbers come from the request's seed and the index of the
token it picks (`fold_in(key, index)`), so batching still cannot change them.

>>> propose_ngram([1, 2, 3, 4, 1, 2], num_speculative_tokens=3, prompt_lookup_min=1,
...               prompt_lookup_max=3)        # [1, 2] occurred at 0: then came 3, 4, 1
[3, 4, 1]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from minilib.engine.sampling import GREEDY_BELOW, processed_logits
from minilib.errors import EngineError

__all__ = [
    "check_drafts",
    "check_speculative_settings",
    "keep_draft",
    "propose_ngram",
    "rejection_sample",
]

PROMPT_LOOKUP = 1, 5  # the engine's default n-gram sizes: (min, max)


def propose_ngram(
    token_ids, *, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
) -> list[int]:
    """Up to `num_speculative_tokens` drafts for a sequence of `token_ids` (vLLM's
    `NgramProposer.propose`): the tokens after the earliest earlier occurrence of the longest
    n-gram that ends the sequence, n in [prompt_lookup_min, prompt_lookup_max]. [] if none.

    >>> propose_ngram([5, 6, 7, 5, 6], num_speculative_tokens=2, prompt_lookup_min=2,
    ...               prompt_lookup_max=2)
    [7, 5]
    >>> propose_ngram([5, 6, 7, 8], num_speculative_tokens=2, prompt_lookup_min=1,
    ...               prompt_lookup_max=2)      # 8 never occurred before: no drafts
    []
    """
    tokens = list(token_ids)
    for n in range(min(prompt_lookup_max, len(tokens) - 1), prompt_lookup_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):  # earliest first; never the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_speculative_tokens]
    return []


def check_speculative_settings(
    num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, max_num_batched_tokens: int
) -> None:
    """`EngineError` for speculative settings that cannot work.

    >>> check_speculative_settings(16, 1, 5, max_num_batched_tokens=16)
    Traceback (most recent call last):
    ...
    minilib.errors.EngineError: num_speculative_tokens=16 needs 17 q rows per sequence, more \
than a step's max_num_batched_tokens=16.
    Hint: use num_speculative_tokens <= 15 (vLLM's n-gram runs use 2 to 5), or raise \
max_num_batched_tokens.
    """
    for name, value, least in (
        ("num_speculative_tokens", num_speculative_tokens, 0),
        ("prompt_lookup_min", prompt_lookup_min, 1),
        ("prompt_lookup_max", prompt_lookup_max, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
            raise EngineError(
                f"Engine: {name}={value!r} must be an int >= {least}.",
                "num_speculative_tokens=0 turns speculation off; k > 0 proposes up to k "
                "drafts per decoding sequence, from n-grams of prompt_lookup_min to "
                "prompt_lookup_max tokens.",
            )
    if num_speculative_tokens + 1 > max_num_batched_tokens:
        raise EngineError(
            f"num_speculative_tokens={num_speculative_tokens} needs "
            f"{num_speculative_tokens + 1} q rows per sequence, more than a step's "
            f"max_num_batched_tokens={max_num_batched_tokens}.",
            f"use num_speculative_tokens <= {max_num_batched_tokens - 1} (vLLM's n-gram runs "
            "use 2 to 5), or raise max_num_batched_tokens.",
        )
    if prompt_lookup_min > prompt_lookup_max:
        raise EngineError(
            f"prompt_lookup_min={prompt_lookup_min} > prompt_lookup_max={prompt_lookup_max}: "
            "no n-gram size is left to look up.",
            "give prompt_lookup_min <= prompt_lookup_max (vLLM's default is 5 and 5; this "
            f"engine's, {PROMPT_LOOKUP[0]} and {PROMPT_LOOKUP[1]}).",
        )


def check_drafts(drafts, request_id: int, most: int, vocab_size: int) -> list[int]:
    """A proposer's drafts for one request as a list of ints, or `EngineError`: more than
    `most`, or not token ids of the vocabulary.

    >>> check_drafts(np.array([3, 4]), 0, most=2, vocab_size=8)
    [3, 4]
    >>> check_drafts([3, 9], 0, most=2, vocab_size=8)
    Traceback (most recent call last):
    ...
    minilib.errors.EngineError: The proposer's drafts for request 0, [3, 9], must be at most 2 \
token ids in [0, vocab_size=8).
    Hint: a proposer returns a list of up to num_speculative_tokens ids, [] for none.
    """
    try:
        values = [int(t) for t in drafts]
        ok = len(values) <= most and all(0 <= t < vocab_size for t in values)
        ok = ok and all(not isinstance(t, bool | float) for t in drafts)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise EngineError(
            f"The proposer's drafts for request {request_id}, {drafts!r}, must be at most "
            f"{most} token ids in [0, vocab_size={vocab_size}).",
            "a proposer returns a list of up to num_speculative_tokens ids, [] for none.",
        )
    return values


def keep_draft(uniform: jax.Array, p_draft: jax.Array) -> jax.Array:
    """vLLM's acceptance rule for a draft that is a point mass: keep draft x when a uniform
    draw u < p(x) / q(x), with q(x) = 1.

    >>> keep_draft(jnp.array([0.2, 0.7]), jnp.array([0.5, 0.5])).tolist()
    [True, False]
    """
    return uniform < p_draft


def _verify_one(logits, drafts, num_drafts, key, first_index, temperature, top_k, top_p, keep):
    """One sequence: logits f32[k + 1, vocab_size], drafts i32[k] (the first num_drafts
    real). Returns (tokens i32[k + 1]: the first num_accepted + 1 are its new tokens,
    num_accepted)."""
    k, vocab_size = drafts.shape[0], logits.shape[-1]
    index = first_index + jnp.arange(k + 1)  # the output token index each row picks
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, index)
    scores = jax.vmap(processed_logits, (0, None, None, None))(logits, temperature, top_k, top_p)
    greedy = temperature < GREEDY_BELOW
    gumbel = jax.vmap(lambda rk: jax.random.gumbel(rk, (vocab_size,)))(row_keys)
    noisy = scores + jnp.where(greedy, 0.0, gumbel)  # [k + 1, vocab_size]
    target = jnp.argmax(noisy, axis=-1)  # each row's own draw, as without speculation
    # Keep draft x with probability p(x): u < p(x), u uniform from the row's key.
    uniform = jax.vmap(lambda rk: jax.random.uniform(jax.random.fold_in(rk, 1)))(row_keys[:k])
    p_draft = jnp.take_along_axis(jax.nn.softmax(scores[:k]), drafts[:, None], axis=1)[:, 0]
    accept = jnp.where(greedy, drafts == target[:k], keep(uniform, p_draft))
    accept = accept & (jnp.arange(k) < num_drafts)
    num_accepted = jnp.argmin(jnp.append(accept, False))  # the first draft not kept
    # Rejected: a draw from p without x (the same Gumbel race, x left out); greedy: argmax.
    without_draft = jnp.where(jax.nn.one_hot(drafts, vocab_size, dtype=bool), -jnp.inf, noisy[:k])
    recovered = jnp.where(greedy, target[:k], jnp.argmax(without_draft, axis=-1))
    rejected = num_accepted < num_drafts
    last = jnp.where(
        rejected, jnp.append(recovered, 0)[num_accepted], target[num_accepted]
    )  # a rejected draft's replacement, or the bonus token
    tokens = jnp.append(drafts, 0).at[num_accepted].set(last)
    return tokens, num_accepted


@functools.partial(jax.jit, static_argnames="keep")
def rejection_sample(
    logits, drafts, num_drafts, keys, first_indices, temperature, top_k, top_p, keep=keep_draft
):
    """Each sequence's new tokens, its drafts verified (vLLM's rejection sampler with a
    point-mass draft distribution).

      logits:        f32[num_seqs, k + 1, vocab_size]  rows of the last sampled token and
                                                       the k draft slots
      drafts:        i32[num_seqs, k]; num_drafts: i32[num_seqs], how many are real
      keys:          u32[num_seqs, 2]; first_indices: i32[num_seqs], the output token index
                     of row 0; temperature, top_p: f32[num_seqs]; top_k: i32[num_seqs]
      keep:          the acceptance rule (`keep_draft`; the tests give a wrong one)
      returns        (tokens i32[num_seqs, k + 1], num_accepted i32[num_seqs]): the new
                     tokens of sequence i are tokens[i, : num_accepted[i] + 1]

    >>> logits = jnp.array([[[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]]])  # 1, 2, 0
    >>> tokens, accepted = rejection_sample(logits, jnp.array([[1, 1]]), jnp.array([2]),
    ...     jnp.zeros((1, 2), jnp.uint32), jnp.zeros(1, jnp.int32), jnp.zeros(1),
    ...     jnp.zeros(1, jnp.int32), jnp.ones(1))
    >>> tokens[0, : accepted[0] + 1].tolist()   # greedy: draft 1 kept, draft 1 wrong: 2
    [1, 2]
    """
    verify = jax.vmap(functools.partial(_verify_one, keep=keep))
    return verify(logits, drafts, num_drafts, keys, first_indices, temperature, top_k, top_p)
