"""Expert parallelism inside ``shard_map``: MoonEP (exactly S×K pairs per rank) and two baselines.

Every device holds S tokens (``z [S, D]``, top-K ``idx``/``w [S, K]``) and its E/R home experts' weights; the
``expert`` mesh axis (R ranks) is the exchange group. Methods (same interface, same result up to drops):

* ``"moonep"`` — plan (:mod:`k3jax.parallel.moonep`) from the all-gathered ``[R, E]`` counts, send each pair to
  its planned slot (:class:`~k3jax.parallel.moonep.PairLayout`: both sides derive where every row goes from the
  replicated counts and plan, so rows travel without keys), fetch ≤ E/R redundant experts' weights from their
  homes into static slots, the experts over exactly S·K rows (E/R home + ⌈m/8⌉ redundant slots through the
  grouped FFN's padded layouts — box, box + overflow tiles, or tiles — chosen at run time; slots past those in a
  branch taken only when some rank hosts more), and back. Gradients of fetched weights flow back to their home
  copy through the transposed exchange.
* ``"dropless"`` — every pair to its expert's home rank; a receive buffer sized for the worst case (S·K from each
  of R sources: S·K·R rows) and a grouped matmul over it.
* ``"capacity"`` — GShard-style: at most C = ⌈cf·S·K/E⌉ pairs per (source, expert); the rest are dropped
  (contribute 0). Static buffer cf·S·K per rank.

The pair exchange has five implementations with the same semantics (:data:`EXCHANGES`): ``"ragged"``
(``jax.lax.ragged_all_to_all``: send and receive buffers of exactly S·K rows — GPU/TPU); ``"one_hop"`` (the CPU
default: the plan fixes every (source, destination) count ``T`` before the exchange and every rank knows it, so
all ranks send one static ``all_to_all`` of an ``[R, c]`` box with c the smallest of :func:`one_hop_chunks` —
1.25×, 1.5×, 2× the mean S·K/R — that holds ``max T``, else the two-hop exchange); ``"two_hop"``
(:mod:`k3jax.parallel.exchange`, two static ``all_to_all`` through an intermediate rank, ≈ 2·S·K rows per rank);
with either CPU exchange MoonEP's weight fetch is one ``all_to_all`` of an ``[R, c]`` box of expert rows (a rank's
redundant experts all come from the one donor that filled it; c ≤ ⌈E/8R⌉) and its transpose one ``all_gather`` of
the slots' gradients, the rare slots past those two-hop (:mod:`k3jax.parallel.ep_fetch`); and two that
transiently receive the worst-case R·S·K rows (the plan and the grouped matmul still see exactly S·K):
``"gather"`` (one ``all_gather`` of the S·K send rows, then each rank gathers the rows the all-gathered offsets
say are its own; the weight fetch an ``all_gather`` of every home's experts) and ``"dense"`` (``all_to_all`` of an
[R, S·K] box built by a gather and unpacked by a scatter). ``"auto"`` picks ragged off CPU, one_hop on it.
Stats: ``overflow`` counts rows a two-hop exchange could not carry (0 whenever its bounds hold; tests assert it);
``chunk_rows`` the one-hop chunk that ran (0: two-hop or another exchange); ``box_rows``, ``tile_rows``,
``tiles`` the grouped FFN's layout (:class:`~k3jax.ops.grouped.Layout`: rows per slot in the padded box, 0 = no
box; rows per overflow tile and the static tile count, 0 = no tiles); ``fetch_slots`` the redundant-expert slots
per rank MoonEP's step ran with (:func:`~k3jax.parallel.ep_fetch.fetch_menu`: ⌈m/8⌉, or the planner's bound m when
the branch for the slots past them ran) and ``fetch_rows`` the expert rows a rank sent in the fetch
(:meth:`~k3jax.parallel.ep_fetch.FetchLayout.rows`). The redundant-weight fetch is :mod:`k3jax.parallel.ep_fetch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.parallel.mesh import inner_mesh
from k3jax.ops.grouped import ffn_layouts, grouped_ffn, grouped_ffn_backward, grouped_ffn_forward, layout_index
from k3jax.parallel.ep_fetch import (FetchLayout, any_slots_layout, fetch_forward, fetch_layout_index, fetch_layouts,
                                    fetch_route, fetch_transpose, fetch_weights)
from k3jax.parallel.exchange import inverse_map, rows_at, two_hop_exchange, two_hop_return, two_hop_route
from k3jax.parallel.moonep import PairLayout, pair_counts, pair_layout, plan, rank_in_group, slots_from_alloc

Act = Callable[[jax.Array, jax.Array], jax.Array]
METHODS = ("moonep", "dropless", "capacity")


# ------------------------------------------------------------------------------------------------ exchanges
def _bincount(x: jax.Array, n: int) -> jax.Array:
    return jnp.zeros((n,), jnp.int32).at[x].add(1)


def ragged_all_to_all_dense(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                            output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: str) -> jax.Array:
    """``jax.lax.ragged_all_to_all``'s semantics from a dense ``all_to_all`` (runs on CPU; holds R×operand rows)."""
    R = send_sizes.shape[0]
    M = operand.shape[0]
    j = jnp.arange(M)
    # box[d, j] = operand[input_offsets[d] + j] for j < send_sizes[d]
    src = jnp.clip(input_offsets[:, None] + j[None, :], 0, M - 1)
    box = jnp.take(operand, src.reshape(-1), axis=0).reshape(R, M, *operand.shape[1:])
    # the destination offset travels with the rows
    dst = jnp.where(j[None, :] < send_sizes[:, None], output_offsets[:, None] + j[None, :], output.shape[0])
    rbox = jax.lax.all_to_all(box, axis_name, 0, 0)
    rdst = jax.lax.all_to_all(dst, axis_name, 0, 0)
    del recv_sizes
    return output.at[rdst.reshape(-1)].set(rbox.reshape(-1, *operand.shape[1:]), mode="drop")


