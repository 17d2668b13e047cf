"""Continuous batching over a static slot pool, with a paged MLA latent cache — the engine behind ``k3jax serve``.

* **Slots.** ``max_slots`` decode slots, fixed. A slot holds one sequence's KDA state and conv windows (constant
  size) and a row of the page table. One jitted decode step runs the decoding slots, gathered into the smallest of
  a few static batch sizes (:func:`decode_buckets`: ``max_slots`` and, from 8 slots on, 1, 4, 16, …; idle slots
  fill the bucket masked — ``n_new = 0`` leaves their state, windows and pages untouched), each compiled once.
* **Pages.** Each MLA layer keeps its latent cache in a pool of ``num_pages`` pages of ``page_size`` tokens,
  shared by all slots (:class:`~k3jax.nn.cache.PagedMLACache`). A request is admitted when a slot is free and
  the pages for its prompt are; decode takes one more page each time a sequence crosses a page boundary. When none
  is free, the most recently admitted running request is **preempted**: its slot and pages are freed and it goes
  back to the head of the queue with its prompt and the tokens generated so far, to be recomputed (its stream
  continues where it stopped; nothing already sent is repeated). Admission, paging and preemption live in
  :mod:`k3jax.infer.admission`.
* **Steps.** Each step runs at most one prefill chunk (the oldest admitted prompt; chunk lengths come from a few
  static buckets, the largest that fits the step's token budget left after the decode tokens) and then one decode
  step, so a long prompt never stalls the running streams (a smaller budget: shorter chunks between decode steps,
  lower time per output token, longer time to first token). A request joins at the next step and leaves the
  moment it stops (its slot and pages are free for the next step).
* **Nothing recompiles while serving**: :meth:`Scheduler.warmup` compiles every prefill bucket and the decode
  step; ``compiles`` in :meth:`Scheduler.snapshot` counts traces.

Python API: ``sched = Scheduler(model, max_slots=8, …); sched.start()``; ``req = sched.submit(ids, SamplingParams(
max_tokens=64))``; ``for ev in req.stream(): …``; ``sched.cancel(req)``; ``sched.close()``. Events are
:class:`TokenEvent`; a callback given to :meth:`Scheduler.submit` receives them on the scheduler thread instead.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import secrets
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.infer.admission import SlotAdmission
from k3jax.infer.prefix_slots import PrefixCaching
from k3jax.infer.requests import (_DECODE, _DONE, _PREFILL, PageAllocator, QueueFull, Request,
                                  RequestError, SamplingParams, TokenEvent, _dev, _i32)
from k3jax.infer.sampling import SamplingError, sample_rows
from k3jax.infer.spec_slots import SpeculativeDecoding, slot_chunk
from k3jax.infer.speculative import SpecConfig
from k3jax.nn.cache import Cache, init_paged_cache, page_bytes, slot_state_bytes
from k3jax.nn.model import K3ForCausalLM

log = logging.getLogger("k3jax.scheduler")


def decode_buckets(max_slots: int) -> tuple[int, ...]:
    """The static decode batch sizes: ``max_slots``, and from 8 slots on also the powers of 4 below it (1, 4, 16,
    …), so a lightly loaded pool does not pay for every slot. Each step runs the smallest that holds the active
    slots."""
    out = {max_slots}
    if max_slots >= 8:
        b = 1
        while b < max_slots:
            out.add(b)
            b *= 4
    return tuple(sorted(out))


def prefill_buckets(chunk: int) -> tuple[int, ...]:
    """The static prefill chunk lengths: ``chunk``, ``chunk/4``, ``chunk/16`` (those ≥ 16, multiples of 16)."""
    out = {chunk}
    for d in (4, 16):
        c = chunk // d
        if c >= 16 and c % 16 == 0:
            out.add(c)
    return tuple(sorted(out))


class Scheduler(SlotAdmission, PrefixCaching, SpeculativeDecoding):
    """Continuous batching for a :class:`K3ForCausalLM` (see the module docstring).

    ``max_slots`` decode slots; ``max_model_len`` longest prompt + generation; ``page_size`` tokens per MLA page;
    ``num_pages`` pool size (default: enough for every slot at ``max_model_len``; or from ``kv_cache_memory`` bytes
    of MLA latent cache); ``chunk`` the largest prefill chunk; ``max_step_tokens`` the per-step token budget
    (decode tokens + one prefill chunk; default ``chunk``); ``max_queue`` waiting requests before
    :class:`QueueFull`.

    Prefix cache (:mod:`k3jax.infer.prefix_cache`; ``prefix_cache=False`` turns it off): ``prefix_block`` tokens
    per hash block, a KDA checkpoint every ``prefix_stride`` blocks inside a prompt (besides each prompt's last
    boundary, branch points and the end of each turn), ``prefix_cache_memory`` bytes for checkpoints and cached
    pages together (default: the page pool plus one checkpoint per slot); ``prefix_verify`` recomputes every hit
    from scratch and compares (a debug mode: a mismatch is logged, counted and the request recomputed without the
    cache). ``record_logits`` keeps each request's next-token logits per generated token (``Request.logits``).

    Speculative decoding (:mod:`k3jax.infer.spec_slots`): ``speculative`` is a :class:`SpecConfig` or its text
    (``"ngram:4"``, ``"draft:PATH:4"``); ``draft_model`` a loaded draft (else PATH is loaded); ``drafter(request,
    n)`` replaces prompt lookup with another host-side proposer (at most n tokens). Requests submitted with
    ``use_speculative=False`` decode plainly."""

    def __init__(self, model: K3ForCausalLM, *, max_slots: int = 8, max_model_len: int | None = None,
                 page_size: int = 64, num_pages: int | None = None, kv_cache_memory: int | None = None,
                 chunk: int = 256, max_step_tokens: int | None = None, max_queue: int = 256,
                 eos_token_ids: Sequence[int] | None = None, prefix_cache: bool = True,
                 prefix_cache_memory: int | None = None, prefix_block: int = 512, prefix_stride: int = 4,
                 prefix_verify: bool = False, record_logits: bool = False,
                 speculative: SpecConfig | str | None = None, draft_model: K3ForCausalLM | None = None,
                 drafter: Callable[[Request, int], Sequence[int]] | None = None):
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.max_slots = int(max_slots)
        if self.max_slots < 1:
            raise ValueError(f"max_slots: expected ≥ 1, got {max_slots}")
        if chunk < 16 or chunk % 16:
            raise ValueError(f"chunk: expected a multiple of 16 (KDA's tile), got {chunk}")
        if page_size < 1:
            raise ValueError(f"page_size: expected ≥ 1, got {page_size}")
        self.max_model_len = int(max_model_len or min(cfg.max_position_embeddings, 8192))
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        self.page_size = int(page_size)
        self.max_pages = -(-self.max_model_len // self.page_size)
        self.token_bytes = page_bytes(cfg)
        if num_pages is None and kv_cache_memory is not None:
            num_pages = int(kv_cache_memory) // max(1, self.token_bytes * self.page_size)
            if num_pages < 1:
                raise ValueError(f"kv_cache_memory: {kv_cache_memory} bytes is less than one page "
                                 f"({self.token_bytes * self.page_size} bytes = {self.page_size} tokens × "
                                 f"{self.token_bytes} bytes of MLA latent per token)")
        self.num_pages = int(num_pages if num_pages is not None else self.max_slots * self.max_pages)
        if self.num_pages < 1:
            raise ValueError(f"num_pages: expected ≥ 1, got {self.num_pages}")
        self.chunk = int(chunk)
        self.buckets = prefill_buckets(self.chunk)
        self.decode_sizes = decode_buckets(self.max_slots)
        self.max_step_tokens = int(max_step_tokens or self.chunk)
        self.max_queue = int(max_queue)
        eos = cfg.eos_token_id if eos_token_ids is None else eos_token_ids
        self.eos_ids = frozenset([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))

        self.graphdef, self.state = nnx.split(model)
        self.cache: Cache = init_paged_cache(cfg, self.max_slots, self.num_pages, self.page_size,
                                             self.max_model_len)
        self.table = np.zeros((self.max_slots, self.max_pages), np.int32)
        self.lengths = np.zeros(self.max_slots, np.int32)
        self.alloc = PageAllocator(self.num_pages)
        self.traces = {"prefill": 0, "decode": 0}
        self._prefill = jax.jit(self._prefill_impl, donate_argnums=(1,))
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1,))
        self._init_prefix_cache(prefix_cache, prefix_cache_memory, prefix_block, prefix_stride, prefix_verify,
                                record_logits)


        self.slots: list[Request | None] = [None] * self.max_slots
        self.waiting: collections.deque[Request] = collections.deque()
        self._inbox: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._admit_seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._accepting = True
        self.counters = {"steps": 0, "decode_steps": 0, "decode_rows": 0, "prefill_chunks": 0, "preemptions": 0,
                         "prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0,
                         "requests_finished": 0}
        self.finish_hooks: list[Callable[[Request], None]] = []  # called on the scheduler thread (server metrics)
        self.step_hooks: list[Callable[[], None]] = []           # after every step, on its thread (invariant checks)
        self._init_speculative(speculative, draft_model, drafter)

    # --------------------------------------------------------------------------------------------- jitted
    def _prefill_impl(self, state, cache, table, lengths, slot, ids, n, samp, embeds=None):
        """One chunk ``ids [1, C]`` (first ``n`` real) of slot ``slot`` starting at ``lengths[slot]``; a slot at
        length 0 starts from a zero KDA state; ``embeds`` (rows [1, C, hidden], mask [1, C]): image rows spliced in.
        Returns (token sampled from the chunk's last real logits, cache)."""
        self.traces["prefill"] += 1                           # runs at trace time only: counts compilations
        out, cache = slot_chunk(nnx.merge(self.graphdef, state), cache, table, lengths, slot, ids, n, embeds)
        last = jax.lax.dynamic_index_in_dim(out.logits[0], jnp.maximum(n - 1, 0), 0, keepdims=True)
        tok = sample_rows(last, *[jnp.reshape(s, (1,)) for s in samp])
        return tok[0], last[0], cache

    def _decode_impl(self, state, cache, table, lengths, slot_ids, tokens, active, samp):
        """One token for each of the slots ``slot_ids [b]`` (``tokens [b]`` at their ``lengths``; rows with
        ``active`` False are idle slots filling the bucket: masked, untouched); the other slots are not computed."""
        self.traces["decode"] += 1
        cache = Cache(cache.layers, lengths).with_page_table(table)
        rows = cache.read_slots(slot_ids)
        out = nnx.merge(self.graphdef, state)(tokens[:, None], cache=rows, n_new=active.astype(jnp.int32))
        return sample_rows(out.logits[:, 0], *samp), out.logits[:, 0], cache.write_slots(slot_ids, out.cache)

    def _samp_arrays(self, reqs: Sequence[Request | None]):
        n = len(reqs)
        seeds = np.zeros(n, np.uint32)
        ctr = np.zeros(n, np.int32)
        temp = np.zeros(n, np.float32)
        tk = np.zeros(n, np.int32)
        tp = np.ones(n, np.float32)
        for i, r in enumerate(reqs):
            if r is None:
                continue
            p = r.params
            seeds[i], ctr[i], temp[i] = r.seed, len(r.tokens), p.temperature
            tk[i] = max(0, p.top_k or 0)
            tp[i] = 1.0 if p.top_p is None else p.top_p
        return tuple(_dev(a) for a in (seeds, ctr, temp, tk, tp))

    def warmup(self) -> dict:
        """Compile every prefill bucket and the decode step (all slots idle: nothing in the cache changes).
        Returns ``{"prefill": [buckets], "decode": [max_slots]}`` — the compiled shapes."""
        if any(self.slots):
            raise RuntimeError("warmup() must run before requests are served")
        samp1 = self._samp_arrays([None])
        table, lengths = _dev(self.table), _dev(self.lengths)
        for C in self.buckets:
            _, last, self.cache = self._prefill(self.state, self.cache, table, lengths, _i32(0),
                                                jnp.zeros((1, C), jnp.int32), _i32(0), samp1)
        self._warm_prefix_cache(last, samp1)
        for b in self.decode_sizes:
            tok, _, self.cache = self._decode(self.state, self.cache, table, lengths, jnp.arange(b, dtype=jnp.int32),
                                           jnp.zeros(b, jnp.int32), jnp.zeros(b, bool), self._samp_arrays([None] * b))
        tok.block_until_ready()
        self._warm_speculative()
        shapes = {"prefill": [[1, C] for C in self.buckets], "decode": [[b, 1] for b in self.decode_sizes]}
        if self.spec is not None:
            shapes["speculative"] = [[b, self.spec.k + 1] for b in self.decode_sizes]
        return shapes

    # ------------------------------------------------------------------------------------------- public API
    def start(self) -> "Scheduler":
        """Run the scheduling loop on a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="k3jax-scheduler", daemon=True)
            self._thread.start()
        return self

    def check(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """Validate a request without queueing it; returns the prompt as a list of ints."""
        params.check()
        ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("prompt: empty (no token ids); a prompt needs at least one token", "prompt")
        V = self.cfg.vocab_size
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= V:
            raise RequestError(f"prompt: token ids must lie in [0, {V}) (vocab_size); got min {lo}, max {hi}",
                               "prompt")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt: {len(ids)} tokens; this server's max_model_len is {self.max_model_len} "
                               f"tokens (prompt + at least one generated token)", "prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"max_tokens: prompt {len(ids)} + max_tokens {params.max_tokens} = "
                               f"{len(ids) + params.max_tokens} exceeds max_model_len {self.max_model_len}",
                               "max_tokens")
        need = -(-(len(ids) + params.max_tokens) // self.page_size)
        if need > self.num_pages:
            raise RequestError(f"max_tokens: prompt + max_tokens need {need} pages of {self.page_size} tokens; the "
                               f"page pool has {self.num_pages} (raise --kv-cache-memory)", "max_tokens")
        return ids

    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
               callback: Callable[[TokenEvent], None] | None = None, request_id: str | None = None,
               use_prefix_cache: bool = True, content_keys: Sequence[tuple[int, bytes]] = (),
               use_speculative: bool = True, prediction: Sequence[int] = (), embeds=None) -> Request:
        """Queue a request (it joins the batch at the next step). Raises :class:`RequestError` for a request that
        can never run and :class:`QueueFull` when ``max_queue`` requests are waiting. ``use_prefix_cache=False``:
        neither reuses nor adds cached prefixes; ``content_keys``: ``(position, digest bytes)`` of inputs that are
        not token ids (image content), hashed into the prefix cache's key of the block holding the position;
        ``use_speculative=False``: plain decode for this request when the scheduler speculates; ``prediction``:
        token ids the answer is expected to resemble (OpenAI's predicted output, e.g. the document an edit starts
        from), which prompt lookup drafts from too."""
        params = params or SamplingParams()
        if embeds is not None:                      # a MultimodalPrompt: its expanded ids are the prompt
            prompt = embeds.ids
            if embeds.rows.shape[1:] != (self.cfg.hidden_size,):
                raise RequestError(f"embeds: rows of width {embeds.rows.shape[1:]}, expected "
                                   f"({self.cfg.hidden_size},)", "embeds")
            if not content_keys:
                content_keys = embeds.content_keys
        ids = self.check(prompt, params)
        keys = []
        for k in content_keys:
            if not (isinstance(k, tuple) and len(k) == 2 and isinstance(k[0], int) and 0 <= k[0] < len(ids)
                    and isinstance(k[1], (bytes, bytearray))):
                raise RequestError(f"content_keys: expected (position in [0, {len(ids)}), digest bytes) pairs, got "
                                   f"{k!r}", "content_keys")
            keys.append((int(k[0]), bytes(k[1])))
        pred = [int(t) for t in prediction]
        if pred and (min(pred) < 0 or max(pred) >= self.cfg.vocab_size):
            raise RequestError(f"prediction: token ids must lie in [0, {self.cfg.vocab_size}) (vocab_size); got min "
                               f"{min(pred)}, max {max(pred)}", "prediction")
        stops = frozenset(int(s) for s in params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                                     else self.eos_ids)
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        req = Request(id=request_id or f"req-{next(self._ids)}", prompt=ids, params=params, stops=stops, seed=seed,
                      callback=callback, sequence=list(ids), arrival=time.perf_counter(),
                      use_prefix_cache=bool(use_prefix_cache), content_keys=tuple(sorted(keys)), embeds=embeds,
                      use_speculative=bool(use_speculative), prediction=pred,
                      logits=[] if self.record_logits else None)
        if callback is None:
            req._q = queue.Queue()
        with self._cv:
            if not self._accepting:
                raise QueueFull("the server is shutting down", retry_after=5.0)
            if len(self.waiting) + len(self._inbox) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting (max_queue); retry later")
            self._inbox.append(("submit", req))
            self._cv.notify()
        return req

    def cancel(self, req: Request | str) -> None:
        """Stop a request at the next step; its slot and pages are freed, its last event has reason ``abort``."""
        with self._cv:
            self._inbox.append(("cancel", req))
            self._cv.notify()

    def close(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests; let running ones finish for up to ``drain_timeout`` seconds, then cancel the rest
        and stop the loop."""
        with self._cv:
            self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while drain_timeout > 0 and time.monotonic() < deadline and self._thread is not None and self.busy():
            time.sleep(0.02)
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        for r in list(self.waiting) + [r for r in self.slots if r is not None] + \
                [x for kind, x in self._inbox if kind == "submit"]:
            self._finish(r, "abort")
        self._inbox.clear()
        self.waiting.clear()

    def busy(self) -> bool:
        return bool(self._inbox or self.waiting or any(r is not None for r in self.slots))

    def snapshot(self) -> dict:
        """Slot, page and queue occupancy, counters and compile counts (read by ``/metrics``)."""
        return {"slots_in_use": sum(r is not None for r in self.slots), "max_slots": self.max_slots,
                "free_pages": self.alloc.free, "num_pages": self.num_pages, "page_size": self.page_size,
                "queue_length": len(self.waiting) + sum(1 for k, _ in list(self._inbox) if k == "submit"),
                "compiles": dict(self.traces), **self.counters,
                "prefix": self.prefix.snapshot() if self.prefix is not None else None,
                "spec": self.spec_snapshot()}

    def memory(self) -> dict:
        """Bytes of the slot pool: KDA state per slot, MLA latent per token and per page, and the totals."""
        per_slot = slot_state_bytes(self.cfg)
        out = {"kda_state_bytes_per_slot": per_slot, "kda_state_bytes": per_slot * self.max_slots,
               "mla_bytes_per_token": self.token_bytes, "mla_bytes_per_page": self.token_bytes * self.page_size,
               "mla_pool_bytes": self.token_bytes * self.page_size * self.num_pages,
               "total_bytes": per_slot * self.max_slots + self.token_bytes * self.page_size * self.num_pages}
        if self.prefix is not None:
            out.update(prefix_checkpoint_bytes=self.checkpoint_bytes, prefix_budget_bytes=self.prefix.budget)
        out.update(self.spec_memory())
        return out

    # ------------------------------------------------------------------------------------------------ loop
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._closing or self.waiting or any(self.slots)):
                    self._cv.wait(timeout=0.5)
                if self._closing:
                    return
                inbox = list(self._inbox)
                self._inbox.clear()
            try:
                self.step(inbox)
            except Exception as e:  # noqa: BLE001 - a failing step fails the requests in it, not the server
                log.exception("scheduler step failed")
                for r in [r for r in self.slots if r is not None]:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")

    def step(self, inbox: Sequence = ()) -> None:
        """One scheduling step: take submissions and cancellations, admit, one prefill chunk, one decode step.
        (The background loop calls it; call it yourself to drive the scheduler without a thread.)"""
        for kind, x in inbox:
            if kind == "submit":
                self.waiting.append(x)
            else:
                self._cancel_now(x)
        self._admit()
        self._prefill_one()
        self._decode_all()
        self.counters["steps"] += 1
        for hook in self.step_hooks:
            hook()

    def _cancel_now(self, x: Request | str) -> None:
        rid = x if isinstance(x, str) else x.id
        for r in list(self.waiting):
            if r.id == rid:
                self.waiting.remove(r)
                self._finish(r, "abort")
        for r in self.slots:
            if r is not None and r.id == rid:
                self._finish(r, "abort")

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

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.state == _DONE:
            return
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.state, req.finish_reason, req.error = _DONE, reason, error
        req.finish_time = time.perf_counter()
        self.counters["requests_finished"] += 1
        self._emit(req, [], True, reason, error)
        for hook in self.finish_hooks:
            try:
                hook(req)
            except Exception:  # noqa: BLE001 - a hook's failure is logged, the request is already finished
                log.exception("finish hook raised")

    def _accept_token(self, req: Request, tok: int) -> None:
        """Record one generated token; finish the request when it stops."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        req.tokens.append(tok)
        self.counters["generated_tokens"] += 1
        self._emit(req, [tok])
        if req.state == _DONE:                              # its consumer failed
            return
        if tok in req.stops:
            self._finish(req, "stop")
        elif len(req.tokens) >= req.params.max_tokens or len(req.prompt) + len(req.tokens) >= self.max_model_len:
            self._finish(req, "length")
        else:
            req.state = _DECODE

    def _prefill_one(self) -> None:
        cands = [r for r in self.slots if r is not None and r.state == _PREFILL and not r.cancelled]
        if not cands:
            return
        req = min(cands, key=lambda r: r.admitted)
        n_decode = sum(1 for r in self.slots if r is not None and r.state == _DECODE)
        # nothing decoding: no stream to stall, the whole chunk; else what the step's budget leaves
        budget = self.chunk if n_decode == 0 else max(self.buckets[0], self.max_step_tokens - n_decode)
        want = len(req.sequence) - req.computed
        ahead = [p for p in req.save_at if p > req.computed]
        if ahead:                               # a chunk ends where a checkpoint is saved
            want = min(want, min(ahead) - req.computed)
        fits = [b for b in self.buckets if b <= budget] or [self.buckets[0]]
        C = next((b for b in fits if b >= want), fits[-1])
        n = min(want, C)
        ids = np.zeros((1, C), np.int32)
        ids[0, :n] = req.sequence[req.computed:req.computed + n]
        self.lengths[req.slot] = req.computed
        embeds = self._chunk_embeds(req, req.computed, C)
        tok, last, self.cache = self._prefill(self.state, self.cache, _dev(self.table), _dev(self.lengths),
                                              _i32(req.slot), _dev(ids), _i32(n), self._samp_arrays([req]),
                                              *(() if embeds is None else (embeds,)))   # None would retrace
        req.computed += n
        if self.prefix is not None and req.use_prefix_cache:
            self._register(req, last if req.computed in req.save_at else None)
        self.lengths[req.slot] = req.computed
        self.counters["prefill_chunks"] += 1
        if req.preemptions == 0 or req.computed > len(req.prompt):
            self.counters["prompt_tokens"] += n if req.preemptions == 0 else 0
        if req.computed == len(req.sequence):
            if req.logits is not None:
                req.logits.append(np.array(last))
            self._accept_token(req, int(tok))

    def _chunk_embeds(self, req: Request, start: int, C: int):
        """``(rows [1, C, hidden], mask [1, C])`` of the request's image rows in ``[start, start + C)``, or None."""
        if req.embeds is None:
            return None
        ov = req.embeds.overlay(start, C)
        if ov is None:
            return None
        return jnp.asarray(ov[0][None], self.cfg.dtype), jnp.asarray(ov[1][None])

    def _decode_all(self) -> None:
        for r in sorted((r for r in self.slots if r is not None and r.state == _DECODE), key=lambda r: r.admitted):
            if r.state == _DECODE and r.slot >= 0:
                self._ensure_page(r)
        live = [i for i, r in enumerate(self.slots) if r is not None and r.state == _DECODE]
        if not live:
            return
        b = next(x for x in self.decode_sizes if x >= len(live))
        idle = [i for i in range(self.max_slots) if i not in set(live)]
        slot_ids = live + idle[: b - len(live)]
        if self.spec is not None and self._speculate(live, b, slot_ids):
            return
        reqs = [self.slots[i] for i in live] + [None] * (b - len(live))
        t0 = time.perf_counter()
        tokens = np.array([r.tokens[-1] if r is not None else 0 for r in reqs], np.int32)
        active = np.array([r is not None for r in reqs])
        out, logits, self.cache = self._decode(self.state, self.cache, _dev(self.table), _dev(self.lengths),
                                               _dev(np.array(slot_ids, np.int32)), _dev(tokens), _dev(active),
                                               self._samp_arrays(reqs))
        out = np.asarray(out)
        if self.spec is not None:
            self._observe(("decode", b), time.perf_counter() - t0)
        host_logits = np.array(logits) if self.record_logits else None
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(live)
        for j, r in enumerate(reqs):
            if r is None:
                continue
            self.lengths[r.slot] += 1
            r.computed += 1
            if self.prefix is not None and r.use_prefix_cache and r.computed % self.prefix.block == 0:
                self._register(r, logits[j], provisional=True)     # the end of this turn, so far
            if host_logits is not None:
                r.logits.append(host_logits[j])
            self._accept_token(r, int(out[j]))


__all__ = ["Scheduler", "SamplingParams", "Request", "TokenEvent", "RequestError", "QueueFull", "PageAllocator",
           "prefill_buckets", "decode_buckets", "SamplingError"]
