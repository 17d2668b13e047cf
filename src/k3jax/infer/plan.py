"""What one engine step does (:class:`StepPlan`, made by the scheduler) and what it gave (:class:`StepOutput`, made by
the model runner). Plain host data: numpy arrays handed over fresh each step (the runner may read them after the
scheduler moved on; nothing changes them), and opaque device handles (KDA checkpoints, logits) the runner made.

A step is at most one forward of the target model over two groups of rows, in order:

1. ``copies`` (page ``src`` → ``dst`` in every paged pool: copy-on-write of a page the prefix cache now holds),
   ``restores`` (a KDA checkpoint into a slot: a prefix-cache hit) and ``draft_chunks`` (the draft model catching
   up on a slot's tokens);
2. the forward: ``rows`` — decoding slots, one token each, or a speculative round over them (k drafts + the last
   token, verified and accepted in the same call) — and ``chunk``, one slot's prefill chunk, in one mixed forward;
3. ``samples`` (a first token drawn from a cached checkpoint's logits: a prompt served whole from the cache) and
   ``saves`` (a slot's KDA state and next-token logits, when its length after the step is the one named: a
   prefix-cache checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """Per-row sampling settings, ``[n]`` each: ``seeds`` uint32, ``counters`` int32 (tokens the row has drawn: the
    next draw is token number ``counters[b]``), ``temperature`` f32 (0 = greedy), ``top_k`` int32 (0 = all),
    ``top_p`` f32 (1 = all), ``bans`` uint32 ``[n, ⌈V/32⌉]`` (tokens a row may not draw)."""

    seeds: np.ndarray
    counters: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    bans: np.ndarray

    def arrays(self) -> tuple:
        return (self.seeds, self.counters, self.temperature, self.top_k, self.top_p)


def sampling_for(vocab_size: int, reqs) -> Sampling:
    """The settings of ``reqs`` (:class:`~k3jax.infer.requests.Request`; None: an idle row, greedy), with each row's
    banned tokens (``req.ban``)."""
    from k3jax.infer.processors import ban_mask

    n = len(reqs)
    seeds, ctr = np.zeros(n, np.uint32), np.zeros(n, np.int32)
    temp, tk, tp = np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32)
    for i, r in enumerate(reqs):
        if r is not None:
            p = r.params
            seeds[i], ctr[i], temp[i] = r.seed, len(r.tokens), p.temperature
            tk[i] = p.top_k or 0
            tp[i] = 1.0 if p.top_p is None else p.top_p
    bans = ban_mask([r.ban.banned() if r is not None and r.ban is not None else None for r in reqs], vocab_size)
    return Sampling(seeds, ctr, temp, tk, tp, bans)


@dataclass(frozen=True)
class Rows:
    """The decoding rows of a step: ``slots [b]`` (a decode bucket; rows with ``active`` False are idle slots filling
    it, untouched), ``tokens [b]`` (each row's last token). A speculative round also has ``drafts [b, k]`` and
    ``n_draft [b]`` (row b verifies its first ``n_draft[b]`` drafts; a draft model makes them on the device, then
    ``drafts`` only gives the shape)."""

    slots: np.ndarray
    tokens: np.ndarray
    active: np.ndarray
    sampling: Sampling
    drafts: np.ndarray | None = None
    n_draft: np.ndarray | None = None

    @property
    def verify(self) -> bool:
        return self.drafts is not None

    @property
    def size(self) -> int:
        return int(self.slots.shape[0])


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk: ``ids [C]`` (the first ``n`` real) continue ``slot`` at position ``start`` (0: a fresh
    sequence, zero KDA state); ``embeds`` = ``(rows [C, hidden], mask [C])`` image rows spliced in (None: none)."""

    slot: int
    start: int
    ids: np.ndarray
    n: int
    sampling: Sampling | None = None
    embeds: tuple | None = None

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class StepPlan:
    """See the module docstring. ``table [slots, max_pages]`` and ``lengths [slots]``: the page table and the tokens
    each slot holds before the step; ``saves``: ``(slot, length)`` pairs; ``want_logits``: return host logits."""

    table: np.ndarray
    lengths: np.ndarray
    rows: Rows | None = None
    chunk: Chunk | None = None
    copies: tuple[tuple[int, int], ...] = ()
    restores: tuple[tuple[int, object], ...] = ()
    draft_chunks: tuple[Chunk, ...] = ()
    samples: tuple[tuple[int, object, Sampling], ...] = ()
    saves: tuple[tuple[int, int], ...] = ()
    want_logits: bool = False

    @property
    def forward(self) -> bool:
        return self.rows is not None or self.chunk is not None

    @property
    def empty(self) -> bool:
        return not (self.forward or self.copies or self.restores or self.draft_chunks or self.samples)

    def shape(self) -> tuple:
        """The forward's static shape: ``(rows kind, rows, chunk)``; the runner compiles one program per shape."""
        r = self.rows
        kind = None if r is None else ("verify" if r.verify else "decode")
        return kind, 0 if r is None else r.size, 0 if self.chunk is None else self.chunk.size


@dataclass
class StepOutput:
    """What a step gave. ``tokens [b, T]`` per row (decode: T = 1; a round: the accepted drafts then the drawn token,
    ``kept [b]`` of them valid); ``chunk_token`` (the token after the chunk; None without a chunk);
    ``banned_changed``: per row (then the chunk) whether a ban changed the draw; ``row_logits [b, T, V]`` and
    ``chunk_logits [V]`` host arrays when the plan asked; ``sampled``: slot → token of ``plan.samples``;
    ``checkpoints``: slot → :class:`~k3jax.infer.prefix_cache.KDACheckpoint` (the slot's KDA rows and next-token
    logits, device handles) of the ``saves`` that applied;
    ``seconds``: the step's wall time."""

    tokens: np.ndarray | None = None
    kept: np.ndarray | None = None
    chunk_token: int | None = None
    banned_changed: np.ndarray | None = None
    row_logits: np.ndarray | None = None
    chunk_logits: np.ndarray | None = None
    sampled: dict = field(default_factory=dict)
    checkpoints: dict = field(default_factory=dict)
    seconds: float = 0.0


__all__ = ["sampling_for", "Sampling", "Rows", "Chunk", "StepPlan", "StepOutput"]
