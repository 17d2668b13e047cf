"""The inference engine: chunked prefill into constant-size KDA state + MLA latent cache, then one-token decode.

Both steps are jit-compiled once per (batch, cache length bucket) — the prefill chunk and the decode step have
static shapes, positions and lengths are traced — so decoding N tokens compiles once. Prompts of different lengths
share a batch: they are right-padded, padding leaves KDA state and conv windows untouched and is masked out of
MLA, and each row then decodes from its own position.
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

from k3jax.infer.sampling import check_sampling, sample_next
from k3jax.nn.cache import cache_bytes, init_cache
from k3jax.nn.model import K3ForCausalLM

MIN_BUCKET = 256


def length_bucket(n: int, chunk: int, minimum: int = MIN_BUCKET) -> int:
    """The preallocated cache length for ``n`` tokens: the next power of two ≥ n (≥ ``minimum``), a multiple of
    the prefill ``chunk``."""
    L = max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
    return -(-L // chunk) * chunk


class GenerationError(ValueError):
    """A request the engine cannot serve (empty or over-long prompt, bad token ids); the message says why."""


@dataclass
class GenerateResult:
    tokens: list[list[int]]                      # generated ids per prompt (stop token included when hit)
    prompt_lengths: list[int]
    stats: dict = field(default_factory=dict)    # prefill/decode seconds, tokens/s, cache bytes, compiles


class Engine:
    """Serve a :class:`K3ForCausalLM`: ``Engine(model).generate(prompts, max_new_tokens, …)``.

    ``chunk``: prefill chunk length (peak activation memory is set by it, not by the prompt); ``max_len``: the
    longest prompt + generation accepted (default ``max_position_embeddings``)."""

    def __init__(self, model: K3ForCausalLM, *, chunk: int = 256, max_len: int | None = None):
        self.model = model
        self.cfg = model.config
        self.chunk = int(chunk)
        self.max_len = int(max_len or self.cfg.max_position_embeddings)
        self.graphdef, self.state = nnx.split(model)
        self.traces = {"prefill": 0, "decode": 0}
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("all_logits",), donate_argnums=(2,))
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1,))
        self._sample = jax.jit(sample_next)

    # ------------------------------------------------------------------------------------------- jitted steps
    def _prefill_impl(self, state, ids, cache, n_new, embeds=None, all_logits: bool = False):
        self.traces["prefill"] += 1                           # runs at trace time only: counts compilations
        out = nnx.merge(self.graphdef, state)(ids, cache=cache, n_new=n_new, embeds=embeds)
        if all_logits:
            return out.logits, out.cache
        last = jnp.take_along_axis(out.logits, jnp.clip(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
        return last, out.cache

    def _decode_impl(self, state, cache, tok, key, temperature, top_k, top_p):
        self.traces["decode"] += 1
        out = nnx.merge(self.graphdef, state)(tok[:, None], cache=cache)
        logits = out.logits[:, 0]
        return sample_next(logits, key, temperature, top_k, top_p), logits, out.cache

    # ------------------------------------------------------------------------------------------------ prefill
    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[np.ndarray]:
        if len(prompts) == 0:
            raise GenerationError("prompts: expected at least one prompt, got none")
        out = []
        V = self.cfg.vocab_size
        for i, p in enumerate(prompts):
            a = np.asarray(p, dtype=np.int64).reshape(-1)
            if a.size == 0:
                raise GenerationError(f"prompt {i}: empty (no token ids); a prompt needs at least one token "
                                      f"(e.g. the BOS id {self.cfg.bos_token_id})")
            if a.min() < 0 or a.max() >= V:
                raise GenerationError(f"prompt {i}: token ids must lie in [0, {V}) (vocab_size); "
                                      f"got min {a.min()}, max {a.max()}")
            if a.size + max_new_tokens > self.max_len:
                raise GenerationError(
                    f"prompt {i}: {a.size} tokens + max_new_tokens {max_new_tokens} = {a.size + max_new_tokens} "
                    f"exceeds the engine's limit of {self.max_len} tokens (max_position_embeddings="
                    f"{self.cfg.max_position_embeddings}; pass max_len to raise it)")
            out.append(a.astype(np.int32))
        return out

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 0, *, all_logits: bool = False,
                progress: Callable[[int, int], None] | None = None, embeds: Sequence | None = None):
        """Run the prompts through the model in chunks of ``self.chunk``; returns ``(cache, logits, lengths)``
        where logits are each prompt's last-token logits ``[B, vocab]`` (or ``[B, T, vocab]`` with
        ``all_logits``) and the :class:`~k3jax.nn.cache.Cache` has room for ``max_new_tokens`` more tokens.
        ``embeds``: per prompt None or a :class:`~k3jax.vision.model.MultimodalPrompt` (anything with
        ``overlay(start, length)``) whose rows replace the token embeddings at its image positions."""
        if embeds is not None:
            if len(embeds) != len(prompts):
                raise GenerationError(f"embeds: {len(embeds)} entries for {len(prompts)} prompts")
            prompts = [e.ids if e is not None else p for p, e in zip(prompts, embeds)]
        arrs = self.check_prompts(prompts, max_new_tokens)
        self.graphdef, self.state = nnx.split(self.model)     # the model's current weights (and router biases)
        B = len(arrs)
        lengths = np.array([a.size for a in arrs], np.int32)
        T = int(lengths.max())
        C = self.chunk
        n_chunks = -(-T // C)
        ids = np.full((B, n_chunks * C), self.cfg.pad_token_id or 0, np.int32)
        for b, a in enumerate(arrs):
            ids[b, : a.size] = a
        cache = init_cache(self.cfg, B, length_bucket(T + max_new_tokens, C))
        last = None
        outs = []
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
        H = self.cfg.hidden_size
        rows = np.zeros((len(parts), C, H), np.float32)
        mask = np.zeros((len(parts), C), bool)
        for b, p in enumerate(parts):
            if p is not None:
                rows[b], mask[b] = p
        return jnp.asarray(rows, self.cfg.dtype), jnp.asarray(mask)

    # ----------------------------------------------------------------------------------------------- generate
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 stop_tokens: Sequence[int] = (), on_token: Callable[[int, int], None] | None = None,
                 progress: Callable[[int, int], None] | None = None, no_repeat_ngram: int = 0,
                 embeds: Sequence | None = None) -> GenerateResult:
        """Generate up to ``max_new_tokens`` per prompt. ``on_token(row, token)`` streams each new token as it is
        produced; a row stops after emitting a stop token. The same seed gives the same output.

        ``no_repeat_ngram=n`` (> 0; a guard against the loops of small models, transformers' ``no_repeat_ngram_size``):
        a token that would complete an n-gram already present in the row (prompt and output) is excluded and the
        token is drawn again without it; ``stats["no_repeat_ngram_changed"]`` counts the tokens it changed.
        ``embeds``: per prompt None or a :class:`~k3jax.vision.model.MultimodalPrompt` (images spliced in; its
        ``ids`` replace the prompt)."""
        check_sampling(temperature, top_k, top_p, max_new_tokens)
        if not isinstance(no_repeat_ngram, int) or no_repeat_ngram < 0:
            raise GenerationError(f"no_repeat_ngram: expected an integer ≥ 0 (0 = off), got {no_repeat_ngram!r}")
        B = len(prompts)
        t0 = time.perf_counter()
        if embeds is not None:
            prompts = [e.ids if e is not None else p for p, e in zip(prompts, embeds)]
        cache, logits, lengths = self.prefill(prompts, max_new_tokens, progress=progress, embeds=embeds)
        logits.block_until_ready()
        t_prefill = time.perf_counter() - t0
        out: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        stops = set(int(s) for s in stop_tokens)
        key = jax.random.key(seed)
        temp = jnp.float32(temperature)
        tk, tp = jnp.int32(top_k or 0), jnp.float32(1.0 if top_p is None else top_p)
        t1 = time.perf_counter()
        t_first = None                                        # end of the first decode step (it compiles)
        steps = 0
        guard = NgramGuard(no_repeat_ngram, [list(map(int, p)) for p in prompts]) if no_repeat_ngram else None
        if max_new_tokens:
            k0 = jax.random.fold_in(key, 0)
            tok = self._sample(logits, k0, temp, tk, tp)
            if guard is not None:
                tok = guard.check(tok, logits, lambda lg: self._sample(lg, k0, temp, tk, tp), done)
            for i in range(max_new_tokens):
                host = np.asarray(tok)
                for b in range(B):
                    if not done[b]:
                        out[b].append(int(host[b]))
                        if on_token is not None:
                            on_token(b, int(host[b]))
                        done[b] = int(host[b]) in stops
                if done.all() or i + 1 == max_new_tokens:
                    break
                ki = jax.random.fold_in(key, i + 1)
                tok, lg, cache = self._decode(self.state, cache, tok, ki, temp, tk, tp)
                if guard is not None:
                    tok = guard.check(tok, lg, lambda lg_, ki=ki: self._sample(lg_, ki, temp, tk, tp), done)
                steps += 1
                if steps == 1:
                    tok.block_until_ready()
                    t_first = time.perf_counter()
        t_end = time.perf_counter()
        t_decode = t_end - t1
        steady = (steps - 1) * B / (t_end - t_first) if steps > 1 else 0.0
        n_gen = sum(len(o) for o in out)
        bytes_now = cache_bytes(cache)
        stats = {"prefill_s": t_prefill, "prefill_tokens": int(lengths.sum()),
                 "prefill_tokens_per_s": float(lengths.sum()) / max(t_prefill, 1e-9),
                 "decode_s": t_decode, "decode_steps": steps, "generated_tokens": n_gen,
                 "decode_tokens_per_s": (steps * B) / max(t_decode, 1e-9) if steps else 0.0,
                 "decode_steady_tokens_per_s": steady,
                 "cache_bytes_per_sequence": bytes_now,
                 "cache_bytes_in_use_per_sequence": cache_bytes(cache, int(lengths.max()) + max_new_tokens),
                 "cache_bucket": int(cache.capacity), "compiles": dict(self.traces)}
        if guard is not None:
            stats["no_repeat_ngram_changed"] = guard.changed
        return GenerateResult(out, lengths.tolist(), stats)


class NgramGuard:
    """``no_repeat_ngram``: per row, the tokens that would complete an n-gram already in the row are banned.

    Keeps each row's tokens and a map (n−1)-gram → the tokens that followed it; ``check`` bans the current
    (n−1)-gram's followers in the step's logits and redraws only the rows whose token was banned."""

    def __init__(self, n: int, prompts: list[list[int]]):
        self.n, self.changed = n, 0
        self.rows = [list(p) for p in prompts]
        self.follow: list[dict[tuple, set]] = [{} for _ in prompts]
        for b, row in enumerate(self.rows):
            for j in range(len(row) - n + 1):
                self.follow[b].setdefault(tuple(row[j:j + n - 1]), set()).add(row[j + n - 1])

    def banned(self, b: int) -> set:
        row = self.rows[b]
        if self.n == 1:
            return set(row)
        return self.follow[b].get(tuple(row[len(row) - self.n + 1:]), set()) if len(row) >= self.n - 1 else set()

    def check(self, tok: jax.Array, logits: jax.Array, redraw, done: np.ndarray) -> jax.Array:
        host = np.asarray(tok).copy()
        bans = [self.banned(b) if not done[b] else set() for b in range(len(host))]
        hit = [b for b in range(len(host)) if int(host[b]) in bans[b]]
        if hit:
            lg = np.asarray(logits, np.float32).copy()
            for b in hit:
                lg[b, sorted(bans[b])] = -np.inf
            if np.isfinite(lg[hit]).any(axis=-1).all():       # a row with every token banned keeps its token
                new = np.asarray(redraw(jnp.asarray(lg)))
                host[hit] = new[hit]
                self.changed += len(hit)
        for b in range(len(host)):
            if not done[b]:
                row = self.rows[b]
                row.append(int(host[b]))
                if len(row) >= self.n:
                    self.follow[b].setdefault(tuple(row[len(row) - self.n:-1]), set()).add(row[-1])
        return jnp.asarray(host)


def generate(model: K3ForCausalLM, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop_tokens: Sequence[int] = (), chunk: int = 256) -> list[int] | list[list[int]]:
    """Generated token ids for one prompt (a list of ids) or several (a list of lists); greedy at temperature 0."""
    single = len(prompt_ids) > 0 and np.ndim(prompt_ids[0]) == 0
    prompts = [list(prompt_ids)] if single or len(prompt_ids) == 0 else [list(p) for p in prompt_ids]
    engine = _engine_for(model, chunk)
    res = engine.generate(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          stop_tokens=stop_tokens)
    return res.tokens[0] if single or len(prompt_ids) == 0 else res.tokens


_ENGINES: dict[tuple[int, int], Engine] = {}


def _engine_for(model: K3ForCausalLM, chunk: int) -> Engine:
    """One engine per (model, chunk) so repeated ``generate`` calls reuse compiled steps."""
    key = (id(model), chunk)
    e = _ENGINES.get(key)
    if e is None or e.model is not model:
        e = _ENGINES[key] = Engine(model, chunk=chunk)
    return e


__all__ = ["Engine", "GenerateResult", "GenerationError", "generate"]
