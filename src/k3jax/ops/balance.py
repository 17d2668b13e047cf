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
    return histogram_per_expert(r, bounds[0], bounds[1], bins, clip=True)


def histogram_per_expert(r: jax.Array, lo: jax.Array, hi: jax.Array, bins: int, *, clip: bool) -> jax.Array:
    """``[n, bins]`` int32 counts of the columns of ``r [N, n]`` over ``[lo, hi)`` (scalars or ``[n]``).

    ``clip``: values outside fall into the edge bins; otherwise they are not counted."""
    n = r.shape[1]
    lo = jnp.broadcast_to(jnp.asarray(lo, jnp.float32), (n,))
    hi = jnp.broadcast_to(jnp.asarray(hi, jnp.float32), (n,))
    pos = jnp.floor((r - lo) / (hi - lo) * bins)
    inside = (pos >= 0) & (pos < bins)
    idx = jnp.clip(pos, 0, bins - 1).astype(jnp.int32)                              # [N, n]
    flat = (idx + bins * jnp.arange(n, dtype=jnp.int32)[None, :]).reshape(-1)
    ones = jnp.ones_like(flat) if clip else inside.reshape(-1).astype(jnp.int32)
    return jnp.zeros((n * bins,), jnp.int32).at[flat].add(ones).reshape(n, bins)


def _crossing(hist: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row: first bin whose cumulative count reaches ``target``, the count before it, the count in it."""
    cum = jnp.cumsum(hist, axis=1).astype(jnp.float32)
    j = jnp.argmax(cum >= target[:, None], axis=1)
    inbin = jnp.take_along_axis(hist, j[:, None], 1)[:, 0].astype(jnp.float32)
    before = jnp.take_along_axis(cum, j[:, None], 1)[:, 0] - inbin
    return j, before, inbin


def quantile_from_histogram(hist: jax.Array, bounds: jax.Array, k: int, center: bool = True) -> jax.Array:
    """Per expert the k/n quantile of the histogrammed ``r`` (linear inside the crossing bin), mean-centred."""
    n, bins = hist.shape
    total = jnp.sum(hist, axis=1).astype(jnp.float32)                               # tokens (same for all)
    j, before, inbin = _crossing(hist, total * (k / n))
    frac = jnp.where(inbin > 0, (total * (k / n) - before) / jnp.maximum(inbin, 1.0), 0.0)
    width = (bounds[1] - bounds[0]) / bins
    b = bounds[0] + (j.astype(jnp.float32) + frac) * width
    return b - jnp.mean(b) if center else b


def quantile_balance_update(scores: jax.Array, bias: jax.Array, k: int, bins: int = DEFAULT_BINS,
                            passes: int = 3, reduce=None, center: bool = True) -> jax.Array:
    """Quantile Balancing: the bias for the next step from this step's scores ``[N, n]`` (fp32 sigmoid).

    Each pass histograms ``r = α − s`` (α from the current candidate bias) twice, each an int32 ``[n, bins]`` that
    ``reduce`` sums over data-parallel devices (e.g. ``lambda h: lax.psum(h, "data")``): first over the bounds
    ``[min b − 1, max b + 1]``, which hold every ``r``, then inside each expert's crossing bin, so the k/n quantile
    is read to ``width / bins`` (≈ 4e-6 for 1000 bins) instead of one coarse bin. Later passes re-solve with α
    recomputed from the new bias: the experts' thresholds interact through α, and the fixed point on this batch
    is what balances it — one pass moves most of the way (spec'd QB is ``passes=1`` with the coarse read only)."""
    reduce = reduce or (lambda h: h)
    n = scores.shape[1]
    b = bias.astype(jnp.float32)
    for _ in range(passes):
        r = required_bias(scores, b, k)
        bounds = bias_bounds(b)
        coarse = reduce(histogram_per_expert(r, bounds[0], bounds[1], bins, clip=True))
        total = jnp.sum(coarse, axis=1).astype(jnp.float32)
        target = total * (k / n)
        j, before, inbin = _crossing(coarse, target)
        width = (bounds[1] - bounds[0]) / bins
        lo = bounds[0] + j.astype(jnp.float32) * width
        fine = reduce(histogram_per_expert(r, lo, lo + width, bins, clip=False))
        jf, before_f, inbin_f = _crossing(fine, target - before)
        frac = jnp.where(inbin_f > 0, (target - before - before_f) / jnp.maximum(inbin_f, 1.0), 0.0)
        b_fine = lo + (jf.astype(jnp.float32) + frac) * (width / bins)
        # the edge bins also hold clipped values the fine pass does not see; there the coarse read stands
        covered = jnp.sum(fine, axis=1) == inbin
        b_coarse = lo + jnp.where(inbin > 0, (target - before) / jnp.maximum(inbin, 1.0), 0.0) * width
        b = jnp.where(covered, b_fine, b_coarse)
    return b - jnp.mean(b) if center else b


def quantile_bias_exact(scores: jax.Array, bias: jax.Array, k: int, center: bool = True,
                        passes: int = 1) -> jax.Array:
    """Reference: the exact k/n quantile of ``r_·j`` per expert by sorting (the ⌈N·k/n⌉-th smallest), centred;
    ``passes`` re-solves with α from the new bias as :func:`quantile_balance_update` does."""
    N, n = scores.shape
    m = max(1, -(-N * k // n))
    b = bias.astype(jnp.float32)
    for _ in range(passes):
        b = jnp.sort(required_bias(scores, b, k), axis=0)[m - 1]
    return b - jnp.mean(b) if center else b


def sign_update(bias: jax.Array, counts: jax.Array, gamma: float = 1e-3) -> jax.Array:
    """DeepSeek-V3's aux-loss-free update: ``b ← b + γ · sign(mean load − load)``."""
    load = counts.astype(jnp.float32)
    return bias + gamma * jnp.sign(jnp.mean(load) - load)


def max_violation(counts: jax.Array) -> jax.Array:
    """MaxVio = max load / mean load − 1 (0 when perfectly balanced)."""
    c = counts.astype(jnp.float32)
    return jnp.max(c, axis=-1) / jnp.maximum(jnp.mean(c, axis=-1), 1e-9) - 1.0
