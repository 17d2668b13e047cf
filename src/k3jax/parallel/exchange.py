"""A ragged row exchange in two static all-to-all hops (Valiant routing), for backends without
``ragged_all_to_all`` (XLA:CPU) — buffers ≈ 2× the rows actually sent instead of R×.

Each rank holds rows sorted by destination; ``T [R, R]`` (replicated on every rank) says how many rows source s
sends to destination d (``Σ_d T[s, d] ≤ M_in``, ``Σ_s T[s, d] ≤ M_out``). A ragged exchange has no static
per-pair bound, so a one-hop ``all_to_all`` needs a chunk of ``M_in`` rows per pair (R·M_in rows per rank, what
an ``all_gather`` of the send rows also costs). Two hops need none that large:

1. source s sends its row k to the intermediate rank ``k mod R`` — an ``[R, ⌈M_in/R⌉]`` box that is a reshape of
   the send rows (no gather), moved by one ``all_to_all``;
2. each intermediate forwards what it holds to the rows' destinations — an ``[R, c2]`` box, one ``all_to_all``.

Rows s → d are a contiguous range of s's send order, so at most ``⌈T[s, d]/R⌉`` of them pass through any one
intermediate, and an intermediate holds at most ``Σ_s ⌈T[s, d]/R⌉ ≤ M_out/R + R − 1`` rows for d: the default
``c2``. When every destination receives from a single source (MoonEP's weight fetch: a rank's redundant experts
all come from the one donor that filled it) the bound is ``⌈M_out/R⌉``, passed as ``c2``. Rows past ``c2``
would be dropped; the route counts them (``overflow``) so that a violated bound is visible, never silent.

Every index map is computed on every rank from ``T`` alone (integer work of O(R³ + R·c2 + M)); the row moves
are a reshape, two ``all_to_all`` and two row gathers. The exchange is a partial permutation, so its transpose
(the backward, and the return trip of an expert-parallel MoE) is the same two hops run backwards through the
inverse maps — gathers again, no scatter-add.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp


class TwoHopRoute(NamedTuple):
    """Index maps of one two-hop exchange as seen by one rank (all int32; −1 = no row)."""
    fwd2: jax.Array        # [R·c2] as intermediate: row of the hop-1 receive buffer [R·c1] for each hop-2 send row
    inv2: jax.Array        # [R·c1] the hop-2 send row of each hop-1 received row
    fwd3: jax.Array        # [M_out] as destination: row of the hop-2 receive buffer [R·c2] for each output row
    inv3: jax.Array        # [R·c2] the output row of each hop-2 received row
    overflow: jax.Array    # int32 scalar: rows this rank could not forward (0 whenever the c2 bound holds)


def two_hop_sizes(R: int, M_in: int, M_out: int, c2: int | None = None) -> tuple[int, int]:
    """Static chunk rows ``(c1, c2)`` of the two hops (see the module docstring)."""
    c1 = max(1, math.ceil(M_in / R))
    return c1, max(1, c2 if c2 is not None else math.ceil(M_out / R) + R - 1)


def inverse_map(f: jax.Array, n: int) -> jax.Array:
    """``inv [n]`` with ``inv[f[p]] = p`` for the valid entries of the injective map ``f`` (−1 elsewhere)."""
    p = jnp.arange(f.shape[0], dtype=jnp.int32)
    return jnp.full((n,), -1, jnp.int32).at[jnp.where(f >= 0, f, n)].set(p, mode="drop")


def two_hop_route(T: jax.Array, r: jax.Array, M_in: int, M_out: int, c2: int | None = None) -> TwoHopRoute:
    """Rank ``r``'s maps for sending rows sorted by destination with counts ``T [R(src), R(dst)]``."""
    R = T.shape[0]
    c1, c2 = two_hop_sizes(R, M_in, M_out, c2)
    T = T.astype(jnp.int32)
    in_off = jnp.cumsum(T, 1) - T                                          # [s, d] start in s's send rows
    out_off = jnp.cumsum(T, 0) - T                                         # [s, d] start in d's output rows
    i = jnp.arange(R, dtype=jnp.int32)[:, None, None]                      # intermediate
    k0 = in_off[None] + jnp.mod(i - in_off[None], R)                      # [i, s, d] first row of s→d at i
    end = (in_off + T)[None]
    cnt = jnp.where(k0 < end, (end - k0 + R - 1) // R, 0)                  # rows s→d through i
    base = jnp.cumsum(cnt, 1) - cnt                                        # [i, s, d] start in i's chunk for d
    held = cnt.sum(1)                                                      # [i, d]
    overflow = jnp.sum(jnp.maximum(held[r] - c2, 0)).astype(jnp.int32)

    # hop 2, this rank as intermediate: chunk row p for destination d ← hop-1 row (s, j)
    p = jnp.arange(c2, dtype=jnp.int32)
    cum = (base + cnt)[r]                                                  # [s, d] inclusive over s
    s = jnp.sum(cum.T[:, None, :] <= p[None, :, None], axis=-1).astype(jnp.int32)    # [d, p]
    sv = jnp.minimum(s, R - 1)
    d = jnp.arange(R, dtype=jnp.int32)[:, None]
    k = k0[r][sv, d] + (p[None, :] - base[r][sv, d]) * R
    fwd2 = jnp.where(p[None, :] < held[r][:, None], sv * c1 + k // R, -1).reshape(-1).astype(jnp.int32)

    # hop 3, this rank as destination: output row q ← hop-2 row (i, p)
    q = jnp.arange(M_out, dtype=jnp.int32)
    cum_out = jnp.cumsum(T[:, r])                                          # [s] inclusive
    s3 = jnp.minimum(jnp.sum(cum_out[None, :] <= q[:, None], axis=1), R - 1).astype(jnp.int32)
    k3 = in_off[s3, r] + (q - out_off[s3, r])
    i3 = jnp.mod(k3, R)
    p3 = base[i3, s3, r] + (k3 - k0[i3, s3, r]) // R
    ok = (q < cum_out[-1]) & (p3 < c2)
    fwd3 = jnp.where(ok, i3 * c2 + p3, -1).astype(jnp.int32)
    return TwoHopRoute(fwd2, inverse_map(fwd2, R * c1), fwd3, inverse_map(fwd3, R * c2), overflow)


def rows_at(x: jax.Array, idx: jax.Array) -> jax.Array:
    """``x[idx]`` with 0 where ``idx < 0`` (``take`` would wrap −1 to the last row)."""
    return jnp.take(x, jnp.where(idx < 0, x.shape[0], idx), axis=0, mode="fill", fill_value=0)


def two_hop_forward(x: jax.Array, route: TwoHopRoute, axis: str, R: int) -> jax.Array:
    """:func:`two_hop_exchange` without its VJP (for callers that write their own backward)."""
    c1 = route.inv2.shape[0] // R
    c2 = route.inv3.shape[0] // R
    tail = x.shape[1:]
    xp = jnp.pad(x, [(0, R * c1 - x.shape[0])] + [(0, 0)] * len(tail))
    box1 = jnp.swapaxes(xp.reshape(c1, R, *tail), 0, 1)                   # box1[i, j] = x[j·R + i]
    recv1 = jax.lax.all_to_all(box1, axis, 0, 0).reshape(R * c1, *tail)
    box2 = rows_at(recv1, route.fwd2).reshape(R, c2, *tail)
    recv2 = jax.lax.all_to_all(box2, axis, 0, 0).reshape(R * c2, *tail)
    return rows_at(recv2, route.fwd3)


def two_hop_backward(y: jax.Array, route: TwoHopRoute, axis: str, R: int, M_in: int) -> jax.Array:
    """The transpose of :func:`two_hop_forward` (:func:`two_hop_return` without its VJP)."""
    c1 = route.inv2.shape[0] // R
    c2 = route.inv3.shape[0] // R
    tail = y.shape[1:]
    recv2 = rows_at(y, route.inv3).reshape(R, c2, *tail)
    box2 = jax.lax.all_to_all(recv2, axis, 0, 0).reshape(R * c2, *tail)
    recv1 = rows_at(box2, route.inv2).reshape(R, c1, *tail)
    box1 = jax.lax.all_to_all(recv1, axis, 0, 0)
    return jnp.swapaxes(box1, 0, 1).reshape(R * c1, *tail)[:M_in]


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def two_hop_exchange(x: jax.Array, route: TwoHopRoute, axis: str, R: int) -> jax.Array:
    """Send ``x [M_in, ...]`` (rows sorted by destination) along ``route`` (:func:`two_hop_route`) inside
    ``shard_map`` over ``axis`` (size R) → ``[M_out, ...]``: the rows each source sent here, by source then in
    the source's order (what ``jax.lax.ragged_all_to_all`` gives with offsets from the same ``T``); 0 past them."""
    return two_hop_forward(x, route, axis, R)


def _ex_fwd(x, route, axis, R):
    return two_hop_forward(x, route, axis, R), (route, x.shape[0])


def _ex_bwd(axis, R, res, ct):
    route, M_in = res
    return two_hop_backward(ct, route, axis, R, M_in), None


two_hop_exchange.defvjp(_ex_fwd, _ex_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def two_hop_return(y: jax.Array, route: TwoHopRoute, axis: str, R: int, M_in: int) -> jax.Array:
    """The transpose of :func:`two_hop_exchange`: rows ``y [M_out, ...]`` at their destinations go back to
    where they came from → ``[M_in, ...]`` in each source's send order (the return trip of a MoE)."""
    return two_hop_backward(y, route, axis, R, M_in)


def _ret_fwd(y, route, axis, R, M_in):
    return two_hop_backward(y, route, axis, R, M_in), route


def _ret_bwd(axis, R, M_in, route, ct):
    return two_hop_forward(ct, route, axis, R), None


two_hop_return.defvjp(_ret_fwd, _ret_bwd)
