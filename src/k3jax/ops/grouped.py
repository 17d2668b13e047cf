"""Dropless routed-expert FFN: grouped matmul on tokens sorted by expert, and a per-token reference."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype

HIGHEST = jax.lax.Precision.HIGHEST
Act = Callable[[jax.Array, jax.Array], jax.Array]


def moe_grouped(x: jax.Array, idx: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, act: Act) -> jax.Array:
    """``y_t = Σ_j w_{tj} · E_{idx_{tj}}(x_t)``, ``E_e(x) = act(x W1_e, x W3_e) W2_e``; no capacity, no drop.

    ``x [N, D]``, ``idx, weights [N, k]``, ``w_gate, w_up [E, D, I]``, ``w_down [E, I, D]``. The N·k (token, expert)
    pairs are sorted by expert and pushed through ``jax.lax.ragged_dot`` with per-expert group sizes; the
    combine is in fp32. Returns ``[N, D]`` fp32.
    """
    N, k = idx.shape
    E = w_gate.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k                                                       # source token of each sorted pair
    xs = jnp.take(x, tok, axis=0)                                          # [N·k, D]
    sizes = jnp.zeros((E,), jnp.int32).at[flat].add(1)
    f = acc_dtype(x)
    out = grouped_ffn(xs, sizes, w_gate, w_up, w_down, act)
    wsorted = jnp.take(weights.reshape(-1), order).astype(f)
    return jnp.zeros((N, x.shape[-1]), f).at[tok].add(out.astype(f) * wsorted[:, None])


def grouped_ffn(xs: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                act: Act) -> jax.Array:
    """Rows ``xs [M, D]`` sorted into consecutive groups of ``sizes [G]`` (Σ ≤ M; rows past the groups give 0),
    group g through expert g: ``act(x W1_g, x W3_g) W2_g`` → ``[M, D]`` in ``promote(dtype, f32)``."""
    h = act(jax.lax.ragged_dot(xs, w_gate, sizes, precision=HIGHEST),
            jax.lax.ragged_dot(xs, w_up, sizes, precision=HIGHEST))
    return jax.lax.ragged_dot(h, w_down, sizes, precision=HIGHEST, preferred_element_type=acc_dtype(xs))


def moe_per_token(x: jax.Array, idx: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                  w_down: jax.Array, act: Act) -> jax.Array:
    """Reference for :func:`moe_grouped`: a loop over tokens, each gathering its k experts' weights."""

    f = acc_dtype(x)

    def one(args):
        xt, it, wt = args
        g = jnp.einsum("d,kdi->ki", xt, w_gate[it], precision=HIGHEST)
        u = jnp.einsum("d,kdi->ki", xt, w_up[it], precision=HIGHEST)
        o = jnp.einsum("ki,kid->kd", act(g, u), w_down[it], precision=HIGHEST, preferred_element_type=f)
        return jnp.sum(o.astype(f) * wt.astype(f)[:, None], axis=0)

    return jax.lax.map(one, (x, idx, weights))
