"""Block Attention Residuals: the depth-mixing read (spec §6.1)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype

HIGHEST = jax.lax.Precision.HIGHEST


def attnres_mix(blocks: Sequence[jax.Array], partial: jax.Array, norm_weight: jax.Array, proj_weight: jax.Array,
                eps: float, valid: jax.Array | None = None) -> jax.Array:
    """``Mix(blocks, p) = Σ_j π_j v_j`` over candidates ``v = [b_0, …, b_{K−1}, p]`` (each ``[..., H]``).

    ``s_j = Σ_d v_j[d] · (mean_d v_j² + ε)^(−1/2) · w[d]`` with ``w = norm_weight ⊙ proj_weight`` (the norm gain
    and pseudo-query only ever appear as this product), ``π = softmax_j(s)``; the weighted sum uses the raw
    candidates. fp32 with ``Precision.HIGHEST`` throughout, cast back to ``partial.dtype``. With no blocks
    this is the identity on ``partial``. ``valid [K]`` bool (a scanned run's block buffer, :mod:`k3jax.nn.scan`):
    the blocks where False are left out of the softmax (weight exactly 0; with none valid, the identity).
    """
    if len(blocks) == 0:
        return partial
    f32 = acc_dtype(partial, *blocks)
    cand = jnp.stack([b.astype(f32) for b in blocks] + [partial.astype(f32)], axis=0)   # [K+1, ..., H]
    w = norm_weight.astype(f32) * proj_weight.reshape(-1).astype(f32)
    inv_rms = jax.lax.rsqrt(jnp.mean(cand * cand, axis=-1) + eps)                      # [K+1, ...]
    scores = jnp.einsum("j...d,d->j...", cand, w, precision=HIGHEST) * inv_rms
    if valid is not None:
        keep = jnp.concatenate([valid, jnp.ones((1,), bool)]).reshape((-1,) + (1,) * (scores.ndim - 1))
        scores = jnp.where(keep, scores, -jnp.inf)
    pi = jax.nn.softmax(scores, axis=0)
    out = jnp.einsum("j...,j...d->...d", pi, cand, precision=HIGHEST)
    return out.astype(partial.dtype)
