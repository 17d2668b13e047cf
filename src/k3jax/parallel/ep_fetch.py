"""MoonEP's redundant-expert weight fetch: each rank's redundant slots (the plan's ``fetch [R, F]``, global
expert ids, −1 = empty) filled with their experts' weights from the home ranks, and the gradients of those copies
sent back home (the fetch's transpose).

Three routes (:func:`fetch_route`, chosen by a :class:`FetchLayout`): one static ``all_to_all`` of an ``[R, c]``
box of expert rows (the CPU exchanges' default for the first slots: a receiver's slots all come from the one donor
that filled it, so it reads one row of the box), a two-hop exchange of only the rows a home sends (≈ 2·F rows per
rank, any number of slots: the rare slots past the first ones) or one ``all_gather`` of every home's experts.
:func:`fetch_forward` and :func:`fetch_transpose` move the weights and their gradients (the transpose adds into
given home gradients); :func:`fetch_weights` is the two as one differentiable function. :func:`fetch_layouts`
lists the static layouts MoonEP compiles its step for and :func:`fetch_layout_index` picks the one a plan needs.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.grouped import compact_index
from k3jax.parallel.exchange import TwoHopRoute, two_hop_backward, two_hop_forward, two_hop_route


def fetch_weights(ws: tuple[jax.Array, ...], fetch: jax.Array, axis: str, R: int,
                  layout: FetchLayout) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Each rank's redundant slots ``fetch [R, F]`` (global expert ids, −1 = empty: zero weights) filled from the
    home experts ``ws`` (``[m, ...]`` each) along :func:`fetch_route`, differentiably: the transpose
    (:func:`fetch_transpose`) scatter-adds the slots' gradients into fresh zeros per weight — callers that hold
    the home gradients add into those instead. Returns ``(fetched weights [F, ...] each, overflow)``."""
    fr, overflow = fetch_route(fetch, ws[0].shape[0], R, axis, layout)
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


class FetchLayout(NamedTuple):
    """A static shape of the fetch: ``slots`` redundant slots per rank, moved by a one-hop ``all_to_all`` of
    ``chunk`` expert rows per (home, receiver) pair, or else along the two-hop route with at most ``send`` rows
    from one home, or else (both None) by an ``all_gather``."""
    slots: int
    chunk: int | None = None
    send: int | None = None

    def rows(self, R: int) -> int:
        """Expert rows one rank sends in the fetch (its one-hop box, the two-hop rows; −1: the all_gather)."""
        return R * self.chunk if self.chunk else (self.send or -1)


class FetchRoute(NamedTuple):
    """One rank's side of a redundant-weight fetch. ``src [M]``: the home expert row behind each row this rank
    sends (one-hop box rows ``(receiver, j)``, two-hop send order) or receives back in the transpose
    (``all_gather``), ``m`` = none — the scatter index of the slots' gradients into this rank's home experts;
    ``route``: the two-hop maps; ``donor``: the one-hop box row this rank reads (the rank that filled its slots)."""
    src: jax.Array
    route: TwoHopRoute | None = None
    donor: jax.Array | None = None


