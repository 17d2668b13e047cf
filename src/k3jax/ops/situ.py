"""Gated activations of the FFNs (spec §7.1)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype


def situ_glu_reference(a: jax.Array, u: jax.Array, beta: float | None = 4.0, beta_lin: float | None = 25.0
                       ) -> jax.Array:
    """SiTU-GLU in fp32, cast back to ``a.dtype``; its gradient is JAX's autodiff of this formula.

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def situ_glu(a: jax.Array, u: jax.Array, beta: float | None = 4.0, beta_lin: float | None = 25.0) -> jax.Array:
    """SiTU-GLU (:func:`situ_glu_reference`'s values) with a hand-written backward: from the saved inputs,
    ``∂/∂a = g·up·[(1 − tanh²(a/β))·σ(a) + gate·(1 − σ(a))]`` and ``∂/∂u = g·gate·(1 − tanh²(u/β_lin))``, in one
    elementwise pass (autodiff's backward keeps tanh and σ as residuals and costs ~3× the forward's elementwise
    work around the FFN's matmuls on XLA:CPU)."""
    return situ_glu_reference(a, u, beta, beta_lin)


def _situ_fwd(a, u, beta, beta_lin):
    return situ_glu_reference(a, u, beta, beta_lin), (a, u)


def _situ_bwd(beta, beta_lin, res, g):
    a, u = res
    f = acc_dtype(a, u)
    af, uf, gf = a.astype(f), u.astype(f), g.astype(f)
    b = 1.0 if beta is None else float(beta)
    ta, s = jnp.tanh(af / b), jax.nn.sigmoid(af)
    gate = b * ta * s
    if beta_lin is None:
        up, dup = uf, jnp.ones_like(uf)
    else:
        tu = jnp.tanh(uf / float(beta_lin))
        up, dup = float(beta_lin) * tu, 1.0 - tu * tu
    dgate = (1.0 - ta * ta) * s + gate * (1.0 - s)
    return (gf * up * dgate).astype(a.dtype), (gf * gate * dup).astype(u.dtype)


situ_glu.defvjp(_situ_fwd, _situ_bwd)


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
