"""The scheduler: which requests run in the next step, with how many tokens each.

A request's tokens are its prompt followed by what it has generated so far. Its K/V is in
the cache for the first `num_computed` of them; the rest still have to go through the model:

    prefill   the prompt, in chunks of at most the step's token budget
    decode    one token: the one sampled in the previous step

One step of `Scheduler.schedule`, in order:

  1. Running requests first, oldest first. Each gets as many of its new tokens as the token
     budget (`max_num_batched_tokens`) has left, and the pages to hold them. When the pool is
     out of pages, the newest running request is *preempted*: its pages go back to the pool,
     it forgets its cache, and it waits at the front of the queue. When it is admitted again
     it recomputes its prompt and the tokens it had generated (greedy decoding computes
     the same K/V again), so its output does not change.
  2. Then waiting requests, first come first served, while `can_admit` says yes: a sequence
     slot is free, the budget has tokens left, and the pool has the pages of the first chunk.
     Nobody is admitted in a step that preempted: the pool is short already.

Progress is guaranteed: the oldest running request is never preempted for a newer one, and
`Engine` refuses any request that could not fit in the whole pool alone.
"""

from __future__ import annotations

import collections
import dataclasses

from minilib.kv_cache import PageAllocator, pages_needed

__all__ = [
    "Request",
    "ScheduledSeq",
    "Scheduler",
    "StepPlan",
    "can_admit",
    "preempt",
    "schedule_tokens",
]


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and how far it has got.

    >>> r = Request(0, prompt=[5, 6, 7], max_new_tokens=2, output=[9], num_computed=3)
    >>> r.tokens, r.num_uncomputed, r.finished   # 9 was sampled, not yet in the cache
    ([5, 6, 7, 9], 1, False)
    """

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)  # its page table row
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        """The prompt, then the generated tokens."""
        return self.prompt + self.output

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model (the whole prompt after a preemption)."""
        return len(self.prompt) + len(self.output) - self.num_computed

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step: `num_tokens` new tokens of `request`, from position `start`.

    kind: 'decode' for the one token sampled in the previous step, else 'prefill' (a prompt
      chunk, or a recompute after preemption).
    samples: whether the step reaches the sequence's last token, so that the logits of its
      last row give the next token.

    >>> r = Request(0, prompt=[5, 6, 7, 8, 9], max_new_tokens=1)
    >>> seq = schedule_tokens(r, 2)     # the first chunk of the prompt
    >>> seq.start, seq.num_tokens, seq.kind, seq.samples   # no token to sample yet
    (0, 2, 'prefill', False)
    """

    request: Request
    start: int  # the first new token's position = num_computed before the step
    num_tokens: int  # this step's q_len
    kind: str
    samples: bool


def schedule_tokens(request: Request, num_tokens: int) -> ScheduledSeq:
    """`request`'s next `num_tokens` uncomputed tokens, as one sequence of the step.

    >>> r = Request(0, prompt=[5, 6, 7], max_new_tokens=2, output=[9], num_computed=3)
    >>> seq = schedule_tokens(r, 1)     # the token sampled last step
    >>> seq.start, seq.kind, seq.samples
    (3, 'decode', True)
    """
    start, total = request.num_computed, len(request.prompt) + len(request.output)
    is_decode = bool(request.output) and num_tokens == 1 and start == total - 1
    return ScheduledSeq(
        request,
        start,
        num_tokens,
        "decode" if is_decode else "prefill",
        start + num_tokens == total,
    )


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step runs: the sequences in batch order, and who was admitted or preempted.

    >>> s = Scheduler(num_pages=4, page_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    >>> s.add(Request(0, prompt=[1] * 3, max_new_tokens=1))
    >>> s.add(Request(1, prompt=[2] * 3, max_new_tokens=1))
    >>> plan = s.schedule()
    >>> [seq.request.request_id for seq in plan.seqs], plan.admitted, plan.preempted
    ([0, 1], (0, 1), ())
    """

    seqs: tuple[ScheduledSeq, ...]
    admitted: tuple[int, ...]
    preempted: tuple[int, ...]


def can_admit(
    num_prompt_tokens: int,
    *,
    token_budget_left: int,
    num_free_pages: int,
    page_size: int,
    num_running: int,
    max_num_seqs: int,
) -> bool:
    """The admission rule: may a waiting request with `num_prompt_tokens` tokens to compute
    start now?

    Yes when a sequence slot is free, the step's token budget has tokens left, and the pool
    has the pages for the request's first chunk (as many tokens as the budget allows).

    >>> can_admit(20, token_budget_left=8, num_free_pages=2, page_size=4, num_running=1,
    ...           max_num_seqs=4)   # the first chunk is 8 tokens: 2 pages
    True
    >>> can_admit(20, token_budget_left=8, num_free_pages=1, page_size=4, num_running=1,
    ...           max_num_seqs=4)
    False
    """
    first_chunk = min(num_prompt_tokens, token_budget_left)
    return (
        num_running < max_num_seqs
        and token_budget_left > 0
        and pages_needed(first_chunk, page_size) <= num_free_pages
    )


