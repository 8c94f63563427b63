"""Async scheduling: the host plans step n + 1 while the device runs step n.

A synchronous step plans, launches the model, waits for its tokens and records them; while
the host plans, the device is idle, and while the device runs, the host waits. JAX returns
from a dispatch at once, with the device still working, so the host can do the next step's
planning in that time, as vLLM's `AsyncScheduler` does. `AsyncStepLoop.step`:

  1. plans step n + 1 while step n is in flight, and launches it (queued behind step n);
  2. waits for step n's tokens and records them;
  3. counts step n + 1's tokens as computed, each of its sampled tokens a placeholder.

The plan of step n + 1 cannot know the tokens step n samples. So, as vLLM does:

  * each request in step n that samples gets a `PLACEHOLDER` token at the end of its output
    (`add_placeholders`), and step n + 1 decodes it: its id is copied on the device from step
    n's sampled tokens (`take_sampled`), so the host never waits for it;
  * a request whose step-n token is its last (max_new_tokens) sits step n + 1 out, and with
    speculative decoding so does every request with a token in flight: its drafts come from
    its tokens (`Scheduler.awaits_tokens`);
  * when step n's tokens arrive (`record_tokens`), a request that sampled a stop token ends;
    the token step n + 1 samples for it is dropped, as is an aborted request's;
  * a request that step n + 1's plan preempted gets its step-n tokens in the waiting queue;
    no request is admitted in a step that preempts, so it runs again only after they arrive.

Each request's draws are its own (seed and token index, `minilib.engine.sampling`), and the
model's rows do not depend on their neighbours in the batch, so the tokens are those of
synchronous scheduling, though the steps may be formed differently.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from minilib.engine.packing import PackedBatch
from minilib.engine.scheduler import PLACEHOLDER, Request, Scheduler, StepPlan

__all__ = [
    "AsyncStepLoop",
    "add_placeholders",
    "record_tokens",
    "take_sampled",
]


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A step launched whose tokens are not read yet: its plan, the device's outputs
    (tokens i32[S, k + 1], num_accepted i32[S], logprob rows; None for no sequence) and the
    time it was launched."""

    plan: StepPlan
    outputs: tuple | None
    started: float


@jax.jit
def take_sampled(tokens, sources, sampled):
    """tokens i32[T], each row with a source slot (sources i32[T], -1 for none) replaced by
    the first token that slot sampled (sampled i32[S, k + 1]), on the device.

    >>> take_sampled(jnp.array([5, -1, 7]), jnp.array([-1, 1, -1]),
    ...              jnp.array([[3, 0], [4, 0]])).tolist()
    [5, 4, 7]
    """
    return jnp.where(sources >= 0, sampled[sources, 0], tokens)


def placeholder_sources(batch: PackedBatch, plan: StepPlan, previous: StepPlan) -> np.ndarray:
    """i32[T]: for each row of `batch` that holds a placeholder, the slot of `previous` (the
    step in flight) that samples its token; -1 elsewhere. A placeholder is always the last
    token of its sequence, and decoded alone (never with drafts)."""
    slots = {seq.request.request_id: i for i, seq in enumerate(previous.seqs)}
    sources = np.full(batch.tokens.shape, -1, np.int32)
    for i, seq in enumerate(plan.seqs):
        if seq.request.output[-1:] == [PLACEHOLDER]:
            sources[batch.cu_q_lens[i + 1] - 1] = slots[seq.request.request_id]
    return sources


def fill_placeholders(batch: PackedBatch, plan: StepPlan, previous: InFlight) -> PackedBatch:
    """`batch` of `plan`, its placeholder tokens taken from the tokens that `previous`, the
    step in flight, samples: a device array, read by the model without waiting for it."""
    sources = placeholder_sources(batch, plan, previous.plan)
    tokens = take_sampled(batch.tokens, sources, previous.outputs[0])
    return dataclasses.replace(batch, tokens=tokens)


def add_placeholders(plan: StepPlan) -> None:
    """A step is launched: count its tokens as computed, and give every sequence that samples
    a placeholder for its token (vLLM: `_update_after_schedule`). Requests that ended while
    the step was in flight are skipped.

    >>> from minilib.engine.scheduler import Scheduler
    >>> s = Scheduler(num_pages=4, page_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    >>> s.add(Request(0, prompt=[5, 6, 7], max_new_tokens=3))
    >>> add_placeholders(s.schedule())
    >>> r = s.running[0]
    >>> r.output, r.num_computed, s.schedule().seqs[0].kind   # it decodes the placeholder
    ([-1], 3, 'decode')
    """
    for seq in plan.seqs:
        request = seq.request
        if request.finished:
            continue
        request.num_computed = seq.start + seq.num_tokens
        if seq.samples:
            request.output.append(PLACEHOLDER)


