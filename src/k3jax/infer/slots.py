"""The slot pool's host side: slots, per-slot lengths, the page table, reference-counted pages and prefix pins.

The device holds one cache row per slot (KDA state and conv windows) and a pool of MLA pages shared by every slot;
this module decides which slot and which pages a sequence uses, and nothing else: it imports no JAX, so admission,
preemption and eviction policy can be tested without a model.

* :class:`PageAllocator` — ``num_pages`` page ids with a reference count each (a running sequence and every
  prefix-cache node that covers a page hold one reference); a page is free at zero.
* :class:`SlotPool` — per slot: its owner (a request id), the tokens its device cache holds (``lengths``), its row
  of the page table and the pages it holds in order, and the prefix-cache node it started from (its *pin*: a
  pinned node is never evicted). Pages come from the allocator; when the free list is short the pool asks its
  ``reclaim`` callback (the prefix cache's eviction) to free some first.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import numpy as np


class PageAllocator:
    """Reference-counted pages: ``num_pages`` ids, a free list, and per page the number of holders (running
    sequences and prefix-cache nodes). :meth:`alloc` hands out pages with one reference, :meth:`retain` adds one,
    :meth:`release` drops one and frees the page at zero."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = collections.deque(range(num_pages))
        self.refs = [0] * num_pages

    @property
    def free(self) -> int:
        return len(self._free)

    def is_free(self, page: int) -> bool:
        return self.refs[page] == 0

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for p in out:
            self.refs[p] = 1
        return out

    def retain(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"page {p}: retained while free (a holder released it too early)")
            self.refs[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"page {p}: released more often than it was taken")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)


