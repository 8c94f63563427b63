"""The free-page pool of a paged KV cache: which pages are free, and who owns each used one.

`PageAllocator` only counts; `minilib.kv_cache.PagedKVCache` holds the data and takes its pages
from one. The two checks before a pool hands out or takes back pages, `check_can_allocate`
and `check_page_number`, are shared with the serving engine's `BlockPool`.

Every mistake (out of pages, a double free, a page the pool does not have) raises
`KVCacheError` (`minilib.errors`) before anything changes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np

from minilib.errors import KVCacheError

__all__ = ["PageAllocator", "check_can_allocate", "check_page_number"]


def check_can_allocate(n, num_free: int, total_num_pages: int, fix: str | None = None) -> None:
    """The checks before a pool of `total_num_pages` pages, `num_free` of them free, hands out
    `n`, all of them or none: `n` is a count, and that many pages are free. `PageAllocator`
    makes them, and so does the serving engine's `BlockPool`, which names its own `fix`.

    >>> check_can_allocate(3, num_free=2, total_num_pages=8)
    Traceback (most recent call last):
    ...
    minilib.errors.KVCacheError: Out of pages: allocate(n=3) needs 3 free pages, but only \
num_free=2 of total_num_pages=8 are free.
    Hint: free the pages of finished sequences first (free(pages)), or build the allocator with \
more pages (PageAllocator(total_num_pages=9) or more).
    """
    if not _is_int(n) or n < 0:
        raise KVCacheError(
            f"allocate(n={n!r}): n must be a non-negative int.",
            "n is the number of pages to take; 0 is allowed and takes none.",
        )
    if n > num_free:
        num_used = total_num_pages - num_free
        fix = fix or (
            "free the pages of finished sequences first (free(pages)), or build the allocator "
            f"with more pages (PageAllocator(total_num_pages={num_used + n}) or more)."
        )
        raise KVCacheError(
            f"Out of pages: allocate(n={n}) needs {n} free pages, but only "
            f"num_free={num_free} of total_num_pages={total_num_pages} are free.",
            fix,
        )


def check_page_number(page, total_num_pages: int) -> None:
    """Raise KVCacheError unless `page` is an int in [0, total_num_pages): a page of the pool.

    >>> check_page_number(3, total_num_pages=4)
    >>> check_page_number(True, total_num_pages=4)     # True is not page 1
    Traceback (most recent call last):
    ...
    minilib.errors.KVCacheError: page=True is not a page number in [0, 4).
    Hint: pages are numbered 0 .. total_num_pages - 1 = 3.
    """
    if not _is_int(page) or not 0 <= page < total_num_pages:
        raise KVCacheError(
            f"page={page!r} is not a page number in [0, {total_num_pages}).",
            f"pages are numbered 0 .. total_num_pages - 1 = {total_num_pages - 1}.",
        )


class PageAllocator:
    """The free-page pool of a paged KV cache. It hands out page numbers; it holds no data.

    Free pages are handed out in first-in first-out order: pages returned by `free` go to the
    back of the queue. After a few sequences come and go, a sequence's pages are scattered
    over the pool, as in a real server.

    >>> alloc = PageAllocator(8)
    >>> alloc.allocate(3, owner="a")
    [0, 1, 2]
    >>> alloc.free([1])
    >>> alloc.num_free, alloc.num_used, alloc.owner(1)
    (6, 2, None)
    """

    def __init__(self, total_num_pages: int):
        _check_positive_int("total_num_pages", total_num_pages)
        self.total_num_pages = total_num_pages
        self._free: list[int] = list(range(total_num_pages))  # next to hand out first
        self._owner: dict[int, Hashable] = {}  # used page -> its owner

    @property
    def num_free(self) -> int:
        """Pages ready to allocate."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages allocated and not yet freed. Always `num_free + num_used == total_num_pages`."""
        return len(self._owner)

    @property
    def free_pages(self) -> tuple[int, ...]:
        """The free pages, in the order `allocate` will hand them out."""
        return tuple(self._free)

    @property
    def owners(self) -> tuple[Hashable | None, ...]:
        """The owner of every page, indexed by page number; None for a free page."""
        return tuple(self._owner.get(page) for page in range(self.total_num_pages))

    def owner(self, page: int) -> Hashable | None:
        """The `owner` that `page` was allocated with; None if it is free (or had no owner)."""
        check_page_number(page, self.total_num_pages)
        return self._owner.get(page)

    def allocate(self, n: int, owner: Hashable = None) -> list[int]:
        """Take `n` free pages, all of them or none. Returns their numbers.

        `owner` (for example a sequence id) is recorded for each page, for bookkeeping and
        display.
        """
        check_can_allocate(n, self.num_free, self.total_num_pages)
        pages, self._free = self._free[:n], self._free[n:]
        for page in pages:
            self._owner[page] = owner
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Give `pages` back to the pool. Every page must be allocated, and listed once."""
        if _is_int(pages) or isinstance(pages, str | bytes) or not isinstance(pages, Iterable):
            raise KVCacheError(
                f"free(pages={pages!r}): pages must be a list of page numbers.",
                f"to free one page, pass a list: free([{pages!r}]).",
            )
        pages = list(pages)
        seen = set()
        for page in pages:  # check them all before changing anything
            check_page_number(page, self.total_num_pages)
            if page in seen:
                raise KVCacheError(
                    f"free(pages={pages}) lists page {page} twice.",
                    "free each page once; a page freed twice would be handed out twice, "
                    "and two sequences would overwrite each other's K/V.",
                )
            if page not in self._owner:
                raise KVCacheError(
                    f"free(pages={pages}): page {page} is not allocated (it is already free: "
                    "a double free, or a page this allocator never handed out).",
                    "free only pages that allocate() returned, once each. PagedKVCache.free "
                    "does this for you from the sequence's page list.",
                )
            seen.add(page)
        for page in pages:
            del self._owner[page]
        self._free.extend(pages)

    def __repr__(self) -> str:
        return (
            f"PageAllocator(total_num_pages={self.total_num_pages}, "
            f"num_used={self.num_used}, num_free={self.num_free})"
        )


def _is_int(value) -> bool:
    """An int or NumPy integer, but not a bool (True is not page 1)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _check_positive_int(name: str, value) -> None:
    if not _is_int(value) or value < 1:
        raise KVCacheError(
            f"{name}={value!r} must be a positive int.",
            "sizes of the cache are counts: at least 1.",
        )
