"""The engine's device side: :class:`ModelRunner` owns the parameters, the slot caches (the target's and a draft
model's), the page pool and every jitted function, and executes a :class:`~k3jax.infer.plan.StepPlan`.

* **One forward per step.** The decoding rows (``[b, 1]``) and the step's prefill chunk (``[1, C]``) run in one
  mixed forward (:meth:`K3ForCausalLM.forward_groups <k3jax.nn.model.K3ForCausalLM.forward_groups>`): every weight
  is read once for both; the KDA recurrence and MLA attention run per group. Logits are computed only for the rows
  that need them (each decoding row, the chunk's last real token). One program per step shape — ``(rows kind,
  bucket, chunk)`` — all compiled by :meth:`warmup`. (A speculative round beside a chunk runs as the chunk's
  forward, then the round's: a round's program is large, and one per chunk bucket would multiply the compiles.)
* **A speculative round** is one call too: a draft model (if any) proposes k tokens per slot in a ``lax.scan`` over
  its own slot cache, the target verifies them with its KDA layers recording their inputs, the acceptance rule
  picks each row's length, and every KDA layer (target and draft) is replayed to it (:meth:`Cache.accept
  <k3jax.nn.cache.Cache.accept>`).
* **Prefix-cache operations** (save a slot's KDA state, restore one, copy a page, draw a token from cached logits,
  recompute a hit from scratch) are small jitted functions of their own.

Host inputs arrive as fresh numpy arrays the scheduler never changes afterwards, so a step never waits for its
host-to-device copies; it waits once, for the tokens it returns.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.infer.config import EngineSizes
from k3jax.infer.plan import Chunk, Rows, Sampling, StepOutput, StepPlan
from k3jax.infer.prefix_cache import KDACheckpoint
from k3jax.infer.processors import mask_words
from k3jax.infer.sampling import sample_rows
from k3jax.infer.speculative import emitted_tokens, row_probs, speculative_accept, token_key
from k3jax.nn.cache import (Cache, KDACache, KDAPending, init_cache, init_paged_cache, kda_record_bytes,
                            slot_state_bytes)
from k3jax.nn.scan import use_scan


def _fresh(view: Cache) -> Cache:
    """A one-slot view whose KDA state and windows are zero when the slot holds no tokens (a new sequence)."""
    empty = view.lengths[0] == 0
    return Cache(tuple(jax.tree.map(lambda x: jnp.where(empty, jnp.zeros((), x.dtype), x), c)
                       if isinstance(c, KDACache) else c for c in view.layers), view.lengths)


def _samp(s: dict) -> tuple:
    return s["seeds"], s["counters"], s["temperature"], s["top_k"], s["top_p"]


def sampling_inputs(s: Sampling) -> dict:
    return {"seeds": s.seeds, "counters": s.counters, "temperature": s.temperature, "top_k": s.top_k,
            "top_p": s.top_p, "bans": s.bans}


def idle_sampling(n: int, vocab: int) -> Sampling:
    """Greedy settings for ``n`` idle rows (warm-up, bucket padding)."""
    return Sampling(np.zeros(n, np.uint32), np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32),
                    np.ones(n, np.float32), np.zeros((n, mask_words(vocab)), np.uint32))


class ModelRunner:
    """Device state and programs of the engine (see the module docstring). ``model``: the target
    :class:`~k3jax.nn.model.K3ForCausalLM`; ``sizes``: the static shapes (:class:`~k3jax.infer.config.EngineSizes`);
    ``draft``: a draft model (its own slot cache over the target's page table); ``k``: drafts per round (0: no
    speculation); ``encoder``: a :class:`~k3jax.vision.model.VisionEncoder` for requests with images; ``mixed``:
    one forward for the rows and the chunk (False: two); ``reference``: compile the from-scratch prefill a
    verified prefix-cache hit is compared with; ``scan``: every program runs the model's periodic run of layers
    as one scan body (:mod:`k3jax.nn.scan`; None: where :func:`~k3jax.nn.scan.scan_pays`, per model)."""

    def __init__(self, model, sizes: EngineSizes, *, draft=None, k: int = 0, encoder=None, pad_id: int | None = None,
                 mixed: bool = True, reference: bool = False, scan: bool | None = None):
        self.cfg, self.sizes, self.k, self.mixed = model.config, sizes, int(k), bool(mixed)
        self.scan = use_scan(self.cfg, scan)
        self.dscan = use_scan(draft.config, scan) if draft is not None else False
        self.graphdef, self.state = nnx.split(model)
        self.cache = init_paged_cache(self.cfg, sizes.max_slots, sizes.num_pages, sizes.page_size,
                                      sizes.max_model_len)
        self.draft_cfg = None if draft is None else draft.config
        self.dgraph, self.dstate, self.dcache = None, None, None
        if draft is not None:
            self._check_draft(draft.config)
            self.dgraph, self.dstate = nnx.split(draft)
            self.dcache = init_paged_cache(draft.config, sizes.max_slots, sizes.num_pages, sizes.page_size,
                                           sizes.max_model_len)
        self.encoder, self.encoder_pad_id = encoder, pad_id
        if encoder is not None and pad_id is None:
            raise ValueError("pad_id: the <|media_pad|> id is needed with a vision encoder")
        self.reference = bool(reference)
        self.traces: dict[str, int] = {}
        self._step = jax.jit(self._step_impl, donate_argnums=(1, 3))
        self._draft_chunk = jax.jit(self._draft_chunk_impl, donate_argnums=(1,))
        self._save = jax.jit(self._save_impl)
        self._restore = jax.jit(self._restore_impl, donate_argnums=(0,))
        self._copy = jax.jit(self._copy_impl, donate_argnums=(0,))
        self._sample = jax.jit(self._sample_impl)
        self._reference_chunk = jax.jit(self._reference_impl, donate_argnums=(1,))

    def _check_draft(self, dcfg) -> None:
        if dcfg.vocab_size != self.cfg.vocab_size:
            raise ValueError(f"speculative: the draft model has vocab_size {dcfg.vocab_size}, the target "
                             f"{self.cfg.vocab_size}; a draft must share the target's tokenizer")
        if self.sizes.max_model_len > dcfg.max_position_embeddings:
            raise ValueError(f"speculative: max_model_len {self.sizes.max_model_len} exceeds the draft model's "
                             f"max_position_embeddings {dcfg.max_position_embeddings}")

    def _count(self, kind: str) -> None:
        self.traces[kind] = self.traces.get(kind, 0) + 1     # runs at trace time only: counts compilations

    # ------------------------------------------------------------------------------------------ the step
    def _step_impl(self, state, cache, dstate, dcache, table, lengths, rows, chunk):
        """One forward over ``rows`` (decode / verify; None) and ``chunk`` (None) — see :class:`StepPlan`."""
        kind = "+".join(x for x in (None if rows is None else ("spec" if "drafts" in rows else "decode"),
                                    None if chunk is None else "prefill") if x)
        self._count(kind)
        model = nnx.merge(self.graphdef, state)
        c = Cache(cache.layers, lengths).with_page_table(table)
        ids, views, n_new, embeds, record, out = [], [], [], [], [], {}
        pending = None
        if rows is not None:
            view = c.read_slots(rows["slots"])
            if "drafts" in rows:
                drafts, q, pending = self._drafts(dstate, dcache, table, lengths, rows)
                rows = {**rows, "drafts": drafts, "q": q}
                ids.append(jnp.concatenate([rows["tokens"][:, None], drafts], axis=1))
                n_new.append(jnp.where(rows["active"], rows["n_draft"] + 1, 0).astype(jnp.int32))
            else:
                ids.append(rows["tokens"][:, None])
                n_new.append(rows["active"].astype(jnp.int32))
            views.append(view), embeds.append(None), record.append("drafts" in rows)
        if chunk is not None:
            views.append(_fresh(c.read_slots(chunk["slot"])))
            ids.append(chunk["ids"][None])
            n_new.append(jnp.reshape(chunk["n"], (1,)))
            embeds.append((chunk["rows"][None], chunk["mask"][None]))
            record.append(False)
        hidden, new = model.forward_groups(tuple(ids), tuple(views), tuple(n_new), embeds=tuple(embeds),
                                           kda_record=tuple(record), scan_layers=self.scan)
        if rows is not None:
            new_rows, dcache = self._finish_rows(model, rows, hidden[0], new[0], dcache, pending, out)
            c = c.write_slots(rows["slots"], new_rows)                # rows first: an idle row may be the chunk's
        if chunk is not None:
            h = jax.lax.dynamic_index_in_dim(hidden[-1][0], jnp.maximum(chunk["n"] - 1, 0), 0, keepdims=True)
            last = model.head(h)                                        # [1, V]
            tok, changed = sample_rows(last, *_samp(chunk), chunk["bans"])
            out.update(chunk_token=tok[0], chunk_changed=changed[0], chunk_logits=last[0])
            c = c.write_slots(chunk["slot"], new[-1])
        return out, Cache(c.layers, cache.lengths), dcache

    def _finish_rows(self, model, rows, h, new, dcache, pending, out):
        """Logits, tokens and the kept cache of the decoding rows (decode, or verify + accept + replay)."""
        if "drafts" not in rows:
            logits = model.head(h[:, 0])                                                  # [b, V]
            tok, changed = sample_rows(logits, *_samp(rows), rows["bans"])
            out.update(row_tokens=tok[:, None], kept=rows["active"].astype(jnp.int32), row_logits=logits[:, None],
                       row_changed=changed)
            return new, dcache
        logits = model.head(h)                                                            # [b, k+1, V]
        seeds, ctr, temp, tk, tp = _samp(rows)
        n_acc, tok = speculative_accept(logits, rows["drafts"], rows["n_draft"], rows["q"], seeds, ctr, temp, tk,
                                        tp)
        keep = jnp.where(rows["active"], n_acc + 1, 0).astype(jnp.int32)
        out.update(row_tokens=emitted_tokens(rows["drafts"], n_acc, tok), kept=keep, row_logits=logits,
                   row_changed=jnp.zeros_like(rows["active"]))
        if pending is not None:
            dc, drafted, drafting = pending
            dc = dc.write_slots(rows["slots"], drafted.accept(jnp.where(drafting, keep, 0)))
            dcache = Cache(dc.layers, dcache.lengths)
        return new.accept(keep), dcache

    def _drafts(self, dstate, dcache, table, lengths, rows):
        """The round's drafts ``[b, k]``, the distributions they were drawn from ``[b, k, V]`` (None: host drafts,
        a point mass each) and what accepting them needs (None without a draft model: the draft slot view, its
        pending cache after the round, the rows that drafted). A draft model takes k + 1 single-token steps in a ``lax.scan``
        over its own slot cache (the last step only records its inputs, so an all-accepted round leaves the draft
        in step with the target); a slot without drafts leaves the draft alone (it catches up later)."""
        if dstate is None:
            return rows["drafts"], None, None
        seeds, ctr, temp, tk, tp = _samp(rows)
        k = rows["drafts"].shape[1]
        dc = Cache(dcache.layers, lengths).with_page_table(table)
        drows = dc.read_slots(rows["slots"])
        draft = nnx.merge(self.dgraph, dstate)
        drafting = rows["active"] & (rows["n_draft"] > 0)

        def step(carry, t):
            work, tok = carry
            act = (drafting & (t <= rows["n_draft"])).astype(jnp.int32)
            o = draft(tok[:, None], cache=work, n_new=act, kda_record=True, scan_layers=self.dscan)
            lg = o.logits[:, 0].astype(jnp.float32)
            q = row_probs(lg[:, None], temp, tk, tp)[:, 0]                               # [b, V]
            # step t drafts the row's token number ctr + 1 + t; its own stream (fold_in 2) beside the target's
            keys = jax.vmap(lambda s_, c_: jax.random.fold_in(token_key(s_, c_ + 1 + t), 2))(seeds, ctr)
            drawn = jax.vmap(lambda kk, d: jax.random.categorical(kk, jnp.log(d)))(keys, q).astype(jnp.int32)
            d = jnp.where(temp > 0, drawn, jnp.argmax(lg, axis=-1).astype(jnp.int32))
            return (o.cache.accept(act), d), (d, q, o.cache.kda_records())

        (work, _), (ds, qs, recs) = jax.lax.scan(step, (drows, rows["tokens"]), jnp.arange(k + 1))
        recs = iter(jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1)[:, :, 0], recs))       # [k+1, b, 1, …] → [b, k+1, …]
        layers = tuple(KDAPending(b, next(recs)) if isinstance(b, KDACache) else w
                       for b, w in zip(drows.layers, work.layers))
        return jnp.moveaxis(ds[:k], 0, 1), jnp.moveaxis(qs[:k], 0, 1), (dc, Cache(layers, drows.lengths), drafting)

    # ------------------------------------------------------------------------------------------ small programs
    def _draft_chunk_impl(self, dstate, dcache, table, lengths, slot, ids, n):
        """A prefill chunk of the draft model into its slot cache (catching up with the target)."""
        self._count("draft_prefill")
        c = Cache(dcache.layers, lengths).with_page_table(table)
        out = nnx.merge(self.dgraph, dstate)(ids[None], cache=_fresh(c.read_slots(slot)), n_new=jnp.reshape(n, (1,)),
                                             scan_layers=self.dscan)
        return Cache(c.write_slots(slot, out.cache).layers, dcache.lengths)

    def _save_impl(self, cache, slot):
        self._count("prefix")
        return cache.kda_rows(slot)

    def _restore_impl(self, cache, slot, rows):
        self._count("prefix")
        return cache.with_kda_rows(slot, rows)

    def _copy_impl(self, cache, src, dst):
        self._count("prefix")
        return cache.copy_page(src, dst)

    def _sample_impl(self, logits, samp):
        self._count("prefix")
        tok, _ = sample_rows(logits[None], *_samp(samp), samp["bans"])
        return tok[0]

    def _reference_impl(self, state, cache, ids, n, rows, mask):
        """A chunk of a from-scratch prefill into a contiguous cache (``prefix_cache_verify``'s independent path)."""
        self._count("prefix")
        out = nnx.merge(self.graphdef, state)(ids[None], cache=cache, n_new=jnp.reshape(n, (1,)),
                                              embeds=(rows[None], mask[None]), scan_layers=self.scan)
        return jax.lax.dynamic_index_in_dim(out.logits[0], jnp.maximum(n - 1, 0), 0, keepdims=False), out.cache

    # ------------------------------------------------------------------------------------------ execute
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run ``plan`` (see :mod:`k3jax.infer.plan` for the order); returns what it gave."""
        t0 = time.perf_counter()
        for src, dst in plan.copies:
            self.copy_page(src, dst)
        for slot, rows in plan.restores:
            self.cache = self._restore(self.cache, np.int32(slot), rows)
        for ch in plan.draft_chunks:
            self.dcache = self._draft_chunk(self.dstate, self.dcache, plan.table, self._at(plan.lengths, ch),
                                            np.int32(ch.slot), ch.ids, np.int32(ch.n))
        res = StepOutput()
        dev: dict = {}
        if plan.forward:
            dev = self._forward(plan)
            self._read(plan, dev, res)
        for slot, logits, samp in plan.samples:
            res.sampled[slot] = int(self._sample(logits, sampling_inputs(samp)))
        self._saves(plan, dev, res)
        res.seconds = time.perf_counter() - t0
        return res

    @staticmethod
    def _at(lengths: np.ndarray, ch: Chunk) -> np.ndarray:
        out = lengths.copy()
        out[ch.slot] = ch.start
        return out

    def _inputs(self, plan: StepPlan) -> tuple[dict | None, dict | None]:
        lengths = plan.lengths
        rows = chunk = None
        if plan.rows is not None:
            r = plan.rows
            rows = {"slots": r.slots, "tokens": r.tokens, "active": r.active, **sampling_inputs(r.sampling)}
            if r.verify:
                rows.update(drafts=r.drafts, n_draft=r.n_draft)
        if plan.chunk is not None:
            ch = plan.chunk
            if int(lengths[ch.slot]) != ch.start:
                raise ValueError(f"chunk: slot {ch.slot} holds {lengths[ch.slot]} tokens, the chunk starts at {ch.start}")
            H, C, dt = self.cfg.hidden_size, ch.size, np.dtype(self.cfg.dtype)
            emb = ch.embeds if ch.embeds is not None else (np.zeros((C, H), dt), np.zeros(C, bool))
            chunk = {"slot": np.int32(ch.slot), "ids": ch.ids, "n": np.int32(ch.n),
                     "rows": np.asarray(emb[0], dt), "mask": np.asarray(emb[1], bool),
                     **sampling_inputs(ch.sampling or idle_sampling(1, self.cfg.vocab_size))}
        return rows, chunk

    def _forward(self, plan: StepPlan) -> dict:
        rows, chunk = self._inputs(plan)
        one = rows is None or chunk is None or (self.mixed and not plan.rows.verify)
        out = {}
        for r, c in [(rows, chunk)] if one else [(None, chunk), (rows, None)]:
            o, self.cache, self.dcache = self._step(self.state, self.cache, self.dstate, self.dcache, plan.table,
                                                    plan.lengths, r, c)      # two forwards: mixed steps off, or a
            out.update(o)                                                    # round beside a chunk
        return out

    @staticmethod
    def _read(plan: StepPlan, dev: dict, res: StepOutput) -> None:
        """Host copies of what the scheduler reads (one wait, for the tokens)."""
        changed = []
        if plan.rows is not None:
            res.tokens, res.kept = np.asarray(dev["row_tokens"]), np.asarray(dev["kept"])
            changed.append(np.asarray(dev["row_changed"]))
            if plan.want_logits:
                res.row_logits = np.asarray(dev["row_logits"], np.float32)
        if plan.chunk is not None:
            res.chunk_token = int(dev["chunk_token"])
            changed.append(np.asarray(dev["chunk_changed"])[None])
            if plan.want_logits:
                res.chunk_logits = np.asarray(dev["chunk_logits"], np.float32)
        res.banned_changed = np.concatenate(changed) if changed else None

    def _saves(self, plan: StepPlan, dev: dict, res: StepOutput) -> None:
        """The prefix-cache checkpoints the plan asked for whose slot reached the named length."""
        for slot, at in plan.saves:
            logits = None
            if plan.chunk is not None and plan.chunk.slot == slot:
                if plan.chunk.start + plan.chunk.n == at:
                    logits = dev["chunk_logits"]
            elif plan.rows is not None:
                hit = np.flatnonzero((plan.rows.slots == slot) & plan.rows.active)
                kept = int(res.kept[hit[0]]) if hit.size else 0
                if kept > 0 and int(plan.lengths[slot]) + kept == at:
                    logits = dev["row_logits"][int(hit[0]), kept - 1]
            if logits is not None:
                rows = self._save(self.cache, np.int32(slot))
                res.checkpoints[slot] = KDACheckpoint(rows, logits, sum(x.nbytes for x in jax.tree.leaves(rows))
                                                      + logits.nbytes)

    # ------------------------------------------------------------------------------------------ direct calls
    def copy_page(self, src: int, dst: int) -> None:
        """Page ``dst`` a copy of page ``src`` in every paged pool (the target's and a draft model's)."""
        self.cache = self._copy(self.cache, np.int32(src), np.int32(dst))
        if self.dcache is not None:
            self.dcache = self._copy(self.dcache, np.int32(src), np.int32(dst))

    def save(self, slot: int):
        return self._save(self.cache, np.int32(slot))

    def encode_images(self, images: Sequence) -> list[np.ndarray]:
        """Feature rows per processed image (the vision encoder; its buckets compile on first use or in warm-up)."""
        if self.encoder is None:
            raise ValueError("images: this engine has no vision encoder")
        return self.encoder.encode(list(images))

    def reference_prefill(self, ids: Sequence[int], overlay=None) -> tuple:
        """``ids`` prefilled from scratch through a contiguous cache in chunks (the prefix-cache verifier's
        independent path): ``(next-token logits, cache)``; ``overlay(start, C)`` gives image rows per chunk."""
        C, n = self.sizes.chunk, len(ids)
        buf = np.zeros(-(-n // C) * C, np.int32)
        buf[:n] = ids
        cache = init_cache(self.cfg, 1, self.sizes.max_model_len)
        H, dt = self.cfg.hidden_size, np.dtype(self.cfg.dtype)
        logits = None
        for s in range(0, n, C):
            ov = overlay(s, C) if overlay is not None else None
            rows, mask = ov if ov is not None else (np.zeros((C, H), dt), np.zeros(C, bool))
            logits, cache = self._reference_chunk(self.state, cache, buf[s:s + C], np.int32(min(C, n - s)),
                                                  np.asarray(rows, dt), np.asarray(mask))
        return logits, cache

    def compare_prefix(self, ids: Sequence[int], overlay, checkpoint, pages: Sequence[int]) -> tuple[float, str, bool]:
        """A prefix-cache hit of ``len(ids)`` tokens against its recomputation from scratch
        (:meth:`reference_prefill`): the checkpoint's KDA state and windows in every KDA layer, its next-token
        logits, and the MLA latents the cached ``pages`` hold. Returns ``(max |Δ|, where, ok)``; ok when every
        tensor agrees within tol·max(1, max |reference|), tol 1e-4 in fp32 (5e-2 otherwise)."""
        hit = len(ids)
        logits, ref = self.reference_prefill(ids, overlay)
        pairs = [("logits", logits, checkpoint.logits)]
        rows = iter(checkpoint.rows)
        page_ids = jnp.asarray(np.asarray(pages[:-(-hit // self.sizes.page_size)], np.int32))
        for i, (r, c) in enumerate(zip(ref.layers, self.cache.layers)):
            if isinstance(r, KDACache):
                g = next(rows)
                pairs += [(f"layer {i} kda {f}", getattr(r, f), getattr(g, f))
                          for f in ("state", "conv_q", "conv_k", "conv_v")]
            else:
                ckv, kr = c.gather(page_ids, hit)
                pairs += [(f"layer {i} mla c_kv", r.c_kv[0, :hit], ckv), (f"layer {i} mla k_r", r.k_r[0, :hit], kr)]
        tol = 1e-4 if jnp.dtype(self.cfg.dtype) == jnp.float32 else 5e-2
        worst, ok = (0.0, ""), True
        for name, a, b in pairs:
            a, b = np.array(a, np.float32), np.array(b, np.float32).reshape(np.shape(a))
            err = float(np.max(np.abs(a - b))) if a.size else 0.0
            worst = max(worst, (err, name))
            ok &= err <= tol * max(1.0, float(np.max(np.abs(a))) if a.size else 1.0)
        return worst[0], worst[1], bool(ok)

    # ------------------------------------------------------------------------------------------ warm-up
    def warmup(self, shapes: Sequence[tuple]) -> dict:
        """Compile (and run, on idle rows: nothing in the caches changes) every step shape ``(kind, rows, chunk)``
        and the small programs; returns each step shape's wall time on its second run (seconds)."""
        S, V = self.sizes.max_slots, self.cfg.vocab_size
        table, lengths = np.zeros((S, self.sizes.max_pages), np.int32), np.zeros(S, np.int32)
        seconds = {}
        for kind, b, C in shapes:
            plan = StepPlan(table, lengths, rows=self._idle_rows(kind, b) if b else None,
                            chunk=Chunk(0, 0, np.zeros(C, np.int32), 0, idle_sampling(1, V)) if C else None)
            for i in range(2 if kind == "verify" or (kind == "decode" and self.k and not C) else 1):
                t0 = time.perf_counter()
                self._forward(plan)["chunk_token" if C else "kept"].block_until_ready()
                seconds[(kind, b, C)] = time.perf_counter() - t0
        if self.dstate is not None:
            for C in self.sizes.prefill:
                self.dcache = self._draft_chunk(self.dstate, self.dcache, table, lengths, np.int32(0),
                                                np.zeros(C, np.int32), np.int32(0))
        self.cache = self._restore(self.cache, np.int32(0), self.save(0))
        self.copy_page(0, 0)
        self._sample(jnp.zeros((V,), self.cfg.dtype), sampling_inputs(idle_sampling(1, V))).block_until_ready()
        if self.reference:
            self.reference_prefill([0])
        return seconds

    def _idle_rows(self, kind: str | None, b: int) -> Rows:
        z = np.zeros(b, np.int32)
        r = Rows(np.arange(b, dtype=np.int32), z, np.zeros(b, bool), idle_sampling(b, self.cfg.vocab_size))
        if kind == "verify":
            r = Rows(r.slots, z, r.active, r.sampling, np.zeros((b, self.k), np.int32), z.copy())
        return r

    def warm_vision(self) -> None:
        """Compile the vision encoder's program for each of its patch buckets (a 2×2-patch image in each)."""
        from k3jax.vision.packing import plan_packing
        from k3jax.vision.processor import ProcessedImage

        p = self.encoder.cfg.patch_size
        im = ProcessedImage(np.zeros((4, 3, p, p), np.float32), (1, 2, 2), (2 * p, 2 * p), (2 * p, 2 * p), b"")
        for L in self.encoder.buckets:
            (pk,) = plan_packing([im.grid], (int(L),))
            jax.block_until_ready(self.encoder.run_bucket([im], pk))

    # ------------------------------------------------------------------------------------------ figures
    def memory(self, checkpoint_bytes: int = 0) -> dict:
        """Bytes of the slot pool (KDA state per slot, MLA latent per token and page, totals) and speculation."""
        sz, per_slot = self.sizes, slot_state_bytes(self.cfg)
        pool = sz.token_bytes * sz.page_size * sz.num_pages
        out = {"kda_state_bytes_per_slot": per_slot, "kda_state_bytes": per_slot * sz.max_slots,
               "mla_bytes_per_token": sz.token_bytes, "mla_bytes_per_page": sz.token_bytes * sz.page_size,
               "mla_pool_bytes": pool, "total_bytes": per_slot * sz.max_slots + pool}
        if self.k:
            T = self.k + 1
            out.update(spec_record_bytes_per_slot=kda_record_bytes(self.cfg, T),
                       spec_state_snapshots_bytes_per_slot=T * slot_state_bytes(self.cfg))
        if self.dcache is not None:
            dpool = sum(x.nbytes for c in self.dcache.layers if not isinstance(c, KDACache) for x in (c.c_kv, c.k_r))
            out.update(draft_state_bytes_per_slot=slot_state_bytes(self.draft_cfg), draft_pool_bytes=dpool,
                       draft_record_bytes_per_slot=kda_record_bytes(self.draft_cfg, self.k + 1))
        return out

    def checkpoint_bytes(self) -> int:
        """Bytes of one prefix-cache checkpoint: a slot's KDA state and windows plus the next-token logits."""
        return slot_state_bytes(self.cfg) + self.cfg.vocab_size * jnp.dtype(self.cfg.dtype).itemsize


__all__ = ["ModelRunner", "sampling_inputs", "idle_sampling"]
