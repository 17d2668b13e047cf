"""Kimi Delta Attention (spec §4): gates, short conv, and the recurrence in three forms.

Recurrence per head (state ``S ∈ R^{K×V}``, fp32), for t = 1…T::

    S ← Diag(exp(g_t)) S                    (decay along the key axis)
    S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ           (delta-rule write)
    o_t = Sᵀ (scale · q_t)                  (read after write)

* :func:`kda_recurrent` — the reference: a ``lax.scan`` over tokens.
* :func:`k3jax.ops.kda_chunked.kda_chunked` — training/prefill: chunks (32 tokens on CPU, 64 on accelerators)
  solved in parallel, the state carried across them by a ``lax.scan`` (its own module, with its two registered
  implementations).
* :func:`kda_step` — one token, for decode.
* :func:`kda_replay` — speculative decoding: the state after the first ``n[b]`` of T recorded tokens (a masked
  recurrence with a static trip count), and :func:`conv_window_advance` the conv window after them.

All three take fla's convention: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H, K]`` the activated
log-decay, ``beta [B, T, H]`` after sigmoid, state ``[B, H, K, V]``; they return ``(o, final_state or None)``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype

HIGHEST = jax.lax.Precision.HIGHEST


def _mm(spec: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *xs, precision=HIGHEST, preferred_element_type=acc_dtype(*xs))


# ----------------------------------------------------------------------------------------------------- gates
def kda_gate_lower_bound(f: jax.Array, dt_bias: jax.Array, A_log: jax.Array, lower_bound: float) -> jax.Array:
    """K3's safe gate: ``γ = λ · σ(exp(A_log[h]) · (f + dt_bias))`` ∈ (λ, 0), in fp32.

    ``f [..., H, K]`` (gate projection output), ``dt_bias [H, K]``, ``A_log [H]``, ``λ ∈ [-5, 0)``.
    """
    a = acc_dtype(f)
    z = f.astype(a) + dt_bias.astype(a)
    return lower_bound * jax.nn.sigmoid(jnp.exp(A_log.astype(a))[:, None] * z)


def kda_gate_softplus(f: jax.Array, dt_bias: jax.Array, A_log: jax.Array) -> jax.Array:
    """Kimi Linear's gate: ``γ = −exp(A_log[h]) · softplus(f + dt_bias)`` ∈ (−∞, 0), in fp32."""
    a = acc_dtype(f)
    z = f.astype(a) + dt_bias.astype(a)
    return -jnp.exp(A_log.astype(a))[:, None] * jax.nn.softplus(z)


