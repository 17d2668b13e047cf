"""How the scheduler uses the prefix cache (:mod:`k3jax.infer.prefix_cache`): the device side.

:class:`PrefixCaching` is a mixin of :class:`k3jax.infer.scheduler.Scheduler`. On admission the scheduler looks the
sequence up and, on a hit, :meth:`~PrefixCaching._start_from` copies the cached KDA checkpoint into the slot
(decode mutates the slot's state in place, so the checkpoint itself is never handed out) and copies the partial last
page, so a request never writes into a page the cache holds; prefill then resumes at the hit. After each prefill
chunk and at each block boundary decode crosses, :meth:`~PrefixCaching._register` adds the boundaries the slot now
holds (nodes over its pages) and, at the chosen boundaries, a checkpoint. ``prefix_verify`` recomputes every hit
from scratch through the contiguous cache and compares. Each device operation is one jitted function with static
shapes (the slot and page ids are arguments), compiled in ``warmup``.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.infer.prefix_cache import KDACheckpoint, PrefixCache, PrefixNode, extend_hashes
from k3jax.infer.requests import _WAITING, Request, _dev, _i32
from k3jax.infer.sampling import sample_rows
from k3jax.nn.cache import KDACache, init_cache, slot_state_bytes

log = logging.getLogger("k3jax.scheduler")


class PrefixCaching:
    """The prefix-cache half of the scheduler (state set up by :meth:`_init_prefix_cache`)."""

    def _init_prefix_cache(self, prefix_cache: bool, prefix_cache_memory: int | None, prefix_block: int,
                           prefix_stride: int, prefix_verify: bool, record_logits: bool) -> None:
        self.record_logits = bool(record_logits)
        self.prefix_verify = bool(prefix_verify)
        self.prefix: PrefixCache | None = None
        if prefix_cache:
            self.checkpoint_bytes = slot_state_bytes(self.cfg) + self.cfg.vocab_size * jnp.dtype(self.cfg.dtype).itemsize
            pool = self.token_bytes * self.page_size * self.num_pages
            budget = prefix_cache_memory if prefix_cache_memory is not None else \
                pool + self.max_slots * self.checkpoint_bytes
            self.prefix = PrefixCache(self.alloc, block=prefix_block, page_size=self.page_size,
                                      page_bytes=self.token_bytes * self.page_size, budget=budget,
                                      stride=prefix_stride)
            self.traces["prefix"] = 0
            self._save_rows = jax.jit(self._save_rows_impl)
            self._restore_rows = jax.jit(self._restore_rows_impl, donate_argnums=(0,))
            self._copy_page = jax.jit(self._copy_page_impl, donate_argnums=(0,))
            self._sample_logits = jax.jit(self._sample_logits_impl)
            self._reference_chunk = jax.jit(self._reference_chunk_impl, donate_argnums=(1,))
            self.verify_log: list[dict] = []

    def _warm_prefix_cache(self, last: jax.Array, samp1) -> None:
        """Compile the checkpoint save / restore, page copy and sample-from-logits steps (and the verifier's)."""
        if self.prefix is None:
            return
        self.cache = self._restore_rows(self.cache, _i32(0), self._save_rows(self.cache, _i32(0)))
        self._copy_pages(0, 0)
        self._sample_logits(jnp.zeros_like(last), samp1)
        if self.prefix_verify:
            self._reference_chunk(self.state, init_cache(self.cfg, 1, self.max_model_len),
                                  jnp.zeros((1, self.chunk), jnp.int32), _i32(0))

    # --------------------------------------------------------------------------------------------- jitted
    def _save_rows_impl(self, cache, slot):
        self.traces["prefix"] += 1
        return cache.kda_rows(slot)

    def _restore_rows_impl(self, cache, slot, rows):
        self.traces["prefix"] += 1
        return cache.with_kda_rows(slot, rows)

    def _copy_page_impl(self, cache, src, dst):
        self.traces["prefix"] += 1
        return cache.copy_page(src, dst)

    def _sample_logits_impl(self, logits, samp):
        self.traces["prefix"] += 1
        return sample_rows(logits[None], *[jnp.reshape(s, (1,)) for s in samp])[0]

    def _reference_chunk_impl(self, state, cache, ids, n, embeds=None):
        """A chunk of a from-scratch prefill into a contiguous cache (``prefix_verify``'s independent path)."""
        self.traces["prefix"] += 1
        out = nnx.merge(self.graphdef, state)(ids, cache=cache, n_new=jnp.reshape(n, (1,)), embeds=embeds)
        return jax.lax.dynamic_index_in_dim(out.logits[0], jnp.maximum(n - 1, 0), 0, keepdims=False), out.cache

    # ------------------------------------------------------------------------------------------- host side
    def _copy_pages(self, src: int, dst: int) -> None:
        """Page ``dst`` a copy of page ``src`` in every paged pool (the target's, and a draft model's)."""
        self.cache = self._copy_page(self.cache, _i32(src), _i32(dst))
        if getattr(self, "draft_model", None) is not None:
            self.dcache = self._copy_page(self.dcache, _i32(src), _i32(dst))

    def _take_pages(self, n: int) -> list[int] | None:
        """``n`` free pages, evicting cached prefixes when the free list is short (live requests come first)."""
        got = self.alloc.alloc(n)
        if got is None and self.prefix is not None and self.prefix.make_room(n):
            got = self.alloc.alloc(n)
        return got

    def _start_from(self, req: Request, node: PrefixNode) -> bool:
        """Resume ``req`` from the cached prefix ``node``: copy the partial last page (a request never writes into a
        page the cache holds) and the KDA checkpoint into the slot. With ``prefix_verify``, compare with a
        from-scratch recomputation first; on a mismatch drop the node (and all built on it) and re-queue ``req``."""
        hit, page = node.length, self.page_size
        if hit % page:
            self.cache = self._copy_page(self.cache, _i32(node.pages[hit // page]),
                                         _i32(req.pages[hit // page]))
        self.cache = self._restore_rows(self.cache, _i32(req.slot), node.checkpoint.rows)
        if not self.prefix_verify or self._verify_hit(req, node):
            return True
        self.prefix.discard(node)
        self._release(req)
        req.state, req.computed = _WAITING, 0
        self.waiting.appendleft(req)
        return False

    def _verify_hit(self, req: Request, node: PrefixNode) -> bool:
        """Recompute the first ``node.length`` tokens of ``req`` from scratch through the contiguous cache and
        compare every KDA layer's state and windows, every MLA layer's latents and the next-token logits with what
        the cache restored. Returns True when all agree (max |Δ| ≤ tol·max(1, max|ref|); tol 1e-4 in fp32)."""
        hit, C = node.length, self.chunk
        ids = np.zeros(-(-hit // C) * C, np.int32)
        ids[:hit] = req.sequence[:hit]
        ref = init_cache(self.cfg, 1, self.max_model_len)
        for s in range(0, hit, C):
            embeds = self._chunk_embeds(req, s, C)
            logits, ref = self._reference_chunk(self.state, ref, _dev(ids[None, s:s + C]), _i32(min(C, hit - s)),
                                                *(() if embeds is None else (embeds,)))
        pairs = [("logits", logits, node.checkpoint.logits)]
        got = iter(self._save_rows(self.cache, _i32(req.slot)))
        pages = _dev(np.array(req.pages[:-(-hit // self.page_size)], np.int32))
        for i, (r, c) in enumerate(zip(ref.layers, self.cache.layers)):
            if isinstance(r, KDACache):
                g = next(got)
                pairs += [(f"layer {i} kda {f}", getattr(r, f), getattr(g, f))
                          for f in ("state", "conv_q", "conv_k", "conv_v")]
            else:
                ckv, kr = c.gather(pages, hit)
                pairs += [(f"layer {i} mla c_kv", r.c_kv[0, :hit], ckv), (f"layer {i} mla k_r", r.k_r[0, :hit], kr)]
        tol = 1e-4 if jnp.dtype(self.cfg.dtype) == jnp.float32 else 5e-2
        worst = ("", 0.0)
        ok = True
        for name, a, b in pairs:
            a, b = np.array(a, np.float32), np.array(b, np.float32).reshape(np.shape(a))
            err = float(np.max(np.abs(a - b))) if a.size else 0.0
            if err > worst[1]:
                worst = (name, err)
            ok &= err <= tol * max(1.0, float(np.max(np.abs(a))) if a.size else 1.0)
        self.prefix.stats["verified"] += 1
        self.verify_log.append({"request": req.id, "cached_tokens": hit, "ok": ok, "max_abs_diff": worst[1],
                                "worst": worst[0]})
        if not ok:
            self.prefix.stats["verify_failures"] += 1
            log.error("prefix cache: the hit of %d tokens for %s does not match its recomputation (%s: max |Δ| "
                      "%.3g); dropped, recomputing without it", hit, req.id, worst[0], worst[1])
        return ok

    def _register(self, req: Request, logits: jax.Array | None = None, provisional: bool = False,
                  pending: list[int] = ()) -> None:
        """Cache every block boundary of the tokens ``req``'s slot holds (nodes over its pages), and with ``logits``
        (the next-token logits after them) a KDA checkpoint where the slot's length is a boundary. ``pending``:
        tokens the slot holds that ``req.tokens`` does not list yet (a speculative round's accepted drafts)."""
        P, B, page = self.prefix, self.prefix.block, self.page_size
        have = req.computed
        nb = have // B
        if nb == 0:
            return
        extend_hashes(req.hashes, (req.prompt + req.tokens + list(pending))[:nb * B], B, req.content_keys)
        parent = None
        for b in range(1, nb + 1):
            node = P.nodes.get(req.hashes[b - 1])
            if node is None:
                n_pg = -(-(b * B) // page)
                pages, take = req.pages[:n_pg], ()
                if have < n_pg * page:          # req still writes into that page: it goes on in a copy
                    got = self.alloc.alloc(1)
                    if got is None:
                        break
                    old = pages[-1]
                    self._copy_pages(old, got[0])
                    req.pages[n_pg - 1] = got[0]
                    self.table[req.slot, n_pg - 1] = got[0]
                    take = (old,)
                node = P.insert(req.hashes[b - 1], parent, b * B, pages, take=take)
            parent = node
        if parent is None:
            return
        P.touch(parent)
        if logits is not None and parent.length == have and parent.checkpoint is None:
            rows = self._save_rows(self.cache, _i32(req.slot))
            ck = KDACheckpoint(rows, logits, sum(x.nbytes for x in jax.tree.leaves(rows)) + logits.nbytes)
            P.attach(parent, ck)
            if provisional:
                prev = req.provisional
                if prev is not None and prev[0].checkpoint is prev[1] and (prev[0].length // B) % P.stride:
                    P.drop_checkpoint(prev[0])          # only the latest end-of-sequence checkpoint is kept
                req.provisional = (parent, ck)
        P.enforce_budget()
