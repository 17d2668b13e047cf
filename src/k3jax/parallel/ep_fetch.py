"""MoonEP's redundant-expert weight fetch: each rank's redundant slots (the plan's ``fetch [R, F]``, global
expert ids, −1 = empty) filled with their experts' weights from the home ranks, and the gradients of those copies
sent back home (the fetch's transpose).

Two routes (:func:`fetch_route`): a two-hop exchange of only the rows a home sends (the CPU exchanges' default,
≈ 2·F rows per rank) or one ``all_gather`` of every home's experts. :func:`fetch_forward` and
:func:`fetch_transpose` move the weights and their gradients (the transpose adds into given home gradients);
:func:`fetch_weights` is the two as one differentiable function.
:func:`fetch_layouts` lists the static ``(slots, rows a home may send)`` shapes MoonEP compiles its step for and
:func:`fetch_layout_index` picks the one a plan needs.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.grouped import compact_index
from k3jax.parallel.exchange import TwoHopRoute, two_hop_backward, two_hop_forward, two_hop_route


def fetch_weights(ws: tuple[jax.Array, ...], fetch: jax.Array, axis: str, R: int, M_in: int | None = None,
                  two_hop: bool = True) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Each rank's redundant slots ``fetch [R, F]`` (global expert ids, −1 = empty: zero weights) filled from the
    home experts ``ws`` (``[m, ...]`` each) along :func:`fetch_route`, differentiably: the transpose
    (:func:`fetch_transpose`) scatter-adds the slots' gradients into fresh zeros per weight — callers that hold
    the home gradients add into those instead. Returns ``(fetched weights [F, ...] each, overflow)``."""
    fr, overflow = fetch_route(fetch, ws[0].shape[0], R, axis, M_in, two_hop)
    return _fetch_differentiable(tuple(ws), fetch, fr, axis, R), overflow


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fetch_differentiable(ws, fetch, fr, axis, R):
    return fetch_forward(ws, fetch, fr, axis, R)


def _fetch_differentiable_fwd(ws, fetch, fr, axis, R):
    return fetch_forward(ws, fetch, fr, axis, R), (ws, fr)


def _fetch_differentiable_bwd(axis, R, res, ct):
    ws, fr = res
    return fetch_transpose(tuple(ct), tuple(jnp.zeros_like(w) for w in ws), fr, axis, R), None, None


_fetch_differentiable.defvjp(_fetch_differentiable_fwd, _fetch_differentiable_bwd)


class FetchRoute(NamedTuple):
    """One rank's side of a redundant-weight fetch. ``src [M]``: the home expert row behind each row this rank
    sends (two-hop) or receives back in the transpose (``all_gather``), ``m`` = none — the scatter index of the
    slots' gradients into this rank's home experts; ``route``: the two-hop maps (None: the ``all_gather`` fetch)."""
    src: jax.Array
    route: TwoHopRoute | None