# -------------------------------------------------------------------------------------------- short conv
def causal_conv1d(x: jax.Array, weight: jax.Array, state: jax.Array | None = None,
                  activation: str | None = "silu", reset: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv over time, then ``silu``: ``z_t[c] = Σ_j w[c, j] · x_{t−W+1+j}[c]``.

    ``x [B, T, C]``, ``weight [C, W]`` (``w[:, W−1]`` multiplies the current token), ``state [B, W−1, C]`` the
    previous W−1 inputs (zeros when ``None``). ``reset [B, T]`` (bool) marks tokens that start a new document:
    the window never reaches back across one. Returns ``(y [B, T, C], new_state [B, W−1, C])``; fp32 inside.
    The taps and the activation have a hand-written backward (:func:`_conv_taps`; autodiff of the tap sum cost
    16 ms more per KDA layer of the 100m preset, fwd+bwd of its three convs after their projections: 53 → 35 ms);
    :func:`causal_conv1d_reference` is the plain definition it is tested against.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
    B, T, C = x.shape
    W = weight.shape[-1]
    f = acc_dtype(x)
    masks = _conv_masks(reset, W) if reset is not None else None
    st = None if state is None else state.astype(f)
    y = _conv_taps(x.astype(f), weight.astype(f), st, masks, activation == "silu")
    if T >= W - 1:
        new_state = x[:, T - (W - 1):].astype(f)
    else:
        new_state = _padded(x.astype(f), weight, st)[:, T:]
    return y.astype(x.dtype), new_state


def _conv_masks(reset: jax.Array, W: int) -> jax.Array:
    """``[W, B, T]``: tap j of token t reaches the same document as t (the window's past inputs belong to
    document 0)."""
    B, T = reset.shape
    doc = jnp.concatenate([jnp.zeros((B, W - 1), jnp.int32), jnp.cumsum(reset.astype(jnp.int32), axis=1)], 1)
    return jnp.stack([doc[:, j:j + T] == doc[:, W - 1:] for j in range(W)])


def _taps(xp, w, masks, T):
    """``z = Σ_j xp[:, j:j+T] · w[:, j]`` (tap j masked where it crosses a document)."""
    W = w.shape[-1]
    if masks is None:
        return sum(xp[:, j:j + T] * w[:, j] for j in range(W))
    return sum(xp[:, j:j + T] * w[:, j] * masks[j][..., None] for j in range(W))


def _padded(x, w, state):
    """``state ‖ x`` along time, ``[B, W−1+T, C]`` (a zero window when ``state`` is None)."""
    B, _, C = x.shape
    W = w.shape[-1]
    prev = jnp.zeros((B, W - 1, C), x.dtype) if state is None else state
    return jnp.concatenate([prev, x], axis=1)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _conv_taps(x: jax.Array, w: jax.Array, state: jax.Array | None, masks: jax.Array | None,
               silu: bool) -> jax.Array:
    """``silu(z)`` (or ``z``) of :func:`_taps` over ``x [B, T, C]`` after the window ``state [B, W−1, C]`` (zeros
    when None), ``w [C, W]`` → ``[B, T, C]`` (fp32 operands)."""
    return _conv_taps_fwd(x, w, state, masks, silu)[0]


def _conv_taps_fwd(x, w, state, masks, silu):
    z = _taps(_padded(x, w, state), w, masks, x.shape[1])
    return (jax.nn.silu(z) if silu else z), (x, w, state, masks, z if silu else None)


def _conv_taps_bwd(silu, res, dy):
    """``dz = dy · silu′(z)``, ``dz_j`` its tap-j mask; ``dx[t] = Σ_j w_j · dz_j[t + W−1−j]``, the window's
    ``dstate[s] = Σ_{j ≤ s} w_j · dz_j[s − j]``, ``dw_j = Σ_{b,t} xp[t + j] · dz_j[t]`` (``xp`` = window ‖ x). The
    input gradient is formed at x's own length, not as a padded ``dxp`` sliced afterwards: that slice fed the
    projection's backward ~17 ms slower (100m KDA layer, three convs)."""
    x, w, state, masks, z = res
    W = w.shape[-1]
    T = dy.shape[1]
    if silu:
        s = jax.nn.sigmoid(z)
        dz = dy * s * (1 + z * (1 - s))
    else:
        dz = dy
    dzj = [dz if masks is None else dz * masks[j][..., None] for j in range(W)]
    dx = sum(jnp.pad(dzj[j], ((0, 0), (0, W - 1), (0, 0)))[:, W - 1 - j:W - 1 - j + T] * w[:, j] for j in range(W))
    xp = _padded(x, w, state)
    dw = jnp.stack([jnp.einsum("btc,btc->c", xp[:, j:j + T], dzj[j]) for j in range(W)], axis=1)
    dstate = None
    if state is not None:
        n = min(W - 1, T)                 # only the first W−1 outputs reach back into the window
        dstate = sum(jnp.pad(w[:, j] * dzj[j][:, :n], ((0, 0), (j, W - 1), (0, 0)))[:, :W - 1] for j in range(W))
    return dx, dw, dstate, None


_conv_taps.defvjp(_conv_taps_fwd, _conv_taps_bwd)


def causal_conv1d_reference(x: jax.Array, weight: jax.Array, state: jax.Array | None = None,
                            activation: str | None = "silu", reset: jax.Array | None = None
                            ) -> tuple[jax.Array, jax.Array]:
    """:func:`causal_conv1d` as its plain definition, differentiated by autodiff (the reference)."""
    f = acc_dtype(x)
    xp = _padded(x.astype(f), weight, None if state is None else state.astype(f))
    masks = None if reset is None else _conv_masks(reset, weight.shape[-1])
    z = _taps(xp, weight.astype(f), masks, x.shape[1])
    y = jax.nn.silu(z) if activation == "silu" else z
    return y.astype(x.dtype), xp[:, xp.shape[1] - (weight.shape[-1] - 1):]


def conv_window_advance(window: jax.Array, x: jax.Array, n: jax.Array) -> jax.Array:
    """The conv window after the first ``n[b]`` of the new inputs: the last W−1 of ``window ‖ x[b, :n[b]]``.

    ``window [B, W−1, C]`` (the previous W−1 inputs), ``x [B, T, C]`` (projected inputs, before the conv),
    ``n [B]`` int in ``[0, T]`` → ``[B, W−1, C]`` in ``window.dtype`` (``n = 0`` leaves the window as it was)."""
    xp = jnp.concatenate([window, x.astype(window.dtype)], axis=1)                    # [B, W−1+T, C]
    keep = n[:, None] + jnp.arange(window.shape[1])[None, :]
    return jnp.take_along_axis(xp, keep[:, :, None], axis=1)


# ------------------------------------------------------------------------------------- recurrent / step
def _check(q, k, v, g, beta, initial_state):
    if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"kda: q, k, g must share shape [B, T, H, K]; got q{q.shape} k{k.shape} g{g.shape}")
    B, T, H, _ = q.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"kda: v must be [B, T, H, V] with B, T, H = {(B, T, H)}; got {v.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"kda: beta must be [B, T, H] = {(B, T, H)}; got {beta.shape}")
    if initial_state is not None and initial_state.shape != (B, H, q.shape[-1], v.shape[-1]):
        raise ValueError(f"kda: initial_state must be [B, H, K, V] = {(B, H, q.shape[-1], v.shape[-1])}; "
                         f"got {initial_state.shape}")


