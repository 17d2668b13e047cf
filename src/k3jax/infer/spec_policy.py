"""When and how much the scheduler speculates: host-side policy of speculative decoding.

A step whose decoding slots have drafts runs a round instead of a plain decode (the runner verifies, accepts and
replays in one call: :mod:`k3jax.infer.runner`). Per slot, :meth:`Speculation.room` caps the drafts so a round never
writes past ``max_model_len`` or the request's ``max_tokens`` and never steps over a prefix-cache block boundary
(the checkpoint there needs the state at exactly that length); the pages the drafts write into are taken without
preempting anyone (fewer drafts instead). A request drafts while its acceptance rate holds
(:class:`~k3jax.infer.speculative.AcceptanceTracker`), and a step speculates only when the expected tokens per second
beat plain decode's, from the step times measured per shape (at warm-up, then as the server runs).

A draft model follows the target lazily: before a slot's first round (after its prompt, a prefix-cache hit or a
preemption) it prefills the tokens the target holds, one chunk per slot and step, and the slot decodes plainly
meanwhile.
"""

from __future__ import annotations

import numpy as np

from k3jax.infer.config import EngineSizes
from k3jax.infer.plan import Chunk, Rows
from k3jax.infer.proposers import Proposer
from k3jax.infer.requests import Request
from k3jax.infer.slots import SlotPool
from k3jax.infer.speculative import AcceptanceTracker, SpecConfig

_COST_WEIGHT = 0.2          # exponential average of the measured step times
_RETIME_EVERY = 64          # refused rounds in a row at one shape before one runs to measure its time again


