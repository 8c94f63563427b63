"""What the engine tells a caller: about a request, `RequestOutput` and its `RequestMetrics`;
about a step, `StepStats`.

The names are vLLM's (`vllm.outputs.RequestOutput`, `RequestMetrics`), flattened to one
sequence per request. Latency, as serving measures it:

    time to first token (TTFT)   first_token_time - arrival_time: queueing, then the prefill
    time per output token (TPOT) (last_token_time - first_token_time) / (num tokens - 1): decode
    queue time                   first_scheduled_time - arrival_time

Each time is kept twice: in seconds (`time.perf_counter`), and in engine steps (the index of
the step in which it happened). Seconds depend on the machine; steps depend only on the
scheduler, so they compare runs across machines.
"""

from __future__ import annotations

import dataclasses

__all__ = ["FINISH_REASONS", "RequestMetrics", "RequestOutput", "StepStats", "step_stats"]

# Why a request ended: a stop token, max_tokens reached, or abort_request. (vLLM's names.)
FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass
class RequestMetrics:
    """When a request arrived, was first scheduled, got its first and its latest token, and
    finished.

    Times are seconds (`time.perf_counter`); `*_step` fields are engine step indices (the
    step in which it happened; `arrival_step` is the first step that could run it). None:
    not yet. An aborted request's `finished_step` is the step that would have run next.
    TPOT is measured between token timestamps, first to last, as vLLM does: the time an
    aborted request then waited for nothing does not count.

    >>> m = RequestMetrics(arrival_time=1.0, arrival_step=0, first_scheduled_time=1.5,
    ...                    first_scheduled_step=2, first_token_time=2.0, first_token_step=3,
    ...                    last_token_time=3.0, last_token_step=7,
    ...                    finished_time=3.0, finished_step=7)
    >>> m.time_to_first_token, m.time_in_queue, m.time_per_output_token(num_tokens=5)
    (1.0, 0.5, 0.25)
    >>> m.steps_to_first_token, m.steps_per_output_token(num_tokens=5)
    (4, 1.0)
    """

    arrival_time: float
    arrival_step: int
    first_scheduled_time: float | None = None
    first_scheduled_step: int | None = None
    first_token_time: float | None = None
    first_token_step: int | None = None
    last_token_time: float | None = None
    last_token_step: int | None = None
    finished_time: float | None = None
    finished_step: int | None = None

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to the first step that ran it."""
        return _since(self.arrival_time, self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT, seconds from arrival to the end of the step that sampled its first token."""
        return _since(self.arrival_time, self.first_token_time)

    @property
    def steps_to_first_token(self) -> int | None:
        """TTFT in steps: how many steps ran from its arrival to its first token, that one
        included."""
        steps = _since(self.arrival_step, self.first_token_step)
        return None if steps is None else steps + 1

    def time_per_output_token(self, num_tokens: int) -> float | None:
        """TPOT, seconds per token after the first, from the first token to the last (None
        with fewer than two tokens)."""
        return _per_token(self.first_token_time, self.last_token_time, num_tokens)

    def steps_per_output_token(self, num_tokens: int) -> float | None:
        """TPOT in steps: 1.0 when the request decoded in every step from its first token to
        its last."""
        return _per_token(self.first_token_step, self.last_token_step, num_tokens)


def _since(start, end):
    """`end - start`, in seconds or in steps; None while `end` has not happened."""
    return None if end is None else end - start