def record_tokens(scheduler: Scheduler, plan: StepPlan, sampled: dict) -> tuple[list, dict]:
    """Step `plan`'s tokens have arrived (`sampled`, {request_id: tokens}): each replaces
    its request's placeholder, and `Scheduler.finish_step` records them. A request that ended
    while the step ran gets nothing; one preempted since, its tokens in the waiting queue.
    Returns (the requests that finished, the tokens kept).

    >>> s = Scheduler(num_pages=4, page_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    >>> s.add(Request(0, prompt=[5, 6, 7], max_new_tokens=3))
    >>> plan = s.schedule()
    >>> add_placeholders(plan)
    >>> finished, kept = record_tokens(s, plan, {0: [9]})
    >>> s.running[0].output, s.running[0].num_computed, kept
    ([9], 3, {0: [9]})
    """
    kept = {}
    for seq in plan.seqs:
        request = seq.request
        if seq.samples and not request.finished:
            request.output.pop()  # the placeholder
            kept[request.request_id] = sampled[request.request_id]
    running = tuple(seq for seq in plan.seqs if seq.request in scheduler.running)
    finished = scheduler.finish_step(StepPlan(running, (), ()), kept)
    for seq in plan.seqs:
        if seq.request in scheduler.waiting and seq.request.request_id in kept:
            if record_while_waiting(seq.request, kept[seq.request.request_id], scheduler):
                finished.append(seq.request)
    return finished, kept


def record_while_waiting(request: Request, tokens: list[int], scheduler: Scheduler) -> bool:
    """Record the tokens of a request preempted while they were in flight; if that ends it,
    it leaves the waiting queue (it holds no pages). Returns whether it ended."""
    for token in tokens:
        if not request.finished:
            request.record_token(token)
    if request.finished:
        scheduler.waiting.remove(request)
    return request.finished


class AsyncStepLoop:
    """The step loop of `Engine(..., async_scheduling=True)`: one step always in flight.

    `num_overlapped` counts the steps that were still running on the device when the host
    had planned and launched the next one: the steps whose successor's planning was hidden.

    >>> from minilib.engine import Engine, ModelConfig, init_params
    >>> config = ModelConfig(vocab_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
    ...                      head_dim=32)
    >>> def engine(**kw):
    ...     return Engine(init_params(config), config, num_pages=8, page_size=4,
    ...                   max_num_batched_tokens=8, max_num_seqs=2, **kw)
    >>> prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    >>> engine(async_scheduling=True).generate(prompts, 5) == engine().generate(prompts, 5)
    True
    """

    def __init__(self, engine):
        self.engine = engine
        self.in_flight: InFlight | None = None
        self.num_overlapped = 0

    def step(self):
        """Plan and launch the next step, then read and record the one in flight; returns
        the recorded step's `StepStats`. With no step in flight, one is launched first."""
        engine = self.engine
        if self.in_flight is None:
            self.in_flight = self.launch(engine.plan(), previous=None)
            add_placeholders(self.in_flight.plan)
        current = self.in_flight
        plan = engine.plan(in_flight=True)  # step n + 1, while step n runs
        self.in_flight = self.launch(plan, previous=current) if plan.seqs else None
        sampled, logprobs = engine.read_tokens(current.plan, current.outputs)
        finished, kept = record_tokens(engine.scheduler, current.plan, sampled)
        if self.in_flight is not None:
            add_placeholders(self.in_flight.plan)
        return engine.record_step(current.plan, current.started, kept, logprobs, finished)

    def launch(self, plan: StepPlan, previous: InFlight | None) -> InFlight:
        """Launch `plan`, its placeholders filled on the device from `previous`'s tokens."""
        started = time.perf_counter()
        if previous is None or previous.outputs is None:
            return InFlight(plan, self.engine.launch(plan), started)
        fill = functools.partial(fill_placeholders, plan=plan, previous=previous)
        outputs = self.engine.launch(plan, fill)
        self.num_overlapped += not previous.outputs[0].is_ready()
        return InFlight(plan, outputs, started)
