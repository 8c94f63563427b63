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
     it recomputes its prompt and the tokens it had generated, in as many prefill chunks as
     the token budget needs, and carries on from there. Its output so far is kept, not
     sampled again, so it changes only if the recomputed K/V differs by enough rounding to
     flip a later near-tie (see `minilib.engine.sampling` on batch invariance).
  2. Then waiting requests, first come first served, while `can_admit` says yes: a sequence
     slot is free, the budget has tokens left, and the pool has the pages of the first chunk.
     Nobody is admitted in a step that preempted: the pool is short already.

With prefix caching (`enable_prefix_caching=True`) the pool is a `BlockPool`, and two more
things happen (vLLM's KVCacheManager does the same; `minilib.engine.prefix_cache` explains
the pool):

  * on admission, `get_computed_pages` finds the longest cached prefix of the request's
    tokens in whole pages, stopping before its last token; the request takes a reference on
    those pages (`touch`) and computes only the rest;
  * after every step, `cache_full_pages` names each page that has just become full, so that
    later requests can find it.

Progress is guaranteed: the oldest running request is never preempted for a newer one, and
`Engine` refuses any request that could not fit in the whole pool alone.
"""

from __future__ import annotations

import collections
import dataclasses

from minilib.engine.prefix_cache import (
    BlockPool,
    accounting_problems,
    find_longest_cache_hit,
    hash_block_tokens,
    hash_request_tokens,
)
from minilib.engine.sampling import SamplingParams
from minilib.engine.spec_decode import check_drafts
from minilib.errors import EngineError
from minilib.kv_cache import PageAllocator, pages_needed

# Async scheduling (`minilib.engine.async_scheduling`): the id of a token that the step in
# flight samples, not yet read back. A request holds at most one, at the end of its output.
PLACEHOLDER = -1

__all__ = [
    "PLACEHOLDER",
    "Request",
    "ScheduledSeq",
    "Scheduler",
    "StepPlan",
    "cache_full_pages",
    "can_admit",
    "get_computed_pages",
    "preempt",
    "schedule_tokens",
]


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and how far it has got.

    `sampling_params` None means greedy, `max_new_tokens` tokens, no stop tokens.
    `finish_reason` is None while it runs, then "stop", "length" or "abort".
    `cached_hashes` are the hashes of its first pages, which are in the prefix cache. (vLLM's
    request keeps `block_hashes`, the hashes of every full page of its tokens, computed or not,
    and its cache manager counts how many of them are cached.)

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
    sampling_params: SamplingParams | None = None
    finish_reason: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens hit in the prefix cache, on admission
    cached_hashes: list[bytes] = dataclasses.field(default_factory=list)
    metrics: object = None  # the engine's RequestMetrics
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)  # one per token

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
        return self.finish_reason is not None

    @property
    def known_output(self) -> list[int]:
        """The output, without the placeholder of a token still in flight (async scheduling).

        >>> Request(0, prompt=[5], max_new_tokens=4, output=[9, PLACEHOLDER]).known_output
        [9]
        """
        in_flight = self.output[-1:] == [PLACEHOLDER]
        return self.output[:-1] if in_flight else list(self.output)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return () if self.sampling_params is None else self.sampling_params.stop_token_ids

    def record_token(self, token: int) -> None:
        """Append a sampled token, and finish: "stop" on a stop token, "length" at
        max_new_tokens.

        >>> r = Request(0, prompt=[1], max_new_tokens=3,
        ...             sampling_params=SamplingParams(max_tokens=3, stop_token_ids=[2]))
        >>> r.record_token(5); r.finish_reason is None
        True
        >>> r.record_token(2); r.output, r.finish_reason      # the stop token is kept
        ([5, 2], 'stop')
        """
        self.output.append(int(token))
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.max_new_tokens:
            self.finish_reason = "length"


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step: `num_tokens` new tokens of `request`, from position `start`.

    kind: 'decode' for the one token sampled in the previous step, else 'prefill' (a prompt
      chunk, or a recompute after preemption).
    samples: whether the step reaches the sequence's last token, so that the logits of its
      last row give the next token.
    draft_token_ids: speculative decoding's drafts, the last len(draft_token_ids) of the
      num_tokens (`minilib.engine.spec_decode`): the rows that verify them.

    >>> r = Request(0, prompt=[5, 6, 7, 8, 9], max_new_tokens=1)
    >>> seq = schedule_tokens(r, 2)     # the first chunk of the prompt
    >>> seq.start, seq.num_tokens, seq.kind, seq.samples   # no token to sample yet
    (0, 2, 'prefill', False)
    """

    request: Request
    start: int  # the first new token's position = num_computed before the step
    num_tokens: int  # this step's q_len, drafts included
    kind: str
    samples: bool
    draft_token_ids: tuple[int, ...] = ()