class Speculation:
    """Speculative decoding's policy state: the config, the proposer, measured step times and the counters."""

    def __init__(self, config: SpecConfig, proposer: Proposer, sizes: EngineSizes, block: int | None):
        self.config, self.proposer, self.sizes, self.block = config, proposer, sizes, block
        self.k = config.k
        self.step_seconds: dict[tuple, float] = {}
        self.refused: dict[tuple, int] = {}     # (bucket, chunk) → rounds refused in a row
        self.counters = {"spec_steps": 0, "spec_rounds": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                         "spec_fallback_steps": 0, "spec_retime_rounds": 0,
                         "draft_prefill_chunks": 0}

    def tracker(self, req: Request) -> AcceptanceTracker:
        if req.spec.tracker is None:
            req.spec.tracker = AcceptanceTracker()
        return req.spec.tracker

    def observe(self, key: tuple, seconds: float) -> None:
        old = self.step_seconds.get(key)
        self.step_seconds[key] = seconds if old is None else (1 - _COST_WEIGHT) * old + _COST_WEIGHT * seconds

    def room(self, req: Request, length: int, prefix: bool) -> int:
        """How many drafts ``req`` (its slot holding ``length`` tokens) may propose this step (0: decode plainly)."""
        if not req.spec.use or req.ban is not None:
            return 0
        if self.config.adaptive and not self.tracker(req).active(len(req.tokens)):
            return 0
        n = min(self.k, req.params.max_tokens - len(req.tokens) - 1, self.sizes.max_model_len - length - 2)
        if prefix and self.block and req.prefix.use:             # land on the next block boundary, not past it
            n = min(n, (length // self.block + 1) * self.block - length - 1)
        return max(0, n)

    def pays(self, reqs: list[Request], n_draft: np.ndarray, bucket: int, chunk: int) -> bool:
        """Whether a round beats a plain step in expected tokens per second (always, without ``adaptive``, before
        both have been timed at this shape or without the chunk, or while a request's rate is unknown). After
        ``_RETIME_EVERY`` refusals in a row at a shape one round runs anyway, so that a verify time measured on a
        bad step (the times are only updated by steps that run) cannot switch speculation off for good."""
        if not self.config.adaptive:
            return True
        plain, spec = self.step_seconds.get(("decode", bucket, chunk)), self.step_seconds.get(("verify", bucket, chunk))
        if plain is None or spec is None:
            plain, spec = self.step_seconds.get(("decode", bucket, 0)), self.step_seconds.get(("verify", bucket, 0))
        if plain is None or spec is None:
            return True
        trackers = [self.tracker(r) for r, n in zip(reqs, n_draft) if n]
        if any(t.exploring for t in trackers):
            return True
        expected = sum(self.tracker(r).expected_tokens(int(n)) if n else 1.0 for r, n in zip(reqs, n_draft))
        if expected / spec >= len(reqs) / plain:
            self.refused.pop((bucket, chunk), None)
            return True
        n = self.refused[(bucket, chunk)] = self.refused.get((bucket, chunk), 0) + 1
        if n >= _RETIME_EVERY:
            self.refused.pop((bucket, chunk))
            self.counters["spec_retime_rounds"] += 1
            return True
        self.counters["spec_fallback_steps"] += 1
        return False

    def catch_up(self, req: Request, length: int) -> Chunk | None:
        """The draft model's next prefill chunk toward the ``length`` tokens the target holds for ``req`` (None:
        caught up); ``req.spec.draft_len`` counts it as done (the step runs it before the round)."""
        have = req.spec.draft_len
        if have >= length:
            return None
        seq = (req.prompt + req.tokens)[:length]
        P = self.sizes.prefill
        C = next((b for b in P if b >= length - have), P[-1])
        n = min(C, length - have)
        ids = np.zeros(C, np.int32)
        ids[:n] = seq[have:have + n]
        req.spec.draft_len += n
        self.counters["draft_prefill_chunks"] += 1
        return Chunk(req.slot, have, ids, n)

    def draft_pages(self, req: Request, n: int, pool: SlotPool) -> int:
        """Pages for ``n`` drafts after the slot's tokens (never preempting); the drafts that fit."""
        L = int(pool.lengths[req.slot])
        if pool.grow(req.slot, L + n + 1):
            return n
        return max(0, min(n, len(pool.pages[req.slot]) * pool.page_size - 1 - L))

    def round(self, decoding: list[Request], rows: Rows, chunk: Chunk | None, pool: SlotPool,
              prefix: bool) -> tuple[Rows, tuple] | None:
        """A speculative round over the decoding rows (``rows``: their plain decode step, ``decoding`` its active
        requests in order) and the draft model's catch-up chunks, or None when no row drafts or a round would not
        pay (the step decodes plainly)."""
        b, on_device = rows.size, self.proposer.on_device
        n_draft, drafts = np.zeros(b, np.int32), np.zeros((b, self.k), np.int32)
        for j, r in enumerate(decoding):
            n = self.room(r, int(pool.lengths[r.slot]), prefix)
            if n and not on_device:
                d = self.proposer.propose(r, n)
                drafts[j, :len(d)] = d
                n = len(d)
            n_draft[j] = n
        if not n_draft.any() or not self.pays(decoding, n_draft[:len(decoding)], b, 0 if chunk is None else chunk.size):
            return None
        catch_up = []
        if on_device:                                       # the draft must hold what the target holds
            for j, r in enumerate(decoding):
                if n_draft[j]:
                    ch = self.catch_up(r, int(pool.lengths[r.slot]))
                    catch_up += [ch] if ch is not None else []
                    if r.spec.draft_len < int(pool.lengths[r.slot]):
                        n_draft[j] = 0
        for j, r in enumerate(decoding):
            if n_draft[j]:
                n_draft[j] = self.draft_pages(r, int(n_draft[j]), pool)
        if not n_draft.any():
            return None if not catch_up else (rows, tuple(catch_up))
        return Rows(rows.slots, rows.tokens, rows.active, rows.sampling, drafts, n_draft), tuple(catch_up)

    def applied(self, req: Request, drafted: int, kept: int) -> None:
        """A row's round result: ``drafted`` drafts, ``kept`` tokens emitted (accepted drafts + 1)."""
        self.counters["spec_rounds"] += 1
        self.counters["spec_draft_tokens"] += drafted
        self.counters["spec_accepted_tokens"] += kept - 1
        req.spec.drafted += drafted
        req.spec.accepted += kept - 1
        self.tracker(req).update(drafted, kept - 1, len(req.tokens))

    def snapshot(self) -> dict:
        """Drafted and accepted tokens, acceptance rate, mean accepted length per round, measured step times."""
        c = self.counters
        rounds, drafted, accepted = c["spec_rounds"], c["spec_draft_tokens"], c["spec_accepted_tokens"]
        return {"method": self.config.method, "k": self.k, "steps": c["spec_steps"], "rounds": rounds,
                "draft_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": accepted / rounds if rounds else 0.0,
                "fallback_steps": c["spec_fallback_steps"], "retime_rounds": c["spec_retime_rounds"],
                "draft_prefill_chunks": c["draft_prefill_chunks"],
                "step_seconds": {f"{kind}@{b}" + (f"+{C}" if C else ""): s
                                 for (kind, b, C), s in sorted(self.step_seconds.items(), key=str)}}


__all__ = ["Speculation"]
