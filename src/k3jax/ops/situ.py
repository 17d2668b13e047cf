"""Gated activations of the FFNs (spec §7.1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype


def situ_glu(a: jax.Array, u: jax.Array, beta: float | None = 4.0, beta_lin: float | None = 25.0) -> jax.Array:
    """SiTU-GLU in fp32, cast back to ``a.dtype``.

    ``SiTU(a, u) = [β·tanh(a/β)·σ(a)] · [β_lin·tanh(u/β_lin)]``; ``β=None`` means 1, ``β_lin=None`` leaves ``u``
    uncapped. With both set, ``|SiTU| < β·β_lin`` for any input.
    """
    f = acc_dtype(a, u)
    af = a.astype(f)
    uf = u.astype(f)
    b = 1.0 if beta is None else float(beta)
    gate = b * jnp.tanh(af / b) * jax.nn.sigmoid(af)
    up = uf if beta_lin is None else float(beta_lin) * jnp.tanh(uf / float(beta_lin))
    return (gate * up).astype(a.dtype)


def silu_glu(a: jax.Array, u: jax.Array) -> jax.Array:
    """SwiGLU: ``silu(a) · u`` (Kimi Linear's ``hidden_act = "silu"``)."""
    return jax.nn.silu(a) * u


def glu(a: jax.Array, u: jax.Array, hidden_act: str, beta: float | None = None,
        beta_lin: float | None = None) -> jax.Array:
    """The config's gated activation: ``"situ"`` or ``"silu"``."""
    if hidden_act == "situ":
        return situ_glu(a, u, beta, beta_lin)
    if hidden_act == "silu":
        return silu_glu(a, u)
    raise ValueError(f"hidden_act: expected 'situ' or 'silu', got {hidden_act!r}")