def _write(S: jax.Array, k, v, g, beta) -> jax.Array:
    """Decay and delta-rule write of one token on fp32 arrays: k, g ``[B, H, K]``, v ``[B, H, V]``, beta ``[B, H]``."""
    S = S * jnp.exp(g)[..., None]
    pred = _mm("bhk,bhkv->bhv", k, S)
    return S + _mm("bhk,bhv->bhkv", beta[..., None] * k, v - pred)


def _step(S: jax.Array, q, k, v, g, beta):
    """One delta-rule step on fp32 arrays (write, then read with q ``[B, H, K]``)."""
    S = _write(S, k, v, g, beta)
    return S, _mm("bhk,bhkv->bhv", q, S)


def kda_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
             scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """One token: ``q, k, g [B, H, K]``, ``v [B, H, V]``, ``beta [B, H]``, ``state [B, H, K, V]`` (fp32).

    Returns ``(o [B, H, V] in v.dtype, new_state [B, H, K, V] fp32)``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a = acc_dtype(q, k, v)
    f32 = lambda x: x.astype(a)  # noqa: E731
    S, o = _step(f32(state), f32(q) * scale, f32(k), f32(v), f32(g), f32(beta))
    return o.astype(v.dtype), S


def kda_replay(state: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
               n: jax.Array) -> jax.Array:
    """The state after the first ``n[b]`` of T recorded tokens, from the state before them (speculative decoding:
    rebuild the state at the accepted length after verifying T tokens, without a state per position).

    ``state [B, H, K, V]`` fp32, ``k, g [B, T, H, K]`` (k after conv, silu and L2 norm), ``v [B, T, H, V]``,
    ``beta [B, T, H]``, ``n [B]`` int in ``[0, T]``. The recurrence of :func:`kda_recurrent` over t < n[b]; tokens
    t ≥ n[b] leave the state unchanged. A static trip count of T (unrolled: T is a draft length + 1, small), so one
    compiled program serves every n. Returns ``[B, H, K, V]`` fp32."""
    B, T, H, K = k.shape
    if state.shape != (B, H, K, v.shape[-1]) or v.shape[:3] != (B, T, H) or g.shape != k.shape \
            or beta.shape != (B, T, H) or n.shape != (B,):
        raise ValueError(f"kda_replay: expected state [B, H, K, V], k/g [B, T, H, K], v [B, T, H, V], beta [B, T, H]"
                         f", n [B]; got state{state.shape} k{k.shape} v{v.shape} g{g.shape} beta{beta.shape} "
                         f"n{n.shape}")
    a = acc_dtype(k, v)
    S = state.astype(a)
    for t in range(T):
        S_next = _write(S, k[:, t].astype(a), v[:, t].astype(a), g[:, t].astype(a), beta[:, t].astype(a))
        S = jnp.where((t < n)[:, None, None, None], S_next, S)
    return S


def kda_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                  scale: float | None = None, initial_state: jax.Array | None = None,
                  output_final_state: bool = False, reset: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array | None]:
    """Reference KDA: a token-by-token ``lax.scan`` of the recurrence above (fp32 throughout).

    ``reset [B, T]`` (bool, optional): the state is zeroed before each marked token (a new packed document).
    """
    _check(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    a = acc_dtype(q, k, v)
    S0 = jnp.zeros((B, H, K, V), a) if initial_state is None else initial_state.astype(a)
    tm = lambda x: jnp.moveaxis(x.astype(a), 1, 0)  # noqa: E731  time-major

    rs = jnp.zeros((T, B), bool) if reset is None else jnp.moveaxis(reset.astype(bool), 1, 0)

    def body(S, xs):
        r, *rest = xs
        return _step(jnp.where(r[:, None, None, None], 0.0, S), *rest)

    S, o = jax.lax.scan(body, S0, (rs, tm(q) * scale, tm(k), tm(v), tm(g), tm(beta)))
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    return o, (S if output_final_state else None)
