"""Prefix caching: full pages named by a hash of their tokens, shared by reference count.

Two requests whose prompts begin alike (the same system prompt, the same few-shot examples)
compute the same K/V for that beginning. With a page table, the second one need not compute
it at all: its page table can point at the first one's pages. Three ideas make that safe:

  1. **Only full pages are shared.** A page that is not full will get more tokens written
     into it, and those belong to one sequence only. So a cache hit is a whole number of
     pages, and the page a request writes its next token into is always its own.
  2. **A page is named by a hash of its tokens and of the page before it**
     (`hash_block_tokens`). K/V at position t depends on every token before t, so two pages
     hold the same K/V only if the whole prefix up to and including them is the same. The
     chained hash says exactly that: page i's hash covers pages 0..i. (The hash is SHA-256,
     so two different prefixes do not get one name by accident.)
  3. **Pages are counted, not owned.** `BlockPool` keeps a reference count per page: how
     many requests' page tables hold it. `free` drops a count; at 0 the page is free to
     hand out again, but it keeps its K/V and its hash, so a later request with the same
     prefix can still hit it. Free pages queue in least-recently-used order: a new page
     comes from the front, evicting whatever cached K/V that page held.

vLLM calls a page a *block*; the names here are vLLM V1's where it has the concept
(`BlockPool`, `ref_cnt`, `block_hash`, `touch`, `find_longest_cache_hit`,
`max_cache_hit_length`). As in vLLM, the pool keeps apart from the logic that decides what
to cache (the scheduler): this module only counts and names pages, and holds no K/V.

    >>> pool = BlockPool(4)
    >>> hashes = hash_request_tokens([5, 6, 7, 8, 9, 10], page_size=4)   # 1 full page
    >>> pages = pool.allocate(2)                  # a request computes 6 tokens in 2 pages
    >>> pool.cache_page(pages[0], hashes[0])      # its full page enters the cache
    >>> pool.free(pages)                          # it finishes: both counts drop to 0
    >>> find_longest_cache_hit(hashes, pool, max_cache_hit_length=5, page_size=4)
    [0]
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from minilib.errors import KVCacheError
from minilib.kv_cache import check_can_allocate, check_page_number

__all__ = [
    "BlockPool",
    "accounting_problems",
    "find_longest_cache_hit",
    "hash_block_tokens",
    "hash_request_tokens",
]


def hash_block_tokens(parent_block_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The name of one full page: SHA-256 of the previous page's hash and this page's tokens.

    `parent_block_hash` is None for a sequence's first page. Because each hash covers the one
    before, equal hashes mean equal prefixes, not just equal pages.

    >>> a = hash_block_tokens(None, [1, 2])
    >>> hash_block_tokens(a, [3, 4]) == hash_block_tokens(a, [3, 4])
    True
    >>> hash_block_tokens(None, [3, 4]) == hash_block_tokens(a, [3, 4])  # another prefix
    False
    """
    digest = hashlib.sha256(parent_block_hash or b"")
    digest.update(np.asarray(token_ids, np.int64).tobytes())
    return digest.digest()