def _per_token(first_token, last_token, num_tokens: int) -> float | None:
    """The time (or steps) from the first token to the last, per token after the first;
    None until both happened, or with fewer than two tokens."""
    if first_token is None or last_token is None or num_tokens < 2:
        return None
    return (last_token - first_token) / (num_tokens - 1)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One request as the engine sees it now: its tokens so far, why it ended (None while
    it runs), how many prompt tokens came from the prefix cache, and its metrics.

    `logprobs` is None unless the request's `SamplingParams.logprobs` is an int k; then it
    holds one dict per token of `token_ids`, {token id: log-probability}: the sampled
    token's, then the k most likely tokens' (as vLLM's `CompletionOutput.logprobs`).

    >>> out = RequestOutput(request_id=3, prompt_token_ids=(1, 2), token_ids=(7, 9),
    ...                     finish_reason="length", num_cached_tokens=0,
    ...                     metrics=RequestMetrics(arrival_time=0.0, arrival_step=0))
    >>> out.finished, out.token_ids
    (True, (7, 9))
    """

    request_id: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_cached_tokens: int
    metrics: RequestMetrics
    logprobs: tuple[dict[int, float], ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one step did, and the state it left.

    `batch` lists the step's sequences in batch order as (request_id, kind, num_tokens),
    kind 'prefill' or 'decode'. After the step: `page_tables` holds each running request's
    (request_id, pages), its row of `page_indices`; `page_owners` gives, page by page, the
    requests holding it: () for a free page, two or more for a page shared through the
    prefix cache. `cached_pages` are the pages holding a cached full page (in use or free),
    and `num_cached_tokens` the prompt tokens that this step's admissions found there.
    With speculative decoding, `num_draft_tokens` drafts were verified in the step and
    `num_accepted_tokens` of them kept (vLLM's names); a decode sequence's num_tokens counts
    its drafts.

    >>> stats = StepStats(step=3, num_prefill_tokens=5, num_decode_tokens=2, num_pages_used=4,
    ...                   num_waiting=0, num_running=3, preempted=(), admitted=(2,),
    ...                   finished=(), batch=((0, "decode", 1), (1, "decode", 1),
    ...                   (2, "prefill", 5)), page_owners=((0, 2), (1,), (2,), (2,), ()))
    >>> stats.num_tokens, stats.num_preempted, stats.shared_pages   # page 0: r0 and r2
    (7, 0, (0,))
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
    page_owners: tuple[tuple[int, ...], ...]
    cached_pages: tuple[int, ...] = ()
    num_cached_tokens: int = 0
    page_tables: tuple[tuple[int, tuple[int, ...]], ...] = ()
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def shared_pages(self) -> tuple[int, ...]:
        """Pages that two or more requests hold."""
        return tuple(page for page, owners in enumerate(self.page_owners) if len(owners) > 1)


def step_stats(step: int, plan, scheduler, finished: list, sampled: dict) -> StepStats:
    """The `StepStats` of step `step`, which ran `plan` (a `StepPlan`) and has been recorded:
    `sampled` holds the tokens kept, {request_id: tokens}, and `finished` the requests that
    ended; `scheduler` is the state it left.

    >>> from minilib.engine.scheduler import Request, Scheduler
    >>> s = Scheduler(num_pages=4, page_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    >>> s.add(Request(0, prompt=[1, 2, 3], max_new_tokens=2))
    >>> plan = s.schedule()
    >>> stats = step_stats(0, plan, s, [], {0: [7]})
    >>> stats.batch, stats.num_prefill_tokens, stats.page_tables
    (((0, 'prefill', 3),), 3, ((0, (0,)),))
    """
    decode = sum(seq.num_tokens for seq in plan.seqs if seq.kind == "decode")
    allocator = scheduler.allocator
    return StepStats(
        step=step,
        num_prefill_tokens=sum(seq.num_tokens for seq in plan.seqs) - decode,
        num_decode_tokens=decode,
        num_pages_used=allocator.num_used,
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        preempted=plan.preempted,
        admitted=plan.admitted,
        finished=tuple(r.request_id for r in finished),
        batch=tuple((s.request.request_id, s.kind, s.num_tokens) for s in plan.seqs),
        page_owners=scheduler.page_owners,
        cached_pages=getattr(allocator, "cached_pages", ()),
        num_cached_tokens=plan.num_cached_tokens,
        page_tables=tuple((r.request_id, tuple(r.pages)) for r in scheduler.running),
        num_draft_tokens=sum(len(seq.draft_token_ids) for seq in plan.seqs),
        num_accepted_tokens=sum(
            len(sampled[seq.request.request_id]) - 1
            for seq in plan.seqs
            if seq.draft_token_ids and seq.request.request_id in sampled
        ),
    )
