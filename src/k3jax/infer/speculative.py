"""Speculative decoding: what drafts, how drafts are accepted, and when a slot stops drafting.

A round verifies k drafted tokens in one forward of the target (T = k + 1: the last accepted token and the
drafts). Its KDA layers record their per-token inputs instead of a state per position (``model(…,
kda_record=True)``), and once the accepted length is known the round keeps that prefix (:meth:`Cache.accept
<k3jax.nn.cache.Cache.accept>`: a masked replay of the recurrence and the conv windows from the state before the
round) — the scheduler's side of it is :mod:`k3jax.infer.spec_slots`.

* :func:`speculative_accept` — the acceptance rule, jitted with the round: greedy rows accept while the draft
  equals the target's argmax and then take the argmax; sampled rows run standard speculative rejection sampling
  (accept draft ``d`` with probability ``min(1, p(d)/q(d))``, on the first rejection draw from
  ``norm(max(0, p − q))``, after k acceptances from ``p``), which leaves the target's distribution unchanged. ``p``
  is the distribution plain sampling draws from (:func:`~k3jax.infer.sampling.sampling_probs`: temperature, top-k,
  top-p); ``q`` the drafter's (a point mass for prompt lookup).
* :class:`NgramIndex` / :func:`ngram_propose` — prompt lookup (vLLM's ``ngram`` method): the tokens that followed
  the latest earlier occurrence of the sequence's last n tokens (n from ``prompt_lookup_max`` down to
  ``prompt_lookup_min``), in the prompt or the generated text; an incremental index, O(n) per step.
* :class:`SpecConfig` — ``ngram:K`` or ``draft:PATH:K`` (``--speculative``).
* :class:`AcceptanceTracker` — per request: an estimate of the per-draft acceptance rate; a request whose rate
  stays low stops drafting for a while (16 generated tokens, doubling up to 256 while its one-round probes keep
  failing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from k3jax.infer.sampling import filtered_logits, sampling_probs


# ------------------------------------------------------------------------------------------- acceptance (device)
def token_key(seed: jax.Array, index: jax.Array) -> jax.Array:
    """The key of a row's token ``index``: ``fold_in(key(seed), index)``, as plain sampling draws that token with."""
    return jax.random.fold_in(jax.random.key(seed), index)


