"""Router-bias load balancing (spec §7.3; K3's Quantile Balancing and DeepSeek's sign update).

Quantile Balancing, per MoE layer with biased scores ``s_i + b`` (token i, n experts, top-k):

* admission threshold ``α_i`` = the (k+1)-th largest of ``s_i + b``;
* required bias ``r_ij = α_i − s_ij``: expert j is chosen by token i whenever ``b_j > r_ij``;
* for balance each expert should be chosen by a k/n fraction of tokens, so ``b_j ←`` the k/n quantile of
  ``r_·j``, then mean-centred.

The fast path histograms ``r`` into ``[n, bins]`` int32 counts over persistent bounds ``[min b − 1, max b + 1]``
(with sigmoid scores every r lies inside), so data-parallel devices combine with one integer ``psum`` and the
quantile is read off the cumulative counts (error ≤ one bin width). :func:`quantile_bias_exact` sorts instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_BINS = 1000


def required_bias(scores: jax.Array, bias: jax.Array, k: int) -> jax.Array:
    """``r [N, n] = α − s`` with ``α_i`` the (k+1)-th largest of ``s_i + b`` (fp32)."""
    s = scores.astype(jnp.float32)
    alpha = jax.lax.top_k(s + bias.astype(jnp.float32), k + 1)[0][:, k]
    return alpha[:, None] - s


def bias_bounds(bias: jax.Array) -> jax.Array:
    """The histogram range ``[min b − 1, max b + 1]`` for the next step."""
    return jnp.stack([jnp.min(bias) - 1.0, jnp.max(bias) + 1.0]).astype(jnp.float32)


def required_bias_histogram(scores: jax.Array, bias: jax.Array, k: int, bounds: jax.Array,
                            bins: int = DEFAULT_BINS) -> jax.Array:
    """``[n, bins]`` int32 counts of ``r_ij`` per expert over ``bounds`` (values outside land in the edge bins)."""
    r = required_bias(scores, bias, k)
    lo, hi = bounds[0], bounds[1]
    idx = jnp.clip(jnp.floor((r - lo) / (hi - lo) * bins).astype(jnp.int32), 0, bins - 1)     # [N, n]
    n = r.shape[1]
    flat = idx + bins * jnp.arange(n, dtype=jnp.int32)[None, :]
    return jnp.zeros((n * bins,), jnp.int32).at[flat.reshape(-1)].add(1).reshape(n, bins)


def quantile_from_histogram(hist: jax.Array, bounds: jax.Array, k: int, center: bool = True) -> jax.Array:
    """Per expert the k/n quantile of the histogrammed ``r`` (linear inside the crossing bin), mean-centred."""
    n, bins = hist.shape
    total = jnp.sum(hist, axis=1, keepdims=True).astype(jnp.float32)                # tokens (same for all)
    target = total * (k / n)
    cum = jnp.cumsum(hist, axis=1).astype(jnp.float32)
    j = jnp.argmax(cum >= target, axis=1)                                           # first bin reaching it
    before = jnp.take_along_axis(cum, j[:, None], 1)[:, 0] - jnp.take_along_axis(hist, j[:, None], 1)[:, 0]
    inbin = jnp.take_along_axis(hist, j[:, None], 1)[:, 0].astype(jnp.float32)
    frac = jnp.where(inbin > 0, (target[:, 0] - before) / jnp.maximum(inbin, 1.0), 0.0)
    width = (bounds[1] - bounds[0]) / bins
    b = bounds[0] + (j.astype(jnp.float32) + frac) * width
    return b - jnp.mean(b) if center else b


def quantile_bias_exact(scores: jax.Array, bias: jax.Array, k: int, center: bool = True) -> jax.Array:
    """Reference: the exact k/n quantile of ``r_·j`` per expert by sorting (the ⌈N·k/n⌉-th smallest), centred."""
    r = required_bias(scores, bias, k)
    N, n = r.shape
    m = max(1, -(-N * k // n))
    b = jnp.sort(r, axis=0)[m - 1]
    return b - jnp.mean(b) if center else b


def sign_update(bias: jax.Array, counts: jax.Array, gamma: float = 1e-3) -> jax.Array:
    """DeepSeek-V3's aux-loss-free update: ``b ← b + γ · sign(mean load − load)``."""
    load = counts.astype(jnp.float32)
    return bias + gamma * jnp.sign(jnp.mean(load) - load)


def max_violation(counts: jax.Array) -> jax.Array:
    """MaxVio = max load / mean load − 1 (0 when perfectly balanced)."""
    c = counts.astype(jnp.float32)
    return jnp.max(c, axis=-1) / jnp.maximum(jnp.mean(c, axis=-1), 1e-9) - 1.0