def hash_request_tokens(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The chained hashes of every *full* page of `token_ids`; a partial last page has none.

    >>> len(hash_request_tokens(list(range(9)), page_size=4))   # 2 full pages, 1 token left
    2
    """
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + page_size]))
    return hashes


class BlockPool:
    """The page pool of prefix caching: reference counts, hashes of cached pages, and an LRU
    queue of free pages.

    Every page is in exactly one of two states:

        in use   ref_cnt > 0: that many requests hold it in their page tables
        free     ref_cnt == 0: in `free_block_queue`, least recently used first

    Separately, a page may be *cached*: it holds a full page of K/V named by a block hash,
    so `get_cached_page` finds it. A cached page may be in use (shared, read only) or free
    (kept until `allocate` takes it for something else: evicted).

    It has `PageAllocator`'s interface (`allocate`, `free`, `num_free`, `num_used`,
    `free_pages`), so the scheduler, and a preemption written for chapter 02's allocator,
    use either unchanged.

    >>> pool = BlockPool(3)
    >>> a = pool.allocate(1)
    >>> pool.cache_page(a[0], hash_block_tokens(None, [1, 2]))
    >>> pool.touch(a)                       # a second request shares the page
    >>> pool.ref_cnt(a[0]), pool.num_free
    (2, 2)
    >>> pool.free(a); pool.free(a)          # both let go: free, and still cached
    >>> pool.ref_cnt(a[0]), pool.num_free, pool.cached_pages
    (0, 3, (0,))
    """

    def __init__(self, total_num_pages: int):
        if not _is_int(total_num_pages) or total_num_pages < 1:
            raise KVCacheError(
                f"BlockPool(total_num_pages={total_num_pages!r}) must be a positive int.",
                "the pool's size counts pages: at least 1.",
            )
        self.total_num_pages = total_num_pages
        self._ref_cnt = [0] * total_num_pages
        # Free pages, least recently used first: allocate() takes from the front, free()
        # puts pages at the back.
        self.free_block_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
            (page, None) for page in range(total_num_pages)
        )
        self._block_hash: dict[int, bytes] = {}  # cached page -> its hash
        self.cached_block_hash_to_block: dict[bytes, int] = {}  # hash -> its cached page

    # --- what is in the pool ----------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out (cached free pages included: they get evicted)."""
        return len(self.free_block_queue)

    @property
    def num_used(self) -> int:
        """Pages some request holds. Always `num_free + num_used == total_num_pages`."""
        return self.total_num_pages - self.num_free

    @property
    def free_pages(self) -> tuple[int, ...]:
        """The free pages, in the order `allocate` will hand them out (evict them)."""
        return tuple(self.free_block_queue)

    @property
    def cached_pages(self) -> tuple[int, ...]:
        """The pages that hold a cached full page, in use or free, in page order."""
        return tuple(sorted(self._block_hash))

    def ref_cnt(self, page: int) -> int:
        """How many requests hold `page` in their page tables."""
        check_page_number(page, self.total_num_pages)
        return self._ref_cnt[page]

    def block_hash(self, page: int) -> bytes | None:
        """The hash `page` is cached under, or None."""
        check_page_number(page, self.total_num_pages)
        return self._block_hash.get(page)

    def get_cached_page(self, block_hash: bytes) -> int | None:
        """The page cached under `block_hash`, or None: a cache miss."""
        return self.cached_block_hash_to_block.get(block_hash)

    # --- changing it ------------------------------------------------------------------------

    def allocate(self, n: int, owner=None) -> list[int]:
        """Take `n` free pages, least recently used first, each with ref_cnt 1; all or none.

        A taken page that was cached is evicted: its hash is forgotten, as its K/V is about
        to be overwritten. (`owner` is accepted for `PageAllocator`'s signature: the pool
        counts holders, it does not name them.) vLLM: `get_new_blocks`.
        """
        check_can_allocate(
            n,
            self.num_free,
            self.total_num_pages,
            fix="free pages first (requests that finish or are preempted), or build the pool "
            "with more pages.",
        )
        pages = [self.free_block_queue.popitem(last=False)[0] for _ in range(n)]
        for page in pages:
            self._evict(page)
            self._ref_cnt[page] = 1
        return pages

    def touch(self, pages: Iterable[int]) -> None:
        """Take one more reference on each of `pages`, cached pages a request has hit. A page
        that was free leaves the free queue: it is in use again, and cannot be evicted."""
        pages = self._checked_list("touch", pages)
        for page in pages:
            if page not in self._block_hash:
                raise KVCacheError(
                    f"touch(pages={pages}): page {page} is not cached; only cached full "
                    "pages can be shared.",
                    "touch the pages that find_longest_cache_hit returned, and nothing else.",
                )
        for page in pages:
            self.free_block_queue.pop(page, None)
            self._ref_cnt[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference on each of `pages`. A page whose count reaches 0 is free, at the
        back of the queue (reused last). A request's pages are freed last page first, so that
        the start of a prefix, which more requests share, stays longest. vLLM: `free_blocks`,
        given a request's blocks in reverse.

        Every page must be in use, and listed once.
        """
        pages = self._checked_list("free", pages)
        for page in pages:
            if self._ref_cnt[page] == 0:
                raise KVCacheError(
                    f"free(pages={pages}): page {page} is not in use (ref_cnt 0): a double "
                    "free, or a page this pool never handed out.",
                    "free each page a request holds once, when it finishes, is preempted or "
                    "is aborted.",
                )
        for page in reversed(pages):
            self._ref_cnt[page] -= 1
            if self._ref_cnt[page] == 0:
                self.free_block_queue[page] = None  # at the back

    def cache_page(self, page: int, block_hash: bytes) -> None:
        """Record that `page`, in use and now full, holds the K/V named `block_hash`.

        If another page is cached under the same hash already (two requests computed the
        same prefix at once), `page` stays uncached: one copy is enough, and page tables
        never change under a running request. vLLM: `cache_full_blocks`.
        """
        check_page_number(page, self.total_num_pages)
        if self._ref_cnt[page] == 0:
            raise KVCacheError(
                f"cache_page(page={page}): the page is free; only a page a request holds, "
                "with its K/V just written, can be cached.",
                "cache a request's full pages after the step that filled them.",
            )
        if page in self._block_hash or block_hash in self.cached_block_hash_to_block:
            return
        self._block_hash[page] = block_hash
        self.cached_block_hash_to_block[block_hash] = page

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (new weights make old K/V wrong). Pages in use stay in
        use; their K/V is simply never shared again."""
        self._block_hash.clear()
        self.cached_block_hash_to_block.clear()

    # --- helpers ----------------------------------------------------------------------------

    def _evict(self, page: int) -> None:
        block_hash = self._block_hash.pop(page, None)
        if block_hash is not None:
            del self.cached_block_hash_to_block[block_hash]

    def _checked_list(self, verb: str, pages) -> list[int]:
        if _is_int(pages) or isinstance(pages, str | bytes) or not isinstance(pages, Iterable):
            raise KVCacheError(
                f"{verb}(pages={pages!r}): pages must be a list of page numbers.",
                f"to {verb} one page, pass a list: {verb}([{pages!r}]).",
            )
        pages = list(pages)
        for page in pages:
            check_page_number(page, self.total_num_pages)
        if len(set(pages)) != len(pages):
            raise KVCacheError(
                f"{verb}(pages={pages}) lists a page twice.",
                "a page table holds each page once: list each page once.",
            )
        return pages

    def __repr__(self) -> str:
        return (
            f"BlockPool(total_num_pages={self.total_num_pages}, num_used={self.num_used}, "
            f"num_free={self.num_free}, cached={len(self._block_hash)})"
        )


def find_longest_cache_hit(
    block_hashes: Sequence[bytes], pool: BlockPool, *, max_cache_hit_length: int, page_size: int
) -> list[int]:
    """The pages of the longest cached prefix: page i is hit if page i's hash is cached and
    every page before it was hit. At most `max_cache_hit_length // page_size` pages.

    The scheduler passes `max_cache_hit_length = num_tokens - 1`: even a wholly cached prompt
    must run its last token through the model, for the logits its next token is sampled
    from. As hits are whole pages, that recomputes the whole page holding the last token.

    >>> pool = BlockPool(4)
    >>> hashes = hash_request_tokens(list(range(8)), page_size=4)
    >>> pages = pool.allocate(2)
    >>> for page, h in zip(pages, hashes):
    ...     pool.cache_page(page, h)
    >>> find_longest_cache_hit(hashes, pool, max_cache_hit_length=8, page_size=4)
    [0, 1]
    >>> find_longest_cache_hit(hashes, pool, max_cache_hit_length=7, page_size=4)  # 8 - 1
    [0]
    """
    hit = []
    for block_hash in block_hashes[: max(max_cache_hit_length, 0) // page_size]:
        page = pool.get_cached_page(block_hash)
        if page is None:
            break  # chained hashes: after one miss, every later page misses too
        hit.append(page)
    return hit


def accounting_problems(pool: BlockPool, page_tables: Iterable[Sequence[int]]) -> list[str]:
    """What is wrong with `pool`'s books, given the page tables of every request holding
    pages: each page's ref_cnt must equal the number of page tables holding it; a page is
    free exactly when its count is 0; every cached hash names the page that holds it.

    Returns a list of problems, each naming a page (empty: the books are right).

    >>> pool = BlockPool(3)
    >>> pages = pool.allocate(2)
    >>> accounting_problems(pool, [pages])
    []
    >>> accounting_problems(pool, [pages[:1]])   # a page table forgot page 1
    ['page 1: ref_cnt 1, but 0 page tables hold it']
    """
    holders = [0] * pool.total_num_pages
    problems = []
    for table in page_tables:
        table = list(table)
        if len(set(table)) != len(table):
            problems.append(f"page table {table} holds a page twice")
        for page in set(table):
            holders[page] += 1
    free = set(pool.free_block_queue)
    for page in range(pool.total_num_pages):
        count = pool.ref_cnt(page)
        if count != holders[page]:
            held = holders[page]
            problems.append(f"page {page}: ref_cnt {count}, but {held} page tables hold it")
        if (count == 0) != (page in free):
            where = "in" if page in free else "not in"
            problems.append(f"page {page}: ref_cnt {count}, yet {where} the free queue")
    for block_hash, page in pool.cached_block_hash_to_block.items():
        if pool.block_hash(page) != block_hash:
            problems.append(f"page {page}: cached under a hash it does not hold")
    if len(pool.cached_block_hash_to_block) != len(pool.cached_pages):
        problems.append("the hash table and the cached pages disagree in number")
    return problems


def _is_int(value) -> bool:
    """An int or NumPy integer, but not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)