def fetch_route(fetch: jax.Array, m: int, R: int, axis: str, layout: FetchLayout) -> tuple[FetchRoute, jax.Array]:
    """This rank's :class:`FetchRoute` for the redundant slots ``fetch [R, F]`` and the slots the route could not
    carry (0 when the layout holds the plan).

    One-hop (``layout.chunk`` = c): home o puts ``w[fetch[u, j]]`` at row ``(u, j)`` of an ``[R, c]`` box for each
    of u's first c slots that is one of its experts; the planner fills each receiver from one donor, so receiver u
    finds all its slots, in order, in the row its donor sent. Moves R·c expert rows per rank; a slot from a second
    donor or past c would be lost and is counted instead. The transpose all-gathers every receiver's first c slot
    gradients (R·c rows, as the box) and each home adds those ``src`` marks as its own — no box of mostly zeros
    sent back (``benchmarks.moonep``'s hot-rank routing, side by side with the two-hop route in one process:
    65.7 → 61.8 ms a step).

    Two-hop (``layout.send`` = M_in; :mod:`k3jax.parallel.exchange`): home o sends the rows ``(u, j)`` with
    ``fetch[u, j]`` one of its experts, in (u, j) order — at most m + R − 2 of them, since the planner's fills from
    one donor cut its home experts in one pass and only a cut expert goes to two receivers (and at most (R−1)·F
    for F slots per rank). Each receiver's slots all come from the one donor that filled it, so hop 2 needs ⌈F/R⌉
    rows per pair, and its fetched experts (a prefix of ``fetch[u]``, increasing id, so by home then slot) arrive
    in slot order. Moves ≈ 2·F rows per rank where the ``all_gather`` moves E; ``M_in`` smaller than the bound
    (that :func:`fetch_sends` shows to hold) shrinks hop 1 to ⌈M_in/R⌉ rows per pair.

    Neither: one ``all_gather`` of every home's experts (its transpose all-gathers the slots' gradients and each
    home adds those of its own experts — no reduce-scatter of a mostly-zero [E, ...])."""
    F = fetch.shape[1]
    r = jax.lax.axis_index(axis)
    flat = fetch.reshape(-1)
    home = _fetch_homes(fetch, m, R)                                     # [R·F], R = empty slot
    if layout.chunk:
        c = layout.chunk
        home2 = home.reshape(R, F)
        mine = (home2[:, :c] == r)                                        # my experts in each receiver's first c
        src = jnp.where(mine, fetch[:, :c] % m, m).reshape(-1).astype(jnp.int32)
        donor = jnp.minimum(home2[r, 0], R - 1)                           # who filled my slots (none: any row)
        used = home2[r] < R
        lost = jnp.sum(used & ((home2[r] != donor) | (jnp.arange(F) >= c)))
        return FetchRoute(src, donor=donor.astype(jnp.int32)), lost.astype(jnp.int32)
    if layout.send is None:
        return FetchRoute(jnp.where(home == r, flat % m, m).astype(jnp.int32)), jnp.int32(0)
    T = fetch_sends(fetch, m, R, home)                                   # [home, receiver]
    M_in = layout.send
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
        if fr.donor is not None:
            box = _send_rows(part, fr.src)                                           # [R·c, Σ X]
            c = box.shape[0] // R
            recv = jax.lax.all_to_all(box.reshape(R, c, -1), axis, 0, 0)
            got = jnp.pad(jax.lax.dynamic_index_in_dim(recv, fr.donor, 0, keepdims=False), [(0, F - c), (0, 0)])
        elif fr.route is not None:
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
        if fr.donor is not None:            # every receiver's slots, each home keeping its own rows (src)
            rows = jax.lax.all_gather(flat[:fr.src.shape[0] // R], axis, tiled=True)  # [(receiver, j), ·]
        elif fr.route is not None:
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


def fetch_layouts(m: int, R: int, route: str) -> tuple[FetchLayout, ...]:
    """The static :class:`FetchLayout` s MoonEP compiles its expert step for, in order; the plan picks the first
    that holds its fetches (:func:`fetch_layout_index`). ``route="one_hop"`` (the CPU exchanges): the small slot
    count F0 of :func:`fetch_menu` in one-hop boxes of c ∈ {⌈F0/8⌉, ⌈F0/4⌉, ⌈F0/2⌉, ⌈3·F0/4⌉, F0} rows per pair
    (on the routings of ``benchmarks.moonep`` a rank hosts 1–4 redundant experts: c = 2 or 4, 16 or 32 expert
    rows a rank; on hot-rank routing 9–10 from one donor: c = 11, 88 rows, where the two-hop route moved 128 with
    two gathers per hop), then the planner's bound of m slots along the two-hop route (any number of slots, from
    any donors). ``route="gather"``: each slot count of :func:`fetch_menu` by ``all_gather``."""
    menu = fetch_menu(m)
    if route == "gather":
        return tuple(FetchLayout(F) for F in menu)
    if route != "one_hop":
        raise ValueError(f"route: expected 'one_hop' or 'gather', got {route!r}")
    F0 = menu[0]
    chunks = sorted({max(1, -(-F0 * k // 8)) for k in (1, 2, 4, 6, 8)})
    out = [FetchLayout(F0, chunk=c) for c in chunks]
    if F0 < m:
        out.append(any_slots_layout(m, m, R, route))
    return tuple(out)


def any_slots_layout(F: int, m: int, R: int, route: str) -> FetchLayout:
    """The layout that holds any fetch of ``F`` slots per rank, from any donors: the two-hop route with the
    planner's bound on what one home sends, ``min(m + R − 1, R·F)`` rows (``route="one_hop"``), or the
    ``all_gather`` (``"gather"``)."""
    return FetchLayout(F, send=min(m + R - 1, R * F)) if route == "one_hop" else FetchLayout(F)


def fetch_layout_index(fetch: jax.Array, layouts: tuple[FetchLayout, ...], m: int, R: int) -> jax.Array:
    """The first of ``layouts`` that holds ``fetch [R, m]`` (every rank's redundant slots, the same on every rank,
    so every rank picks the same layout): its used slots fit the layout's slots and one-hop chunk (each rank's from
    a single donor), and no home sends more than its two-hop rows."""
    used = fetch >= 0
    n_fetch = jnp.max(jnp.sum(used, axis=1))
    home = jnp.where(used, fetch // m, -1)
    one_donor = jnp.all(~used | (home == jnp.max(home, axis=1, keepdims=True)))
    n_send = jnp.max(jnp.sum(fetch_sends(fetch, m, R), axis=1))

    def fits(L: FetchLayout):
        ok = n_fetch <= L.slots
        if L.chunk:
            return ok & (n_fetch <= L.chunk) & one_donor
        return ok if L.send is None else ok & (n_send <= L.send)

    return jnp.argmax(jnp.stack([fits(L) for L in layouts])).astype(jnp.int32)   # the last always fits
