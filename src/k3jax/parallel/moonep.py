"""MoonEP planning: every expert-parallel rank processes exactly S×K (token, expert) pairs.

Input ``counts [R, E]``: pairs source rank r routes to expert e (each rank holds S tokens with top-K, so every row
sums to S·K). Expert e's home is rank ``e // (E/R)``. Start from the home placement (rank d's load = the pairs of its
E/R home experts); then, while some rank is underloaded, *fill* the most underloaded rank u completely — its
deficit D taken from one overloaded donor o, out of o's home experts, largest first, so u hosts at most E/R
redundant experts — and never touch u again. The donor is the one whose excess fits D most tightly (it stays
overloaded or lands on S·K exactly); only when no donor's excess covers D does the largest donor give D and turn
underloaded itself (it is filled later, once). Each fill finishes one rank and the last rank is balanced by
conservation, so there are at most R−1 fills, each a contiguous cut of one expert's pairs.

Output ``alloc [R, E]`` int32, destination-major: how many of expert e's pairs rank d processes. An expert's pairs,
ordered by source rank then by their order on the source, are split across ranks in increasing rank order; all
downstream quantities (:func:`slots_from_alloc`, :func:`destinations`) are pure functions of ``alloc`` (and the
routing) with shapes fixed by (S, K, E, R).

:func:`plan_numpy` is the reference; :func:`plan` is the same algorithm (same tie-breaks) jit-compiled with static
shapes (a ``fori_loop`` of R−1 fills).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.grouped import argsort_ids, compact_index, count_le


class PlanError(ValueError):
    """Counts that no S×K plan can serve (shape, divisibility, negative or unequal per-rank totals)."""


class Plan(NamedTuple):
    alloc: np.ndarray | jax.Array       # [R, E] int32: pairs of expert e processed on rank d
    fills: np.ndarray | jax.Array       # [R−1, 3] int32: (donor, receiver, pairs) per fill; −1 rows unused
    n_fills: np.ndarray | jax.Array     # int32 scalar


def _check(counts: np.ndarray) -> tuple[int, int, int]:
    if counts.ndim != 2:
        raise PlanError(f"counts: expected [R, E], got shape {counts.shape}")
    R, E = counts.shape
    if E % R:
        raise PlanError(f"counts: E={E} experts must divide evenly over R={R} ranks")
    if (counts < 0).any():
        raise PlanError("counts: negative entries")
    per_rank = counts.sum(1)
    if (per_rank != per_rank[0]).any():
        raise PlanError(f"counts: every source rank must route the same S·K pairs; row sums {per_rank.tolist()}")
    return R, E, int(per_rank[0])


def plan_numpy(counts, donor: str = "tightest") -> Plan:
    """Reference planner (see the module docstring). ``donor="most_overloaded"`` always takes from the rank with
    the largest excess instead (the MoonEP reference's chain rule; benchmarks compare weight traffic with it)."""
    counts = np.asarray(counts, np.int64)
    R, E, SK = _check(counts)
    m = E // R
    L = counts.sum(0)
    alloc = np.zeros((R, E), np.int64)
    alloc[np.arange(E) // m, np.arange(E)] = L
    load = alloc.sum(1)
    filled = np.zeros(R, bool)
    fills = np.full((max(R - 1, 0), 3), -1, np.int64)
    n = 0
    for _ in range(R - 1):
        deficit = SK - load
        cand = (deficit > 0) & ~filled
        if not cand.any():
            break
        u = int(np.argmax(np.where(cand, deficit, -1)))
        D = int(deficit[u])
        excess = load - SK
        fit = (excess >= D) & (donor == "tightest")
        o = int(np.argmin(np.where(fit, excess, np.iinfo(np.int64).max))) if fit.any() else int(np.argmax(excess))
        home = np.arange(o * m, (o + 1) * m)
        rem = alloc[o, home]
        order = np.argsort(-rem, kind="stable")
        before = np.cumsum(rem[order]) - rem[order]
        take = np.clip(D - before, 0, rem[order])
        alloc[o, home[order]] -= take
        alloc[u, home[order]] += take
        load[o] -= D
        load[u] += D
        filled[u] = True
        fills[n] = (o, u, D)
        n += 1
    assert (load == SK).all()
    return Plan(alloc.astype(np.int32), fills.astype(np.int32), np.int32(n))


def plan(counts: jax.Array) -> Plan:
    """Jittable planner with static shapes; identical results to :func:`plan_numpy` for valid counts."""
    counts = jnp.asarray(counts, jnp.int32)
    R, E = counts.shape
    if E % R:
        raise PlanError(f"counts: E={E} experts must divide evenly over R={R} ranks")
    m = E // R
    L = counts.sum(0)
    SK = counts[0].sum()
    alloc = jnp.zeros((R, E), jnp.int32).at[jnp.arange(E) // m, jnp.arange(E)].set(L)
    big = jnp.iinfo(jnp.int32).max
    j = jnp.arange(m, dtype=jnp.int32)

    def fill(i, carry):
        alloc, load, filled, fills, n = carry
        deficit = SK - load
        cand = (deficit > 0) & ~filled
        active = cand.any()
        u = jnp.argmax(jnp.where(cand, deficit, -1))
        D = deficit[u]
        excess = load - SK
        fit = excess >= D
        o = jnp.where(fit.any(), jnp.argmin(jnp.where(fit, excess, big)), jnp.argmax(excess))
        rem = jax.lax.dynamic_slice_in_dim(alloc[o], o * m, m)
        # largest first, ties by id: one sort of the single key (max − rem)·m + j where it fits in int32 (XLA:CPU
        # runs an argsort's key + index payload with a comparator call per comparison; jitted planner at R=64
        # 0.21 -> 0.18 ms, R=8 0.10 -> 0.07 ms)
        top = jnp.max(rem)
        order = jax.lax.cond(top < (2 ** 31 - 1) // m - 1, lambda: jnp.sort((top - rem) * m + j) % m,
                             lambda: jnp.argsort(-rem, stable=True).astype(jnp.int32))
        r_sorted = rem[order]
        take_sorted = jnp.clip(D - (jnp.cumsum(r_sorted) - r_sorted), 0, r_sorted)
        take = jnp.zeros((m,), jnp.int32).at[order].set(take_sorted) * active
        cols = o * m + jnp.arange(m)
        alloc = alloc.at[o, cols].add(-take).at[u, cols].add(take)
        Da = D * active
        load = load.at[o].add(-Da).at[u].add(Da)
        filled = filled.at[u].set(filled[u] | active)
        fills = fills.at[i].set(jnp.where(active, jnp.stack([o, u, D]).astype(jnp.int32), -1))
        return alloc, load, filled, fills, n + active.astype(jnp.int32)

    init = (alloc, alloc.sum(1), jnp.zeros((R,), bool), jnp.full((max(R - 1, 1), 3), -1, jnp.int32), jnp.int32(0))
    alloc, _, _, fills, n = jax.lax.fori_loop(0, R - 1, fill, init)
    return Plan(alloc, fills[: R - 1], n)


# ------------------------------------------------------------------------------- pure functions of alloc
def slots_from_alloc(alloc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per rank d: ``experts [R, 2m]`` (its m home experts, then up to m redundant ones in increasing id, −1 when
    unused), ``group_sizes [R, 2m]`` (pairs per slot, for the grouped matmul) and ``fetch [R, m]`` (the redundant
    experts whose weights rank d brings from their homes, −1 when none)."""
    alloc = jnp.asarray(alloc)
    R, E = alloc.shape
    m = E // R
    d = jnp.arange(R)[:, None]
    e = jnp.arange(E)[None, :]
    is_home = (e // m) == d
    foreign = (alloc > 0) & ~is_home
    first = compact_index(foreign, m)                                     # the first m foreign experts by id
    fetch = jnp.where(first < E, first, -1).astype(jnp.int32)
    home = (jnp.arange(R)[:, None] * m + jnp.arange(m)[None, :]).astype(jnp.int32)
    experts = jnp.concatenate([home, fetch], axis=1)
    sizes = jnp.where(experts >= 0, jnp.take_along_axis(alloc, jnp.maximum(experts, 0), 1), 0)
    return experts, sizes.astype(jnp.int32), fetch


def rank_in_group(idx: jax.Array, n_groups: int) -> jax.Array:
    """For ``idx [P]`` ints in ``[0, n_groups)``: how many earlier entries carry the same value (a stable sort and
    each entry's distance from its run's start — O(P log P), no ``[P, n_groups]`` one-hot cumsum)."""
    P_ = idx.shape[0]
    order = argsort_ids(idx, n_groups)
    srt = idx[order]
    counts = jnp.zeros((n_groups,), jnp.int32).at[idx].add(1)
    start = jnp.cumsum(counts) - counts
    return jnp.zeros((P_,), jnp.int32).at[order].set(jnp.arange(P_, dtype=jnp.int32) - start[srt])


def slot_index(alloc: jax.Array) -> jax.Array:
    """``[R, E]`` int32: the slot of expert e on rank d in :func:`slots_from_alloc`'s layout — ``e mod m`` for a
    home expert, ``m + j`` for the j-th redundant one (by id), −1 where d holds no slot for e. A running count of
    the foreign experts with pairs, no sort."""
    alloc = jnp.asarray(alloc)
    R, E = alloc.shape
    m = E // R
    e = jnp.arange(E, dtype=jnp.int32)[None, :]
    is_home = (e // m) == jnp.arange(R, dtype=jnp.int32)[:, None]
    foreign = (alloc > 0) & ~is_home
    j = jnp.cumsum(foreign.astype(jnp.int32), axis=1) - 1
    return jnp.where(is_home, e % m, jnp.where(foreign & (j < m), m + j, -1)).astype(jnp.int32)


def destination_slots(alloc: jax.Array, counts: jax.Array, rank: jax.Array, idx: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For the pairs of source ``rank`` — expert ids ``idx [P]`` in their local order — the destination rank, the
    expert slot there (:func:`slot_index`) and the pair's row within that slot's group.

    A pair's position in expert e's global order is (pairs of e on lower source ranks) + (its rank among this
    source's pairs of e); expert e's positions are cut across destination ranks in increasing rank order."""
    alloc = jnp.asarray(alloc)
    local_rank = rank_in_group(idx, alloc.shape[1])
    before_src = jnp.cumsum(counts, 0) - counts                                       # [R, E] exclusive over r
    pos = before_src[rank, idx] + local_rank                                          # [P]
    cum = jnp.cumsum(alloc, 0)                                                        # inclusive over d
    dest = jnp.sum(cum[:, idx] <= pos[None, :], axis=0).astype(jnp.int32)            # [P]
    start = (cum - alloc)[dest, idx]
    return dest, slot_index(alloc)[dest, idx], (pos - start).astype(jnp.int32)


def destinations(alloc: jax.Array, counts: jax.Array, rank: jax.Array, idx: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """For the pairs of source ``rank`` (see :func:`destination_slots`): the destination rank and the row in that
    rank's S·K receive buffer, laid out in the expert-slot order of :func:`slots_from_alloc`."""
    dest, group, row = destination_slots(alloc, counts, rank, idx)
    _, sizes, _ = slots_from_alloc(alloc)
    seg_off = jnp.cumsum(sizes, 1) - sizes                                            # [R, 2m]
    return dest, (seg_off[dest, group] + row).astype(jnp.int32)


def pair_counts(counts: jax.Array, alloc: jax.Array) -> jax.Array:
    """``T [R(source), R(destination)]``: the pairs each source sends to each destination under ``alloc`` — the
    overlap of source s's run of expert e's global order with destination d's cut of it, summed over e. Every
    rank computes it from the replicated ``counts`` and plan (no exchange of the per-rank send counts)."""
    counts = jnp.asarray(counts, jnp.int32)
    alloc = jnp.asarray(alloc, jnp.int32)
    s_lo = jnp.cumsum(counts, 0) - counts                                             # [s, e]
    d_hi = jnp.cumsum(alloc, 0)                                                       # [d, e]
    lo = jnp.maximum(s_lo[:, None, :], (d_hi - alloc)[None])
    hi = jnp.minimum((s_lo + counts)[:, None, :], d_hi[None])
    return jnp.sum(jnp.maximum(hi - lo, 0), axis=-1).astype(jnp.int32)


class PairLayout(NamedTuple):
    """Where one rank's pairs go and where its slots' rows come from, under a plan (all int32).

    Each source sends its pairs for destination d as one chunk ordered by d's expert slot
    (:func:`slot_index`), then by the pairs' global order; each destination lays the rows it receives out in
    *segment order* — by slot, within a slot by source, then in the source's order — exactly S·K rows, the
    grouped matmul's input. Both sides derive their halves from the replicated ``counts`` and ``alloc``, so no
    row carries its slot or position through the exchange."""
    dest: jax.Array        # [P] as source: each pair's destination rank
    j: jax.Array           # [P] as source: its row in the chunk for that destination
    send: jax.Array        # [R] as source: rows sent to each destination (T[r, :])
    recv: jax.Array        # [R] as destination: rows received from each source (T[:, r])
    sizes: jax.Array       # [2m] as destination: rows of each slot (slots_from_alloc's order)
    src_rank: jax.Array    # [P] as destination: the source of each segment row
    src_row: jax.Array     # [P] as destination: its row in that source's chunk for this rank


def pair_layout(counts: jax.Array, alloc: jax.Array, rank: jax.Array, idx: jax.Array) -> PairLayout:
    """:class:`PairLayout` of source/destination ``rank`` whose pairs have experts ``idx [P]`` (local order).

    With ``[lo, hi)`` the range of expert e's global order that source s holds (``counts``, by source) and
    ``[lo', hi')`` the cut destination d processes (``alloc``, by destination), s sends d ``|[lo, hi) ∩ [lo',
    hi')|`` pairs of e — the same overlap :func:`pair_counts` sums."""
    counts = jnp.asarray(counts, jnp.int32)
    alloc = jnp.asarray(alloc, jnp.int32)
    R, E = counts.shape
    P_ = idx.shape[0]
    s_hi = jnp.cumsum(counts, 0)
    s_lo = s_hi - counts                                                              # [s, e]
    d_hi = jnp.cumsum(alloc, 0)
    d_lo = d_hi - alloc                                                               # [d, e]
    slot = slot_index(alloc)                                                          # [d, e]
    n_slots = 2 * (E // R)
    # as source: my overlap with every destination's cut, laid out by the destination's slots
    first = jnp.maximum(s_lo[rank][None], d_lo)                                       # [d, e]
    ov = jnp.maximum(jnp.minimum(s_hi[rank][None], d_hi) - first, 0)
    rows = jnp.arange(R)[:, None]
    ov_slot = jnp.zeros((R, n_slots + 1), jnp.int32).at[rows, jnp.where(ov > 0, slot, n_slots)].add(ov)
    chunk_off = jnp.cumsum(ov_slot, 1) - ov_slot                                      # [d, slot]
    dest, group, row = destination_slots(alloc, counts, rank, idx)                    # row: within d's group
    j = chunk_off[dest, group] + row - (first - d_lo)[dest, idx]
    # as destination: every source's overlap with my slots' cuts
    experts, sizes_all, _ = slots_from_alloc(alloc)
    mine = experts[rank]
    e = jnp.maximum(mine, 0)
    ovr = jnp.where(mine[None] >= 0, jnp.maximum(jnp.minimum(s_hi[:, e], d_hi[rank, e][None])
                                                 - jnp.maximum(s_lo[:, e], d_lo[rank, e][None]), 0), 0)   # [s, g]
    through = jnp.cumsum(ovr, 0)                                                      # [s, g] inclusive
    sizes = sizes_all[rank]
    seg_end = jnp.cumsum(sizes)
    q = jnp.arange(P_, dtype=jnp.int32)
    g = jnp.minimum(count_le(seg_end, P_), n_slots - 1)
    k = q - (seg_end - sizes)[g]
    s = jnp.minimum(jnp.sum(through[:, g] <= k[None, :], axis=0), R - 1).astype(jnp.int32)
    src_row = (jnp.cumsum(ovr, 1) - ovr)[s, g] + k - (through[s, g] - ovr[s, g])
    return PairLayout(dest, j.astype(jnp.int32), ov.sum(1).astype(jnp.int32), ovr.sum(1).astype(jnp.int32),
                      sizes, s, src_row.astype(jnp.int32))
