"""The engine: continuous batching of many requests on one paged KV cache.

Each `Engine.step()`:

  1. asks the `Scheduler` for this step's sequences (admitting, allocating pages, preempting,
     and with prefix caching, starting new requests from their longest cached prefix);
  2. packs their new tokens into one ragged batch (`pack_batch`): token ids, positions,
     where each token's K/V goes in the pool, and the four index arrays of ragged paged
     attention (`kv_lens`, `page_indices`, `cu_q_lens`, `num_seqs`);
  3. runs the model layer by layer: K/V of the new tokens into the pages with the cache's
     jitted scatter (`write_tokens`), then the chosen attention implementation (minilib's
     kernel, on one device, writes them itself: `minilib.kernel.kv_write`);
  4. samples from the last row of every sequence that reached its end, each with its own
     `SamplingParams` and seed (`minilib.engine.sampling`);
  5. records the tokens, names the pages that became full (prefix caching), and frees the
     pages of finished requests.

Every array the model sees is padded to a bucket (`minilib.engine.buckets`: by default one,
`max_num_batched_tokens` rows and `max_num_seqs` sequence slots; `num_pages` pages per
sequence), so each jitted piece compiles once per bucket, and `warm_up()` compiles them all
before the first request. With `num_speculative_tokens`, a decoding sequence brings its
last token and up to k n-gram drafts, and step 4 verifies them (`minilib.engine.spec_decode`).

Continuous batching is this loop: the batch is re-formed at every step (iteration-level
scheduling), so a request that finishes leaves at once and a waiting one takes its place in
the very next step. Static batching, which forms a batch and runs it until its longest
request is done, is the comparison `minilib.engine.throughput` measures.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from minilib.engine.async_scheduling import AsyncStepLoop
from minilib.engine.buckets import bucket_for, check_buckets, reachable_shapes
from minilib.engine.model import (
    ModelConfig,
    attention_inputs,
    attention_output_and_mlp,
    check_request,
    embed_tokens,
    final_logits,
    resolve_sampling_params,
)
from minilib.engine.outputs import RequestMetrics, RequestOutput, StepStats, step_stats
from minilib.engine.packing import PackedBatch, pack_batch
from minilib.engine.sampling import SamplingParams, step_draws, top_logprobs
from minilib.engine.scheduler import PLACEHOLDER, Request, Scheduler, StepPlan
from minilib.engine.sharding import (
    kv_head_replicas,
    nan_kv_pages,
    replicate_kv_heads,
    shard_attention,
    shard_params,
)
from minilib.engine.spec_decode import (
    PROMPT_LOOKUP,
    check_speculative_settings,
    propose_ngram,
    rejection_sample,
)
from minilib.errors import EngineError
from minilib.kernel import ragged_paged_attention
from minilib.kv_cache import pages_needed, write_tokens
from minilib.vectorized import ragged_paged_attention_jnp

__all__ = ["MAX_STATS", "Engine", "default_attention"]

# How many steps' StepStats an Engine keeps by default. Each holds a tuple of num_pages page
# owners, so a server that runs for ever must not keep them all.
MAX_STATS = 1000


@jax.jit
def logits_at(params, x, rows, banned):
    """The logits of `rows` (i32[S, k + 1]) of the final activations x, f32[S, k + 1,
    vocab_size], with the `banned` tokens' at -inf; and their log_softmax, unbanned, for
    `SamplingParams.logprobs`. Compiled per (token bucket, sequence bucket); the sampling
    that follows, per sequence bucket only."""
    logits = final_logits(params, x[rows.reshape(-1)]).reshape(*rows.shape, -1)
    return jnp.where(banned, -jnp.inf, logits), jax.nn.log_softmax(logits)


def default_attention():
    """The engine's attention when none is given: minilib's Pallas kernel, compiled, on a
    TPU; elsewhere the jnp version (`ragged_paged_attention_jnp`), fast on a CPU. Pass
    `attention=minilib.ragged_paged_attention` to run the kernel on a CPU, in TPU interpret
    mode (right answers, slowly).

    >>> default_attention().__name__ if jax.default_backend() == "cpu" else "..."
    'ragged_paged_attention_jnp'
    """
    if jax.default_backend() == "tpu":
        return ragged_paged_attention
    return ragged_paged_attention_jnp


class Engine:
    """A continuous-batching engine on a paged KV cache.

    Args:
      params, config: the model (`init_params`, `ModelConfig`).
      num_pages, page_size: the page pool, shared by all requests and all layers' caches.
      max_num_batched_tokens: the token budget of one step (prefill chunks + decode tokens).
      max_num_seqs: at most this many requests run at once.
      attention: any function with the signature of JAX's ragged paged attention that
        returns an array shaped like q (as all of minilib's do). None (the default):
        `default_attention()`, minilib's kernel compiled on a TPU, the jnp version elsewhere.
      token_buckets, seq_buckets: the sizes a step's token rows and sequence slots are
        padded to, each step to the smallest that holds it (`minilib.engine.buckets`; vLLM
        on TPU pads to powers of two). None: one size, max_num_batched_tokens and
        max_num_seqs. `warm_up()` compiles them all before the first request.
      num_speculative_tokens: 0, or up to k drafts per decoding sequence from vLLM's n-gram
        proposer, verified in one step (`minilib.engine.spec_decode`); n-grams of
        prompt_lookup_min to prompt_lookup_max tokens (vLLM's default is 5 to 5; here 1 to
        5, so that short prompts find matches).
      mesh: None, or a `jax.sharding.Mesh` with one axis "kv_heads": attention and the KV
        cache are split by KV head over its devices (see `minilib.engine.sharding`); with
        more devices than KV heads, each device holds a copy of one KV head.
      enable_prefix_caching: share full pages of equal prefixes between requests
        (`minilib.engine.prefix_cache`). vLLM turns it on by default; here it is off by
        default, so that the first look at the engine shows plain page tables.
      seed: seeds the engine's generator, which gives every request added without a seed
        its own (so a whole run is repeatable, and each request's draws are its own).
      max_stats: `engine.stats` keeps the `StepStats` of the last max_stats steps only
        (default MAX_STATS, 1000), oldest first; `engine.num_steps` counts every step.
      async_scheduling: plan and launch step n + 1 before reading step n's tokens, as vLLM's
        AsyncScheduler does, so that the host's planning hides behind the device's work
        (`minilib.engine.async_scheduling`). The tokens are those of synchronous scheduling.

    >>> from minilib import ragged_paged_attention_jnp
    >>> from minilib.engine import init_params
    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> engine = Engine(init_params(config), config, num_pages=8, page_size=4,
    ...                 max_num_batched_tokens=8, max_num_seqs=2,
    ...                 attention=ragged_paged_attention_jnp)
    >>> outputs = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], max_new_tokens=3)
    >>> [len(o) for o in outputs], engine.scheduler.allocator.num_free
    ([3, 3], 8)
    """

    def __init__(
        self,
        params: dict,
        config: ModelConfig,
        *,
        num_pages: int,
        page_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        attention=None,
        mesh=None,
        enable_prefix_caching: bool = False,
        seed: int = 0,
        max_stats: int = MAX_STATS,
        token_buckets=None,
        seq_buckets=None,
        num_speculative_tokens: int = 0,
        prompt_lookup_min: int = PROMPT_LOOKUP[0],
        prompt_lookup_max: int = PROMPT_LOOKUP[1],
        async_scheduling: bool = False,
    ):
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_stats", max_stats),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise EngineError(
                    f"Engine: {name}={value!r} must be a positive int.",
                    "sizes of the engine are counts: at least 1.",
                )
        if not isinstance(config, ModelConfig):
            raise EngineError(
                f"config={config!r} must be a ModelConfig.",
                "pass the config that init_params was given.",
            )
        attention = default_attention() if attention is None else attention
        if not callable(attention):
            raise EngineError(
                f"attention={attention!r} is not callable.",
                "pass a function such as minilib.ragged_paged_attention_jnp.",
            )
        for name, value, what in (
            ("enable_prefix_caching", enable_prefix_caching, "share cached prefixes"),
            ("async_scheduling", async_scheduling, "plan a step while the one before runs"),
        ):
            if not isinstance(value, bool | np.bool_):
                raise EngineError(
                    f"Engine: {name}={value!r} must be True or False.",
                    f"pass {name}=True to {what}, or False (the default) not to.",
                )
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise EngineError(
                f"Engine: seed={seed!r} must be a non-negative int.",
                "it seeds the generator that gives seedless requests their seeds.",
            )
        check_speculative_settings(
            num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, max_num_batched_tokens
        )
        self.token_buckets = check_buckets(
            "token_buckets", [max_num_batched_tokens] if token_buckets is None else token_buckets,
            "max_num_batched_tokens", max_num_batched_tokens,
        )  # fmt: skip
        self.seq_buckets = check_buckets(
            "seq_buckets", [max_num_seqs] if seq_buckets is None else seq_buckets,
            "max_num_seqs", max_num_seqs,
        )  # fmt: skip
        self.params, self.config, self.mesh = config.check_attention_sinks(params), config, mesh
        self.page_size, self.num_pages = page_size, num_pages
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.attention = attention if mesh is None else shard_attention(attention, mesh, config)
        kernel = getattr(attention, "func", attention) is ragged_paged_attention  # or a partial
        self.kernel_writes_kv = mesh is None and kernel  # it writes the new K/V into the cache
        # More devices than KV heads: each device holds a copy of one KV head (vLLM's way).
        self.kv_head_replicas = 1 if mesh is None else kv_head_replicas(mesh, config)
        self.scheduler = Scheduler(
            num_pages=num_pages,
            page_size=page_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=bool(enable_prefix_caching),
            num_speculative_tokens=int(num_speculative_tokens),
            vocab_size=config.vocab_size,
        )
        self.num_speculative_tokens = int(num_speculative_tokens)
        if num_speculative_tokens:
            self.scheduler.propose_drafts = lambda token_ids: propose_ngram(
                token_ids,
                num_speculative_tokens=int(num_speculative_tokens),
                prompt_lookup_min=int(prompt_lookup_min),
                prompt_lookup_max=int(prompt_lookup_max),
            )
        # One pool per layer, NaN until written: a stale read shows on a page's first use.
        num_kv_heads = config.num_kv_heads * self.kv_head_replicas
        shape = (num_pages, page_size, 2 * num_kv_heads, config.head_dim)
        self.kv_pages = [nan_kv_pages(shape, config.dtype, mesh) for _ in range(config.num_layers)]
        if mesh is not None:
            self.params = shard_params(replicate_kv_heads(params, self.kv_head_replicas), mesh)
        self.requests: dict[int, Request] = {}  # every request not yet popped, finished too
        self.last_batch: PackedBatch | None = None
        self.num_steps = 0  # steps run so far; the next step's index
        self.max_stats = max_stats
        self.stats: list[StepStats] = []  # the last max_stats steps' StepStats, oldest first
        self._num_issued = 0  # request ids come from this counter: never reused
        self._unrun_plan: StepPlan | None = None  # a step's plan whose model raised
        self._seeds = np.random.default_rng(seed)
        self.seconds_waiting = 0.0  # the host's time blocked on the device's tokens
        self.async_loop = AsyncStepLoop(self) if async_scheduling else None

    # --- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt,
        max_new_tokens: int | None = None,
        *,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> int:
        """Queue one request; returns its id (ids count up from 0 and are never reused).

        Give `max_new_tokens` (greedy) or `sampling_params`. A `SamplingParams` without a
        seed gets one from the engine's generator now, kept on the request. `arrival_time`
        (seconds on `time.perf_counter`'s clock) says when the request arrived, if earlier
        than now; latency is measured from it.

        A bad request raises `EngineError` and changes nothing: the requests already queued
        or running carry on.
        """
        max_tokens, sampling = self.check_request(prompt, max_new_tokens, sampling_params)
        now = time.perf_counter()
        if arrival_time is not None and (
            isinstance(arrival_time, bool)
            or not isinstance(arrival_time, int | float | np.integer | np.floating)
            or not math.isfinite(arrival_time)
            or arrival_time > now
        ):
            raise EngineError(
                f"arrival_time={arrival_time!r} must be a time.perf_counter() reading no "
                f"later than now ({now:.3f}).",
                "leave it out to mean now, or pass the perf_counter time the request arrived.",
            )
        if sampling.seed is None:
            sampling = sampling.with_seed(int(self._seeds.integers(2**63)))
        request_id, self._num_issued = self._num_issued, self._num_issued + 1
        request = Request(
            request_id,
            [int(t) for t in prompt],
            max_tokens,
            sampling_params=sampling,
            metrics=RequestMetrics(
                arrival_time=now if arrival_time is None else float(arrival_time),
                arrival_step=self.num_steps,
            ),
        )
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def check_request(
        self, prompt, max_new_tokens=None, sampling_params=None
    ) -> tuple[int, SamplingParams]:
        """Raise `EngineError` for a request the engine can never serve. Returns its
        (max_tokens, sampling params)."""
        max_tokens, sampling = resolve_sampling_params(max_new_tokens, sampling_params, self.config)
        check_request(prompt, max_tokens, self.config)
        # The last sampled token never enters the cache: len(prompt) + max_tokens - 1.
        num_tokens = len(prompt) + max_tokens - 1
        pages_for_request = pages_needed(max(num_tokens, 0), self.page_size)
        if pages_for_request > self.num_pages:
            raise EngineError(
                f"A prompt of len(prompt)={len(prompt)} tokens with "
                f"max_tokens={max_tokens} needs {num_tokens} tokens of cache, "
                f"{pages_for_request} pages of page_size="
                f"{self.page_size}, but the whole pool is num_pages={self.num_pages} pages.",
                "shorten the prompt, ask for fewer tokens, or build the engine with more "
                "num_pages.",
            )
        return max_tokens, sampling

    def abort_request(self, request_id: int) -> None:
        """End a request now, waiting or running: its pages go back to the pool at once, and
        its output so far is kept, with finish_reason "abort". A request that has already
        finished is left as it was. An unknown id raises `EngineError`."""
        request = self._request(request_id)
        if request.finished:
            return
        self.scheduler.abort(request)
        if request.output[-1:] == [PLACEHOLDER]:  # async: the token in flight is dropped
            request.output.pop()
        self._finish(request, "abort")
        if self._unrun_plan and any(seq.request is request for seq in self._unrun_plan.seqs):
            self._unrun_plan = None  # its pages are gone: the next step plans afresh

    def request_output(self, request_id: int) -> RequestOutput:
        """What `request_id` has produced so far: tokens, finish reason, cached tokens and
        its metrics (a copy: it does not change as the engine runs on)."""
        request = self._request(request_id)
        asked = request.sampling_params.logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=tuple(request.prompt),
            token_ids=tuple(request.known_output),
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            metrics=dataclasses.replace(request.metrics),
            logprobs=tuple(map(dict, request.logprobs)) if asked else None,
        )

    def pop_finished_outputs(self) -> list[RequestOutput]:
        """The outputs of every finished request, oldest first, and forget those requests:
        call it as a server hands results back, so that a long run does not keep every
        request it ever served. Their ids stay used; asking for one later raises
        `EngineError`."""
        done = [i for i, request in self.requests.items() if request.finished]
        outputs = [self.request_output(i) for i in done]
        for i in done:
            del self.requests[i]
        return outputs

    def output(self, request_id: int) -> list[int]:
        """The tokens generated so far for `request_id`."""
        return self._request(request_id).known_output

    @property
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | None = None,
        *,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Generate for every prompt, all served together; outputs in prompt order.

        `sampling_params` is one `SamplingParams` for all prompts, or a list of one per
        prompt. Every prompt is checked before any runs: one bad prompt raises
        `EngineError`, naming it, and nothing is queued.
        """
        if isinstance(sampling_params, list | tuple):
            if len(sampling_params) != len(prompts):
                raise EngineError(
                    f"{len(sampling_params)} sampling_params for {len(prompts)} prompts.",
                    "give one SamplingParams for all prompts, or a list of one per prompt.",
                )
            each = list(sampling_params)
        else:
            each = [sampling_params] * len(prompts)
        for i, (prompt, params) in enumerate(zip(prompts, each, strict=True)):
            try:
                self.check_request(prompt, max_new_tokens, params)
            except EngineError as err:
                raise EngineError(f"prompts[{i}]: {err.message}", err.hint) from None
        ids = [
            self.add_request(prompt, max_new_tokens, sampling_params=params)
            for prompt, params in zip(prompts, each, strict=True)
        ]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        return [self.output(i) for i in ids]

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> StepStats:
        """Schedule, pack, run the model, sample, free: one step of continuous batching.

        Raises `EngineError`, and changes nothing, when there are requests but none can run:
        nothing runs, and the admission rule refused the first waiting request.

        When the model raises (a learner's attention, say), the error goes to the caller and the
        step does not count: the KV cache is as it was (with `kernel_writes_kv`, but for this
        step's own slots, written again when it runs), no token is recorded, and `num_steps`,
        `stats` and the requests' metrics do not move. The scheduler has made the plan already
        (admitted, preempted, taken pages), so the plan is kept, and the next `step()` runs it
        again instead of planning anew (unless one of its requests was aborted in between).

        With `async_scheduling`, the step also plans and launches the next one before it
        reads its own tokens (`minilib.engine.async_scheduling.AsyncStepLoop.step`).
        """
        if self.async_loop is not None:
            return self.async_loop.step()
        plan = self.plan()
        started = time.perf_counter()
        sampled, logprobs = self.read_tokens(plan, self.launch(plan))
        finished = self.scheduler.finish_step(plan, sampled)
        return self.record_step(plan, started, sampled, logprobs, finished)

    def plan(self, in_flight: bool = False) -> StepPlan:
        """The next step's plan: the plan whose model raised, or the scheduler's. Raises
        `EngineError` when there are requests but none can run (and no step is `in_flight`,
        whose tokens would let them)."""
        plan = self._unrun_plan or self.scheduler.schedule()
        if not plan.seqs and self.has_unfinished and not in_flight:
            raise self.scheduler.stuck_error()  # schedule() changed nothing
        return plan

    def launch(self, plan: StepPlan, fill_tokens=None):
        """Pack `plan`, padded to the step's buckets, and dispatch the model on it; JAX
        returns at once, the device still running. `fill_tokens(batch)` may swap in token
        ids that are still on the device (async scheduling). Returns the device's
        (tokens i32[S, k + 1], num_accepted i32[S], logprob rows), or None for no sequence."""
        if not plan.seqs:
            return None
        self._unrun_plan = plan  # until the model has run
        batch = pack_batch(
            plan,
            max_num_batched_tokens=bucket_for(
                sum(q.num_tokens for q in plan.seqs), self.token_buckets
            ),
            max_num_seqs=bucket_for(len(plan.seqs), self.seq_buckets),
            num_pages=self.num_pages,
            page_size=self.page_size,
            num_speculative_tokens=self.num_speculative_tokens,
        )
        self.last_batch = batch  # kept for reading: what the model saw in the last step
        draws = step_draws(plan, batch.sample_rows.shape, self.config.vocab_size)
        model_batch = batch if fill_tokens is None else fill_tokens(batch)
        kv_pages, outputs = self._forward(model_batch, draws)
        self.kv_pages = kv_pages  # only now: a step that raised leaves the cache as it was
        self._unrun_plan = None
        return outputs

    def read_tokens(self, plan: StepPlan, outputs) -> tuple[dict, dict]:
        """Wait for the device, and read `launch`'s outputs: {request_id: its new tokens}
        for every sequence that reached its last token (one token, or its kept drafts and
        one more), and {request_id: [logprobs entry per new token]} for those of them that
        asked for logprobs (`top_logprobs`). The wait adds to `seconds_waiting`."""
        if outputs is None:
            return {}, {}
        waited = time.perf_counter()
        tokens, num_accepted, rows = jax.block_until_ready(outputs)
        self.seconds_waiting += time.perf_counter() - waited
        tokens, num_accepted = np.asarray(tokens), np.asarray(num_accepted)
        sampled, logprobs = {}, {}
        for i, seq in enumerate(plan.seqs):
            if seq.samples:
                request = seq.request
                new = tokens[i, : num_accepted[i] + 1].tolist()
                sampled[request.request_id] = new
                k = request.sampling_params.logprobs
                if k is not None:
                    rows = np.asarray(rows)  # once: indexing on the device compiles per index
                    logprobs[request.request_id] = [
                        top_logprobs(rows[i, j], t, k) for j, t in enumerate(new)
                    ]
        return sampled, logprobs

    def record_step(self, plan, started, sampled, logprobs, finished) -> StepStats:
        """The step is done, its tokens recorded (`sampled`: those kept) and `finished`
        released: the requests' logprobs and metrics, the step's `StepStats`, one more step."""
        step = self.num_steps
        for seq in plan.seqs:
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time, metrics.first_scheduled_step = started, step
        for request_id, entries in logprobs.items():
            request = self.requests[request_id]
            request.logprobs += entries[: len(request.output) - len(request.logprobs)]
        ended = time.perf_counter()
        for seq in plan.seqs:
            metrics, sampled_now = seq.request.metrics, seq.request.request_id in sampled
            if sampled_now and metrics.first_token_time is None:
                metrics.first_token_time, metrics.first_token_step = ended, step
            if sampled_now:
                metrics.last_token_time, metrics.last_token_step = ended, step
        for request in finished:
            request.metrics.finished_time, request.metrics.finished_step = ended, step
        stats = step_stats(step, plan, self.scheduler, finished, sampled)
        self.stats.append(stats)
        del self.stats[: -self.max_stats]  # keep the last max_stats steps only
        self.num_steps += 1
        return stats

    def _forward(self, batch: PackedBatch, draws: tuple):
        """Every layer on `batch`: K/V of the new rows into the pages, attention, the MLP;
        then each sequence's next tokens: the logits of its sample rows, stop tokens banned
        until min_tokens, its drafts verified (`rejection_sample`; with no drafts, one draw
        as `sample_tokens` makes it). Returns (the new kv_pages, (tokens i32[S, k + 1],
        num_accepted i32[S], each row's log-probabilities, log_softmax of its logits))."""
        metadata = (batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs)
        x = embed_tokens(self.params, batch.tokens)
        kv_pages = list(self.kv_pages)
        for i, layer in enumerate(self.params["layers"]):
            q, k, v = attention_inputs(layer, self.config, x, batch.positions)
            options = self.config.attention_args(layer)
            if self.kernel_writes_kv:  # the kernel writes k and v; the old cache is donated
                kv = dict(new_keys=k, new_values=v)
                attn, self.kv_pages[i] = self.attention(q, kv_pages[i], *metadata, **options, **kv)
                kv_pages[i] = self.kv_pages[i]
            else:
                kv_pages[i] = write_tokens(kv_pages[i], batch.page_ids, batch.slot_ids, k, v)
                attn = self.attention(q, kv_pages[i], *metadata, **options)
            x = attention_output_and_mlp(layer, x, attn)
        keys, first_indices, temperature, top_k, top_p, banned = draws
        logits, logprobs = logits_at(self.params, x, batch.sample_rows, banned)
        tokens, num_accepted = rejection_sample(
            logits, batch.drafts, batch.num_drafts, keys, first_indices, temperature, top_k,
            top_p,
        )  # fmt: skip
        return kv_pages, (tokens, num_accepted, logprobs)

    def warm_up(self) -> int:
        """Compile every shape a step can take before any request runs, as vLLM on TPU does
        at start-up: each (token bucket, sequence bucket) pair a step can reach
        (`minilib.engine.buckets.reachable_shapes`), on an all-padding batch, which writes
        nothing to the cache. Returns how many shapes it ran."""
        shapes = reachable_shapes(self.token_buckets, self.seq_buckets, self.max_num_seqs)
        empty = StepPlan((), (), ())
        for num_tokens, num_seqs in shapes:
            batch = pack_batch(
                empty,
                max_num_batched_tokens=num_tokens,
                max_num_seqs=num_seqs,
                num_pages=self.num_pages,
                page_size=self.page_size,
                num_speculative_tokens=self.num_speculative_tokens,
            )
            jax.block_until_ready(
                self._forward(
                    batch, step_draws(empty, batch.sample_rows.shape, self.config.vocab_size)
                )
            )
        return len(shapes)

    def _request(self, request_id) -> Request:
        is_id = isinstance(request_id, int | np.integer) and not isinstance(request_id, bool)
        if is_id and request_id in self.requests:
            return self.requests[request_id]
        if not is_id:
            why = "request ids are the ints that add_request returns"
        elif 0 <= request_id < self._num_issued:
            why = "it finished and pop_finished_outputs() has forgotten it"
        elif self._num_issued:
            why = f"the engine has issued ids 0 .. {self._num_issued - 1} only"
        else:
            why = "the engine has issued no ids yet"
        raise EngineError(
            f"request_id={request_id!r} is not a request of this engine: {why}.",
            "use an id that add_request returned, before its output was popped.",
        )

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.metrics.finished_time = time.perf_counter()
        request.metrics.finished_step = self.num_steps
