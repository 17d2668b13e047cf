"""Normalisation primitives (spec §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm: ``w ⊙ cast(x_f32 · (mean(x_f32²) + ε)^(-1/2))`` over the last axis.

    The reduction runs in fp32, the normalised value goes back to ``x.dtype``, then the gain multiplies.
    """
    xf = x.astype(acc_dtype(x))
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def l2_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(Σ x² + ε)`` over the last axis in fp32 (ε added to the sum, inside the root)."""
    xf = x.astype(acc_dtype(x))
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def gated_rms_norm(o: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """KDA output norm (norm, then gain, then sigmoid gate), all in fp32, result cast to ``o.dtype``.

    ``GN(o, g) = w ⊙ o · (mean(o²) + ε)^(-1/2) ⊙ σ(g)`` over the last axis (the head dim).
    """
    f = acc_dtype(o)
    of = o.astype(f)
    y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    y = y * weight.astype(f) * jax.nn.sigmoid(gate.astype(f))
    return y.astype(o.dtype)