def fetch_route(fetch: jax.Array, m: int, R: int, axis: str, M_in: int | None = None,
                two_hop: bool = True) -> tuple[FetchRoute, jax.Array]:
    """This rank's :class:`FetchRoute` for the redundant slots ``fetch [R, F]`` and the rows the two-hop route could
    not carry (0 when the bounds hold).

    Two-hop (the CPU exchanges' default; :mod:`k3jax.parallel.exchange`): home o sends the rows ``(u, j)`` with
    ``fetch[u, j]`` one of its experts, in (u, j) order — at most m + R − 2 of them, since the planner's fills from
    one donor cut its home experts in one pass and only a cut expert goes to two receivers (and at most (R−1)·F
    for F slots per rank). Each receiver's slots all come from the one donor that filled it, so hop 2 needs ⌈F/R⌉
    rows per pair, and its fetched experts (a prefix of ``fetch[u]``, increasing id, so by home then slot) arrive
    in slot order. Moves ≈ 2·F rows per rank where the ``all_gather`` moves E. ``M_in``: the rows a home may send
    (default the bound above; a smaller one that :func:`fetch_sends` shows to hold shrinks hop 1 to ⌈M_in/R⌉ rows
    per pair). ``two_hop`` False: one ``all_gather`` of every home's experts (its transpose all-gathers the slots'
    gradients and each home adds those of its own experts — no reduce-scatter of a mostly-zero [E, ...])."""
    F = fetch.shape[1]
    r = jax.lax.axis_index(axis)
    flat = fetch.reshape(-1)
    home = _fetch_homes(fetch, m, R)                                     # [R·F], R = empty slot
    if not two_hop:
        return FetchRoute(jnp.where(home == r, flat % m, m).astype(jnp.int32), None), jnp.int32(0)
    T = fetch_sends(fetch, m, R, home)                                   # [home, receiver]
    M_in = min(m + R - 1, R * F) if M_in is None else M_in
    mine = compact_index(home == r, M_in)                                # my entries in (u, j) order
    n_mine = T[r].sum()
    src = jnp.where(mine < flat.shape[0], flat[jnp.minimum(mine, flat.shape[0] - 1)] % m, m).astype(jnp.int32)
    route = two_hop_route(T, r, M_in, F, c2=-(-F // R))
    return FetchRoute(src, route), route.overflow + jnp.maximum(n_mine - M_in, 0).astype(jnp.int32)


def fetch_forward(ws: tuple[jax.Array, ...], fetch: jax.Array, fr: FetchRoute, axis: str,
                  R: int) -> tuple[jax.Array, ...]:
    """The redundant slots' weights ``[F, ...]`` each (``fetch [R, F]``, zeros in empty slots) along ``fr``, with
    no VJP: :func:`fetch_transpose` is its transpose."""
    F = fetch.shape[1]
    out: list[jax.Array] = [None] * len(ws)   # type: ignore[list-item]
    for g in _dtype_groups(ws):
        part = [ws[i] for i in g]
        if fr.route is not None:
            got = two_hop_forward(_send_rows(part, fr.src), fr.route, axis, R)
        else:
            m = part[0].shape[0]
            full = jax.lax.all_gather(jnp.concatenate([w.reshape(m, -1) for w in part], 1), axis, tiled=True)
            mine = fetch[jax.lax.axis_index(axis)]
            got = jnp.take(full, jnp.where(mine >= 0, mine, full.shape[0]), axis=0, mode="fill", fill_value=0)
        for i, v in zip(g, _split(got, part, F)):
            out[i] = v
    return tuple(out)


def fetch_transpose(d_slots: tuple[jax.Array, ...], dws: tuple[jax.Array, ...], fr: FetchRoute, axis: str,
                    R: int) -> tuple[jax.Array, ...]:
    """The transpose of :func:`fetch_forward`: the slots' gradients ``d_slots [F, ...]`` each go back to their
    home ranks and are added to the home experts' gradients ``dws [m, ...]`` there — a scatter-add of the few
    rows into ``dws`` (in place when ``dws`` is not used again), never a zero-filled ``[m, ...]`` per weight."""
    out: list[jax.Array] = [None] * len(dws)   # type: ignore[list-item]
    for g in _dtype_groups(d_slots):
        part = [d_slots[i] for i in g]
        flat = jnp.concatenate([d.reshape(d.shape[0], -1) for d in part], 1)
        if fr.route is not None:
            rows = two_hop_backward(flat, fr.route, axis, R, fr.src.shape[0])          # [M_in, ·] send order
        else:
            rows = jax.lax.all_gather(flat, axis, tiled=True)                         # [R·F, ·] every slot
        a = 0
        for i in g:
            dw = dws[i]
            b = a + math.prod(dw.shape[1:])
            upd = rows[:, a:b].astype(dw.dtype)
            out[i] = dw.reshape(dw.shape[0], -1).at[fr.src].add(upd, mode="drop").reshape(dw.shape)
            a = b
    return tuple(out)


def _dtype_groups(ws) -> list[list[int]]:
    """Indices of ``ws`` grouped by dtype, in order (one exchange per dtype)."""
    groups: dict = {}
    for i, w in enumerate(ws):
        groups.setdefault(jnp.dtype(w.dtype), []).append(i)
    return list(groups.values())


def _send_rows(ws: list[jax.Array], src: jax.Array) -> jax.Array:
    """The rows ``src`` (``m`` = a zero row) of each weight, side by side ``[M, Σ X]`` — each weight's few rows
    first, then one concatenation (concatenating the whole home weights first copied all m experts: the largest
    single op of MoonEP's step at R=8, E=896)."""
    m = ws[0].shape[0]
    return jnp.concatenate([jnp.take(w.reshape(m, -1), src, axis=0, mode="fill", fill_value=0) for w in ws], 1)


def _split(got: jax.Array, ws: list[jax.Array], F: int) -> list[jax.Array]:
    """Columns of ``got [F, Σ X]`` back into ``[F, ...]`` per weight of ``ws``."""
    out, a = [], 0
    for w in ws:
        b = a + math.prod(w.shape[1:])
        out.append(got[:, a:b].reshape(F, *w.shape[1:]))
        a = b
    return out


def _fetch_homes(fetch: jax.Array, m: int, R: int) -> jax.Array:
    """The home rank of each redundant slot of ``fetch [R, F]`` (flattened ``[R·F]``; R = empty slot)."""
    flat = fetch.reshape(-1)
    return jnp.where(flat >= 0, flat // m, R)


def fetch_sends(fetch: jax.Array, m: int, R: int, home: jax.Array | None = None) -> jax.Array:
    """``[R(home), R(receiver)]``: how many of each receiver's redundant slots (``fetch [R, F]``, −1 = none)
    each home rank fills (row sums: the weight rows a home sends). ``home``: :func:`_fetch_homes`, if at hand."""
    F = fetch.shape[1]
    home = _fetch_homes(fetch, m, R) if home is None else home
    return jnp.zeros((R + 1, R), jnp.int32).at[home, jnp.arange(R * F) // F].add(1)[:R]


def fetch_menu(m: int) -> tuple[int, ...]:
    """Static numbers of redundant-expert slots per rank MoonEP compiles for: ⌈m/8⌉ (what the plan needs on the
    routings of ``benchmarks.moonep``: ≤ 10 of 112 at R=8, ≤ 2 of 14 at R=64), then the planner's bound m. The
    smallest that holds every rank's fetches runs; the others cost compile time only."""
    small = max(1, -(-m // 8))
    return (small, m) if small < m else (m,)


def fetch_layouts(m: int, R: int, two_hop: bool) -> tuple[tuple[int, int | None], ...]:
    """The static ``(F slots per rank, M_in weight rows a home sends)`` MoonEP compiles its expert step for, in
    order: with the two-hop fetch, each slot count of :func:`fetch_menu` with the planner's bound on what one home
    sends (``min(m + R − 1, R·F)``), preceded for the small slot count by ``M_in = ⌈m/8⌉`` — on the routings of
    ``benchmarks.moonep`` a home sends a few expert rows, and the bound's hop 1 moved m of them per rank
    (2.75 MB of the 3.1 MB a rank sent at R=8, E=896). ``M_in`` None: not a two-hop fetch. The plan picks the
    first layout that holds its fetches (:func:`fetch_layout_index`)."""
    if not two_hop:
        return tuple((F, None) for F in fetch_menu(m))
    out: list[tuple[int, int | None]] = []
    for F in fetch_menu(m):
        bound = min(m + R - 1, R * F)
        small = min(max(1, -(-m // 8)), bound)
        if F < m and small < bound:
            out.append((F, small))
        out.append((F, bound))
    return tuple(out)


def fetch_layout_index(fetch: jax.Array, layouts: tuple[tuple[int, int | None], ...], m: int, R: int) -> jax.Array:
    """The first of ``layouts`` that holds ``fetch [R, m]`` (every rank's redundant slots, the same on every rank,
    so every rank picks the same layout): its used slots fit F and no home sends more than M_in rows."""
    n_fetch = jnp.max(jnp.sum(fetch >= 0, axis=1))
    n_send = jnp.max(jnp.sum(fetch_sends(fetch, m, R), axis=1))
    fits = jnp.stack([(n_fetch <= F) & (True if M is None else n_send <= M) for F, M in layouts])
    return jnp.argmax(fits).astype(jnp.int32)       # the last layout (the planner's bounds) always fits
