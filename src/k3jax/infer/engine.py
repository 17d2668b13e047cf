"""Offline generation on the serving engine, driven synchronously: :class:`Engine` and :func:`generate`.

``Engine(model).generate(prompts, max_new_tokens, …)`` submits every prompt to a
:class:`~k3jax.infer.scheduler.Scheduler` (one slot per prompt, the paged cache sized to the longest prompt +
generation, in power-of-two buckets) and steps it on the caller's thread until every prompt is done — the same
model runner, sampling and stop rules as ``k3jax serve``. A scheduler is kept per (prompts, length bucket), so
repeated calls compile nothing new; it compiles the step shapes a call uses as it meets them.

:meth:`Engine.prefill` is the scoring path: prompts through the model in chunks over a contiguous cache, returning
the cache and the last (or every) position's logits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.infer.config import EngineConfig
from k3jax.infer.requests import DONE, PREFILL, RequestError, SamplingParams, check_prompt
from k3jax.infer.scheduler import Scheduler
from k3jax.nn.cache import cache_bytes, init_cache
from k3jax.nn.model import K3ForCausalLM
from k3jax.nn.scan import use_scan

MIN_BUCKET = 256


def length_bucket(n: int, chunk: int, minimum: int = MIN_BUCKET) -> int:
    """The preallocated cache length for ``n`` tokens: the next power of two ≥ n (≥ ``minimum``), a multiple of
    the prefill ``chunk``."""
    L = max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
    return -(-L // chunk) * chunk


class GenerationError(RequestError):
    """A request the engine cannot serve (empty or over-long prompt, bad token ids); the message says why."""


@dataclass
class GenerateResult:
    tokens: list[list[int]]                      # generated ids per prompt (stop token included when hit)
    prompt_lengths: list[int]
    stats: dict = field(default_factory=dict)    # prefill/decode seconds, tokens/s, cache bytes, compiles
    logits: list | None = None                   # per prompt [generated, vocab] (generate(record_logits=True))


class Engine:
    """Offline generation for a :class:`K3ForCausalLM` (see the module docstring). ``chunk``: the largest prefill
    chunk (default :class:`~k3jax.infer.config.EngineConfig`'s); ``max_len``: the longest prompt + generation accepted (default ``max_position_embeddings``);
    ``speculative`` / ``draft_model``: speculative decoding (:class:`~k3jax.infer.speculative.SpecConfig` or its
    text); ``encoder``, ``pad_id``: a vision encoder for prompts with ``images``; ``scan_layers``:
    :attr:`EngineConfig.scan_layers <k3jax.infer.config.EngineConfig.scan_layers>`."""

    def __init__(self, model: K3ForCausalLM, *, chunk: int | None = None, max_len: int | None = None,
                 speculative=None, draft_model=None, encoder=None, pad_id: int | None = None,
                 scan_layers: bool | None = None):
        self.model, self.cfg = model, model.config
        self.options = EngineConfig(prefix_cache=False, speculative=speculative, scan_layers=scan_layers,
                                    **({} if chunk is None else {"chunk": int(chunk)}))
        self.chunk = self.options.chunk
        self.max_len = int(max_len or self.cfg.max_position_embeddings)
        self.draft_model, self.encoder, self.pad_id = draft_model, encoder, pad_id
        self._schedulers: dict[tuple, Scheduler] = {}
        self.graphdef, self.state = nnx.split(model)
        self._prefill_traces = {"score": 0}
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("all_logits",), donate_argnums=(2,))

    @property
    def traces(self) -> dict[str, int]:
        """Compilations so far, by kind: the schedulers' step shapes and the scoring prefill."""
        out = {k: v for k, v in self._prefill_traces.items() if v}
        for s in self._schedulers.values():
            for k, v in s.runner.traces.items():
                out[k] = out.get(k, 0) + v
        return out

    def scheduler(self, prompts: int, length: int, record_logits: bool = False) -> Scheduler:
        """The scheduler for ``prompts`` sequences of up to ``length`` tokens (bucketed; made once)."""
        L = min(length_bucket(length, self.chunk), self.max_len)
        key = (prompts, L, record_logits)
        if key not in self._schedulers:
            cfg = self.options.replace(max_slots=prompts, max_model_len=L, max_queue=prompts,
                                       record_logits=record_logits)
            self._schedulers[key] = Scheduler(self.model, cfg, draft_model=self.draft_model, encoder=self.encoder,
                                              pad_id=self.pad_id)
        return self._schedulers[key]

    # ----------------------------------------------------------------------------------------------- generate
    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        if len(prompts) == 0:
            raise GenerationError("prompts: expected at least one prompt, got none", "prompts")
        hint = (f" (max_position_embeddings={self.cfg.max_position_embeddings}; pass max_len to raise it)")
        return [check_prompt(np.asarray(p).reshape(-1).tolist(), vocab_size=self.cfg.vocab_size,
                             max_len=self.max_len, max_tokens=max_new_tokens, where=f"prompt {i}",
                             tokens_name="max_new_tokens", limit_name="max_len", hint=hint, error=GenerationError)
                for i, p in enumerate(prompts)]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 stop_tokens: Sequence[int] = (), on_token: Callable[[int, int], None] | None = None,
                 progress: Callable[[int, int], None] | None = None, no_repeat_ngram: int = 0,
                 embeds: Sequence | None = None, images: Sequence | None = None,
                 record_logits: bool = False) -> GenerateResult:
        """Generate up to ``max_new_tokens`` per prompt; a row stops after emitting one of ``stop_tokens`` (only
        those: no implicit end-of-sequence). ``on_token(row, token)`` streams each new token; ``progress(done,
        total)`` reports prompt tokens prefilled. Row i samples with seed ``seed + i``: the same seed gives the
        same output, and row 0 the output ``k3jax serve`` gives that seed.

        ``no_repeat_ngram=n`` (> 0; transformers' ``no_repeat_ngram_size``): a token that would complete an n-gram
        already in the row (prompt and output) is banned; ``stats["no_repeat_ngram_changed"]`` counts the tokens
        the ban changed. ``embeds``: per prompt None or a :class:`~k3jax.vision.model.MultimodalPrompt` (its ids
        replace the prompt); ``images``: per prompt None or processed images (the engine's encoder);
        ``record_logits``: ``result.logits`` holds each row's next-token logits per generated token."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens: expected an integer ≥ 0, got {max_new_tokens!r}", "max_new_tokens")
        if not isinstance(no_repeat_ngram, int) or no_repeat_ngram < 0:
            raise GenerationError(f"no_repeat_ngram: expected an integer ≥ 0 (0 = off), got {no_repeat_ngram!r}",
                                  "no_repeat_ngram")
        B = len(prompts)
        params = [SamplingParams(max_tokens=max(1, max_new_tokens), temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=(int(seed) + i) % 2 ** 32, stop_token_ids=tuple(stop_tokens),
                                 ignore_eos=True, no_repeat_ngram=no_repeat_ngram) for i in range(B)]
        if embeds is not None:
            prompts = [e.ids if e is not None else p for p, e in zip(prompts, embeds)]
        images = list(images) if images is not None else [None] * B
        ids = self.check_prompts(prompts, max_new_tokens) if not any(images) else [list(p) for p in prompts]
        if max_new_tokens == 0:
            return GenerateResult([[] for _ in ids], [len(p) for p in ids], {"compiles": self.traces})
        longest = max(len(p) + sum(im.tokens for im in (images[i] or ())) for i, p in enumerate(ids))
        sched = self.scheduler(B, longest + max_new_tokens, record_logits)
        t0, banned0 = time.perf_counter(), sched.counters["banned_changed"]
        reqs = []
        for i, p in enumerate(ids):
            cb = (lambda ev, i=i: [on_token(i, t) for t in ev.tokens]) if on_token is not None else (lambda ev: None)
            try:
                reqs.append(sched.submit(p, params[i], callback=cb, use_prefix_cache=False,
                                         embeds=embeds[i] if embeds is not None else None, images=images[i]))
            except RequestError as e:
                for r in reqs:                          # nothing of this call stays queued
                    sched.cancel(r)
                sched.step()
                raise GenerationError(f"prompt {i}: {e}", e.field) from None
        marks = self._run(sched, reqs, progress)
        res = self._result(sched, reqs, marks, t0, record_logits)
        if no_repeat_ngram:
            res.stats["no_repeat_ngram_changed"] = sched.counters["banned_changed"] - banned0
        return res

    @staticmethod
    def _run(sched: Scheduler, reqs, progress) -> list[tuple[float, int]]:
        """Step until every request is done; ``(time, tokens generated)`` after each step."""
        marks, total = [], sum(len(r.prompt) for r in reqs)
        while any(r.state != DONE for r in reqs):
            sched.step()
            marks.append((time.perf_counter(), sum(len(r.tokens) for r in reqs)))
            if progress is not None and any(r.state == PREFILL for r in reqs):
                progress(sum(min(r.computed, len(r.prompt)) for r in reqs), total)
        for r in reqs:
            if r.finish_reason == "error":
                raise RuntimeError(f"generation failed: {r.error}")
        return marks

    def _result(self, sched: Scheduler, reqs, marks, t0: float, record: bool) -> GenerateResult:
        B = len(reqs)
        t_first = max(r.first_token_time for r in reqs)
        t_end = marks[-1][0] if marks else t0
        decode = [(t, n) for t, n in marks if t > t_first]
        n_gen = sum(len(r.tokens) for r in reqs)
        steady = (decode[-1][1] - decode[0][1]) / (decode[-1][0] - decode[0][0]) if len(decode) > 1 else 0.0
        L = sched.sizes.max_model_len
        longest = max(len(r.prompt) + len(r.tokens) for r in reqs)
        stats = {"prefill_s": t_first - t0, "prefill_tokens": sum(len(r.prompt) for r in reqs),
                 "prefill_tokens_per_s": sum(len(r.prompt) for r in reqs) / max(t_first - t0, 1e-9),
                 "decode_s": t_end - t_first, "decode_steps": len(decode), "generated_tokens": n_gen,
                 "decode_tokens_per_s": (n_gen - B) / max(t_end - t_first, 1e-9) if decode else 0.0,
                 "decode_steady_tokens_per_s": steady,
                 "cache_bytes_per_sequence": cache_bytes(sched.runner.cache),
                 "cache_bytes_in_use_per_sequence": cache_bytes(sched.runner.cache, longest),
                 "cache_bucket": L, "compiles": self.traces}
        if sched.spec is not None:
            stats["speculative"] = sched.spec.snapshot()
        logits = [np.stack(r.logits) for r in reqs] if record else None
        return GenerateResult([list(r.tokens) for r in reqs], [len(r.prompt) for r in reqs], stats, logits)

    # ------------------------------------------------------------------------------------------------ scoring
    def _prefill_impl(self, state, ids, cache, n_new, embeds=None, all_logits: bool = False):
        self._prefill_traces["score"] += 1                 # runs at trace time only: counts compilations
        scan = use_scan(self.cfg, self.options.scan_layers)
        out = nnx.merge(self.graphdef, state)(ids, cache=cache, n_new=n_new, embeds=embeds, scan_layers=scan)
        if all_logits:
            return out.logits, out.cache
        last = jnp.take_along_axis(out.logits, jnp.clip(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
        return last, out.cache

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 0, *, all_logits: bool = False,
                progress: Callable[[int, int], None] | None = None, embeds: Sequence | None = None):
        """Score the prompts: run them through the model in chunks of ``self.chunk`` over a contiguous cache;
        returns ``(cache, logits, lengths)`` — each prompt's last-token logits ``[B, vocab]`` (or ``[B, T, vocab]``
        with ``all_logits``), and a :class:`~k3jax.nn.cache.Cache` with room for ``max_new_tokens`` more tokens.
        ``embeds``: per prompt None or a :class:`~k3jax.vision.model.MultimodalPrompt` whose rows replace the token
        embeddings at its image positions."""
        if embeds is not None:
            if len(embeds) != len(prompts):
                raise GenerationError(f"embeds: {len(embeds)} entries for {len(prompts)} prompts", "embeds")
            prompts = [e.ids if e is not None else p for p, e in zip(prompts, embeds)]
        arrs = [np.asarray(p, np.int32) for p in self.check_prompts(prompts, max_new_tokens)]
        self.graphdef, self.state = nnx.split(self.model)     # the model's current weights (and router biases)
        B = len(arrs)
        lengths = np.array([a.size for a in arrs], np.int32)
        T, C = int(lengths.max()), self.chunk
        n_chunks = -(-T // C)
        ids = np.full((B, n_chunks * C), self.cfg.pad_token_id or 0, np.int32)
        for b, a in enumerate(arrs):
            ids[b, : a.size] = a
        cache = init_cache(self.cfg, B, length_bucket(T + max_new_tokens, C))
        last, outs = None, []
        for c in range(n_chunks):
            n_new = np.clip(lengths - c * C, 0, C).astype(np.int32)
            lg, cache = self._prefill(self.state, jnp.asarray(ids[:, c * C:(c + 1) * C]), cache,
                                      jnp.asarray(n_new), self._overlay(embeds, c * C, C), all_logits=all_logits)
            if all_logits:
                outs.append(lg)
            else:
                ends_here = jnp.asarray((lengths - 1) // C == c)
                last = lg if last is None else jnp.where(ends_here[:, None], lg, last)
            if progress is not None:
                progress(min((c + 1) * C, T), T)
        logits = jnp.concatenate(outs, axis=1)[:, :T] if all_logits else last
        return cache, logits, lengths

    def _overlay(self, embeds, start: int, C: int):
        """The chunk's ``(rows [B, C, hidden], mask [B, C])`` of spliced image rows (all-False masks on chunks without
        any: one compiled prefill per chunk shape for a multimodal batch), or None for a text-only one."""
        if embeds is None or all(e is None for e in embeds):
            return None
        parts = [e.overlay(start, C) if e is not None else None for e in embeds]
        rows = np.zeros((len(parts), C, self.cfg.hidden_size), np.float32)
        mask = np.zeros((len(parts), C), bool)
        for b, p in enumerate(parts):
            if p is not None:
                rows[b], mask[b] = p
        return jnp.asarray(rows, self.cfg.dtype), jnp.asarray(mask)


def generate(model: K3ForCausalLM, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_tokens: Sequence[int] = (), chunk: int | None = None) -> list[int] | list[list[int]]:
    """Generated token ids for one prompt (a list of ids) or several (a list of lists); greedy at temperature 0."""
    single = len(prompt_ids) > 0 and np.ndim(prompt_ids[0]) == 0
    prompts = [list(prompt_ids)] if single or len(prompt_ids) == 0 else [list(p) for p in prompt_ids]
    engine = _engine_for(model, chunk)
    res = engine.generate(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          stop_tokens=stop_tokens)
    return res.tokens[0] if single or len(prompt_ids) == 0 else res.tokens


_ENGINES: dict[tuple, Engine] = {}


def _engine_for(model: K3ForCausalLM, chunk: int | None) -> Engine:
    """One engine per (model, chunk) so repeated ``generate`` calls reuse compiled steps."""
    chunk = EngineConfig().chunk if chunk is None else int(chunk)
    key = (id(model), chunk)
    e = _ENGINES.get(key)
    if e is None or e.model is not model:
        e = _ENGINES[key] = Engine(model, chunk=chunk)
    return e


__all__ = ["Engine", "GenerateResult", "GenerationError", "generate", "length_bucket"]
