"""What the engine serves: a request's sampling settings, its prompt checks, its events and its state.

:class:`SamplingParams` (validated once, at construction, with one rule per field; errors name the field),
:func:`check_prompt` (the prompt rules every entry point shares), :class:`TokenEvent` (new tokens, the last one with
the finish reason) and :class:`Request` (one sequence: prompt, generated tokens, slot; the state of each feature in
its own sub-object: :class:`PrefixState`, :class:`SpecState`). Host only: nothing here touches JAX.
"""

from __future__ import annotations

import queue
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence


class RequestError(ValueError):
    """A request the engine cannot take (bad ids, too long, bad sampling values); ``field`` names the input."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue``; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for, validated when it is made (:class:`RequestError` naming the field).

    ``max_tokens`` ≥ 1 tokens to generate; ``temperature`` in [0, 100], 0 = greedy; ``top_k`` None (all tokens) or
    ≥ 1 (OpenAI-style front ends map their "all" values, -1 and 0, to None); ``top_p`` None (all) or in (0, 1];
    ``seed`` None = a fresh random seed, else in [0, 2³²); ``stop_token_ids`` end the sequence (the stop token is
    reported); ``ignore_eos`` drops the model's end-of-sequence ids from the stop set; ``no_repeat_ngram`` > 0 bans
    every token that would complete an n-gram already in the prompt + output (a guard against a small model's
    loops; 0 = off)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_repeat_ngram: int = 0

    def __post_init__(self):
        def bad(name, want):
            raise RequestError(f"{name}: expected {want}, got {getattr(self, name)!r}", name)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer ≥ 1")
        t = self.temperature
        if not _is_number(t) or not (0 <= t <= MAX_TEMPERATURE):
            bad("temperature", f"a number ≥ 0 and ≤ {MAX_TEMPERATURE:g} (0 = greedy)")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            bad("top_k", "a positive integer (all tokens: None in Python, -1 or 0 over HTTP)")
        if self.top_p is not None and (not _is_number(self.top_p) or not 0 < self.top_p <= 1):
            bad("top_p", "a number in (0, 1] or None")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2 ** 32):
            bad("seed", "an integer in [0, 2^32) or None")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not all(_is_int(s) and s >= 0 for s in stops):
            bad("stop_token_ids", "token ids ≥ 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in stops))
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "true or false")
        if not _is_int(self.no_repeat_ngram) or self.no_repeat_ngram < 0:
            bad("no_repeat_ngram", "an integer ≥ 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_prompt(prompt: Sequence[int], *, vocab_size: int, max_len: int, max_tokens: int, where: str = "prompt",
                 tokens_name: str = "max_tokens", limit_name: str = "max_model_len", hint: str = "",
                 error: type[RequestError] = RequestError) -> list[int]:
    """``prompt`` as a list of ints, or ``error`` naming ``where`` (the prompt's name in the caller's API):
    not empty, ids in ``[0, vocab_size)``, and room in ``max_len`` for the prompt and ``max_tokens`` more
    (``tokens_name`` / ``limit_name`` / ``hint``: how the caller's API calls them)."""
    try:
        ids = [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise error(f"{where}: expected a list of token ids", where) from None
    if not ids:
        raise error(f"{where}: empty (no token ids); a prompt needs at least one token", where)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise error(f"{where}: token ids must lie in [0, {vocab_size}) (vocab_size); got min {lo}, max {hi}", where)
    if len(ids) >= max_len:
        raise error(f"{where}: {len(ids)} tokens; the {limit_name} is {max_len} tokens (prompt + at least one "
                    f"generated token){hint}", where)
    if len(ids) + max_tokens > max_len:
        raise error(f"{where}: {len(ids)} tokens + {tokens_name} {max_tokens} = {len(ids) + max_tokens} exceeds "
                    f"{limit_name} {max_len}{hint}", tokens_name)
    return ids


@dataclass
class TokenEvent:
    """New tokens of one request; the last event has ``finished`` set and ``finish_reason`` in ``stop`` (a stop
    token, or a stop string its consumer found), ``length`` (max_tokens or max_model_len), ``abort`` (cancelled /
    shut down) or ``error``."""

    request_id: str
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    time: float = 0.0


WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"


@dataclass(eq=False)
class PrefixState:
    """A request's use of the prefix cache: ``use`` (False: no lookup and no registration — a reference run, or
    privacy), ``content_keys`` ``(token position, digest)`` of non-token inputs (images) hashed into the keys,
    the chain ``hashes`` per complete block, the boundaries where this admission's prefill saves a KDA checkpoint
    (``save_at``), the pinned node it started from (``node``), the end-of-sequence checkpoint decode saved last
    (``provisional``), and the prompt tokens served from the cache at its first admission (``cached_tokens``)."""

    use: bool = True
    content_keys: tuple = ()
    hashes: list = field(default_factory=list)
    save_at: frozenset = frozenset()
    node: object = None
    provisional: tuple | None = None
    cached_tokens: int = 0


@dataclass(eq=False)
class SpecState:
    """A request's speculative decoding: ``use`` (False: plain decode), a ``prediction`` (predicted output ids prompt
    lookup also drafts from), its acceptance ``tracker``, its prompt-lookup index (``ngram``), the tokens the draft
    model holds for it (``draft_len``), and the tokens drafted for it / accepted."""

    use: bool = True
    prediction: list = field(default_factory=list)
    tracker: object = None
    ngram: object = None
    draft_len: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass(eq=False)
class Request:
    """One sequence in the engine. ``tokens``: generated so far; ``sequence``: what prefill runs (the prompt, plus
    the generated tokens after a preemption); ``computed``: tokens of ``sequence`` the slot's cache holds. Fields
    are written by the scheduler thread only; a consumer reads them after the request's last event."""

    id: str
    prompt: list[int]
    params: SamplingParams
    stops: frozenset
    seed: int
    callback: Callable[[TokenEvent], None] | None = None
    tokens: list[int] = field(default_factory=list)
    state: str = WAITING
    slot: int = -1
    computed: int = 0
    sequence: list[int] = field(default_factory=list)
    admitted: int = -1                  # admission order (the newest running request is preempted first)
    preemptions: int = 0
    arrival: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    media: object = None                # a MultimodalPrompt: image rows spliced at its positions during prefill
    images: list | None = None          # processed images the engine encodes at admission (then ``media``)
    logits: list | None = None          # next-token logits per generated token (EngineConfig.record_logits)
    ban: object = None                  # a NoRepeatNgram (SamplingParams.no_repeat_ngram)
    prefix: PrefixState = field(default_factory=PrefixState)
    spec: SpecState = field(default_factory=SpecState)
    _q: queue.Queue | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def cached_tokens(self) -> int:
        return self.prefix.cached_tokens

    @property
    def finished(self) -> bool:
        return self.state == DONE

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


def new_request(prompt, params: SamplingParams, sizes, *, hidden: int, request_id: str, callback=None,
                use_prefix_cache: bool = True, content_keys=(), use_speculative: bool = True, prediction=(),
                embeds=None, images=None, record_logits: bool = False) -> Request:
    """A checked :class:`Request` for an engine of ``sizes`` (:class:`~k3jax.infer.config.EngineSizes`) whose model
    has width ``hidden`` — every rule a request must pass before it is queued, errors naming the field (see
    :meth:`~k3jax.infer.scheduler.Scheduler.submit` for the arguments)."""
    if not isinstance(params, SamplingParams):
        raise RequestError("params: expected SamplingParams", "params")
    V = sizes.vocab_size
    if embeds is not None:                      # a MultimodalPrompt: its expanded ids are the prompt
        prompt = embeds.ids
        if embeds.rows.shape[1:] != (hidden,):
            raise RequestError(f"embeds: rows of width {embeds.rows.shape[1:]}, expected ({hidden},)", "embeds")
        content_keys = content_keys or embeds.content_keys
    ids = check_prompt(prompt if prompt is not None else [], vocab_size=V, max_len=sizes.max_model_len,
                       max_tokens=params.max_tokens)
    need = -(-(len(ids) + params.max_tokens) // sizes.page_size)
    if need > sizes.num_pages:
        raise RequestError(f"max_tokens: prompt + max_tokens need {need} pages of {sizes.page_size} tokens; the "
                           f"page pool has {sizes.num_pages} (raise --kv-cache-memory)", "max_tokens")
    for t in params.stop_token_ids:
        if t >= V:
            raise RequestError(f"stop_token_ids: {t} is outside [0, {V})", "stop_token_ids")
    pred = [int(t) for t in prediction]
    if pred and (min(pred) < 0 or max(pred) >= V):
        raise RequestError(f"prediction: token ids must lie in [0, {V}) (vocab_size); got min {min(pred)}, max "
                           f"{max(pred)}", "prediction")
    stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else sizes.eos_ids)
    req = Request(id=request_id, prompt=ids, params=params, stops=stops,
                  seed=params.seed if params.seed is not None else secrets.randbits(32), callback=callback,
                  sequence=list(ids), arrival=time.perf_counter(), media=embeds,
                  images=list(images) if images else None, logits=[] if record_logits else None,
                  _q=queue.Queue() if callback is None else None)
    req.prefix.use, req.prefix.content_keys = bool(use_prefix_cache), _content_keys(content_keys, len(ids))
    req.spec.use, req.spec.prediction = bool(use_speculative), pred
    if params.no_repeat_ngram:
        from k3jax.infer.processors import NoRepeatNgram

        req.ban = NoRepeatNgram(params.no_repeat_ngram, ids)
    return req


def _content_keys(content_keys, n: int) -> tuple:
    keys = []
    for k in content_keys:
        if not (isinstance(k, tuple) and len(k) == 2 and isinstance(k[0], int) and 0 <= k[0] < n
                and isinstance(k[1], (bytes, bytearray))):
            raise RequestError(f"content_keys: expected (position in [0, {n}), digest bytes) pairs, got {k!r}",
                               "content_keys")
        keys.append((int(k[0]), bytes(k[1])))
    return tuple(sorted(keys))


__all__ = ["new_request", "RequestError", "QueueFull", "SamplingParams", "check_prompt", "TokenEvent", "Request", "PrefixState",
           "SpecState", "WAITING", "PREFILL", "DECODE", "DONE"]