def schedule_tokens(request: Request, num_tokens: int, drafts=()) -> ScheduledSeq:
    """`request`'s next `num_tokens` uncomputed tokens, as one sequence of the step; with
    `drafts`, the last len(drafts) of them are drafts to verify.

    >>> r = Request(0, prompt=[5, 6, 7], max_new_tokens=4, output=[9], num_computed=3)
    >>> seq = schedule_tokens(r, 1)     # the token sampled last step
    >>> seq.start, seq.kind, seq.samples
    (3, 'decode', True)
    >>> schedule_tokens(r, 3, drafts=(5, 6)).num_tokens   # 9, then drafts 5 and 6
    3
    """
    start, total = request.num_computed, len(request.prompt) + len(request.output)
    num_new = num_tokens - len(drafts)
    is_decode = bool(request.output) and num_new == 1 and start == total - 1
    return ScheduledSeq(
        request,
        start,
        num_tokens,
        "decode" if is_decode else "prefill",
        start + num_new == total,
        tuple(drafts),
    )


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step runs: the sequences in batch order, who was admitted or preempted, and
    how many tokens the admitted requests found in the prefix cache.

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
    num_cached_tokens: int = 0


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


def preempt(request: Request, allocator: PageAllocator | BlockPool) -> None:
    """Evict `request` from the cache: its pages go back to the pool and it forgets its
    cached tokens, so that it recomputes them all when it runs again. Its output is kept.

    With prefix caching, `free` drops the request's reference on each page: a page another
    request shares stays in use, and a full page stays cached, so the request may find it
    again when it comes back.

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


def get_computed_pages(token_ids: list[int], pool: BlockPool, page_size: int) -> list[int]:
    """The pages of the longest cached prefix of `token_ids`: whole pages, and never the
    last token, which must run through the model to give logits to sample from.
    (vLLM: `KVCacheManager.get_computed_blocks`.) It only looks; the caller touches them.

    >>> pool = BlockPool(4)
    >>> prompt = list(range(8))
    >>> pages = pool.allocate(2)
    >>> for page, h in zip(pages, hash_request_tokens(prompt, page_size=4)):
    ...     pool.cache_page(page, h)
    >>> get_computed_pages(prompt, pool, page_size=4)   # all 8 cached; the last page reruns
    [0]
    >>> get_computed_pages(prompt + [9], pool, page_size=4)
    [0, 1]
    """
    max_cache_hit_length = len(token_ids) - 1
    hashes = hash_request_tokens(token_ids[:max_cache_hit_length], page_size)
    return find_longest_cache_hit(
        hashes, pool, max_cache_hit_length=max_cache_hit_length, page_size=page_size
    )


def cache_full_pages(request: Request, pool: BlockPool, page_size: int) -> None:
    """Name every page of `request` that is now full of computed K/V, so that later requests
    can share it: its hash chains from the page before, and `request.cached_hashes` grows.

    A page counts as full only when all its tokens' K/V are in it (`num_computed`), not when
    the request merely *has* its tokens: a prompt chunk or a sampled token may still be on
    its way. The cache takes no reference: the page stays the request's, counted once.

    >>> pool = BlockPool(4)
    >>> r = Request(0, prompt=list(range(10)), max_new_tokens=2, num_computed=6)
    >>> r.pages = pool.allocate(2)            # 6 tokens computed: page 0 full, page 1 not
    >>> cache_full_pages(r, pool, page_size=4)
    >>> pool.cached_pages, len(r.cached_hashes), pool.ref_cnt(0)
    ((0,), 1, 1)
    """
    for i in range(len(request.cached_hashes), request.num_computed // page_size):
        parent = request.cached_hashes[-1] if request.cached_hashes else None
        block_hash = hash_block_tokens(parent, request.tokens[i * page_size : (i + 1) * page_size])
        pool.cache_page(request.pages[i], block_hash)
        request.cached_hashes.append(block_hash)


class Scheduler:
    """Requests waiting and running, the page pool, and the rule of one step.

    `allocator` is chapter 02's `PageAllocator`, or a `BlockPool` with prefix caching.

    >>> s = Scheduler(num_pages=4, page_size=4, max_num_batched_tokens=6, max_num_seqs=2)
    >>> s.add(Request(0, prompt=[1] * 10, max_new_tokens=2))
    >>> plan = s.schedule()   # a 6-token chunk of the 10-token prompt: 2 pages
    >>> [(q.request.request_id, q.start, q.num_tokens, q.kind) for q in plan.seqs]
    [(0, 0, 6, 'prefill')]
    >>> s.allocator.num_used
    2
    """

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_prefix_caching: bool = False,
        num_speculative_tokens: int = 0,
        vocab_size: int | None = None,
    ):
        self.enable_prefix_caching = enable_prefix_caching
        pool = BlockPool if enable_prefix_caching else PageAllocator
        self.allocator: PageAllocator | BlockPool = pool(num_pages)
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.num_speculative_tokens, self.vocab_size = num_speculative_tokens, vocab_size
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # oldest first
        # Hooks, so the notebook's exercises can swap in the learner's versions.
        self.admission_rule = can_admit
        self.preempt_request = preempt
        self.cache_pages = cache_full_pages
        # Speculative decoding: token ids -> up to num_speculative_tokens drafts. The engine
        # sets vLLM's n-gram proposer (`minilib.engine.spec_decode.propose_ngram`).
        self.propose_drafts = None

    def add(self, request: Request) -> None:
        """Queue a new request at the back."""
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        """Choose the next step's sequences; take the pages they need (see the module doc)."""
        budget = self.max_num_batched_tokens
        seqs, preempted = [], []
        ready = [r for r in self.running if not self.awaits_tokens(r)]
        drafts = {r.request_id: self._drafts(r) for r in ready}  # before any change
        for request in ready:  # 1. running requests, oldest first
            if request not in self.running:  # preempted earlier in this loop
                continue
            wanted = drafts[request.request_id]
            num_tokens = min(request.num_uncomputed + len(wanted), budget)
            if num_tokens == 0:
                break
            if not self._make_room(request, request.num_computed + num_tokens, preempted):
                break  # it was the newest, and preempted itself
            kept = wanted[: num_tokens - request.num_uncomputed]  # as many as the budget allows
            seqs.append(schedule_tokens(request, num_tokens, kept))
            budget -= num_tokens
        admitted, num_cached_tokens = [], 0
        while self.waiting and not preempted:  # 2. admit waiting requests, in order
            request = self.waiting[0]
            hit = self._cache_hit(request)
            num_hit_tokens = len(hit) * self.page_size
            # Hit pages nobody holds sit in the free queue: taking them leaves fewer free.
            idle_hits = sum(self.allocator.ref_cnt(page) == 0 for page in hit)
            admit = self.admission_rule(
                request.num_uncomputed - num_hit_tokens,
                token_budget_left=budget,
                num_free_pages=self.allocator.num_free - idle_hits,
                page_size=self.page_size,
                num_running=len(self.running),
                max_num_seqs=self.max_num_seqs,
            )
            if not admit:
                break
            if hit:
                self.allocator.touch(hit)
                request.pages = list(hit)
                request.num_computed = num_hit_tokens
            if self.enable_prefix_caching:  # the pages it starts from are named already
                request.cached_hashes = [self.allocator.block_hash(page) for page in hit]
            if request.num_cached_tokens is None:  # as vLLM: what the first admission found
                request.num_cached_tokens = num_hit_tokens
            num_cached_tokens += num_hit_tokens
            num_tokens = min(request.num_uncomputed, budget)
            self._grow(request, request.num_computed + num_tokens)
            self.running.append(self.waiting.popleft())
            seqs.append(schedule_tokens(request, num_tokens))
            admitted.append(request.request_id)
            budget -= num_tokens
        return StepPlan(tuple(seqs), tuple(admitted), tuple(preempted), num_cached_tokens)

    def finish_step(self, plan: StepPlan, sampled: dict[int, list[int]]) -> list[Request]:
        """Record the step: new tokens are in the cache (and full pages in the prefix cache),
        and sampled tokens are appended, one per sequence that sampled, or with speculative
        decoding its kept drafts and one more (`sampled[request_id]`: a list). The K/V of
        rejected drafts is not kept: pages that hold only those go back to the pool.
        Finished requests leave, and their pages go back to the pool. Returns them."""
        finished = []
        for seq in plan.seqs:
            request = seq.request
            new_tokens = sampled[request.request_id] if seq.samples else []
            for token in new_tokens:  # a stop token or max_new_tokens ends it early
                if not request.finished:
                    request.record_token(token)
            num_rejected = len(seq.draft_token_ids) + 1 - len(new_tokens) if seq.samples else 0
            computed = seq.start + seq.num_tokens - num_rejected
            request.num_computed = min(
                computed, len(request.tokens) - 1 if seq.samples else computed
            )
            if self.enable_prefix_caching:
                self.cache_pages(request, self.allocator, self.page_size)
            if request.finished:
                self._release(request)
                finished.append(request)
            elif seq.draft_token_ids:
                self._trim(request)
        return finished

    def abort(self, request: Request) -> None:
        """End `request` now, waiting or running: its pages go back to the pool at once."""
        if request in self.running:
            self._release(request)
        else:
            self.waiting.remove(request)
        request.finish_reason = "abort"

    def stuck_error(self) -> EngineError:
        """The error for a step that has requests but can run none of them: nothing running,
        and the admission rule refused the first waiting request."""
        return EngineError(
            f"No request could be scheduled: {len(self.waiting)} waiting, "
            f"{len(self.running)} running, "
            f"{self.allocator.num_free} of {self.allocator.total_num_pages} pages free. "
            "The admission rule refused every waiting request.",
            "with nothing running, the admission rule must admit the first waiting "
            "request when a step's budget and the free pages allow it (as can_admit "
            "does): fix scheduler.admission_rule, or find the pages that were never "
            "freed (scheduler.accounting_problems()); or abort_request the waiting "
            "requests.",
        )

    def accounting_problems(self) -> list[str]:
        """What is wrong with the pool's books, given the running requests' page tables
        (an empty list: nothing). Tests check it after every step.

        >>> s = Scheduler(num_pages=4, page_size=4, max_num_batched_tokens=8, max_num_seqs=2,
        ...               enable_prefix_caching=True)
        >>> s.add(Request(0, prompt=[1] * 6, max_new_tokens=1))
        >>> _ = s.schedule()
        >>> s.accounting_problems()
        []
        """
        tables = [request.pages for request in self.running]
        if isinstance(self.allocator, BlockPool):
            return accounting_problems(self.allocator, tables)
        problems = []
        owners = self.allocator.owners
        held = {page: r.request_id for r in self.running for page in r.pages}
        for page, owner in enumerate(owners):
            if held.get(page) != owner:
                problems.append(f"page {page}: owner {owner}, but held by {held.get(page)}")
        if sum(len(t) for t in tables) != len(held):
            problems.append("two requests hold one page")
        return problems

    @property
    def page_owners(self) -> tuple[tuple[int, ...], ...]:
        """For every page, the running requests holding it (several, for a shared prefix)."""
        owners: list[list[int]] = [[] for _ in range(self.allocator.total_num_pages)]
        for request in self.running:
            for page in request.pages:
                owners[page].append(request.request_id)
        return tuple(tuple(sorted(o)) for o in owners)

    def _cache_hit(self, request: Request) -> list[int]:
        """The cached pages a waiting request would start from (none without caching, or for
        a request that still holds pages)."""
        if not self.enable_prefix_caching or request.pages:
            return []
        return get_computed_pages(request.tokens, self.allocator, self.page_size)

    def awaits_tokens(self, request: Request) -> bool:
        """Async scheduling: whether `request` sits this step out, waiting for the token that
        the step in flight samples for it: when that token is its last (max_new_tokens), or
        when drafts are to be proposed, since they come from its tokens. (Without a token in
        flight, never.)

        >>> s = Scheduler(num_pages=4, page_size=4, max_num_batched_tokens=8, max_num_seqs=2)
        >>> r = Request(0, prompt=[1, 2], max_new_tokens=2, output=[7, PLACEHOLDER])
        >>> s.awaits_tokens(r), s.awaits_tokens(Request(1, prompt=[1], max_new_tokens=2))
        (True, False)
        """
        if request.output[-1:] != [PLACEHOLDER]:
            return False
        last = len(request.output) >= request.max_new_tokens
        return last or self.propose_drafts is not None

    def _drafts(self, request: Request) -> list[int]:
        """The drafts to verify for a running request: none unless it decodes and a proposer
        is set; at most num_speculative_tokens, and none past its last token (whose K/V never
        enters the cache). `EngineError` for drafts that are not token ids."""
        room = request.max_new_tokens - len(request.output) - 1
        if not (self.propose_drafts and request.output and request.num_uncomputed == 1):
            return []
        most = min(self.num_speculative_tokens, max(room, 0))
        drafts = check_drafts(
            self.propose_drafts(request.tokens), request.request_id,
            self.num_speculative_tokens, self.vocab_size,
        )  # fmt: skip
        return drafts[:most]

    def _trim(self, request: Request) -> None:
        """Give back the pages past the ones its tokens need (rejected drafts' pages)."""
        keep = pages_needed(len(request.tokens), self.page_size)
        self.allocator.free(request.pages[keep:])
        del request.pages[keep:]

    def _release(self, request: Request) -> None:
        self.allocator.free(request.pages)
        request.pages = []
        self.running.remove(request)

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
