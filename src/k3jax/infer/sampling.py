"""Next-token sampling on the device: greedy, temperature, top-k, top-p and per-row token bans — all traced, so
changing them never recompiles. (The settings are checked once, on the host: :class:`~k3jax.infer.requests.
SamplingParams`; a bad one raises :class:`SamplingError`, the request error naming the field.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.infer.requests import RequestError as SamplingError



def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``logits [B, V]`` → ``logits / T`` with every token outside the ``top_k`` largest (0 = all) and outside the
    smallest set whose probability reaches ``top_p`` (1 = all) set to −inf: the distribution a temperature > 0
    draw samples from (``softmax`` of it)."""
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    x = logits / jnp.maximum(temperature, 1e-6)
    srt = jnp.sort(x, axis=-1)[:, ::-1]                                          # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take(srt, k - 1, axis=-1)                                          # [B]
    p = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(p, axis=-1) - p                                          # mass strictly above each entry
    keep_sorted = (before < top_p) | (jnp.arange(V) == 0)
    pth = jnp.min(jnp.where(keep_sorted, srt, jnp.inf), axis=-1)                 # smallest kept logit
    return jnp.where((x >= kth[:, None]) & (x >= pth[:, None]), x, -jnp.inf)


def sample_next(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """``logits [B, V]`` → token ids ``[B]`` int32.

    ``temperature`` 0 → argmax; otherwise one categorical draw per row from :func:`filtered_logits`."""
    greedy = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    drawn = jax.random.categorical(key, filtered_logits(logits, temperature, top_k, top_p), axis=-1)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)


def sampling_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The distribution :func:`sample_next` draws from, ``[B, V]`` fp32: one-hot at the argmax when ``temperature``
    is 0, else ``softmax`` of :func:`filtered_logits`."""
    greedy = jax.nn.one_hot(jnp.argmax(logits.astype(jnp.float32), axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(temperature > 0, jax.nn.softmax(filtered_logits(logits, temperature, top_k, top_p), axis=-1),
                     greedy)


def unpack_bans(bans: jax.Array, vocab: int) -> jax.Array:
    """``bans [B, ⌈V/32⌉]`` uint32 bitmasks (:func:`k3jax.infer.processors.ban_mask`) → ``[B, V]`` bool; a row that
    would ban every token bans none (it keeps its own draw)."""
    v = jnp.arange(vocab)
    bit = (bans[:, v // 32] >> (v % 32).astype(jnp.uint32)) & jnp.uint32(1)
    banned = bit.astype(bool)
    return banned & ~jnp.all(banned, axis=-1, keepdims=True)


def sample_rows(logits: jax.Array, seeds: jax.Array, counters: jax.Array, temperature: jax.Array,
                top_k: jax.Array, top_p: jax.Array, bans: jax.Array | None = None):
    """Per-row settings: ``logits [B, V]``, ``seeds [B]`` uint32, ``counters [B]`` int32 (tokens the row has
    drawn), ``temperature``/``top_k``/``top_p [B]`` → ids ``[B]`` int32. Row b draws with
    ``fold_in(key(seeds[b]), counters[b])``, so a seeded sequence gives the same tokens whatever shares its batch.

    ``bans [B, ⌈V/32⌉]``: tokens a row may not draw (their logits are −inf); then returns ``(ids, changed [B])``,
    ``changed`` where the ban moved the draw. The same key draws both, so under plain temperature sampling a ban
    changes a row's token only when the token it would have drawn is banned (the Gumbel-max draw over the other
    tokens is unchanged), as a "draw, then draw again without the banned tokens" rule would."""
    if bans is not None:
        masked = jnp.where(unpack_bans(bans, logits.shape[-1]), -jnp.inf, logits.astype(jnp.float32))
        free = sample_rows(logits, seeds, counters, temperature, top_k, top_p)
        tok = sample_rows(masked, seeds, counters, temperature, top_k, top_p)
        return tok, tok != free

    def one(lg, s, c, t, k, p):
        return sample_next(lg[None], jax.random.fold_in(jax.random.key(s), c), t, k, p)[0]

    def greedy():
        return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)

    # an all-greedy batch skips the vocabulary sort top-k / top-p need
    return jax.lax.cond(jnp.any(temperature > 0), lambda: jax.vmap(one)(logits, seeds, counters, temperature,
                                                                          top_k, top_p), greedy)


__all__ = ["SamplingError", "filtered_logits", "sample_next", "sampling_probs", "sample_rows", "unpack_bans"]