def _read_index(lo: jax.Array, n: jax.Array, base: jax.Array, rows: int, src_rows: int) -> jax.Array:
    """For each of ``rows`` positions p: the flat row ``s·src_rows + base_s + (p − lo_s)`` of the all-gathered
    source that lands at p, where source s fills ``[lo_s, lo_s + n_s)`` (``lo, n, base [R]``, ranges disjoint);
    ``−1`` where no source writes."""
    p = jnp.arange(rows, dtype=jnp.int32)[:, None]
    covered = (p >= lo[None, :]) & (p < (lo + n)[None, :])                # [rows, R]
    s = jnp.argmax(covered, axis=1).astype(jnp.int32)
    flat = s * src_rows + base[s] + (p[:, 0] - lo[s])
    return jnp.where(jnp.any(covered, axis=1), flat, -1).astype(jnp.int32)


def _take_rows(full: jax.Array, read: jax.Array) -> jax.Array:
    return jnp.take(full, read, axis=0, mode="fill", fill_value=0)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_exchange(x: jax.Array, read: jax.Array, back: jax.Array, axis_name: str) -> jax.Array:
    """Rows of the all-gathered ``x`` at ``read`` (a partial permutation across ranks); its transpose is the same
    exchange of the cotangents the other way, at ``back`` (no scatter, no reduce over ranks)."""
    return _take_rows(jax.lax.all_gather(x, axis_name, tiled=True), read)


def _gather_exchange_fwd(x, read, back, axis_name):
    return _gather_exchange(x, read, back, axis_name), (read, back)


def _gather_exchange_bwd(axis_name, res, ct):
    read, back = res
    return _take_rows(jax.lax.all_gather(ct, axis_name, tiled=True), back), None, None


_gather_exchange.defvjp(_gather_exchange_fwd, _gather_exchange_bwd)


def ragged_all_to_all_gather(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                             send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                             axis_name: str) -> jax.Array:
    """``jax.lax.ragged_all_to_all``'s semantics from one ``all_gather`` of the operand and one row gather (runs on
    CPU). Every rank's offsets are all-gathered (``[R, R]`` ints), so each rank computes which source row lands
    at each of its output rows; no ``[R, M]`` box is built or scattered. The backward is the reverse exchange of
    the cotangent rows (each operand row is read at most once), again a gather. Receives R×operand rows
    transiently, like the dense emulation; moves them once."""
    del recv_sizes
    r = jax.lax.axis_index(axis_name)
    in_off, send, out_off = (jax.lax.all_gather(a.astype(jnp.int32), axis_name)
                             for a in (input_offsets, send_sizes, output_offsets))   # [R(src), R(dst)]
    M_in, M_out = operand.shape[0], output.shape[0]
    read = _read_index(out_off[:, r], send[:, r], in_off[:, r], M_out, M_in)       # my output rows ← (s, row)
    back = _read_index(in_off[r], send[r], out_off[r], M_in, M_out)               # my operand rows → (d, row)
    got = _gather_exchange(operand, read, back, axis_name)
    return jnp.where((read >= 0).reshape(-1, *([1] * (operand.ndim - 1))), got, output)


EXCHANGES = ("ragged", "one_hop", "two_hop", "gather", "dense")


