"""How the scheduler uses the prefix cache (:mod:`k3jax.infer.prefix_cache`, the index): host-side policy only.

On admission :meth:`PrefixPolicy.lookup` finds the deepest cached prefix of the request's sequence that has a KDA
checkpoint and pins it; the scheduler then starts the slot from it (the step restores the checkpoint into the slot
and copies the partial last page, so a request never writes into a page the cache holds) and prefill resumes
there. After each step :meth:`PrefixPolicy.register` adds the block boundaries the slot now holds (nodes over its
pages, a page the slot still writes into being handed to the node and the slot continuing in a copy) and, where
the step saved one, a checkpoint. With ``verify``, every hit is first recomputed from scratch and compared
(:meth:`~k3jax.infer.runner.ModelRunner.compare_prefix`); a mismatch drops the node and the request goes on
without it.
"""

from __future__ import annotations

import logging
from typing import Sequence

from k3jax.infer.prefix_cache import PrefixCache, PrefixNode, extend_hashes
from k3jax.infer.requests import Request
from k3jax.infer.slots import SlotPool

log = logging.getLogger("k3jax.scheduler")


class PrefixPolicy:
    """The scheduler's side of the prefix cache over ``index`` and ``pool`` (``pool.reclaim`` evicts from the
    index: live requests come first)."""

    def __init__(self, index: PrefixCache, pool: SlotPool, *, verify: bool = False):
        self.index, self.pool, self.verify = index, pool, bool(verify)
        self.block = index.block
        self.verify_log: list[dict] = []
        pool.reclaim = index.make_room

    def lookup(self, req: Request) -> tuple[PrefixNode | None, int]:
        """``(node, shared)``: the deepest cached boundary of ``req.sequence`` with a checkpoint (pinned; None on a
        miss) and the number of leading blocks cached at all (deeper ones lack a checkpoint)."""
        seq = req.sequence
        extend_hashes(req.prefix.hashes, seq, self.block, req.prefix.content_keys)
        shared, node = self.index.lookup(req.prefix.hashes[:len(seq) // self.block])
        if node is not None:
            self.index.pin(node)
        return node, shared

    def admitted(self, req: Request, hit: int, shared: int) -> None:
        """Record the lookup, the prompt tokens the hit served (first admission) and where this prefill saves."""
        n = len(req.sequence)
        self.index.record(n, hit)
        if req.preemptions == 0:
            req.prefix.cached_tokens = hit
        req.prefix.save_at = self.index.save_points(n, hit, shared)

    def check_hit(self, req: Request, node: PrefixNode, runner) -> bool:
        """With ``verify``: recompute the hit from scratch and compare; on a mismatch drop the node (and all built
        on it). True when the hit may be used."""
        if not self.verify:
            return True
        ids = req.sequence[:node.length]
        overlay = req.media.overlay if req.media is not None else None
        err, where, ok = runner.compare_prefix(ids, overlay, node.checkpoint, node.pages)
        self.index.count("verified")
        self.verify_log.append({"request": req.id, "cached_tokens": node.length, "ok": ok, "max_abs_diff": err,
                                "worst": where})
        if not ok:
            self.index.count("verify_failures")
            log.error("prefix cache: the hit of %d tokens for %s does not match its recomputation (%s: max |Δ| "
                      "%.3g); dropped, recomputing without it", node.length, req.id, where, err)
            self.index.unpin(node)
            self.index.discard(node)
        return ok

    def register(self, req: Request, checkpoint=None, provisional: bool = False,
                 pending: Sequence[int] = ()) -> list[tuple[int, int]]:
        """Cache every block boundary of the tokens ``req``'s slot holds, and with ``checkpoint`` (a
        :class:`~k3jax.infer.prefix_cache.KDACheckpoint` saved at the slot's length) attach it where that length is
        a boundary. ``pending``: tokens the slot holds that ``req.tokens`` does not list yet; ``provisional``: the
        checkpoint marks the end of the sequence so far (only the latest such is kept, off the stride). Returns the
        page copies ``(src, dst)`` the next step must make before the slot writes again (copy-on-write)."""
        B, have = self.block, req.computed
        nb = have // B
        if nb == 0:
            return []
        extend_hashes(req.prefix.hashes, (req.prompt + req.tokens + list(pending))[:nb * B], B,
                      req.prefix.content_keys)
        parent, copies = None, []
        for b in range(1, nb + 1):
            node = self.index.node(req.prefix.hashes[b - 1])
            if node is None:
                node = self._insert(req, b, parent, copies)
                if node is None:
                    break
            parent = node
        if parent is None:
            return copies
        self.index.touch(parent)
        if checkpoint is not None and parent.length == have and parent.checkpoint is None:
            self.index.attach(parent, checkpoint)
            if provisional:
                prev = req.prefix.provisional
                if prev is not None and prev[0].checkpoint is prev[1] and (prev[0].length // B) % self.index.stride:
                    self.index.drop_checkpoint(prev[0])     # only the latest end-of-sequence checkpoint is kept
                req.prefix.provisional = (parent, checkpoint)
        self.index.enforce_budget()
        return copies

    def _insert(self, req: Request, b: int, parent, copies: list) -> PrefixNode | None:
        """A node for block ``b`` of ``req``'s slot over its pages; a page the slot still writes into goes to the node
        and the slot continues in a fresh copy. None when no page is free for that copy."""
        page, slot = self.pool.page_size, req.slot
        n_pg = -(-(b * self.block) // page)
        pages, take = list(self.pool.pages[slot][:n_pg]), ()
        if req.computed < n_pg * page:
            got = self.pool.alloc.alloc(1)
            if got is None:
                return None
            old = self.pool.replace_page(slot, n_pg - 1, got[0])
            copies.append((old, got[0]))
            take = (old,)
        return self.index.insert(req.prefix.hashes[b - 1], parent, b * self.block, pages, take=take)

    def release(self, node: PrefixNode | None) -> None:
        if node is not None:
            self.index.unpin(node)

    def held_pages(self) -> dict[int, int]:
        """Page → nodes referencing it (for :meth:`SlotPool.check`)."""
        return dict(self.index.page_users)


__all__ = ["PrefixPolicy"]
