"""Continuous batching over a static slot pool — the policy half of the engine behind ``k3jax serve`` and
``k3jax generate``.

The :class:`Scheduler` decides; the :class:`~k3jax.infer.runner.ModelRunner` computes. Each step the scheduler takes
what other threads queued (:class:`~k3jax.infer.inbox.Inbox`), makes sure every decoding sequence has the page its
next token goes to (preempting the newest running request when the pool is empty), admits waiting requests while a
slot and their pages are free (a prefix-cache hit starts from a cached KDA checkpoint), and builds a
:class:`~k3jax.infer.plan.StepPlan`: the decoding rows — or a speculative round over them — and one prefill chunk
(the oldest admitted prompt; its length from a few static buckets, the largest the step's token budget leaves after
the decode tokens), run by the runner in one forward. It applies the :class:`~k3jax.infer.plan.StepOutput`: tokens
to their requests, lengths, prefix-cache registration, events to the consumers. A request joins at the next step
and leaves the moment it stops.

* **Preemption.** When decode finds no free page (after evicting cached prefixes), the most recently admitted
  running request is preempted: its slot and pages are freed and it goes back to the head of the queue with its
  prompt and the tokens generated so far, to be recomputed (its stream continues where it stopped).
* **One owner.** Every mutable structure (slot pool, queue, prefix index, counters) belongs to the scheduler
  thread; :meth:`submit`, :meth:`cancel` and :meth:`call` queue work for it, and after each step it publishes an
  immutable snapshot (:meth:`snapshot`) that ``/metrics`` and ``/health`` read from any thread.
* **Nothing recompiles while serving**: :meth:`warmup` compiles every step shape.

Python API: ``sched = Scheduler(model, EngineConfig(max_slots=8)); sched.warmup(); sched.start()``;
``req = sched.submit(ids, SamplingParams(max_tokens=64))``; ``for ev in req.stream(): …``; ``sched.cancel(req)``;
``sched.close()``. Without :meth:`start`, :meth:`step` drives it from the caller's thread (what
:class:`~k3jax.infer.engine.Engine` does).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import types
from typing import Callable, Sequence

import numpy as np

from k3jax.infer.config import EngineConfig, EngineSizes
from k3jax.infer.inbox import Hooks, Inbox
from k3jax.infer.plan import Chunk, Rows, StepOutput, StepPlan, sampling_for
from k3jax.infer.prefix_cache import PrefixCache
from k3jax.infer.prefix_policy import PrefixPolicy
from k3jax.infer.proposers import DraftModel, Proposer, make_proposer
from k3jax.infer.requests import (DECODE, DONE, PREFILL, WAITING, QueueFull, Request, RequestError, SamplingParams,
                                  TokenEvent, new_request)
from k3jax.infer.slots import SlotPool
from k3jax.infer.spec_policy import Speculation

log = logging.getLogger("k3jax.scheduler")


class _Ops:
    """Device work admission and registration queue for the next step's plan (copies, restores, first tokens)."""

    def __init__(self):
        self.copies: list = []
        self.restores: list = []
        self.samples: list = []

    def take(self) -> tuple[tuple, tuple, tuple]:
        out = tuple(self.copies), tuple(self.restores), tuple(self.samples)
        self.copies, self.restores, self.samples = [], [], []
        return out