def _ragged(kind: str):
    if kind == "ragged":
        return lambda *a, axis_name: jax.lax.ragged_all_to_all(*a, axis_name=axis_name)
    if kind == "gather":
        return ragged_all_to_all_gather
    return ragged_all_to_all_dense


def _exchange_offsets(T: jax.Array, r: jax.Array):
    """Offsets of rank r's ragged exchange of rows sorted by destination, ``T [s, d]`` rows from s to d:
    ``(in_off, send, out_off, recv, recv_in_off, back_out)`` — the forward's and (last two) the return's."""
    send = T[r]
    in_off = jnp.cumsum(send) - send
    out_off = (jnp.cumsum(T, 0) - T)[r]                                   # my rows' start in each d's buffer
    recv = T[:, r]
    recv_in_off = jnp.cumsum(recv) - recv
    back_out = (jnp.cumsum(T, 1) - T)[:, r]                               # where my rows sit in s's send order
    return in_off, send, out_off, recv, recv_in_off, back_out


def _gather_indices(T: jax.Array, r: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """For the exchange of rows sorted by destination with ``T [R, R]`` rows from s to d (each rank sends and
    receives ``rows``): ``read [rows]`` the flat row of the all-gathered send buffers at each of rank r's receive
    positions, ``back [rows]`` the flat row of the all-gathered receive buffers where each of r's sent rows
    landed (see :func:`_read_index`)."""
    in_off = jnp.cumsum(T, 1) - T                                         # [s, d]: start in s's send buffer
    out_off = jnp.cumsum(T, 0) - T                                        # [s, d]: start in d's receive buffer
    read = _read_index(out_off[:, r], T[:, r], in_off[:, r], rows, rows)
    back = _read_index(in_off[r], T[r], out_off[r], rows, rows)
    return read, back


# --------------------------------------------------------------------------------------------------- MoonEP
def one_hop_chunks(P_: int, R: int) -> tuple[int, ...]:
    """Rows per (source, destination) chunk of the one-hop exchange, smallest first: 1.25×, 1.5× and 2× the mean
    ``S·K / R`` (rounded up to 8, below S·K). The plan fixes every pair's rows ``T [R, R]`` before the exchange and
    every rank knows them, so all ranks take the smallest chunk that holds ``max T`` — one static ``all_to_all`` of
    an ``[R, c]`` box — or, past the largest, the two-hop exchange (two ``all_to_all`` and ≈ 2× the rows, any
    counts). On ``benchmarks.moonep``'s routings the largest pair is 1.16–1.43× the mean; 2× (the two-hop
    exchange's volume in one hop) is the last rung."""
    out: list[int] = []
    for f in (1.25, 1.5, 2.0):
        c = 8 * math.ceil(math.ceil(f * P_ / R) / 8)
        if c < P_ and c not in out:
            out.append(c)
    return tuple(out)


def _positions(L: PairLayout, T: jax.Array, r: jax.Array, c: int | None) -> tuple[jax.Array, jax.Array, int]:
    """Send positions of this rank's pairs and the receive position of each of its segment rows, in an
    ``[R, c]`` one-hop box, or (``c`` None) in the ragged layout — sent rows by destination, received rows by
    source, each in (slot, order) — of the other exchanges. Returns ``(send_pos [P], recv_pos [P], rows)``."""
    R = T.shape[0]
    P_ = L.dest.shape[0]
    if c is not None:
        return L.dest * c + L.j, L.src_rank * c + L.src_row, R * c
    out_start = jnp.cumsum(L.send) - L.send
    in_start = jnp.cumsum(L.recv) - L.recv
    return out_start[L.dest] + L.j, in_start[L.src_rank] + L.src_row, P_


def _exchange_with(kind: str, c: int | None, axis: str, R: int, back: bool):
    """One exchange of pair rows ``[P, D]`` (source order) into segment rows ``[P, D]`` at their destination, or
    (``back``) its transpose: segment rows back to their source's pair order."""
    def run(x, L, T):
        r = jax.lax.axis_index(axis)
        send_pos, recv_pos, n = _positions(L, T, r, c)
        here, there = (recv_pos, send_pos) if back else (send_pos, recv_pos)
        buf = rows_at(x, inverse_map(here, n))                               # the rows as they leave
        if c is not None:                                                    # an all_to_all is its own transpose
            moved = jax.lax.all_to_all(buf.reshape(R, c, -1), axis, 0, 0).reshape(n, -1)
        elif kind == "two_hop":
            route = two_hop_route(T, r, n, n)
            moved = two_hop_return(buf, route, axis, R, n) if back else two_hop_exchange(buf, route, axis, R)
        elif kind == "gather":
            read, back_map = _gather_indices(T, r, n)
            moved = _gather_exchange(buf, *((back_map, read) if back else (read, back_map)), axis)
        else:
            in_off, send, out_off, recv, recv_in_off, back_out = _exchange_offsets(T, r)
            offsets = (recv_in_off, recv, back_out, send) if back else (in_off, send, out_off, recv)
            moved = _ragged(kind)(buf, jnp.zeros_like(buf), *offsets, axis_name=axis)
        return rows_at(moved, there)
    return run


def _exchange_branches(kind: str, chunks: tuple[int, ...], axis: str, R: int, back: bool):
    fallback = "two_hop" if kind == "one_hop" else kind
    return [_exchange_with(kind, c, axis, R, back) for c in chunks] + [_exchange_with(fallback, None, axis, R, back)]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _route_rows(x, L, T, index, kind, chunks, axis, R, back):
    """Pair rows to their destination's segment rows (``back`` False) or back (True), by the ``index``-th of
    :func:`_exchange_branches` (the same on every rank); either direction's backward is the other direction."""
    return jax.lax.switch(index, _exchange_branches(kind, chunks, axis, R, back), x, L, T)


def _route_fwd(x, L, T, index, kind, chunks, axis, R, back):
    return _route_rows(x, L, T, index, kind, chunks, axis, R, back), (L, T, index)


def _route_bwd(kind, chunks, axis, R, back, res, ct):
    L, T, index = res
    return jax.lax.switch(index, _exchange_branches(kind, chunks, axis, R, not back), ct, L, T), None, None, None


_route_rows.defvjp(_route_fwd, _route_bwd)


@dataclass(frozen=True)
class _Experts:
    """Static configuration of :func:`_moonep_experts`."""
    act: Act
    axis: str
    R: int
    route: str               # the redundant-weight fetch: "one_hop" (CPU exchanges) or "gather" (ep_fetch)

    def branches(self, m: int, M: int, D: int, I: int):
        """``(the fetch layouts of the common step (:class:`~k3jax.parallel.ep_fetch.FetchLayout`, F0 slots), the
        layout of the rare case of more slots (the planner's bounds), the grouped FFN's layouts over the home + F0
        slots)``."""
        layouts = fetch_layouts(m, self.R, self.route)
        F0 = layouts[0].slots
        return tuple(lt for lt in layouts if lt.slots == F0), layouts[-1], ffn_layouts("padded", M, m + F0, D, I)


def _experts_index(fetch: jax.Array, ex: _Experts, main: tuple, m: int) -> jax.Array:
    """The branch of :func:`_moonep_experts` every rank runs: the first of ``main`` that holds the first F0 slots'
    fetches, or ``len(main)`` when some rank hosts more than F0 redundant experts (the same on every rank)."""
    F0 = main[0].slots
    more = jnp.max(jnp.sum(fetch >= 0, axis=1)) > F0
    return jnp.where(more, len(main), fetch_layout_index(fetch[:, :F0], main, m, ex.R)).astype(jnp.int32)


def _past_F0(xs, sizes, fetch, w1, w3, w2, ex: _Experts, F0: int):
    """The redundant slots past the first F0 (rare: a rank hosting more): their own fetch (the planner's bound)
    and grouped FFN over the segment rows after the first m + F0 slots → ``(y [P, D], overflow)``."""
    m, Pn = w1.shape[0], xs.shape[0]
    layout = any_slots_layout(m - F0, m, ex.R, ex.route)
    fw, overflow = fetch_weights((w1, w3, w2), fetch[:, F0:], ex.axis, ex.R, layout)
    q = jnp.arange(Pn, dtype=jnp.int32)
    first = jnp.sum(sizes[:m + F0])                                       # their rows follow the first m + F0 slots
    y = grouped_ffn(rows_at(xs, jnp.where(q + first < Pn, q + first, -1)), sizes[m + F0:], *fw, ex.act,
                    strategy="padded")
    return rows_at(y, jnp.where(q >= first, q - first, -1)), overflow


def _experts_forward(xs, sizes, fetch, w1, w3, w2, ex: _Experts, residuals: bool):
    m, (Pn, D), I = w1.shape[0], xs.shape, w1.shape[2]
    main, _, ffn = ex.branches(m, Pn, D, I)
    F0 = main[0].slots

    def fetch_with(layout: FetchLayout):
        def run(fetch, w1, w3, w2):
            fr, overflow = fetch_route(fetch[:, :F0], m, ex.R, ex.axis, layout)
            return fetch_forward((w1, w3, w2), fetch[:, :F0], fr, ex.axis, ex.R), overflow
        return run

    # the first F0 slots' weights in the smallest layout that holds them (the planner's bound when a rank hosts
    # more); the grouped FFN once, outside any branch
    index = _experts_index(fetch, ex, main, m)
    pre, overflow = jax.lax.switch(index, [fetch_with(L) for L in main] + [fetch_with(main[-1])],
                                   fetch, w1, w3, w2)
    W = [(a, b.astype(a.dtype)) for a, b in zip((w1, w3, w2), pre)]      # home and fetched, not concatenated
    y, res = grouped_ffn_forward(xs, sizes[:m + F0], *W, ex.act, ffn, residuals)
    if F0 < m:                                                           # rare: the slots past F0
        def none(xs, sizes, fetch, w1, w3, w2):
            return jnp.zeros(y.shape, y.dtype), jnp.int32(0)

        def more(xs, sizes, fetch, w1, w3, w2):
            y_more, more_overflow = _past_F0(xs, sizes, fetch, w1, w3, w2, ex, F0)
            return y_more.astype(y.dtype), more_overflow

        y_more, more_overflow = jax.lax.switch((index == len(main)).astype(jnp.int32), [none, more],
                                               xs, sizes, fetch, w1, w3, w2)
        y, overflow = y + y_more, overflow + more_overflow
    return index, (y, overflow, (*res, *pre)) if residuals else (y, overflow)


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moonep_experts(xs, sizes, fetch, w1, w3, w2, ex: _Experts):
    """MoonEP's experts at one rank: its segment rows ``xs [P, D]`` (slot sizes ``sizes [2m]``) through its m home
    experts and its redundant slots ``fetch [R, 2m − m]`` (weights fetched from their homes) → ``(y [P, D],
    overflow)``. The home slots and the first F0 redundant ones (F0 = :func:`~k3jax.parallel.ep_fetch.fetch_menu`'s
    small count) run through the grouped FFN with weights fetched in the smallest layout that holds them; a rank
    hosting more runs the slots past F0 too (a branch taken by all ranks together, the plan being replicated).

    The backward adds the fetched slots' weight gradients to their home experts' gradients by a scatter of those
    few rows into the FFN's home gradient (:func:`~k3jax.parallel.ep_fetch.fetch_transpose`), and the branch not
    taken adds nothing: letting autodiff transpose the fetch and the rare branch added zero-filled ``[m, ...]``
    gradients per weight — passes over the expert weights' size for a few rows (``benchmarks.moonep``'s MoonEP step,
    side by side: uniform routing 74.4 → 67.0 ms, Zipf 1.0 85.0 → 74.0 ms)."""
    return _experts_forward(xs, sizes, fetch, w1, w3, w2, ex, residuals=False)[1]


def _experts_fwd(xs, sizes, fetch, w1, w3, w2, ex):
    index, (y, overflow, res) = _experts_forward(xs, sizes, fetch, w1, w3, w2, ex, residuals=True)
    return (y, overflow), (xs, sizes, fetch, w1, w3, w2, index, res)


def _experts_bwd(ex, saved, ct):
    xs, sizes, fetch, w1, w3, w2, index, res = saved
    m, (Pn, D), I = w1.shape[0], xs.shape, w1.shape[2]
    main, _, ffn = ex.branches(m, Pn, D, I)
    F0 = main[0].slots
    ffn_index, a, b, *pre = res
    W = [(w, p.astype(w.dtype)) for w, p in zip((w1, w3, w2), pre)]
    dxs, *dws = grouped_ffn_backward(xs, sizes[:m + F0], *W, ex.act, ffn, (ffn_index, a, b), ct[0])
    d_slots, d_home = tuple(d[1] for d in dws), tuple(d[0] for d in dws)

    def branch(layout: FetchLayout, more: bool):
        def run(xs, sizes, fetch, w1, w3, w2, d_slots, d_home, dxs, ct):
            fr, _ = fetch_route(fetch[:, :F0], m, ex.R, ex.axis, layout)
            d_home = fetch_transpose(d_slots, d_home, fr, ex.axis, ex.R)
            if more:                          # rare: autodiff of the slots past F0, recomputing their forward
                _, pull = jax.vjp(lambda x, *w: _past_F0(x, sizes, fetch, *w, ex, F0)[0], xs, w1, w3, w2)
                dx_more, *dw_more = pull(ct.astype(jnp.promote_types(ct.dtype, jnp.float32)))
                dxs = dxs + dx_more.astype(dxs.dtype)
                d_home = tuple(d + e.astype(d.dtype) for d, e in zip(d_home, dw_more))
            return dxs, d_home
        return run

    branches = [branch(L, False) for L in main] + [branch(main[-1], True)]
    dxs, (dw1, dw3, dw2) = jax.lax.switch(index, branches, xs, sizes, fetch, w1, w3, w2, d_slots, d_home, dxs,
                                          ct[0])
    return dxs, None, None, dw1, dw3, dw2


_moonep_experts.defvjp(_experts_fwd, _experts_bwd)


def moonep_local(z, idx, w, w1, w3, w2, *, act: Act, axis: str, exchange: str = "dense"):
    """Per-device body of the MoonEP MoE (see the module docstring). Returns ``(y [S, D] fp32, stats)``."""
    S, K = idx.shape
    R = jax.lax.axis_size(axis)
    m = w1.shape[0]
    E = m * R
    Pn = S * K
    r = jax.lax.axis_index(axis)
    e_flat = idx.reshape(Pn).astype(jnp.int32)
    counts = jax.lax.all_gather(_bincount(e_flat, E), axis)               # [R, E]
    pl = plan(counts)
    L = pair_layout(counts, pl.alloc, r, e_flat)
    T = pair_counts(counts, pl.alloc)                                     # [R, R], the same on every rank
    chunks = one_hop_chunks(Pn, R) if exchange == "one_hop" else ()
    chunk = jnp.sum(jnp.max(T) > jnp.asarray(chunks, jnp.int32)).astype(jnp.int32) if chunks else jnp.int32(0)
    route = (L, T, chunk, exchange, chunks, axis, R)
    zp = jnp.broadcast_to(z[:, None], (S, K, z.shape[-1])).reshape(Pn, -1)  # pair p = (token p // K, choice)
    xs = _route_rows(zp, *route, False)                                   # [Pn, D] by slot here
    _, _, fetch = slots_from_alloc(pl.alloc)
    ex = _Experts(act, axis, R, "one_hop" if exchange in ("one_hop", "two_hop") else "gather")
    ys, overflow = _moonep_experts(xs, L.sizes, fetch, w1, w3, w2, ex)
    main, last, ffn = ex.branches(m, Pn, w1.shape[1], w1.shape[2])      # the layouts _moonep_experts chose among
    F0 = main[0].slots
    index = _experts_index(fetch, ex, main, m)
    if exchange in ("one_hop", "two_hop"):   # rows a two-hop exchange of the pairs could not carry
        two_hop = exchange == "two_hop" or chunk == len(chunks)
        overflow += jnp.where(two_hop, two_hop_route(T, r, Pn, Pn).overflow, 0)
    y_pairs = _route_rows(ys, *route, True)
    y = jnp.sum(y_pairs.reshape(S, K, -1) * w.astype(y_pairs.dtype)[..., None], axis=1)
    ffn_at = layout_index(L.sizes[:m + F0], ffn)                          # the layout grouped_ffn ran
    ffn_stat = lambda k: jnp.asarray([L_[k] for L_ in ffn], jnp.int32)[ffn_at]  # noqa: E731
    stats = {"fills": pl.n_fills, "fetched_experts": jnp.sum(fetch >= 0), "recv_rows": jnp.int32(Pn),
             "fetch_slots": jnp.where(index == len(main), last.slots, F0).astype(jnp.int32),
             "fetch_rows": jnp.asarray([L.rows(R) for L in (*main, last)], jnp.int32)[index],
             "box_rows": ffn_stat(0), "tile_rows": ffn_stat(1), "tiles": ffn_stat(2),
             "chunk_rows": jnp.asarray(list(chunks) + [0], jnp.int32)[chunk],
             "dropped": jnp.int32(0), "overflow": overflow}
    return y, stats


# ------------------------------------------------------------------------------------------------ baselines
def dropless_local(z, idx, w, w1, w3, w2, *, act: Act, axis: str, exchange: str = "dense"):
    """Every pair to its expert's home; receive buffer for the worst case S·K·R; grouped matmul over it."""
    S, K = idx.shape
    R = jax.lax.axis_size(axis)
    m = w1.shape[0]
    Pn = S * K
    e_flat = idx.reshape(Pn).astype(jnp.int32)
    dest = e_flat // m
    order = jnp.argsort(dest, stable=True)
    send_x, send_e, send_dest = jnp.take(z, order // K, axis=0), e_flat[order] % m, dest[order]
    send = _bincount(send_dest, R)
    start = jnp.cumsum(send) - send
    j = jnp.arange(Pn) - start[send_dest]
    box = jnp.zeros((R, Pn, z.shape[-1]), z.dtype).at[send_dest, j].set(send_x)
    ebox = jnp.full((R, Pn), m, jnp.int32).at[send_dest, j].set(send_e)          # m = empty row
    rx = jax.lax.all_to_all(box, axis, 0, 0).reshape(R * Pn, -1)                 # worst-case buffer
    re = jax.lax.all_to_all(ebox, axis, 0, 0).reshape(R * Pn)
    srt = jnp.argsort(re, stable=True)
    sizes = _bincount(re, m + 1)[:m]
    y_sorted = grouped_ffn(jnp.take(rx, srt, axis=0), sizes, w1, w3, w2, act)    # over all R·S·K rows
    y_rx = jnp.zeros_like(y_sorted).at[srt].set(y_sorted).reshape(R, Pn, -1)
    back = jax.lax.all_to_all(y_rx, axis, 0, 0)                                  # [R(dest), Pn, D]
    y_send = back[send_dest, j]
    y_pairs = jnp.zeros_like(y_send).at[order].set(y_send)
    y = jnp.sum(y_pairs.reshape(S, K, -1) * w.astype(y_pairs.dtype)[..., None], axis=1)
    return y, {"fills": jnp.int32(0), "fetched_experts": jnp.int32(0), "fetch_slots": jnp.int32(0),
               "fetch_rows": jnp.int32(0), "box_rows": jnp.int32(0), "tile_rows": jnp.int32(0),
               "tiles": jnp.int32(0), "chunk_rows": jnp.int32(0),
               "recv_rows": jnp.int32(R * Pn),
               "dropped": jnp.int32(0), "overflow": jnp.int32(0)}


def capacity_local(z, idx, w, w1, w3, w2, *, act: Act, axis: str, capacity_factor: float = 1.25,
                   exchange: str = "dense"):
    """GShard capacity: ≤ C = ⌈cf·S·K/E⌉ pairs per (source, expert), overflow dropped; dense per-expert matmuls."""
    S, K = idx.shape
    R = jax.lax.axis_size(axis)
    m = w1.shape[0]
    E = m * R
    Pn = S * K
    C = max(1, math.ceil(capacity_factor * Pn / E))
    e_flat = idx.reshape(Pn).astype(jnp.int32)
    pos = rank_in_group(e_flat, E)
    keep = pos < C
    tok = jnp.arange(Pn) // K
    box = jnp.zeros((E, C, z.shape[-1]), z.dtype).at[jnp.where(keep, e_flat, E), pos].set(
        jnp.take(z, tok, axis=0), mode="drop")
    rx = jax.lax.all_to_all(box.reshape(R, m, C, -1), axis, 0, 0)                # [R(source), m, C, D]
    xs = jnp.swapaxes(rx, 0, 1).reshape(m, R * C, -1)
    hi = jax.lax.Precision.HIGHEST
    h = act(jnp.einsum("mnd,mdi->mni", xs, w1, precision=hi), jnp.einsum("mnd,mdi->mni", xs, w3, precision=hi))
    f = jnp.promote_types(z.dtype, jnp.float32)
    yo = jnp.einsum("mni,mid->mnd", h, w2, precision=hi, preferred_element_type=f)
    back = jax.lax.all_to_all(jnp.swapaxes(yo.reshape(m, R, C, -1), 0, 1), axis, 0, 0).reshape(E, C, -1)
    y_pairs = jnp.where(keep[:, None], back[jnp.minimum(e_flat, E - 1), jnp.minimum(pos, C - 1)], 0.0)
    y = jnp.sum(y_pairs.reshape(S, K, -1) * w.astype(f)[..., None], axis=1)
    return y, {"fills": jnp.int32(0), "fetched_experts": jnp.int32(0), "fetch_slots": jnp.int32(0),
               "fetch_rows": jnp.int32(0), "box_rows": jnp.int32(0), "tile_rows": jnp.int32(0),
               "tiles": jnp.int32(0), "chunk_rows": jnp.int32(0),
               "recv_rows": jnp.int32(E * C),
               "dropped": jnp.sum(~keep).astype(jnp.int32), "overflow": jnp.int32(0)}


LOCAL = {"moonep": moonep_local, "dropless": dropless_local, "capacity": capacity_local}


# -------------------------------------------------------------------------------------------------- wrapper
@dataclass(frozen=True)
class ExpertParallel:
    """How MoE layers run their routed experts over ``mesh``'s ``expert`` axis; passed to the model's call
    (``model(ids, ep=...)``), so it is part of what a jitted function was traced with. Hashable (static)."""
    mesh: jax.sharding.Mesh
    method: str = "moonep"              # "moonep" | "dropless" | "capacity"
    capacity_factor: float = 1.25
    exchange: str = "auto"              # "one_hop" | "two_hop" | "gather" | "dense" (CPU) | "ragged" | "auto"

    @property
    def active(self) -> bool:
        return "expert" in self.mesh.axis_names and self.mesh.shape["expert"] > 1

    def __call__(self, z, idx, w, w1, w3, w2, act):
        return moe_expert_parallel(z, idx, w, w1, w3, w2, act, mesh=self.mesh, method=self.method,
                                   capacity_factor=self.capacity_factor, exchange=self.exchange)

    def local_axes(self, n_tokens: int) -> tuple[str, ...]:
        """Without an expert axis: the mesh axes the tokens are split over (data-like and context, as many as
        divide ``n_tokens``); empty when there is nothing to split."""
        axes, size = [], 1
        for a in token_axes(self.mesh):
            if a != "expert" and self.mesh.shape[a] > 1 and n_tokens % (size * self.mesh.shape[a]) == 0:
                axes.append(a)
                size *= self.mesh.shape[a]
        return tuple(axes)

    def local(self, fn, z, idx, w, w1, w3, w2, act):
        """``fn`` (a dropless routed-expert function, e.g. ``moe_grouped``) on each device's own tokens, in
        ``shard_map`` over :meth:`local_axes` with the expert weights whole: the tokens' sort by expert is then a
        per-device sort. Left to the partitioner, a sort over all tokens gathers every token to every device,
        which undoes the split of a long sequence over the context axis."""
        axes = self.local_axes(z.shape[0])
        if not axes:
            return fn(z, idx, w, w1, w3, w2, act)
        t = P(axes)
        return jax.shard_map(lambda z, idx, w, w1, w3, w2: fn(z, idx, w, w1, w3, w2, act), mesh=inner_mesh(self.mesh),
                             in_specs=(t, t, t, P(), P(), P()), out_specs=t, check_vma=False)(z, idx, w, w1, w3, w2)


def token_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """Mesh axes the token dimension is split over (everything data-like, the context axis — tokens ``[B, T]``
    flatten batch-major, so time comes after the batch's axes — and the expert axis)."""
    return tuple(a for a in ("data", "fsdp", "context", "expert") if a in mesh.axis_names)


def moe_expert_parallel(z: jax.Array, idx: jax.Array, w: jax.Array, w1: jax.Array, w3: jax.Array, w2: jax.Array,
                        act: Act, *, mesh: jax.sharding.Mesh, method: str = "moonep", axis: str = "expert",
                        exchange: str = "auto", capacity_factor: float = 1.25, with_stats: bool = False):
    """Routed experts over the ``axis`` of ``mesh``: ``z [N, D]``, ``idx, w [N, K]``, ``w1, w3 [E, D, I]``,
    ``w2 [E, I, D]`` → ``y [N, D]`` fp32 (= :func:`k3jax.ops.grouped.moe_grouped` for methods without drops).
    N must split evenly over the token axes; E over ``axis``. With ``with_stats`` also per-rank stats [R·…]."""
    if method not in LOCAL:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    R = mesh.shape[axis]
    if w1.shape[0] % R:
        raise ValueError(f"{w1.shape[0]} experts do not split over the {axis!r} axis of size {R}")
    tax = token_axes(mesh)
    ntok = math.prod(mesh.shape[a] for a in tax)
    if z.shape[0] % ntok:
        raise ValueError(f"{z.shape[0]} tokens do not split over mesh axes {tax} ({ntok} shards)")
    if exchange == "auto":
        exchange = "one_hop" if jax.default_backend() == "cpu" else "ragged"
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES} or 'auto', got {exchange!r}")
    kw = {"act": act, "axis": axis, "exchange": exchange}
    if method == "capacity":
        kw["capacity_factor"] = capacity_factor
    body = partial(LOCAL[method], **kw)

    def f(z, idx, w, w1, w3, w2):
        y, st = body(z, idx, w, w1, w3, w2)
        return y, {k: v[None] for k, v in st.items()}

    tok, ex = P(tax), P(axis)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    place = (lambda x, s: jax.reshard(x, jax.NamedSharding(mesh, s))) if explicit else \
        (lambda x, s: jax.lax.with_sharding_constraint(x, jax.NamedSharding(mesh, s)))
    z, idx, w = (place(a, tok) for a in (z, idx, w))
    w1, w3, w2 = (place(a, ex) for a in (w1, w3, w2))
    out = jax.shard_map(f, mesh=inner_mesh(mesh), in_specs=(tok, tok, tok, ex, ex, ex), out_specs=(tok, P(tax)),
                        check_vma=False)(z, idx, w, w1, w3, w2)
    return out if with_stats else out[0]
