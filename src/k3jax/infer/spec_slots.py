"""How the scheduler decodes speculatively (:mod:`k3jax.infer.speculative`): the device side and the per-step plan.

:class:`SpeculativeDecoding` is a mixin of :class:`k3jax.infer.scheduler.Scheduler`. A step whose decoding slots have
drafts runs **one jitted round** over the decode bucket instead of the plain decode step:

1. (draft model) the draft proposes k tokens per slot — k + 1 single-token steps of the draft in a ``lax.scan``
   over its own slot-pool cache (the last step only records its inputs, so an all-accepted round leaves the draft
   in step with the target); prompt lookup's drafts come from the host;
2. the target verifies them in one forward of T = k + 1 tokens (``kda_record=True``): MLA appends k + 1 latents
   per slot, each KDA layer records its per-token inputs and keeps the state from before the round;
3. :func:`~k3jax.infer.speculative.speculative_accept` picks each slot's accepted length (greedy or rejection
   sampling, per row);
4. :meth:`Cache.accept <k3jax.nn.cache.Cache.accept>` rebuilds every KDA layer's state and conv windows at each
   slot's accepted length by a masked replay (static trip count k + 1) — the target's and the draft's — and the
   lengths move on by the tokens kept; the MLA latents past them are masked by the length and overwritten later.

Per slot, the host caps the drafts so a round never writes past ``max_model_len`` or the request's ``max_tokens``
and never steps over a prefix-cache block boundary (the checkpoint there needs the state at exactly that length),
and gets the pages the drafts write into (without preempting anyone: fewer drafts instead). A request drafts while
its acceptance rate holds (:class:`~k3jax.infer.speculative.AcceptanceTracker`: a low rate turns it off for a
while); and a step speculates only when the expected tokens per second beat plain decode's, from the step times
measured for each batch bucket (at warmup, then as the server runs).

The draft model's cache shares the target's page table: a page holds the same tokens' latents in both pools. The
draft follows the target lazily: before a slot's first round (after its prompt, a prefix-cache hit or a
preemption) the draft prefills the tokens the target holds, one chunk per slot and step, and the slot decodes
plainly meanwhile.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.infer.requests import _DECODE, Request, _dev, _i32
from k3jax.infer.speculative import (AcceptanceTracker, NgramIndex, SpecConfig, emitted_tokens, row_probs,
                                     speculative_accept, token_key)
from k3jax.nn.cache import Cache, KDACache, KDAPending, init_paged_cache, kda_record_bytes, slot_state_bytes

log = logging.getLogger("k3jax.scheduler")

_COST_WEIGHT = 0.2          # exponential average of the measured step times


def slot_chunk(model, cache: Cache, table, lengths, slot, ids, n, embeds=None):
    """Run ``ids [1, C]`` (first ``n`` real) through ``model`` as a continuation of slot ``slot`` of the paged
    ``cache`` (a slot at length 0 starts from a zero KDA state). Returns ``(output, cache with the slot's row
    written back)``."""
    cache = Cache(cache.layers, lengths).with_page_table(table)
    row = cache.read_slots(slot)
    fresh = row.lengths[0] == 0
    row = Cache(tuple(jax.tree.map(lambda x: jnp.where(fresh, jnp.zeros((), x.dtype), x), c)
                      if isinstance(c, KDACache) else c for c in row.layers), row.lengths)
    out = model(ids, cache=row, n_new=jnp.reshape(n, (1,)), embeds=embeds)
    return out, cache.write_slots(slot, out.cache)


class SpeculativeDecoding:
    """The speculative half of the scheduler (state set up by :meth:`_init_speculative`)."""

    def _init_speculative(self, speculative: SpecConfig | str | None, draft_model, drafter) -> None:
        self.spec: SpecConfig | None = SpecConfig.parse(speculative) if isinstance(speculative, str) else speculative
        self.draft_model = None
        self.drafter = drafter
        if self.spec is None:
            return
        k = self.spec.k
        self.traces["spec"] = 0
        self.counters.update(spec_steps=0, spec_rounds=0, spec_draft_tokens=0, spec_accepted_tokens=0,
                             spec_fallback_steps=0, draft_prefill_chunks=0)
        self.step_seconds: dict[tuple[str, int], float] = {}
        if self.spec.method == "draft":
            if draft_model is None:
                from k3jax.infer.load import load_model

                draft_model, _, _ = load_model(self.spec.draft)
            dcfg = draft_model.config
            if dcfg.vocab_size != self.cfg.vocab_size:
                raise ValueError(f"speculative: the draft model {self.spec.draft} has vocab_size {dcfg.vocab_size}, "
                                 f"the target {self.cfg.vocab_size}; a draft must share the target's tokenizer")
            if self.max_model_len > dcfg.max_position_embeddings:
                raise ValueError(f"speculative: max_model_len {self.max_model_len} exceeds the draft model's "
                                 f"max_position_embeddings {dcfg.max_position_embeddings}")
            self.draft_model = draft_model
            self.dgraph, self.dstate = nnx.split(draft_model)
            self.dcache = init_paged_cache(dcfg, self.max_slots, self.num_pages, self.page_size, self.max_model_len)
            self.traces["draft_prefill"] = 0
            self._draft_prefill = jax.jit(self._draft_prefill_impl, donate_argnums=(1,))
            self._spec_round = jax.jit(self._draft_round_impl, donate_argnums=(1, 3))
        else:
            self._spec_round = jax.jit(self._ngram_round_impl, donate_argnums=(1,))
        self._spec_zero_drafts = {b: _dev(np.zeros((b, k), np.int32)) for b in self.decode_sizes}

    # --------------------------------------------------------------------------------------------- jitted
    def _verify(self, state, cache, table, lengths, slot_ids, tokens, drafts, n_draft, active, samp, draft_probs):
        """The target's half of a round: verify ``drafts [b, k]`` after ``tokens [b]``, accept, replay. Returns
        (emitted tokens [b, k+1], tokens kept per slot [b], logits [b, k+1, V], cache)."""
        seeds, ctr, temp, tk, tp = samp
        cache = Cache(cache.layers, lengths).with_page_table(table)
        rows = cache.read_slots(slot_ids)
        ids = jnp.concatenate([tokens[:, None], drafts], axis=1)
        n_new = jnp.where(active, n_draft + 1, 0).astype(jnp.int32)
        out = nnx.merge(self.graphdef, state)(ids, cache=rows, n_new=n_new, kda_record=True)
        n_acc, tok = speculative_accept(out.logits, drafts, n_draft, draft_probs, seeds, ctr, temp, tk, tp)
        n_keep = jnp.where(active, n_acc + 1, 0).astype(jnp.int32)
        return (emitted_tokens(drafts, n_acc, tok), n_keep, out.logits,
                cache.write_slots(slot_ids, out.cache.accept(n_keep)))

    def _ngram_round_impl(self, state, cache, table, lengths, slot_ids, tokens, drafts, n_draft, active, samp):
        self.traces["spec"] += 1
        return self._verify(state, cache, table, lengths, slot_ids, tokens, drafts, n_draft, active, samp, None)

    def _draft_round_impl(self, state, cache, dstate, dcache, table, lengths, slot_ids, tokens, drafts, n_draft,
                          active, samp):
        """Draft k tokens per slot with the draft model (``drafts`` is only a shape), verify, accept, and replay both
        models' KDA layers to the accepted length."""
        self.traces["spec"] += 1
        seeds, ctr, temp, tk, tp = samp
        k = drafts.shape[1]
        dc = Cache(dcache.layers, lengths).with_page_table(table)
        drows = dc.read_slots(slot_ids)
        draft = nnx.merge(self.dgraph, dstate)

        drafting = active & (n_draft > 0)            # a slot without drafts leaves the draft alone (it catches up)

        def step(carry, t):
            work, tok = carry
            act = (drafting & (t <= n_draft)).astype(jnp.int32)
            out = draft(tok[:, None], cache=work, n_new=act, kda_record=True)
            lg = out.logits[:, 0].astype(jnp.float32)
            q = row_probs(lg[:, None], temp, tk, tp)[:, 0]                               # [b, V]
            # step t drafts the row's token number ctr + 1 + t; its own stream (fold_in 2) beside the target's
            keys = jax.vmap(lambda s_, c: jax.random.fold_in(token_key(s_, c + 1 + t), 2))(seeds, ctr)
            drawn = jax.vmap(lambda kk, d: jax.random.categorical(kk, jnp.log(d)))(keys, q).astype(jnp.int32)
            d = jnp.where(temp > 0, drawn, jnp.argmax(lg, axis=-1).astype(jnp.int32))
            return (out.cache.accept(act), d), (d, q, out.cache.kda_records())

        (work, _), (ds, qs, recs) = jax.lax.scan(step, (drows, tokens), jnp.arange(k + 1))
        drafts = jnp.moveaxis(ds[:k], 0, 1)                                               # [b, k]
        emitted, n_keep, logits, cache = self._verify(state, cache, table, lengths, slot_ids, tokens, drafts,
                                                      n_draft, active, samp, jnp.moveaxis(qs[:k], 0, 1))
        recs = iter(jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1)[:, :, 0], recs))       # [k+1, b, 1, …] → [b, k+1, …]
        layers = tuple(KDAPending(b, next(recs)) if isinstance(b, KDACache) else w
                       for b, w in zip(drows.layers, work.layers))
        dkeep = jnp.where(drafting, n_keep, 0)
        return emitted, n_keep, logits, cache, dc.write_slots(slot_ids, Cache(layers, drows.lengths).accept(dkeep))

    def _draft_prefill_impl(self, dstate, dcache, table, lengths, slot, ids, n):
        self.traces["draft_prefill"] += 1
        return slot_chunk(nnx.merge(self.dgraph, dstate), dcache, table, lengths, slot, ids, n)[1]

    # -------------------------------------------------------------------------------------------- warmup
    def _warm_speculative(self) -> None:
        """Compile the round for every decode bucket (and the draft's prefill chunks), all slots idle, and time the
        plain and the speculative step once each (the first estimates of what a round costs)."""
        if self.spec is None:
            return
        table, lengths = _dev(self.table), _dev(self.lengths)
        if self.draft_model is not None:
            for C in self.buckets:
                self.dcache = self._draft_prefill(self.dstate, self.dcache, table, lengths, _i32(0),
                                                  jnp.zeros((1, C), jnp.int32), _i32(0))
        for b in self.decode_sizes:
            args = (table, lengths, jnp.arange(b, dtype=jnp.int32), jnp.zeros(b, jnp.int32),
                    self._spec_zero_drafts[b], jnp.zeros(b, jnp.int32), jnp.zeros(b, bool),
                    self._samp_arrays([None] * b))
            for i in range(2):                       # compile, then time
                t0 = time.perf_counter()
                self._run_round(args)
                if i:
                    self._observe(("spec", b), time.perf_counter() - t0)
                t0 = time.perf_counter()
                tok, _, self.cache = self._decode(self.state, self.cache, *args[:4], args[6], args[7])
                np.asarray(tok)
                if i:
                    self._observe(("decode", b), time.perf_counter() - t0)

    def _run_round(self, args):
        """One jitted round (``args``: table, lengths, slot ids, tokens, drafts, n_draft, active, sampling);
        returns host (emitted, kept) and the device logits."""
        if self.draft_model is not None:
            em, keep, logits, self.cache, self.dcache = self._spec_round(self.state, self.cache, self.dstate,
                                                                         self.dcache, *args)
        else:
            em, keep, logits, self.cache = self._spec_round(self.state, self.cache, *args)
        return np.asarray(em), np.asarray(keep), logits

    def _observe(self, key: tuple[str, int], seconds: float) -> None:
        old = self.step_seconds.get(key)
        self.step_seconds[key] = seconds if old is None else (1 - _COST_WEIGHT) * old + _COST_WEIGHT * seconds

    # --------------------------------------------------------------------------------------- host: a step
    def _spec_state(self, req: Request) -> AcceptanceTracker:
        if req.spec is None:
            req.spec = AcceptanceTracker()
        return req.spec

    def _draft_room(self, req: Request) -> int:
        """How many drafts ``req`` may propose this step (0: decode plainly)."""
        if not req.use_speculative:
            return 0
        if self.spec.adaptive and not self._spec_state(req).active(len(req.tokens)):
            return 0
        L = int(self.lengths[req.slot])
        n = min(self.spec.k, req.params.max_tokens - len(req.tokens) - 1, self.max_model_len - L - 2)
        if self.prefix is not None and req.use_prefix_cache:         # land on the next block boundary, not past it
            B = self.prefix.block
            n = min(n, (L // B + 1) * B - L - 1)
        return max(0, n)

    def _draft_pages(self, req: Request, n: int) -> int:
        """Pages for positions up to ``lengths + n`` (without preempting anyone); the drafts that fit."""
        L, page = int(self.lengths[req.slot]), self.page_size
        need = (L + n) // page + 1 - len(req.pages)
        if need > 0:
            got = self._take_pages(need)
            if got is None:
                return max(0, len(req.pages) * page - 1 - L)
            self.table[req.slot, len(req.pages):len(req.pages) + need] = got
            req.pages.extend(got)
        return n

    def _host_drafts(self, req: Request, n: int) -> list[int]:
        """Up to ``n`` drafts from the host: the ``drafter`` given to the scheduler, else prompt lookup over the
        request's prompt, generated tokens and predicted output (its index grows by the tokens added since the last
        step)."""
        if self.drafter is not None:
            return [int(t) for t in self.drafter(req, n)][:n]
        if req.ngram is None:
            req.ngram = NgramIndex(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max, req.prediction,
                                   len(req.prompt))
        have, P = len(req.ngram.tokens), len(req.prompt)
        if have < P:
            req.ngram.extend(req.prompt[have:])
        req.ngram.extend(req.tokens[max(0, have - P):])
        return req.ngram.propose(n)

    def _draft_catch_up(self, req: Request) -> bool:
        """One draft prefill chunk toward the tokens the target holds for ``req``; True once the draft holds them."""
        L = int(self.lengths[req.slot])
        if req.draft_len >= L:
            return True
        seq = (req.prompt + req.tokens)[:L]
        fits = [b for b in self.buckets if b >= L - req.draft_len]
        C = fits[0] if fits else self.buckets[-1]
        n = min(C, L - req.draft_len)
        ids = np.zeros((1, C), np.int32)
        ids[0, :n] = seq[req.draft_len:req.draft_len + n]
        lengths = self.lengths.copy()
        lengths[req.slot] = req.draft_len
        self.dcache = self._draft_prefill(self.dstate, self.dcache, _dev(self.table), _dev(lengths), _i32(req.slot),
                                          _dev(ids), _i32(n))
        req.draft_len += n
        self.counters["draft_prefill_chunks"] += 1
        return req.draft_len >= L

    def _speculate(self, live: list[int], bucket: int, slot_ids: list[int]) -> bool:
        """One speculative round over the decoding slots ``live`` (run at batch ``bucket`` over ``slot_ids``) when
        it pays; False leaves the step to plain decode."""
        k = self.spec.k
        reqs = [self.slots[i] for i in live]
        n_draft = np.zeros(bucket, np.int32)
        drafts = np.zeros((bucket, k), np.int32)
        for j, r in enumerate(reqs):
            n = self._draft_room(r)
            if n and self.draft_model is None:
                d = self._host_drafts(r, n)
                drafts[j, :len(d)] = d
                n = len(d)
            n_draft[j] = n
        if not n_draft.any():
            return False
        plain = self.step_seconds.get(("decode", bucket))
        spec = self.step_seconds.get(("spec", bucket))
        if self.spec.adaptive and plain is not None and spec is not None:
            expected = sum(self._spec_state(r).expected_tokens(int(n)) if n else 1.0 for r, n in zip(reqs, n_draft))
            if expected / spec < len(reqs) / plain:          # a plain step gives more tokens per second
                self.counters["spec_fallback_steps"] += 1
                return False
        if self.draft_model is not None:                     # the draft must hold what the target holds
            for j, r in enumerate(reqs):                     # every lagging drafting slot, by one chunk (a small
                if n_draft[j]:                               # draft: slots catching up one per step would make
                    self._draft_catch_up(r)                  # many rounds that few slots draft in)
            for j, r in enumerate(reqs):
                if r.draft_len < int(self.lengths[r.slot]):
                    n_draft[j] = 0
        for j, r in enumerate(reqs):
            if n_draft[j]:
                n_draft[j] = self._draft_pages(r, int(n_draft[j]))
        if not n_draft.any():
            return False
        tokens = np.array([r.tokens[-1] for r in reqs] + [0] * (bucket - len(reqs)), np.int32)
        active = np.arange(bucket) < len(reqs)
        args = (_dev(self.table), _dev(self.lengths), _dev(np.array(slot_ids, np.int32)), _dev(tokens),
                _dev(drafts), _dev(n_draft), _dev(active), self._samp_arrays(reqs + [None] * (bucket - len(reqs))))
        t0 = time.perf_counter()
        emitted, keep, logits = self._run_round(args)
        self._observe(("spec", bucket), time.perf_counter() - t0)
        host_logits = np.array(logits) if self.record_logits else None
        c = self.counters
        c["decode_steps"] += 1
        c["decode_rows"] += len(reqs)
        c["spec_steps"] += 1
        for j, r in enumerate(reqs):
            kept = int(keep[j])
            toks = [int(t) for t in emitted[j, :kept]]
            if n_draft[j]:
                c["spec_rounds"] += 1
                c["spec_draft_tokens"] += int(n_draft[j])
                c["spec_accepted_tokens"] += kept - 1
                r.spec_drafted += int(n_draft[j])
                r.spec_accepted += kept - 1
                self._spec_state(r).update(int(n_draft[j]), kept - 1, len(r.tokens))
            self.lengths[r.slot] += kept
            r.computed += kept
            if self.draft_model is not None and n_draft[j]:
                r.draft_len += kept                  # the draft kept the same tokens (rows without drafts: none)
            if self.prefix is not None and r.use_prefix_cache and r.computed % self.prefix.block == 0:
                self._register(r, logits[j, kept - 1], provisional=True, pending=toks[:-1])
            if host_logits is not None:
                r.logits.extend(host_logits[j, :kept])
            for t in toks:
                self._accept_token(r, t)
                if r.state != _DECODE:
                    break
        return True

    # -------------------------------------------------------------------------------------------- figures
    def spec_snapshot(self) -> dict | None:
        """Drafted and accepted tokens, acceptance rate and mean accepted length per round (None: off)."""
        if self.spec is None:
            return None
        c = self.counters
        rounds, drafted, accepted = c["spec_rounds"], c["spec_draft_tokens"], c["spec_accepted_tokens"]
        return {"method": self.spec.method, "k": self.spec.k, "steps": c["spec_steps"], "rounds": rounds,
                "draft_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": accepted / rounds if rounds else 0.0,
                "fallback_steps": c["spec_fallback_steps"], "draft_prefill_chunks": c["draft_prefill_chunks"],
                "step_seconds": {f"{kind}@{b}": s for (kind, b), s in sorted(self.step_seconds.items())}}

    def spec_memory(self) -> dict:
        """Bytes speculation adds: the recorded inputs of one round per slot (live only inside the round: one KDA
        state + k + 1 recorded tokens instead of k + 1 states) and the draft model's state and page pool."""
        if self.spec is None:
            return {}
        T = self.spec.k + 1
        rec = kda_record_bytes(self.cfg, T)
        out = {"spec_record_bytes_per_slot": rec,
               "spec_state_snapshots_bytes_per_slot": T * slot_state_bytes(self.cfg)}
        if self.draft_model is not None:
            dcfg = self.draft_model.config
            pool = sum(x.nbytes for c in self.dcache.layers if not isinstance(c, KDACache)
                       for x in (c.c_kv, c.k_r))
            out.update(draft_state_bytes_per_slot=slot_state_bytes(dcfg), draft_pool_bytes=pool,
                       draft_record_bytes_per_slot=kda_record_bytes(dcfg, T))
        return out


__all__ = ["SpeculativeDecoding", "slot_chunk"]