def preempt(request: Request, allocator: PageAllocator) -> None:
    """Evict `request` from the cache: its pages go back to the pool and it forgets its
    cached tokens, so that it recomputes them all when it runs again. Its output is kept.

    >>> allocator = PageAllocator(4)
    >>> r = Request(0, prompt=[5, 6, 7], max_new_tokens=3, output=[9], num_computed=3)
    >>> r.pages = allocator.allocate(1, owner=0)
    >>> preempt(r, allocator)
    >>> r.pages, r.num_computed, r.output, allocator.num_free
    ([], 0, [9], 4)
    """
    allocator.free(request.pages)
    request.pages = []
    request.num_computed = 0


class Scheduler:
    """Requests waiting and running, the page pool, and the rule of one step.

    >>> s = Scheduler(num_pages=4, page_size=4, max_num_batched_tokens=6, max_num_seqs=2)
    >>> s.add(Request(0, prompt=[1] * 10, max_new_tokens=2))
    >>> plan = s.schedule()   # a 6-token chunk of the 10-token prompt: 2 pages
    >>> [(q.request.request_id, q.start, q.num_tokens, q.kind) for q in plan.seqs]
    [(0, 0, 6, 'prefill')]
    >>> s.allocator.num_used
    2
    """

    def __init__(
        self, *, num_pages: int, page_size: int, max_num_batched_tokens: int, max_num_seqs: int
    ):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # oldest first
        # Hooks, so the notebook's exercises can swap in the learner's versions.
        self.admission_rule = can_admit
        self.preempt_request = preempt

    def add(self, request: Request) -> None:
        """Queue a new request at the back."""
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        """Choose the next step's sequences; take the pages they need (see the module doc)."""
        budget = self.max_num_batched_tokens
        seqs, preempted = [], []
        for request in list(self.running):  # 1. running requests, oldest first
            if request not in self.running:  # preempted earlier in this loop
                continue
            num_tokens = min(request.num_uncomputed, budget)
            if num_tokens == 0:
                break
            if not self._make_room(request, request.num_computed + num_tokens, preempted):
                break  # it was the newest, and preempted itself
            seqs.append(schedule_tokens(request, num_tokens))
            budget -= num_tokens
        admitted = []
        while self.waiting and not preempted:  # 2. admit waiting requests, in order
            request = self.waiting[0]
            admit = self.admission_rule(
                request.num_uncomputed,
                token_budget_left=budget,
                num_free_pages=self.allocator.num_free,
                page_size=self.page_size,
                num_running=len(self.running),
                max_num_seqs=self.max_num_seqs,
            )
            if not admit:
                break
            num_tokens = min(request.num_uncomputed, budget)
            self._grow(request, num_tokens)
            self.running.append(self.waiting.popleft())
            seqs.append(schedule_tokens(request, num_tokens))
            admitted.append(request.request_id)
            budget -= num_tokens
        return StepPlan(tuple(seqs), tuple(admitted), tuple(preempted))

    def finish_step(self, plan: StepPlan, sampled: dict[int, int]) -> list[Request]:
        """Record the step: new tokens are in the cache, and sampled tokens are appended.
        Finished requests leave, and their pages go back to the pool. Returns them."""
        finished = []
        for seq in plan.seqs:
            request = seq.request
            request.num_computed = seq.start + seq.num_tokens
            if seq.samples:
                request.output.append(sampled[request.request_id])
            if request.finished:
                self.allocator.free(request.pages)
                request.pages = []
                self.running.remove(request)
                finished.append(request)
        return finished

    def _make_room(self, request: Request, num_tokens: int, preempted: list[int]) -> bool:
        """Give `request` the pages for `num_tokens`, preempting the newest running requests
        while the pool is short. False if `request` itself had to go."""
        while pages_needed(num_tokens, self.page_size) - len(request.pages) > (
            self.allocator.num_free
        ):
            victim = self.running.pop()  # the newest
            self.preempt_request(victim, self.allocator)
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        self._grow(request, num_tokens)
        return True

    def _grow(self, request: Request, num_tokens: int) -> None:
        """Append pages to `request` until it can hold `num_tokens` tokens."""
        missing = pages_needed(num_tokens, self.page_size) - len(request.pages)
        request.pages += self.allocator.allocate(max(missing, 0), owner=request.request_id)
