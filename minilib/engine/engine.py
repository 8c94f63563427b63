"""The engine: continuous batching of many requests on one paged KV cache.

Each `Engine.step()`:

  1. asks the `Scheduler` for this step's sequences (admitting, allocating pages, preempting);
  2. packs their new tokens into one ragged batch (`pack_batch`): token ids, positions,
     where each token's K/V goes in the pool, and the four index arrays of ragged paged
     attention (`kv_lens`, `page_indices`, `cu_q_lens`, `num_seqs`);
  3. runs the model layer by layer: K/V of the new tokens into the pages with the cache's
     jitted scatter (`write_tokens`), then the chosen attention implementation;
  4. samples greedily from the last row of every sequence that reached its end;
  5. records the tokens, and frees the pages of finished requests.

Every array the model sees has a fixed size (`max_num_batched_tokens` rows, `max_num_seqs`
sequence slots, `num_pages` pages per sequence), so each jitted piece compiles once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from minilib.engine.model import (
    ModelConfig,
    attention_inputs,
    attention_output_and_mlp,
    check_request,
    embed_tokens,
    final_logits,
)
from minilib.engine.scheduler import Request, Scheduler, StepPlan
from minilib.engine.sharding import shard_attention, shard_kv_pages, shard_params
from minilib.errors import EngineError
from minilib.kv_cache import pages_needed, write_tokens
from minilib.reference import ref_ragged_paged_attention

__all__ = ["Engine", "PackedBatch", "StepStats", "pack_batch"]


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one step did, and the state it left.

    `batch` lists the step's sequences in batch order as (request_id, kind, num_tokens),
    kind 'prefill' or 'decode'; `page_owners` gives, page by page, the request that owns it
    (None: free).

    >>> stats = StepStats(step=3, num_prefill_tokens=5, num_decode_tokens=2, num_pages_used=4,
    ...                   num_waiting=0, num_running=3, preempted=(), admitted=(2,),
    ...                   finished=(), batch=((0, "decode", 1), (1, "decode", 1),
    ...                   (2, "prefill", 5)), page_owners=(0, 1, 2, 2, None))
    >>> stats.num_tokens, stats.num_preempted    # a step of two decodes and one prefill
    (7, 0)
    """

    step: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_pages_used: int
    num_waiting: int
    num_running: int
    preempted: tuple[int, ...]
    admitted: tuple[int, ...]
    finished: tuple[int, ...]
    batch: tuple[tuple[int, str, int], ...]
    page_owners: tuple[int | None, ...]

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One step's inputs, padded to fixed sizes.  T = max_num_batched_tokens.

    >>> from minilib.engine.scheduler import StepPlan
    >>> empty = pack_batch(StepPlan((), (), ()), max_num_batched_tokens=4, max_num_seqs=2,
    ...                    num_pages=3, page_size=4)
    >>> empty.page_ids.tolist(), empty.cu_q_lens.tolist(), empty.num_seqs.tolist()  # all padding
    ([3, 3, 3, 3], [0, 0, 0], [0])
    """

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T], each row's position in its sequence
    page_ids: np.ndarray  # i32[T], where each row's K/V goes (num_pages for padding: dropped)
    slot_ids: np.ndarray  # i32[T]
    kv_lens: np.ndarray  # i32[max_num_seqs]
    page_indices: np.ndarray  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: np.ndarray  # i32[max_num_seqs + 1]
    num_seqs: np.ndarray  # i32[1]
    sample_rows: np.ndarray  # i32[max_num_seqs], the last row of each sequence (0 if unused)


def pack_batch(
    plan: StepPlan,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    num_pages: int,
    page_size: int,
) -> PackedBatch:
    """Lay the step's sequences out one after another: prefill chunks and decode tokens of
    many requests in one ragged batch.

    >>> from minilib.engine.scheduler import Request, StepPlan, schedule_tokens
    >>> a = Request(0, prompt=[5, 6, 7], max_new_tokens=1, pages=[3])
    >>> b = Request(1, prompt=[8], max_new_tokens=2, output=[9], pages=[0], num_computed=1)
    >>> plan = StepPlan((schedule_tokens(a, 3), schedule_tokens(b, 1)), (), ())
    >>> batch = pack_batch(plan, max_num_batched_tokens=6, max_num_seqs=3, num_pages=4,
    ...                    page_size=4)
    >>> batch.tokens.tolist(), batch.positions.tolist(), batch.page_ids.tolist()
    ([5, 6, 7, 9, 0, 0], [0, 1, 2, 1, 0, 0], [3, 3, 3, 0, 4, 4])
    >>> batch.kv_lens.tolist(), batch.cu_q_lens.tolist(), batch.num_seqs.tolist()
    ([3, 2, 0], [0, 3, 4, 4], [2])
    """
    t, s = max_num_batched_tokens, max_num_seqs
    tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
    page_ids, slot_ids = np.full(t, num_pages, np.int32), np.zeros(t, np.int32)
    kv_lens, cu_q_lens = np.zeros(s, np.int32), np.zeros(s + 1, np.int32)
    page_indices, sample_rows = np.zeros((s, num_pages), np.int32), np.zeros(s, np.int32)
    for i, seq in enumerate(plan.seqs):
        row, end = cu_q_lens[i], cu_q_lens[i] + seq.num_tokens
        new_positions = np.arange(seq.start, seq.start + seq.num_tokens)
        tokens[row:end] = seq.request.tokens[seq.start : seq.start + seq.num_tokens]
        positions[row:end] = new_positions
        pages = np.asarray(seq.request.pages, np.int32)
        page_ids[row:end] = pages[new_positions // page_size]  # token t: page t // page_size
        slot_ids[row:end] = new_positions % page_size  # ... at slot t % page_size
        kv_lens[i] = seq.start + seq.num_tokens
        page_indices[i, : len(pages)] = pages
        cu_q_lens[i + 1] = end
        sample_rows[i] = end - 1
    cu_q_lens[len(plan.seqs) + 1 :] = cu_q_lens[len(plan.seqs)]
    num_seqs = np.array([len(plan.seqs)], np.int32)
    return PackedBatch(
        tokens,
        positions,
        page_ids,
        slot_ids,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sample_rows,
    )


@jax.jit
def greedy_tokens(params: dict, x: jax.Array, rows: jax.Array) -> jax.Array:  # i32[len(rows)]
    """The most likely next token after each of `rows` of the final activations x."""
    return jnp.argmax(final_logits(params, x[rows]), axis=-1)


class Engine:
    """A continuous-batching engine on a paged KV cache.

    Args:
      params, config: the model (`init_params`, `ModelConfig`).
      num_pages, page_size: the page pool, shared by all requests and all layers' caches.
      max_num_batched_tokens: the token budget of one step (prefill chunks + decode tokens).
      max_num_seqs: at most this many requests run at once.
      attention: any function with the signature of JAX's ragged paged attention that
        returns an array shaped like q (as all of minilib's do).
      mesh: None, or a `jax.sharding.Mesh` with one axis "kv_heads": attention and the KV
        cache are split by KV head over its devices (see `minilib.engine.sharding`).

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
        attention=ref_ragged_paged_attention,
        mesh=None,
    ):
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
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
        if not callable(attention):
            raise EngineError(
                f"attention={attention!r} is not callable.",
                "pass a function such as minilib.ragged_paged_attention_jnp.",
            )
        self.params, self.config, self.mesh = params, config, mesh
        self.page_size, self.num_pages = page_size, num_pages
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.attention = attention if mesh is None else shard_attention(attention, mesh, config)
        self.scheduler = Scheduler(
            num_pages=num_pages,
            page_size=page_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        )
        # One pool per layer, NaN until written: a read of a slot no token owns shows at once.
        shape = (num_pages, page_size, 2 * config.num_kv_heads, config.head_dim)
        self.kv_pages = [jnp.full(shape, jnp.nan, config.dtype) for _ in range(config.num_layers)]
        if mesh is not None:
            self.kv_pages = [shard_kv_pages(pages, mesh) for pages in self.kv_pages]
            self.params = shard_params(params, mesh)
        self.requests: dict[int, Request] = {}
        self.last_batch: PackedBatch | None = None
        self.stats: list[StepStats] = []

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, prompt, max_new_tokens: int) -> int:
        """Queue one request; returns its id. A bad request raises `EngineError` and changes
        nothing: the requests already queued or running carry on."""
        self.check_request(prompt, max_new_tokens)
        request = Request(len(self.requests), [int(t) for t in prompt], int(max_new_tokens))
        self.requests[request.request_id] = request
        if request.finished:  # max_new_tokens == 0: nothing to do
            return request.request_id
        self.scheduler.add(request)
        return request.request_id

    def check_request(self, prompt, max_new_tokens: int) -> None:
        """Raise `EngineError` for a request the engine can never serve."""
        check_request(prompt, max_new_tokens, self.config)
        # The last sampled token never enters the cache: len(prompt) + max_new_tokens - 1.
        num_tokens = len(prompt) + max_new_tokens - 1
        pages_for_request = pages_needed(num_tokens, self.page_size)
        if pages_for_request > self.num_pages:
            raise EngineError(
                f"A prompt of len(prompt)={len(prompt)} tokens with "
                f"max_new_tokens={max_new_tokens} needs {num_tokens} tokens of cache, "
                f"{pages_for_request} pages of page_size="
                f"{self.page_size}, but the whole pool is num_pages={self.num_pages} pages.",
                "shorten the prompt, ask for fewer tokens, or build the engine with more "
                "num_pages.",
            )

    def output(self, request_id: int) -> list[int]:
        """The tokens generated so far for `request_id`."""
        return list(self.requests[request_id].output)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generation of every prompt, all served together; outputs in prompt order.

        Every prompt is checked before any runs: one bad prompt raises `EngineError`, naming
        it, and nothing is queued.
        """
        for i, prompt in enumerate(prompts):
            try:
                self.check_request(prompt, max_new_tokens)
            except EngineError as err:
                raise EngineError(f"prompts[{i}]: {err.message}", err.hint) from None
        ids = [self.add_request(prompt, max_new_tokens) for prompt in prompts]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        return [self.output(i) for i in ids]

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> StepStats:
        """Schedule, pack, run the model, sample, free: one step of continuous batching."""
        plan = self.scheduler.schedule()
        if not plan.seqs and self.has_unfinished:
            raise RuntimeError(
                f"No request could be scheduled: {len(self.scheduler.waiting)} waiting, "
                f"{len(self.scheduler.running)} running, "
                f"{self.scheduler.allocator.num_free} of {self.num_pages} pages free. "
                "The admission rule refused every waiting request."
            )
        sampled = self.run_model(plan) if plan.seqs else {}
        finished = self.scheduler.finish_step(plan, sampled)
        stats = self._stats(plan, finished)
        self.stats.append(stats)
        return stats

    def run_model(self, plan: StepPlan) -> dict[int, int]:
        """The model on one packed batch. Returns {request_id: next token} for every sequence
        that reached its last token."""
        batch = pack_batch(
            plan,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            num_pages=self.num_pages,
            page_size=self.page_size,
        )
        self.last_batch = batch  # kept for reading: what the model saw in the last step
        metadata = (batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs)
        x = embed_tokens(self.params, batch.tokens)
        kv_pages = list(self.kv_pages)
        for i, layer in enumerate(self.params["layers"]):
            q, k, v = attention_inputs(layer, self.config, x, batch.positions)
            kv_pages[i] = write_tokens(kv_pages[i], batch.page_ids, batch.slot_ids, k, v)
            attn = self.attention(q, kv_pages[i], *metadata, sm_scale=self.config.sm_scale)
            x = attention_output_and_mlp(layer, x, attn)
        tokens = np.asarray(greedy_tokens(self.params, x, batch.sample_rows))
        self.kv_pages = kv_pages  # only now: a step that raised leaves the cache as it was
        return {
            seq.request.request_id: int(tokens[i]) for i, seq in enumerate(plan.seqs) if seq.samples
        }

    def _stats(self, plan: StepPlan, finished: list[Request]) -> StepStats:
        decode = sum(seq.num_tokens for seq in plan.seqs if seq.kind == "decode")
        prefill = sum(seq.num_tokens for seq in plan.seqs) - decode
        allocator = self.scheduler.allocator
        return StepStats(
            step=len(self.stats),
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            num_pages_used=allocator.num_used,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            preempted=plan.preempted,
            admitted=plan.admitted,
            finished=tuple(r.request_id for r in finished),
            batch=tuple((s.request.request_id, s.kind, s.num_tokens) for s in plan.seqs),
            page_owners=allocator.owners,
        )
