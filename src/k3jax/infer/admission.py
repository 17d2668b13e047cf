"""Slot and page admission for :class:`k3jax.infer.scheduler.Scheduler` (a mixin): a waiting request is admitted
when a slot is free and the pages for its sequence are (less the whole pages a prefix-cache hit shares); decode
takes one more page each time a sequence crosses a page boundary, and when the pool is empty the most recently
admitted running request is preempted — its slot and pages are freed and it goes back to the head of the queue,
to be recomputed from its prompt and the tokens generated so far.
"""

from __future__ import annotations

import logging

import numpy as np

from k3jax.infer.prefix_cache import extend_hashes
from k3jax.infer.requests import _PREFILL, _WAITING, Request

log = logging.getLogger("k3jax.scheduler")


class SlotAdmission:
    """Admission, release and preemption over the scheduler's slots and page pool (``self.slots``, ``self.table``,
    ``self.lengths``, ``self.alloc``, ``self.waiting``, ``self.prefix``)."""

    def _pages_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def _admit(self) -> None:
        while self.waiting:
            free = [i for i, r in enumerate(self.slots) if r is None]
            if not free:
                return
            req = self.waiting[0]
            seq = req.sequence
            node, shared = None, 0
            cache_on = self.prefix is not None and req.use_prefix_cache
            if cache_on:
                extend_hashes(req.hashes, seq, self.prefix.block, req.content_keys)
                shared, node = self.prefix.lookup(req.hashes[:len(seq) // self.prefix.block])
                if node is not None:
                    self.prefix.pin(node)
            hit = node.length if node is not None else 0
            reuse = hit // self.page_size                   # whole pages shared with the cached prefix
            pages = self._take_pages(self._pages_needed(len(seq)) - reuse)
            if pages is None:
                if node is not None:
                    self.prefix.unpin(node)
                return                                      # first come, first served: wait for pages
            self.waiting.popleft()
            slot = free[0]
            if node is not None:
                self.alloc.retain(node.pages[:reuse])
                pages = node.pages[:reuse] + pages
            req.slot, req.pages, req.state, req.computed = slot, pages, _PREFILL, hit
            req.admitted = next(self._admit_seq)
            req.hit_node = node
            req.draft_len = 0                               # a draft model starts over in this slot
            self.slots[slot] = req
            self.table[slot] = 0
            self.table[slot, :len(pages)] = pages
            self.lengths[slot] = hit
            if node is not None and not self._start_from(req, node):
                continue                                    # the hit failed verification: re-queued, no cache
            if cache_on:
                self.prefix.record(len(seq), hit)
                if req.preemptions == 0:
                    req.cached_tokens = hit
                    self.counters["cached_prompt_tokens"] += hit
                req.save_at = self.prefix.save_points(len(seq), hit, shared)
            if node is not None and hit == len(seq):        # all of it cached: the first token from the logits
                ck = node.checkpoint
                if req.logits is not None:
                    req.logits.append(np.array(ck.logits))
                self._accept_token(req, int(self._sample_logits(ck.logits, self._samp_arrays([req]))))

    def _release(self, req: Request) -> None:
        if req.slot >= 0 and self.slots[req.slot] is req:
            self.slots[req.slot] = None
            self.table[req.slot] = 0
            self.lengths[req.slot] = 0
        self.alloc.release(req.pages)
        req.pages, req.slot = [], -1
        if req.hit_node is not None:
            self.prefix.unpin(req.hit_node)
            req.hit_node = None
        req.provisional = None

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s slot and pages; it is recomputed from its prompt + generated tokens when re-admitted."""
        self._release(req)
        req.state, req.computed = _WAITING, 0
        req.sequence = req.prompt + req.tokens
        req.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(req)
        log.info("preempted %s (%d tokens) for lack of pages", req.id, len(req.sequence))

    def _ensure_page(self, req: Request) -> bool:
        """The page for the token ``req`` writes next; preempts newer requests when the pool is empty. False when
        ``req`` itself was preempted."""
        idx = int(self.lengths[req.slot]) // self.page_size
        while idx >= len(req.pages):
            got = self.alloc.alloc(1)
            if got is not None:
                self.table[req.slot, len(req.pages)] = got[0]
                req.pages.extend(got)
                continue
            if self.prefix is not None and self.prefix.make_room(1):
                continue
            running = [r for r in self.slots if r is not None]
            victim = max(running, key=lambda r: r.admitted)
            self._preempt(victim)
            if victim is req:
                return False
        return True