class SlotPool:
    """Slots and pages of the engine (see the module docstring). ``page_size`` tokens per page, ``max_pages``
    page-table entries per slot. Single-threaded: the scheduler thread owns it."""

    def __init__(self, max_slots: int, *, page_size: int, num_pages: int, max_pages: int):
        self.max_slots, self.page_size, self.max_pages = int(max_slots), int(page_size), int(max_pages)
        self.alloc = PageAllocator(int(num_pages))
        self.owner: list[str | None] = [None] * self.max_slots
        self.lengths = np.zeros(self.max_slots, np.int32)
        self.table = np.zeros((self.max_slots, self.max_pages), np.int32)
        self.pages: list[list[int]] = [[] for _ in range(self.max_slots)]
        self.pins: list[object] = [None] * self.max_slots
        self.reclaim: Callable[[int], bool] = lambda n: False     # frees n pages if it can (prefix-cache eviction)

    # ------------------------------------------------------------------------------------------ queries
    @property
    def num_pages(self) -> int:
        return self.alloc.num_pages

    @property
    def free_pages(self) -> int:
        return self.alloc.free

    def pages_for(self, n_tokens: int) -> int:
        """Pages that hold ``n_tokens`` tokens."""
        return -(-int(n_tokens) // self.page_size)

    def free_slots(self) -> list[int]:
        return [i for i, o in enumerate(self.owner) if o is None]

    def used(self) -> int:
        return sum(o is not None for o in self.owner)

    def page_table(self) -> np.ndarray:
        """A fresh copy of the page table (a step's input: never changed after it is handed over)."""
        return self.table.copy()

    def lengths_copy(self) -> np.ndarray:
        return self.lengths.copy()

    # ------------------------------------------------------------------------------------------ pages
    def take_pages(self, n: int) -> list[int] | None:
        """``n`` pages (one reference each), reclaiming cached ones when the free list is short; None if the pool
        cannot give them (nothing is taken then)."""
        got = self.alloc.alloc(n)
        if got is None and self.reclaim(n):
            got = self.alloc.alloc(n)
        return got

    def _append_pages(self, slot: int, pages: Sequence[int]) -> None:
        have = len(self.pages[slot])
        if have + len(pages) > self.max_pages:
            raise RuntimeError(f"slot {slot}: {have + len(pages)} pages exceed the table's {self.max_pages}")
        self.table[slot, have:have + len(pages)] = pages
        self.pages[slot].extend(pages)

    def grow(self, slot: int, n_tokens: int) -> bool:
        """Pages for positions ``< n_tokens`` in ``slot`` (taking new ones as needed, never preempting); False when
        the pool has none to give (the slot keeps what it had)."""
        want = self.pages_for(n_tokens)
        if want > self.max_pages:
            raise RuntimeError(f"slot {slot}: {n_tokens} tokens need {want} pages; the table holds {self.max_pages}")
        need = want - len(self.pages[slot])
        if need <= 0:
            return True
        got = self.take_pages(need)
        if got is None:
            return False
        self._append_pages(slot, got)
        return True

    def replace_page(self, slot: int, index: int, page: int) -> int:
        """Entry ``index`` of ``slot``'s pages becomes ``page`` (a fresh copy of the old one, for copy-on-write);
        the slot's reference on the old page is handed to the caller. Returns the old page."""
        old = self.pages[slot][index]
        self.pages[slot][index] = page
        self.table[slot, index] = page
        return old

    # ------------------------------------------------------------------------------------------ slots
    def assign(self, slot: int, owner: str, shared: Sequence[int], new: Sequence[int], length: int,
               pin: object = None) -> None:
        """``slot`` holds ``owner``'s sequence: the ``shared`` pages (a cached prefix's, retained here) then the
        ``new`` pages (already taken for it), ``length`` tokens already in its cache, ``pin`` the prefix-cache node
        it started from."""
        if self.owner[slot] is not None:
            raise RuntimeError(f"slot {slot}: assigned to {owner} while {self.owner[slot]} holds it")
        self.alloc.retain(shared)
        self.owner[slot] = owner
        self.table[slot] = 0
        self.pages[slot] = []
        self._append_pages(slot, list(shared) + list(new))
        self.lengths[slot] = length
        self.pins[slot] = pin

    def release(self, slot: int) -> object:
        """Free ``slot`` and drop its page references; returns its pin (the caller unpins the node)."""
        self.alloc.release(self.pages[slot])
        pin = self.pins[slot]
        self.owner[slot], self.pins[slot], self.pages[slot] = None, None, []
        self.table[slot] = 0
        self.lengths[slot] = 0
        return pin

    def set_length(self, slot: int, n: int) -> None:
        self.lengths[slot] = n

    def advance(self, slot: int, n: int) -> None:
        self.lengths[slot] += n

    # ------------------------------------------------------------------------------------------ checks
    def check(self, held_elsewhere: dict[int, int] | None = None, exact: bool = True) -> None:
        """Assert the invariants: each slot's table row lists its pages; each page's reference count equals the
        slots holding it plus ``held_elsewhere[page]`` (the prefix cache's nodes) — or is at least that with
        ``exact=False`` (someone else holds pages too); a free slot holds nothing."""
        refs = collections.Counter()
        for s in range(self.max_slots):
            n = len(self.pages[s])
            assert list(self.table[s, :n]) == self.pages[s], f"slot {s}: page table out of date"
            if self.owner[s] is None:
                assert n == 0 and self.lengths[s] == 0 and self.pins[s] is None, f"free slot {s} holds state"
            else:
                assert self.pages_for(int(self.lengths[s])) <= n, f"slot {s}: {self.lengths[s]} tokens in {n} pages"
            refs.update(self.pages[s])
        refs.update(held_elsewhere or {})
        for p in range(self.num_pages):
            ok = self.alloc.refs[p] == refs[p] if exact else self.alloc.refs[p] >= refs[p]
            assert ok, f"page {p}: reference count {self.alloc.refs[p]} for {refs[p]} holders"
        assert self.alloc.free == sum(1 for p in range(self.num_pages) if self.alloc.refs[p] == 0)


__all__ = ["PageAllocator", "SlotPool"]