def row_filtered(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``logits [B, T, V]`` with per-row settings ``[B]`` → :func:`~k3jax.infer.sampling.filtered_logits` per row."""
    return jax.vmap(filtered_logits)(logits, temperature, top_k, top_p)


def row_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``logits [B, T, V]`` with per-row settings ``[B]`` → sampling distributions ``[B, T, V]`` fp32."""
    return jax.vmap(sampling_probs)(logits, temperature, top_k, top_p)


def speculative_accept(logits: jax.Array, drafts: jax.Array, n_draft: jax.Array, draft_probs: jax.Array | None,
                       seeds: jax.Array, counters: jax.Array, temperature: jax.Array, top_k: jax.Array,
                       top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Accept a prefix of each row's drafts and draw the token after it.

    ``logits [B, k+1, V]``: the target's logits after the last accepted token (t = 0) and after each draft;
    ``drafts [B, k]``, ``n_draft [B]`` (row b proposes its first ``n_draft[b]`` drafts); ``draft_probs [B, k, V]``
    the distribution each draft was drawn from (``None``: deterministic drafts, a point mass); ``seeds`` (uint32)
    and ``counters [B]``: the round's first token is the row's token number ``counters[b]``; ``temperature``,
    ``top_k``, ``top_p [B]`` the rows' sampling settings.

    Returns ``(n_acc [B], token [B])``: the first ``n_acc`` drafts are accepted and ``token`` follows them — drawn
    from the residual ``norm(max(0, p − q))`` at the first rejected draft, or from ``p`` after the last one.
    Randomness is per token: token number i uses :func:`token_key` ``(seed, i)`` — the uniform that tests a draft
    there is drawn from ``fold_in(key, 1)``, and the token drawn there from ``key`` itself, exactly as plain
    sampling draws it when no draft was rejected. Greedy rows (temperature 0): accept while ``draft == argmax``,
    then the argmax — exactly plain greedy decoding.
    """
    B, T, V = logits.shape
    k = T - 1
    lg = logits.astype(jnp.float32)
    greedy_tok = jnp.argmax(lg, axis=-1).astype(jnp.int32)                            # [B, T]
    x = row_filtered(lg, temperature, top_k, top_p)                                   # [B, T, V]
    p = jax.nn.softmax(x, axis=-1)
    keys = jax.vmap(lambda s, c: jax.vmap(lambda i: token_key(s, c + i))(jnp.arange(T)))(seeds, counters)  # [B, T]
    if k:
        p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]        # p_t(d_{t+1}) [B, k]
        q_d = 1.0 if draft_probs is None else \
            jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        u = jax.vmap(jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 1))))(keys[:, :k])  # [B, k]
        ok_sampled = u * q_d < p_d                                                     # u < p/q without a division
        ok = jnp.where((temperature > 0)[:, None], ok_sampled, drafts == greedy_tok[:, :k])
        ok &= jnp.arange(k)[None, :] < n_draft[:, None]
        n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)             # leading accepted
    else:
        n_acc = jnp.zeros((B,), jnp.int32)
    at = lambda a: jnp.take_along_axis(a, n_acc.reshape((B,) + (1,) * (a.ndim - 1)), axis=1)[:, 0]  # noqa: E731
    x_j, key_j = at(x), at(keys)
    if k:
        i = jnp.minimum(n_acc, k - 1)
        d_j = jnp.take_along_axis(drafts, i[:, None], axis=1)[:, 0]
        q_j = jax.nn.one_hot(d_j, V, dtype=jnp.float32) if draft_probs is None else \
            jnp.take_along_axis(draft_probs, i[:, None, None], axis=1)[:, 0]
        resid = jnp.maximum(at(p) - q_j, 0.0)
        # p == q up to rounding: a rejection is (nearly) impossible and the residual is noise; draw from p then
        redraw = (n_acc < n_draft) & (jnp.sum(resid, axis=-1) > 1e-6)
        x_j = jnp.where(redraw[:, None], jnp.log(resid), x_j)
    drawn = jax.vmap(jax.random.categorical)(key_j, x_j).astype(jnp.int32)
    token = jnp.where(temperature > 0, drawn, at(greedy_tok))
    return n_acc.astype(jnp.int32), token


def emitted_tokens(drafts: jax.Array, n_acc: jax.Array, token: jax.Array) -> jax.Array:
    """``[B, k+1]``: row b's accepted drafts, then ``token`` at index ``n_acc[b]`` (entries after it: undefined)."""
    B, k = drafts.shape
    out = jnp.concatenate([drafts, jnp.zeros((B, 1), drafts.dtype)], axis=1)
    return jnp.where(jnp.arange(k + 1)[None, :] == n_acc[:, None], token[:, None], out)


# ----------------------------------------------------------------------------------------- prompt lookup (host)
class NgramIndex:
    """Prompt lookup over a growing token list (prompt, then generated tokens): for each n in ``[min_n, max_n]``
    the latest end of every n-gram whose next token is known; :meth:`propose` finds the longest suffix n-gram seen
    before and returns what followed it.

    ``reference``: a predicted output (OpenAI's ``prediction``: e.g. the document an edit starts from), searched
    too — while the generated tokens are a prefix of it, what follows in it is proposed; after that, the suffix
    n-gram is looked up in it at or after the place the last match left off (a document is followed in order), and
    the longer of the two matches wins (the reference on a tie)."""

    def __init__(self, min_n: int, max_n: int, reference=(), prompt_len: int = 0):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last: dict[tuple, int] = {}           # n-gram → index just past its latest (earlier) occurrence
        self.ref = [int(t) for t in reference]
        self.ref_ends: dict[tuple, list[int]] = {}  # n-gram of the reference → every index just past it (ascending)
        for n in range(min_n, max_n + 1):
            for e in range(n, len(self.ref)):
                self.ref_ends.setdefault(tuple(self.ref[e - n:e]), []).append(e)
        self.ref_cursor = 0
        self.prompt_len = prompt_len

    def extend(self, tokens) -> None:
        """Append tokens (the index covers n-grams that end before the last token)."""
        for t in tokens:
            L = len(self.tokens)
            # the n-grams ending at the current last token now have a follower (t): index them
            for n in range(self.min_n, self.max_n + 1):
                if L >= n:
                    self.last[tuple(self.tokens[L - n:L])] = L
            self.tokens.append(int(t))

    def _from_reference(self, k: int) -> tuple[int, list[int]]:
        gen = self.tokens[self.prompt_len:]
        if self.ref and len(gen) < len(self.ref) and gen == self.ref[:len(gen)]:
            return len(gen) + self.max_n, self.ref[len(gen):len(gen) + k]      # still on the reference's start
        L = len(self.tokens)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            ends = self.ref_ends.get(tuple(self.tokens[L - n:]))
            if ends:
                e = next((x for x in ends if x >= self.ref_cursor), ends[0])
                self.ref_cursor = e
                return n, self.ref[e:e + k]
        return 0, []

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix (or the
        reference's continuation, see the class)."""
        L = len(self.tokens)
        n_ref, from_ref = self._from_reference(k) if self.ref else (0, [])
        for n in range(min(self.max_n, L), max(self.min_n, n_ref + 1) - 1, -1):
            e = self.last.get(tuple(self.tokens[L - n:]))
            if e is not None:
                return self.tokens[e:min(e + k, L)]
        return from_ref


def ngram_propose(tokens, k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Prompt lookup over ``tokens`` at once (:class:`NgramIndex` built from scratch; for tests and tools)."""
    idx = NgramIndex(min_n, max_n)
    idx.extend(tokens)
    return idx.propose(k)


# -------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class SpecConfig:
    """``method``: ``"ngram"`` (prompt lookup) or ``"draft"`` (a draft model at ``draft``); ``k`` drafted tokens
    per round; ``prompt_lookup_min/max`` the n-gram sizes prompt lookup matches; ``adaptive`` (default) lets a
    request whose drafts keep failing fall back to plain decode for a while and speculates only when the measured
    step times say a round gives more tokens per second than a plain step (False: every step with drafts
    speculates)."""

    method: str
    k: int
    draft: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative: method must be 'ngram' or 'draft', got {self.method!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise ValueError(f"speculative: k (drafted tokens per round) must be an integer in [1, 16], got "
                             f"{self.k!r}")
        if self.method == "draft" and not self.draft:
            raise ValueError("speculative: the draft method needs a model (draft:PATH:K)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative: need 1 ≤ prompt_lookup_min ≤ prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def parse(cls, text: str) -> "SpecConfig":
        """``ngram:K``, ``ngram:K:MIN:MAX`` (n-gram sizes) or ``draft:PATH:K`` (PATH: a preset, a ``k3jax train``
        run, an Orbax export or a release checkpoint, as ``--model``)."""
        how = "expected ngram:K, ngram:K:MIN:MAX or draft:PATH:K"
        method, _, rest = str(text).partition(":")
        try:
            if method == "ngram":
                parts = [int(x) for x in rest.split(":")]
                if len(parts) == 1:
                    return cls("ngram", parts[0])
                if len(parts) == 3:
                    return cls("ngram", parts[0], prompt_lookup_min=parts[1], prompt_lookup_max=parts[2])
            elif method == "draft":
                path, _, k = rest.rpartition(":")
                if path:
                    return cls("draft", int(k), draft=path)
        except ValueError as e:
            if str(e).startswith("speculative"):
                raise
        raise ValueError(f"speculative: {how}, got {text!r}")

    def describe(self) -> str:
        if self.method == "ngram":
            return (f"n-gram prompt lookup, k={self.k} (n-grams of {self.prompt_lookup_min}–"
                    f"{self.prompt_lookup_max} tokens)")
        return f"draft model {self.draft}, k={self.k}"


@dataclass
class AcceptanceTracker:
    """Per request: ``rate`` — an exponential average (weight ``alpha``) of each round's accepted / drafted — and
    the fallback: once a round leaves ``rate`` under ``floor``, no drafting for ``backoff`` generated tokens, after
    which one round probes again from ``prior``; a probe under ``floor`` backs off again at once with twice the
    backoff (up to ``max_backoff``), a round at or over ``floor`` resets it. While the rate is unknown — before a
    request's first round, and for each probe — :meth:`expected_tokens` is optimistic (every draft accepted), so a
    round is tried at least once whatever the prior says (else a round that costs more than ``1 + prior + …``
    plain steps would never be tried, and its rate never learnt)."""

    prior: float = 0.5
    floor: float = 0.25
    alpha: float = 0.3
    min_backoff: int = 16
    max_backoff: int = 256
    rate: float = field(default=-1.0)
    backoff: int = 0
    resume_at: int = 0          # generated-token count from which the request drafts again
    probing: bool = False       # the next round is a probe after a backoff
    rounds: int = 0             # rounds seen

    def __post_init__(self):
        if self.rate < 0:
            self.rate = self.prior
        self.backoff = self.backoff or self.min_backoff

    def active(self, generated: int) -> bool:
        return generated >= self.resume_at

    def update(self, drafted: int, accepted: int, generated: int) -> None:
        if drafted <= 0:
            return
        self.rounds += 1
        this = accepted / drafted
        self.rate = (1 - self.alpha) * self.rate + self.alpha * this
        failed_probe, self.probing = self.probing and this < self.floor, False
        if self.rate < self.floor or failed_probe:
            self.resume_at = generated + self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.rate, self.probing = self.prior, True
        elif this >= self.floor:
            self.backoff = self.min_backoff

    @property
    def exploring(self) -> bool:
        """The rate is unknown: no round yet, or the next round is a probe."""
        return self.rounds == 0 or self.probing

    def expected_tokens(self, n: int) -> float:
        """Tokens a round of ``n`` drafts emits on average: ``1 + n · rate`` (``rate`` averages accepted / drafted,
        so ``n · rate`` is the accepted count it predicts — whether drafts fail one by one or, as in an edit, all
        at once at a changed span; ``n + 1`` while :attr:`exploring`)."""
        return float(n + 1) if self.exploring else 1.0 + n * self.rate


__all__ = ["speculative_accept", "emitted_tokens", "token_key", "row_filtered", "row_probs", "NgramIndex", "ngram_propose",
           "SpecConfig", "AcceptanceTracker"]
