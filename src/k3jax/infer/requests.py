"""What the scheduler serves: a request's sampling settings, its events, its state, and the page allocator.

:class:`SamplingParams` (validated, errors name the field), :class:`TokenEvent` (new tokens, the last one with the
finish reason), :class:`Request` (one sequence: prompt, generated tokens, slot, pages; ``stream()`` / ``result()``
for requests submitted without a callback), :class:`PageAllocator` (reference-counted MLA cache pages: a page of
a cached prefix is shared by every request that reuses it).
"""

from __future__ import annotations

import collections
import queue
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _dev(a) -> jax.Array:
    """A device copy of a host array, complete when this returns. On XLA:CPU the host-to-device copy of
    ``jnp.asarray`` / ``jnp.array`` can run after the call returns, reading host memory the scheduler has since
    changed or freed (seen as prefill logits that, now and then, differed by ~1e-3 from the same prefill run
    synchronously; blocking on the transfers removed it); the scheduler
    passes every host input through here."""
    return jax.block_until_ready(jnp.array(a, copy=True))


def _i32(x) -> jax.Array:
    return _dev(np.asarray(x, np.int32))


class RequestError(ValueError):
    """A request the scheduler cannot take (bad ids, too long, bad sampling values); ``field`` names the input."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue``; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. ``temperature`` 0 = greedy; ``top_k`` None/0 = all; ``top_p`` 1 = all;
    ``seed`` None = a fresh random seed; ``stop_token_ids`` end the sequence (the stop token is reported);
    ``ignore_eos`` drops the model's end-of-sequence ids from the stop set."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def check(self) -> None:
        def bad(name, want, got):
            raise RequestError(f"{name}: expected {want}, got {got!r}", name)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "an integer ≥ 1", self.max_tokens)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 <= t < float("inf")):
            bad("temperature", "a number ≥ 0 (0 = greedy)", t)
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            bad("top_k", "an integer ≥ 0 (0 or -1 = all) or null", self.top_k)
        if self.top_p is not None and (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                                       or not 0 < self.top_p <= 1):
            bad("top_p", "a number in (0, 1]", self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 32):
            bad("seed", "an integer in [0, 2^32)", self.seed)


@dataclass
class TokenEvent:
    """New tokens of one request; the last event has ``finished`` set and ``finish_reason`` in ``stop`` (a stop
    token), ``length`` (max_tokens or max_model_len), ``abort`` (cancelled / shut down) or ``error``."""

    request_id: str
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    time: float = 0.0


_WAITING, _PREFILL, _DECODE, _DONE = "waiting", "prefill", "decode", "done"


@dataclass(eq=False)
class Request:
    """One sequence in the scheduler. ``tokens``: generated so far; ``prompt_tokens``: its prompt length."""

    id: str
    prompt: list[int]
    params: SamplingParams
    stops: frozenset
    seed: int
    callback: Callable[[TokenEvent], None] | None = None
    tokens: list[int] = field(default_factory=list)
    state: str = _WAITING
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    computed: int = 0                   # tokens of `sequence` already in the cache
    sequence: list[int] = field(default_factory=list)   # what prefill runs: prompt (+ generated, after preemption)
    admitted: int = -1                  # admission order (the newest running request is preempted first)
    preemptions: int = 0
    arrival: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False
    use_prefix_cache: bool = True       # False: no lookup and no registration (a reference run, or privacy)
    content_keys: tuple = ()            # (token position, digest) of non-token inputs (images), hashed in
    embeds: object = None               # a MultimodalPrompt: image rows spliced at its positions during prefill
    cached_tokens: int = 0              # prompt tokens served from the prefix cache (first admission)
    hashes: list = field(default_factory=list)          # chain hash per complete block of prompt + generated
    save_at: frozenset = frozenset()    # boundaries where this admission's prefill saves a KDA checkpoint
    hit_node: object = None             # the prefix-cache node this admission started from (pinned)
    provisional: object = None          # (node, checkpoint) saved in decode, dropped at the next one
    logits: list | None = None          # next-token logits per generated token (Scheduler(record_logits=True))
    use_speculative: bool = True        # False: plain decode even when the scheduler speculates
    prediction: list = field(default_factory=list)      # a predicted output prompt lookup also drafts from
    spec: object = None                 # its AcceptanceTracker (speculative decoding)
    ngram: object = None                # its prompt-lookup index (NgramIndex)
    draft_len: int = 0                  # tokens the draft model holds for it (draft-model speculation)
    spec_drafted: int = 0               # tokens drafted for it / accepted
    spec_accepted: int = 0
    _q: queue.Queue | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.state == _DONE

    def stream(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """The request's events until the last one (only for requests submitted without a callback)."""
        if self._q is None:
            raise RuntimeError("stream(): this request was submitted with a callback; events go there")
        while True:
            ev = self._q.get(timeout=timeout)
            yield ev
            if ev.finished:
                return

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until finished; the generated token ids."""
        for _ in self.stream(timeout):
            pass
        return list(self.tokens)


class PageAllocator:
    """Reference-counted pages: ``num_pages`` ids, a free list, and per page the number of holders (running
    requests and prefix-cache entries). :meth:`alloc` hands out pages with one reference, :meth:`retain` adds one,
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


__all__ = ["RequestError", "QueueFull", "SamplingParams", "TokenEvent", "Request", "PageAllocator"]