class Scheduler:
    """Continuous batching for a :class:`~k3jax.nn.model.K3ForCausalLM` (see the module docstring).

    ``config``: every engine option (:class:`~k3jax.infer.config.EngineConfig`); ``draft_model``: a loaded draft for
    ``config.speculative`` = ``draft:PATH:K`` (else PATH is loaded); ``proposer``: another
    :class:`~k3jax.infer.proposers.Proposer` (e.g. a :class:`~k3jax.infer.proposers.FunctionProposer`); ``encoder``:
    a :class:`~k3jax.vision.model.VisionEncoder` for requests with images (``pad_id``: their ``<|media_pad|>``
    id); ``runner``: a ready runner (or a stand-in
    with its interface: host-policy tests run the scheduler without a model)."""

    def __init__(self, model=None, config: EngineConfig | None = None, *, draft_model=None,
                 proposer: Proposer | None = None, encoder=None, pad_id: int | None = None, runner=None):
        self.config = config = config or EngineConfig()
        spec = config.speculative
        if spec is not None and proposer is None:
            proposer = make_proposer(spec, draft_model)
        if runner is None:
            from k3jax.infer.runner import ModelRunner

            if encoder is not None and config.vision_buckets:
                encoder.buckets = tuple(sorted(config.vision_buckets))
            runner = ModelRunner(model, config.sizes(model.config), mixed=config.mixed_steps, encoder=encoder,
                                 scan=config.scan_layers,
                                 pad_id=pad_id,
                                 draft=proposer.model if isinstance(proposer, DraftModel) else None,
                                 k=spec.k if spec is not None else 0, reference=config.prefix_cache_verify)
        self.runner, self.cfg, self.sizes = runner, runner.cfg, runner.sizes
        sz = self.sizes
        self.pool = SlotPool(sz.max_slots, page_size=sz.page_size, num_pages=sz.num_pages, max_pages=sz.max_pages)
        self.prefix: PrefixPolicy | None = None
        if config.prefix_cache:
            pool_bytes = sz.token_bytes * sz.page_size * sz.num_pages
            budget = config.prefix_cache_memory if config.prefix_cache_memory is not None else \
                pool_bytes + sz.max_slots * runner.checkpoint_bytes()
            index = PrefixCache(self.pool.alloc, block=config.prefix_cache_block, page_size=sz.page_size,
                                page_bytes=sz.token_bytes * sz.page_size, budget=budget,
                                stride=config.prefix_cache_stride)
            self.prefix = PrefixPolicy(index, self.pool, verify=config.prefix_cache_verify)
        self.spec: Speculation | None = None
        if spec is not None:
            self.spec = Speculation(spec, proposer, sz, config.prefix_cache_block if self.prefix else None)
        self.inbox = Inbox(config.max_queue)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request | None] = [None] * sz.max_slots
        self.counters = {"steps": 0, "decode_steps": 0, "decode_rows": 0, "prefill_chunks": 0, "mixed_steps": 0,
                         "preemptions": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0,
                         "requests_finished": 0, "banned_changed": 0}
        self.finish_hooks = Hooks()        # called with each finished request, on the scheduler thread
        self.step_hooks = Hooks()          # after every step, on its thread (invariant checks)
        self._ops = _Ops()
        self._ids, self._admit_seq = itertools.count(), itertools.count()
        self._thread: threading.Thread | None = None
        self._snapshot = types.MappingProxyType({})
        self._publish()

    # ------------------------------------------------------------------------------------------- public API
    @property
    def max_queue(self) -> int:
        return self.inbox.max_queue

    @max_queue.setter
    def max_queue(self, n: int) -> None:
        self.inbox.max_queue = int(n)

    def warmup(self) -> dict:
        """Compile every step shape (all rows idle: nothing in the caches changes) and the small programs. Returns
        the compiled shapes: ``{"prefill": [[1, C]…], "decode": [[b, 1]…], "mixed": [[b, 1, C]…]}`` (+
        ``"speculative"`` ``[[b, k+1]…]``)."""
        if any(self.running) or self.waiting:
            raise RuntimeError("warmup() must run before requests are served")
        shapes = self.step_shapes()
        seconds = self.runner.warmup(shapes)
        if self.spec is not None:
            for key, s in seconds.items():
                if key[0] is not None and not key[2]:   # plain and speculative steps, timed at warm-up
                    self.spec.observe(key, s)
        if self.config.vision_buckets and getattr(self.runner, "encoder", None) is not None:
            self.runner.warm_vision()
        self._publish()
        out = {"prefill": [[1, C] for k, b, C in shapes if not b],
               "decode": [[b, 1] for k, b, C in shapes if k == "decode" and not C],
               "mixed": [[b, 1, C] for k, b, C in shapes if b and C]}
        if self.spec is not None:
            out["speculative"] = [[b, self.spec.k + 1] for k, b, C in shapes if k == "verify" and not C]
        return out

    def step_shapes(self) -> list[tuple]:
        """Every step shape the scheduler can plan: ``(rows kind, rows, chunk)``."""
        sz = self.sizes
        kinds = ["decode"] + (["verify"] if self.spec is not None else [])
        mixed = sz.mixed_chunks() if self.config.mixed_steps else ()
        # a speculative round beside a chunk runs as two forwards (the chunk's, then the round's): no shapes of its own
        return ([(None, 0, C) for C in sz.prefill] + [(k, b, 0) for k in kinds for b in sz.decode] +
                [("decode", b, C) for b in sz.decode for C in mixed])

    def start(self) -> "Scheduler":
        """Run the scheduling loop on a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="k3jax-scheduler", daemon=True)
            self._thread.start()
        return self

    def submit(self, prompt: Sequence[int] | None, params: SamplingParams | None = None, *,
               callback: Callable[[TokenEvent], None] | None = None, request_id: str | None = None,
               use_prefix_cache: bool = True, content_keys: Sequence[tuple[int, bytes]] = (),
               use_speculative: bool = True, prediction: Sequence[int] = (), embeds=None,
               images: Sequence | None = None) -> Request:
        """Queue a request (it joins the batch at the next step); from any thread. Raises :class:`RequestError`
        (naming the field) for a request that can never run and :class:`QueueFull` when ``max_queue`` requests are
        waiting. ``use_prefix_cache=False``: neither reuses nor adds cached prefixes; ``content_keys``:
        ``(position, digest bytes)`` of non-token inputs hashed into the prefix cache's keys; ``use_speculative=
        False``: plain decode; ``prediction``: ids the answer is expected to resemble (OpenAI's predicted output),
        which prompt lookup drafts from too; ``embeds``: a :class:`~k3jax.vision.model.MultimodalPrompt` (image
        rows computed; its ids are the prompt); ``images``: processed images the engine encodes (the prompt
        holds one ``<|media_pad|>`` per image)."""
        if images:
            prompt, content_keys = self._image_prompt(prompt, images)
        req = new_request(prompt, params or SamplingParams(), self.sizes, hidden=self.cfg.hidden_size,
                          request_id=request_id or f"req-{next(self._ids)}", callback=callback,
                          use_prefix_cache=use_prefix_cache, content_keys=content_keys,
                          use_speculative=use_speculative, prediction=prediction, embeds=embeds, images=images,
                          record_logits=self.config.record_logits)
        self.inbox.submit(req)
        return req

    def _image_prompt(self, prompt, images) -> tuple[list[int], tuple]:
        """The prompt with each image's pad expanded to its token count, and the images' content keys (host only:
        the rows are computed at admission)."""
        from k3jax.vision.model import PromptError, expand_pads

        if getattr(self.runner, "encoder", None) is None:
            raise RequestError("images: this engine has no vision encoder", "images")
        try:
            ids, firsts = expand_pads(prompt, [im.tokens for im in images], self.runner.encoder_pad_id)
        except PromptError as e:
            raise RequestError(f"messages: {e}", "messages") from None
        return ids, tuple((p, im.digest) for p, im in zip(firsts, images))

    def cancel(self, req: Request | str, reason: str = "abort") -> None:
        """Stop a request at the next step (from any thread); its slot and pages are freed, its last event has
        ``reason`` (``abort``; ``stop`` when its consumer found a stop string)."""
        self.inbox.cancel(req, reason)

    def call(self, fn: Callable[[], object], timeout: float | None = 60.0):
        """Run ``fn()`` on the scheduler thread between two steps and return its result (or raise its exception):
        how another thread reads or changes engine state. Without a running loop it runs here."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        return self.inbox.call(fn).result(timeout)

    def batched(self):
        """``with sched.batched(): …`` — the submissions inside reach the scheduler in the same step."""
        return self.inbox.held()

    def close(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests; let running ones finish for up to ``drain_timeout`` seconds, then cancel the rest
        and stop the loop."""
        self.inbox.accepting = False
        deadline = time.monotonic() + drain_timeout
        while drain_timeout > 0 and time.monotonic() < deadline and self._thread is not None and self.busy():
            time.sleep(0.02)
        self.inbox.close()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        for item in self.inbox.drain():
            if item[0] == "submit":
                self.waiting.append(item[1])
            elif item[0] == "call":
                item[2].cancel()
        for r in list(self.waiting) + [r for r in self.running if r is not None]:
            self._finish(r, "abort")
        self._publish()

    def busy(self) -> bool:
        """Whether any submitted request has not finished (from any thread)."""
        return self.inbox.live > 0

    def snapshot(self) -> types.MappingProxyType:
        """The latest published figures (slots, pages, queue, counters, compiles, prefix cache, speculation): an
        immutable mapping the scheduler thread replaces after each step; safe to read from any thread."""
        return self._snapshot

    def memory(self) -> dict:
        """Bytes of the slot pool: KDA state per slot, MLA latent per token and per page, the totals, and what the
        prefix cache and speculation add."""
        out = self.runner.memory()
        if self.prefix is not None:
            out.update(prefix_checkpoint_bytes=self.runner.checkpoint_bytes(), prefix_budget_bytes=self.prefix.index.budget)
        return out

    # ------------------------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while True:
            self.inbox.wait(busy=bool(self.waiting) or any(r is not None for r in self.running))
            if self.inbox.closing:
                return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a failing step fails the requests in it, not the server
                log.exception("scheduler step failed")
                for r in [r for r in self.running if r is not None]:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                self._publish()

    def step(self) -> None:
        """One scheduling step: take what was queued, make room for decode, admit, plan, run, apply, publish. (The
        background loop calls it; call it yourself to drive the scheduler without a thread.)"""
        self._take_inbox()
        self._ensure_decode_pages()
        self._admit()
        plan = self._plan()
        if not plan.empty:
            out = self.runner.execute(plan)
            self._apply(plan, out)
        self.counters["steps"] += 1
        self._publish()
        for hook in self.step_hooks:
            hook()

    def _take_inbox(self) -> None:
        for item in self.inbox.drain():
            kind = item[0]
            if kind == "submit":
                self.waiting.append(item[1])
            elif kind == "cancel":
                self._cancel_now(item[1], item[2])
            else:
                fn, fut = item[1], item[2]
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)

    def _cancel_now(self, x: Request | str, reason: str) -> None:
        rid = x if isinstance(x, str) else x.id
        for r in [r for r in self.waiting if r.id == rid] + [r for r in self.running if r is not None and r.id == rid]:
            self._finish(r, reason)

    # ------------------------------------------------------------------------------------------- admission
    def _ensure_decode_pages(self) -> None:
        """The page for each decoding sequence's next token (oldest first); preempts the newest running request
        when neither the free list nor the prefix cache has one."""
        for r in sorted((r for r in self.running if r is not None and r.state == DECODE), key=lambda r: r.admitted):
            while r.state == DECODE and not self.pool.grow(r.slot, int(self.pool.lengths[r.slot]) + 1):
                victim = max((x for x in self.running if x is not None), key=lambda x: x.admitted)
                self._preempt(victim)

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s slot and pages; it is recomputed from its prompt + generated tokens when re-admitted."""
        self._release(req)
        req.state, req.computed = WAITING, 0
        req.sequence = req.prompt + req.tokens
        req.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(req)
        self.inbox.requeued()
        log.info("preempted %s (%d tokens) for lack of pages", req.id, len(req.sequence))

    def _release(self, req: Request) -> None:
        if req.slot >= 0 and self.running[req.slot] is req:
            self.running[req.slot] = None
            pin = self.pool.release(req.slot)
            if self.prefix is not None:
                self.prefix.release(pin)
        req.slot = -1
        req.prefix.provisional = None

    def _admit(self) -> None:
        """Admit waiting requests, first come first served, while a slot and their pages are free."""
        while self.waiting:
            free = self.pool.free_slots()
            if not free:
                return
            req = self.waiting[0]
            if req.images is not None and req.media is None and not self._encode(req):
                continue
            use = self.prefix is not None and req.prefix.use
            node, shared = self.prefix.lookup(req) if use else (None, 0)
            if node is not None and not self.prefix.check_hit(req, node, self.runner):
                continue                                    # a hit that failed verification: look again
            hit = node.length if node is not None else 0
            reuse = hit // self.sizes.page_size             # whole pages shared with the cached prefix
            pages = self.pool.take_pages(self.pool.pages_for(len(req.sequence)) - reuse)
            if pages is None:
                if node is not None:
                    self.prefix.release(node)
                return                                      # first come, first served: wait for pages
            self.waiting.popleft()
            self.inbox.admitted()
            self._start(req, free[0], node, reuse, pages, hit)
            if use:
                self.prefix.admitted(req, hit, shared)
                if req.preemptions == 0:
                    self.counters["cached_prompt_tokens"] += hit

    def _start(self, req: Request, slot: int, node, reuse: int, pages: list[int], hit: int) -> None:
        """``req`` runs in ``slot``: its pages, and from a cached prefix ``node`` the shared pages, a copy of the
        partial last page and the KDA checkpoint (queued for the next step); a sequence cached whole gets its first
        token from the checkpoint's logits."""
        self.pool.assign(slot, req.id, node.pages[:reuse] if node is not None else [], pages, hit, pin=node)
        req.slot, req.state, req.computed = slot, PREFILL, hit
        req.admitted = next(self._admit_seq)
        req.spec.draft_len = 0                              # a draft model starts over in this slot
        self.running[slot] = req
        if node is None:
            return
        page = self.sizes.page_size
        if hit % page:
            self._ops.copies.append((node.pages[hit // page], self.pool.pages[slot][hit // page]))
        self._ops.restores.append((slot, node.checkpoint.rows))
        if hit == len(req.sequence):
            self._ops.samples.append((slot, node.checkpoint, sampling_for(self.cfg.vocab_size, [req])))

    def _encode(self, req: Request) -> bool:
        """The request's image rows (the vision encoder, on this thread); False when it failed (finished)."""
        from k3jax.vision.model import splice_prompt

        try:
            feats = self.runner.encode_images(req.images)
            req.media = splice_prompt(req.prompt, feats, self.runner.encoder_pad_id,
                                      [im.digest for im in req.images])
            return True
        except Exception as e:  # noqa: BLE001 - one request's images fail that request only
            log.exception("request %s: encoding its images failed", req.id)
            self.waiting.popleft()
            self._finish(req, "error", error=f"{type(e).__name__}: {e}", waiting=True)
            return False

    # ------------------------------------------------------------------------------------------- planning
    def _plan(self) -> StepPlan:
        copies, restores, samples = self._ops.take()
        decoding = sorted((r for r in self.running if r is not None and r.state == DECODE), key=lambda r: r.slot)
        chunk, req = self._pick_chunk(len(decoding))
        rows, draft_chunks = self._plan_rows(decoding, chunk)
        saves = self._saves(rows, chunk, req)
        return StepPlan(self.pool.page_table(), self.pool.lengths_copy(), rows=rows, chunk=chunk, copies=copies,
                        restores=restores, draft_chunks=draft_chunks,
                        samples=tuple((s, ck.logits, samp) for s, ck, samp in samples), saves=saves,
                        want_logits=self.config.record_logits)

    def _pick_chunk(self, n_decode: int) -> tuple[Chunk | None, Request | None]:
        """The oldest admitted prompt's next chunk: as long as the budget after ``n_decode`` decode tokens allows
        (the whole largest bucket when nothing decodes), ending where a checkpoint is saved."""
        cands = [r for r in self.running if r is not None and r.state == PREFILL and r.computed < len(r.sequence)]
        if not cands:
            return None, None
        req = min(cands, key=lambda r: r.admitted)
        P = self.sizes.prefill
        budget = self.sizes.chunk if n_decode == 0 else max(P[0], self.sizes.max_step_tokens - n_decode)
        want = len(req.sequence) - req.computed
        ahead = [p for p in req.prefix.save_at if p > req.computed]
        if ahead:                                           # a chunk ends where a checkpoint is saved
            want = min(want, min(ahead) - req.computed)
        fits = [b for b in P if b <= budget] or [P[0]]
        C = next((b for b in fits if b >= want), fits[-1])
        n = min(want, C)
        ids = np.zeros(C, np.int32)
        ids[:n] = req.sequence[req.computed:req.computed + n]
        embeds = req.media.overlay(req.computed, C) if req.media is not None else None
        return Chunk(req.slot, req.computed, ids, n, sampling_for(self.cfg.vocab_size, [req]), embeds), req

    def _plan_rows(self, decoding: list[Request], chunk: Chunk | None) -> tuple[Rows | None, tuple]:
        """The decoding rows: a speculative round when the proposer has drafts and a round pays, else one token
        each; idle rows fill the bucket (free slots first, never the chunk's when another will do)."""
        if not decoding:
            return None, ()
        b = self.sizes.bucket(len(decoding))
        live = [r.slot for r in decoding]
        taken = set(live)
        other = [s for s in self.pool.free_slots() if s not in taken] + \
            [s for s in range(self.sizes.max_slots) if s not in taken and self.running[s] is not None]
        if chunk is not None:
            other = [s for s in other if s != chunk.slot] + [chunk.slot] * (chunk.slot in other)
        slots = np.array(live + other[:b - len(live)], np.int32)
        active = np.arange(b) < len(live)
        tokens = np.array([r.tokens[-1] for r in decoding] + [0] * (b - len(live)), np.int32)
        sampling = sampling_for(self.cfg.vocab_size, decoding + [None] * (b - len(live)))
        if self.spec is not None:
            got = self.spec.round(decoding, Rows(slots, tokens, active, sampling), chunk, self.pool,
                                  self.prefix is not None)
            if got is not None:
                return got
        return Rows(slots, tokens, active, sampling), ()

    def _saves(self, rows: Rows | None, chunk: Chunk | None, chunk_req: Request | None) -> tuple:
        """``(slot, length)`` where the step may reach a prefix-cache checkpoint boundary."""
        if self.prefix is None:
            return ()
        B, out = self.prefix.block, []
        if chunk is not None and chunk_req.prefix.use and chunk.start + chunk.n in chunk_req.prefix.save_at:
            out.append((chunk.slot, chunk.start + chunk.n))
        if rows is not None:
            for j in np.flatnonzero(rows.active):
                r = self.running[int(rows.slots[j])]
                L = int(self.pool.lengths[r.slot])
                if r.prefix.use and (rows.verify or (L + 1) % B == 0):
                    out.append((r.slot, (L // B + 1) * B))
        return tuple(out)

    # ------------------------------------------------------------------------------------------- applying
    def _apply(self, plan: StepPlan, out: StepOutput) -> None:
        for slot, tok in out.sampled.items():              # sequences served whole from the prefix cache
            req = self.running[slot]
            if req is not None:
                if req.logits is not None:
                    req.logits.append(np.asarray(next(lg for s, lg, _ in plan.samples if s == slot), np.float32))
                self._accept_token(req, tok)
        if plan.chunk is not None:
            self._apply_chunk(plan.chunk, out)
        if plan.rows is not None:
            self._apply_rows(plan, out)
        if plan.forward:
            c = self.counters
            c["mixed_steps"] += plan.rows is not None and plan.chunk is not None
            kind, b, C = plan.shape()
            if self.spec is not None and kind is not None:
                self.spec.observe((kind, b, C), out.seconds)

    def _apply_chunk(self, chunk: Chunk, out: StepOutput) -> None:
        req = self.running[chunk.slot]
        req.computed += chunk.n
        self.pool.set_length(req.slot, req.computed)
        self.counters["prefill_chunks"] += 1
        if req.preemptions == 0:
            self.counters["prompt_tokens"] += chunk.n
        if self.prefix is not None and req.prefix.use:
            self._ops.copies += self.prefix.register(req, out.checkpoints.get(req.slot))
        if req.computed == len(req.sequence):
            if req.logits is not None:
                req.logits.append(out.chunk_logits)
            self.counters["banned_changed"] += bool(out.banned_changed[-1])
            self._accept_token(req, out.chunk_token)

    def _apply_rows(self, plan: StepPlan, out: StepOutput) -> None:
        rows, c = plan.rows, self.counters
        c["decode_steps"] += 1
        c["decode_rows"] += int(rows.active.sum())
        if rows.verify:
            self.spec.counters["spec_steps"] += 1
        for j in np.flatnonzero(rows.active):
            req, kept = self.running[int(rows.slots[j])], int(out.kept[j])
            toks = [int(t) for t in out.tokens[j, :kept]]
            if rows.verify and rows.n_draft[j]:
                self.spec.applied(req, int(rows.n_draft[j]), kept)
                if self.spec.proposer.on_device:
                    req.spec.draft_len += kept            # the draft kept the same tokens
            self.pool.advance(req.slot, kept)
            req.computed += kept
            if self.prefix is not None and req.prefix.use and req.computed % self.prefix.block == 0:
                self._ops.copies += self.prefix.register(req, out.checkpoints.get(req.slot), provisional=True,
                                                         pending=toks[:-1])
            if req.logits is not None:
                req.logits.extend(out.row_logits[j, :kept])
            c["banned_changed"] += bool(out.banned_changed[j])
            for t in toks:
                self._accept_token(req, t)
                if req.state != DECODE:
                    break

    def _accept_token(self, req: Request, tok: int) -> None:
        """Record one generated token; finish the request when it stops."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        req.tokens.append(tok)
        if req.ban is not None:
            req.ban.push(tok)
        self.counters["generated_tokens"] += 1
        self._emit(req, [tok])
        if req.state == DONE:                              # its consumer failed
            return
        if tok in req.stops:
            self._finish(req, "stop")
        elif len(req.tokens) >= req.params.max_tokens or len(req.prompt) + len(req.tokens) >= self.sizes.max_model_len:
            self._finish(req, "length")
        else:
            req.state = DECODE

    def _emit(self, req: Request, tokens: list[int], finished: bool = False, reason: str | None = None,
              error: str | None = None) -> None:
        ev = TokenEvent(req.id, tokens, finished, reason, error, time.perf_counter())
        try:
            if req.callback is not None:
                req.callback(ev)
            else:
                req._q.put(ev)
        except Exception as e:  # noqa: BLE001 - a consumer that raises fails its own request only
            if not finished:
                log.exception("request %s: its event consumer raised", req.id)
                self._finish(req, "error", error=f"{type(e).__name__}: {e}")

    def _finish(self, req: Request, reason: str, error: str | None = None, waiting: bool = False) -> None:
        if req.state == DONE:
            return
        was_waiting = waiting or req.state == WAITING
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.state, req.finish_reason, req.error = DONE, reason, error
        req.finish_time = time.perf_counter()
        self.counters["requests_finished"] += 1
        self.inbox.finished(was_waiting)
        self._emit(req, [], True, reason, error)
        for hook in self.finish_hooks:
            try:
                hook(req)
            except Exception:  # noqa: BLE001 - a hook's failure is logged, the request is already finished
                log.exception("finish hook raised")

    # ------------------------------------------------------------------------------------------- figures
    def _publish(self) -> None:
        pool = self.pool
        snap = {"slots_in_use": pool.used(), "max_slots": self.sizes.max_slots, "free_pages": pool.free_pages,
                "num_pages": pool.num_pages, "page_size": self.sizes.page_size, "queue_length": self.inbox.waiting,
                "requests_live": self.inbox.live, "compiles": dict(self.runner.traces), **self.counters,
                "prefix": self.prefix.index.snapshot() if self.prefix is not None else None,
                "spec": self.spec.snapshot() if self.spec is not None else None}
        self._snapshot = types.MappingProxyType(snap)

    def check(self, exact: bool = True) -> None:
        """Assert the slot pool's and the prefix index's invariants (from the scheduler thread: a step hook);
        ``exact=False`` when pages are also held outside the engine (tests squeezing the pool)."""
        if self.prefix is not None:
            self.prefix.index.check()
        self.pool.check(self.prefix.held_pages() if self.prefix is not None else None, exact)


__all__ = ["Scheduler", "SamplingParams", "Request", "TokenEvent", "RequestError", "QueueFull", "EngineConfig",
           "EngineSizes"]
