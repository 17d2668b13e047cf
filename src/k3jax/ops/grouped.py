"""Dropless routed-expert FFN: grouped matmul on tokens sorted by expert, and a per-token reference.

Grouped-matmul strategies (:data:`GROUPED_STRATEGIES`), the same arithmetic; ``"auto"`` (the default) takes
``"padded"`` for few large groups and ``"tiles"`` for many small ones (:func:`resolve_strategy`):

* ``"padded"``: each group's rows in a ``[G, C, D]`` box of capacity C, one batched GEMM per weight with the
  weights as they are (no per-tile weight copies). C is the smallest of :func:`padded_caps` (1.25×, 1.5× and 2× the
  mean group) that holds the largest group, chosen at run time; a batch with a larger group runs the tiles —
  dropless either way. Where the groups are small on average (M < 32·G: a MoonEP rank), a *box + tiles* layout
  joins the menu (:func:`padded_layouts`): every group's first C rows in the box, its rows past C in a static
  number of tiles, each tile multiplied by its group's gathered weight — a heavy tail of a few large groups
  (skewed routing) then costs a few large tiles instead of small tiles for every row. The cheapest layout that
  holds the sizes runs. The fallback tiles run in a scan of chunks of tiles (≤ 1 MiB of gathered weights a step):
  compiled into every step but rarely taken, their all-at-once form sized the step's temporary buffer — the 100m
  preset's routed-expert FFN (fwd+bwd, one device) 121.6 → 42.0 MiB, and when taken 93.6 → 78.8 ms; a MoonEP step
  16.3 → 14.4 MiB and 70.2 → 68.2 ms (uniform), 80.9 → 77.3 ms (zipf 1.0), side by side in one process.
  The FFN's backward is a custom VJP (:func:`grouped_ffn_backward`) whose residuals are the gate and up rows, one
  shape for every layout, so it runs the taken layout's VJP without recomputing the forward
  (:func:`grouped_matmul` keeps :func:`~k3jax.ops.switch.switch_recompute`).
  The 100m preset's routed experts (2048 rows, 16 groups, largest 210, fwd+bwd): 60 ms against 86 ms for the
  tiles (19–24 ms for a perfectly balanced dense batched GEMM); its whole training step 7.7 → 5.7 s (2 cores,
  side by side in one process).
* ``"tiles"``: the sorted rows are laid out in tiles of ``t`` rows, each group padded to whole tiles,
  so every tile belongs to one group; one batched GEMM multiplies each tile by its group's weight. The tile count
  has the static bound ``⌊(M + G·(t−1)) / t⌋`` (every group wastes at most ``t−1`` rows), so the FLOPs are
  ``(M + G·(t−1))/M`` of the exact grouped product at worst; :func:`choose_tile` picks ``t`` from ``M``, ``G`` and
  the weight size. Plain autodiff (gathers and a batched ``dot_general``).
* ``"ragged"``: ``jax.lax.ragged_dot``. XLA:CPU (0.10) lowers it to a dense product of every row with every group's
  weight under a mask (visible in its compiled HLO) — G× the FLOPs (16× for the 100m preset, 224× for a MoonEP
  rank of K3); ``benchmarks.step_profile --grouped ragged`` times it in the step. Kept for accelerators with a
  native grouped GEMM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype, copy_transposed_for_grad, transposed_copy
from k3jax.ops.switch import switch_recompute

HIGHEST = jax.lax.Precision.HIGHEST
Act = Callable[[jax.Array, jax.Array], jax.Array]


def moe_grouped(x: jax.Array, idx: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, act: Act, strategy: str | None = None) -> jax.Array:
    """``y_t = Σ_j w_{tj} · E_{idx_{tj}}(x_t)``, ``E_e(x) = act(x W1_e, x W3_e) W2_e``; no capacity, no drop.

    ``x [N, D]``, ``idx, weights [N, k]``, ``w_gate, w_up [E, D, I]``, ``w_down [E, I, D]``. The N·k (token, expert)
    pairs are sorted by expert and pushed through :func:`grouped_ffn` with per-expert group sizes (``strategy``:
    one of :data:`GROUPED_STRATEGIES`, default :data:`DEFAULT_STRATEGY`); the combine is in fp32. Returns
    ``[N, D]`` fp32.
    """
    N, k = idx.shape
    E = w_gate.shape[0]
    flat = idx.reshape(-1)
    order = argsort_ids(flat, E)
    tok = order // k                                                       # source token of each sorted pair
    xs = jnp.take(x, tok, axis=0)                                          # [N·k, D]
    sizes = jnp.zeros((E,), jnp.int32).at[flat].add(1)
    f = acc_dtype(x)
    out = grouped_ffn(xs, sizes, w_gate, w_up, w_down, act, strategy=strategy)
    wsorted = jnp.take(weights.reshape(-1), order).astype(f)
    return jnp.zeros((N, x.shape[-1]), f).at[tok].add(out.astype(f) * wsorted[:, None])


GROUPED_STRATEGIES = ("auto", "padded", "tiles", "ragged")
DEFAULT_STRATEGY = "auto"


def padded_caps(M: int, G: int) -> tuple[int, ...]:
    """The per-group capacities the ``"padded"`` strategy compiles for ``M`` rows in ``G`` groups: 1.25×, 1.5× and
    2× the mean group (rounded up to 8 rows), below ``M``; a batch whose largest group exceeds them all runs the
    tiles instead (any sizes, bounded padding). The 1.5× rung: the 100m preset's routers at initialisation put
    1.23–1.65× the mean in the largest group, and with it 7 of 11 layers ran a box of 192 rows, not 256 (forward
    647 → 625 ms, its gradient 2.40 → 2.30 s, medians of 6 interleaved rounds in one process; +2 s compile)."""
    caps = []
    for f in (1.25, 1.5, 2.0):
        c = 8 * math.ceil(math.ceil(f * M / G) / 8)
        if c < M and c not in caps:
            caps.append(c)
    return tuple(caps)


class Layout(NamedTuple):
    """A static block layout of ``M`` rows sorted into ``G`` groups: each group's first ``box`` rows in a
    ``[G, box]`` padded box (0: no box), the rows past them in ``tiles`` tiles of ``tile`` rows, every tile rows of
    one group (0: no tiles). Holds the sizes if every group fits the box, or its rows past the box fill at most
    ``tiles`` whole tiles (:func:`layout_fits`). ``chunk`` > 0 (the tiles alone): the FFN runs the tiles in a scan,
    ``chunk`` tiles a step, so only one chunk's gathered weights are live at a time."""
    box: int
    tile: int
    tiles: int
    chunk: int = 0

    def rows(self, G: int) -> int:
        return G * self.box + self.tiles * self.tile


# a tile's weight gather in rows' worth of GEMM work (choose_tile's model: the weight tile's copy from cache plus
# ~8 rows of call overhead), for ordering the layouts by cost
TILE_COST_ROWS = 24


def padded_layouts(M: int, G: int, tile: int) -> tuple[Layout, ...]:
    """The ``"padded"`` strategy's layouts for ``M`` rows in ``G`` groups, cheapest first (rows of GEMM plus
    :data:`TILE_COST_ROWS` per gathered weight tile): the boxes of :func:`padded_caps`; where the groups average
    under 32 rows, a box + tiles layout — the mean group's box with up to every row past it in tiles of twice the
    mean (a heavy tail of a few large groups: skewed routing); last, the tiles of ``tile`` rows, which hold any
    sizes. At a MoonEP rank of ``benchmarks.moonep`` (M = 2048, G = 126): boxes 24/32/40, box 16 + 64 tiles of 32,
    tiles of 16. (A second one, the first rung's box + 1/8 of the rows in tiles of the mean, measured slower than
    the next box on uniform routing, 67.0 vs 60.5 ms a MoonEP step: the tiles' weight gathers and gradient
    scatter cost more than the box rows they save.)"""
    caps = padded_caps(M, G)
    out = [Layout(c, 0, 0) for c in caps]
    if caps and M < 32 * G:
        mean = 8 * max(1, round(M / G / 8))
        out.append(Layout(mean, 2 * mean, max(1, math.ceil(M / (2 * mean)))))
    key = lambda L: L.rows(G) + L.tiles * TILE_COST_ROWS  # noqa: E731
    out = sorted(set(out), key=lambda L: (key(L), L))
    return (*out, Layout(0, tile, tile_count(M, G, tile)))


def layout_fits(sizes: jax.Array, layout: Layout) -> jax.Array:
    """Whether ``layout`` holds groups of ``sizes [G]``: every group within the box, or the rows past the box
    filling at most ``layout.tiles`` whole tiles."""
    sizes = sizes.astype(jnp.int32)
    if layout.tiles == 0:
        return jnp.max(sizes) <= layout.box
    return jnp.sum((jnp.maximum(sizes - layout.box, 0) + layout.tile - 1) // layout.tile) <= layout.tiles


def layout_index(sizes: jax.Array, layouts: tuple[Layout, ...]) -> jax.Array:
    """The first of ``layouts`` that holds ``sizes`` (the last, the tiles, holds any)."""
    if len(layouts) == 1:
        return jnp.int32(0)
    fits = jnp.stack([layout_fits(sizes, L) for L in layouts[:-1]] + [jnp.bool_(True)])
    return jnp.argmax(fits).astype(jnp.int32)


def resolve_strategy(strategy: str | None, M: int, G: int) -> str:
    """``"auto"`` (the default) → ``"padded"`` when the groups average ≥ 32 rows (few large experts: the 100m
    preset's 2048 rows in 16 groups), else ``"tiles"`` (many small groups: a MoonEP rank's 224, a decode step)."""
    strategy = _check_strategy(strategy)
    if strategy == "auto":
        return "padded" if M >= 32 * G and padded_caps(M, G) else "tiles"
    return strategy


def choose_tile(M: int, G: int, D: int, I: int) -> int:
    """Tile rows ``t`` for ``M`` sorted rows in ``G`` groups through ``[D, I]`` weights: the power of two in
    1…512 minimising ``rows·(2·D·I) + tiles·(per-tile cost)``, with the per-tile cost the weight tile's copy
    (``4·D·I`` bytes at ~8 FLOP/byte: a tile's weight is re-read from cache, not memory) plus a fixed ~8 rows of
    call overhead — 24 rows' worth a tile. Many small groups get small tiles (little padding), few large groups
    large ones (few weight copies). Fitted on the 2-core CPU (``benchmarks.step_profile`` and
    ``benchmarks.moonep`` time the two regimes): 100m's (M=2048, G=16, D=256, 3I=1536) → 64, a MoonEP rank's
    (M=2048, G=224, D=64, 3I=96) → 16, each within noise of the fastest forward+backward of 8…256. A decode
    step's few rows (M ≤ G) get ``t = 1``: one gathered weight per row, no padding."""
    best, best_cost = 1, None
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        if t > max(1, M):
            break
        nt = tile_count(M, G, t)
        cost = nt * t * 2 * D * I + nt * (4 * D * I * 8 + 8 * 2 * D * I)
        if best_cost is None or cost < best_cost:
            best, best_cost = t, cost
    return best


def tile_count(M: int, G: int, t: int) -> int:
    """The static bound on tiles of ``t`` rows for ``M`` rows in ``G`` groups, each padded to whole tiles."""
    return max(1, (M + G * (t - 1)) // t)


def argsort_ids(ids: jax.Array, n_ids: int) -> jax.Array:
    """``jnp.argsort(ids, stable=True)`` for ints ``ids [P]`` in ``[0, n_ids)``, as one sort of the single key
    ``ids·P + position`` (unique, so the order is the stable one). XLA:CPU sorts one operand under a plain
    comparison on a fast path, while an argsort (key + index payload) calls the compiled comparator for every
    comparison: 1.30 vs 0.35 ms for P = 2048 on each of 8 host devices (2-core CPU). Falls back to the argsort
    when ``n_ids·P`` does not fit in int32."""
    P_ = ids.shape[0]
    if n_ids * P_ >= 2 ** 31:
        return jnp.argsort(ids, stable=True).astype(jnp.int32)
    key = ids.astype(jnp.int32) * P_ + jnp.arange(P_, dtype=jnp.int32)
    return jnp.sort(key) % P_


def compact_index(mask: jax.Array, n: int) -> jax.Array:
    """The positions of the first ``n`` True entries of ``mask [L]`` or ``[B, L]`` along its last axis, in order,
    padded with ``L`` (= ``argsort(~mask, stable=True)[..., :n]`` where the mask has ≥ n True entries): a running count
    and a scatter, no sort."""
    L = mask.shape[-1]
    pos = jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1
    tgt = jnp.where(mask & (pos < n), pos, n)
    lead = mask.shape[:-1]
    out = jnp.full((*lead, n + 1), L, jnp.int32)
    src = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), mask.shape)
    if not lead:
        return out.at[tgt].set(src)[:n]
    rows = jnp.broadcast_to(jnp.arange(mask.shape[0], dtype=jnp.int32)[:, None], mask.shape)
    return out.at[rows, tgt].set(src)[:, :n]


def count_le(ends: jax.Array, n: int) -> jax.Array:
    """``[#{g : ends_g ≤ i} for i < n]`` for non-decreasing ``ends`` (``searchsorted(ends, arange(n), "right")``)
    in O(n + G): a histogram of the ends and its running sum (XLA:CPU's searchsorted is a sequential loop)."""
    marks = jnp.zeros((n + 1,), jnp.int32).at[jnp.minimum(ends, n)].add(1)
    return jnp.cumsum(marks)[:n]


def grouped_matmul(xs: jax.Array, w: jax.Array, sizes: jax.Array, *, strategy: str | None = None,
                   tile: int | None = None, preferred_element_type=None) -> jax.Array:
    """``y_r = x_r W_{g(r)}`` for rows ``xs [M, D]`` sorted into consecutive groups of ``sizes [G]`` (Σ ≤ M; rows
    past the groups give 0), ``w [G, D, I]`` → ``[M, I]`` (what ``jax.lax.ragged_dot`` computes). ``strategy``:
    one of :data:`GROUPED_STRATEGIES`; ``tile``: the tile rows of ``"tiles"`` (default :func:`choose_tile`)."""
    out_dtype = preferred_element_type or jnp.result_type(xs.dtype, w.dtype)
    M, D = xs.shape
    G, _, I = w.shape
    strategy = resolve_strategy(strategy, M, G)
    if strategy == "ragged":
        return jax.lax.ragged_dot(xs, w, sizes, precision=HIGHEST, preferred_element_type=out_dtype)

    t = tile or choose_tile(M, G, D, I)

    def layout(L: Layout):
        def run(sizes, xs, w):
            lay = _Blocks(sizes, M, G, L)
            return lay.unblock(lay.matmul(lay.blocks(xs), (w,), "gcd,gdi->gci", out_dtype))
        return run

    if strategy == "tiles":
        return layout(Layout(0, t, tile_count(M, G, t)))(sizes, xs, w)
    # the first padded layout that holds the sizes, chosen at run time; the backward runs the taken branch's VJP
    # only (lax.switch's own VJP would carry every branch's residuals)
    layouts = padded_layouts(M, G, t)
    branches = [lambda ints, ops, f=layout(L): (f(*ints, *ops), jnp.int32(0)) for L in layouts]
    return switch_recompute(layout_index(sizes, layouts), branches, (sizes,), (xs, w))[0]


def _check_strategy(strategy: str | None) -> str:
    strategy = DEFAULT_STRATEGY if strategy is None else strategy
    if strategy not in GROUPED_STRATEGIES:
        raise ValueError(f"grouped matmul: strategy must be one of {GROUPED_STRATEGIES}, got {strategy!r}")
    return strategy


def grouped_ffn(xs: jax.Array, sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                act: Act, *, strategy: str | None = None, tile: int | None = None) -> jax.Array:
    """Rows ``xs [M, D]`` sorted into consecutive groups of ``sizes [G]`` (Σ ≤ M; rows past the groups give 0),
    group g through expert g: ``act(x W1_g, x W3_g) W2_g`` → ``[M, D]`` in ``promote(dtype, f32)``. Each weight
    is ``[G, ...]`` or a tuple of parts stacked along the expert axis (not copied into one array by the box).

    Every layout (:class:`Layout`) lays the rows out once and runs all three products and the activation in it
    (padding rows are zeros and are never read back)."""
    f = acc_dtype(xs)
    M, D = xs.shape
    G = sum(w.shape[0] for w in _parts(w_gate))
    I = _parts(w_gate)[0].shape[-1]
    strategy = resolve_strategy(strategy, M, G)
    if strategy == "ragged":
        w_gate, w_up, w_down = (jnp.concatenate(_parts(w), 0) for w in (w_gate, w_up, w_down))
        h = act(jax.lax.ragged_dot(xs, w_gate, sizes, precision=HIGHEST),
                jax.lax.ragged_dot(xs, w_up, sizes, precision=HIGHEST))
        return jax.lax.ragged_dot(h, w_down, sizes, precision=HIGHEST, preferred_element_type=f)
    return _grouped_ffn(xs, sizes, w_gate, w_up, w_down, act, ffn_layouts(strategy, M, G, D, I, tile))


def ffn_layouts(strategy: str, M: int, G: int, D: int, I: int, tile: int | None = None) -> tuple[Layout, ...]:
    """The layouts :func:`grouped_ffn` chooses among for ``M`` rows in ``G`` groups through ``[D, I]`` experts under
    a resolved ``strategy`` (``"padded"``: :func:`padded_layouts`; ``"tiles"``: the tiles alone)."""
    t = tile or choose_tile(M, G, D, 3 * I)
    if strategy != "padded":
        return (Layout(0, t, tile_count(M, G, t)),)
    *first, tiles = padded_layouts(M, G, t)
    # the fallback, rarely taken, in a scan of chunks whose three gathered weights take ≤ 1 MiB (fp32): compiled
    # into every step, its all-at-once form sized the step's temporary buffer (MoonEP rank: 3 × [246, 64, 32]
    # weights and as many gradients; the 100m preset: 3 × [47, 256, 512])
    return (*first, tiles._replace(chunk=max(1, min(tiles.tiles, (1 << 20) // (12 * D * I)))))


def _ein(a: jax.Array, b: jax.Array, spec: str, out) -> jax.Array:
    """``einsum(spec, a, b)`` in ``a``'s dtype, accumulated in :func:`acc_dtype` and rounded to ``out``. A product
    asked for in bf16 is one XLA:CPU runs by converting its operands to fp32 (the fp32 rate); bf16 operands into
    an fp32 result run on the matrix unit (AMX), so the rounding to bf16 comes after."""
    return jnp.einsum(spec, a, b.astype(a.dtype), precision=HIGHEST, preferred_element_type=acc_dtype(a)).astype(out)


def _wgrad(a: jax.Array, b: jax.Array, out) -> jax.Array:
    """A weight gradient over blocks of rows: ``Σ_c a[g, c, x] b[g, c, y]`` → ``[g, x, y]``; with bf16 operands on
    XLA:CPU through :func:`~k3jax.ops.precision.transposed_copy` of ``a``, so the product contracts ``a``'s last axis
    and runs on the matrix unit."""
    if copy_transposed_for_grad(a):
        return _ein(transposed_copy(a), b, "gxc,gcy->gxy", out)
    return _ein(a, b, "gcx,gcy->gxy", out)


def _parts(w) -> tuple[jax.Array, ...]:
    """Expert weights given whole (``[G, ...]``) or as parts stacked along the expert axis (a tuple)."""
    return tuple(w) if isinstance(w, (tuple, list)) else (w,)


def _each(f, *xs):
    """``f`` over the parts of block tuples ``(box, tiles)`` (None where the layout has no such part)."""
    return tuple(None if z[0] is None else f(*z) for z in zip(*xs))


class _Blocks:
    """The grouped rows laid out as blocks of equal rows, each block through one expert, by a :class:`Layout`:
    the padded box ``[G, box]`` (block g = group g's first rows) and/or tiles of ``tile`` rows (tile n = rows of
    group ``group[n]``). Block data are tuples ``(box [G, box, ·] | None, tiles [n, tile, ·] | None)``. ``src``
    gives the row at each block position (M = empty), ``dest`` each row's block position. Weights come as parts
    along the expert axis (e.g. a MoonEP rank's home experts and its fetched ones): the box multiplies each part's
    blocks by it as it is, so the experts' weights are never copied into one array; the tiles gather per-tile
    weights from the parts."""

    def __init__(self, sizes: jax.Array, M: int, G: int, layout: Layout):
        self.G, self.L = G, layout
        C, t, n = layout.box, layout.tile, layout.tiles
        sizes = sizes.astype(jnp.int32)
        end = jnp.cumsum(sizes)
        start = end - sizes
        r = jnp.arange(M, dtype=jnp.int32)
        g = jnp.minimum(count_le(end, M), G - 1)                          # each row's group
        k = r - start[g]                                                  # its place in the group
        nb = layout.rows(G)
        if n:
            over = (jnp.maximum(sizes - C, 0) + t - 1) // t               # each group's tiles
            tile_end = jnp.cumsum(over)
            pos = jnp.where(k < C, g * C + k, G * C + (tile_end - over)[g] * t + k - C)
            self.group = jnp.minimum(count_le(tile_end, n), G - 1).astype(jnp.int32)
        else:
            pos, self.group = g * C + k, None
        self.dest = jnp.where(r < end[-1], pos, nb).astype(jnp.int32)
        self.src = jnp.full((nb,), M, jnp.int32).at[self.dest].set(r, mode="drop")

    def blocks(self, x: jax.Array) -> tuple:
        C, t, n = self.L.box, self.L.tile, self.L.tiles
        xb = jnp.take(x, self.src, axis=0, mode="fill", fill_value=0)
        box = xb[:self.G * C].reshape(self.G, C, x.shape[-1]) if C else None
        return box, (xb[self.G * C:].reshape(n, t, x.shape[-1]) if n else None)

    def unblock(self, yb: tuple) -> jax.Array:
        flat = [y.reshape(-1, y.shape[-1]) for y in yb if y is not None]
        y = flat[0] if len(flat) == 1 else jnp.concatenate(flat, 0)
        return jnp.take(y, self.dest, axis=0, mode="fill", fill_value=0)

    def _spans(self, parts):
        g0 = 0
        for w in parts:
            yield g0, g0 + w.shape[0], w
            g0 += w.shape[0]

    def _tile_weights(self, parts: tuple, group: jax.Array | None = None) -> jax.Array:
        """Each tile's expert weight ``[n, ...]`` (tiles of ``group``, default all), gathered from the part that
        holds its group."""
        group = self.group if group is None else group
        out = None
        for g0, g1, w in self._spans(parts):
            wt = jnp.take(w, jnp.clip(group - g0, 0, g1 - g0 - 1), axis=0)
            if out is None:
                out = wt
            else:
                inside = ((group >= g0) & (group < g1)).reshape(-1, *([1] * (w.ndim - 1)))
                out = jnp.where(inside, wt, out)
        return out

    def _chunks(self, v: jax.Array) -> jax.Array:
        """``[n, ...]`` → ``[n/chunk, chunk, ...]`` (zero-padded; padding tiles have group 0 and zero rows)."""
        n, B = v.shape[0], self.L.chunk
        nc = -(-n // B)
        v = jnp.pad(v, [(0, nc * B - n)] + [(0, 0)] * (v.ndim - 1))
        return v.reshape(nc, B, *v.shape[1:])

    def _unchunk(self, v: jax.Array) -> jax.Array:
        return v.reshape(-1, *v.shape[2:])[:self.L.tiles]

    def ffn_scan(self, xt: jax.Array, ws: tuple, act: Act, dt, f) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The FFN over the tiles ``xt [n, t, D]`` in a scan of ``chunk`` tiles a step, each step gathering only
        its tiles' weights (``ws``: the three weights' parts): ``(y, a, b)`` in tiles (output, gate, up)."""
        def step(_, inp):
            x, g = inp
            Wg, Wu, Wd = (self._tile_weights(parts, g) for parts in ws)
            a, b = _ein(x, Wg, "gcd,gdi->gci", dt), _ein(x, Wu, "gcd,gdi->gci", dt)
            return None, (_ein(act(a, b), Wd, "gci,gid->gcd", f), a, b)

        _, out = jax.lax.scan(step, None, (self._chunks(xt), self._chunks(self.group)))
        return tuple(self._unchunk(v) for v in out)

    def ffn_scan_vjp(self, xt, at, bt, dyt, ws: tuple, act: Act, dt, f) -> tuple:
        """The VJP of :meth:`ffn_scan` from its gate/up tiles ``at, bt`` and the output's cotangent ``dyt``:
        ``(dx tiles, per-part gradients of each of the three weights)``; weight gradients are summed per group in the
        scan's carry."""
        def step(acc, inp):
            x, a, b, dy, g = inp
            Wg, Wu, Wd = (self._tile_weights(parts, g) for parts in ws)
            h, act_vjp = jax.vjp(act, a, b)
            da, db = act_vjp(_ein(dy, Wd, "gcd,gid->gci", dt))
            dx = _ein(da, Wg, "gci,gdi->gcd", f) + _ein(db, Wu, "gci,gdi->gcd", f)
            d = (_wgrad(x, da, f), _wgrad(x, db, f), _wgrad(h, dy, f))
            return tuple(A.at[g].add(v) for A, v in zip(acc, d)), dx

        acc0 = tuple(jnp.zeros((self.G, *parts[0].shape[1:]), f) for parts in ws)
        acc, dx = jax.lax.scan(step, acc0, tuple(self._chunks(v) for v in (xt, at, bt, dyt, self.group)))
        grads = tuple(tuple(A[g0:g1] for g0, g1, _ in self._spans(parts)) for A, parts in zip(acc, ws))
        return self._unchunk(dx), grads

    def matmul(self, xb: tuple, parts: tuple, spec: str, out) -> tuple:
        """Each block through its expert's weight (``spec`` over block, rows and the weight's two axes)."""
        box, tiles = xb
        if box is not None:
            ys = [_ein(box[g0:g1], w, spec, out) for g0, g1, w in self._spans(parts)]
            box = ys[0] if len(ys) == 1 else jnp.concatenate(ys, 0)
        if tiles is not None:
            tiles = _ein(tiles, self._tile_weights(parts), spec, out)
        return box, tiles

    def weight_grad(self, a: tuple, b: tuple, parts: tuple, out) -> tuple[jax.Array, ...]:
        """Per-part expert weight gradients ``Σ_rows a ⊗ b`` (:func:`_wgrad`) from block operands ``a, b``. The tiles'
        gradients are scatter-added into the box's gradient of their part (in place): summing them into a
        zero-filled ``[G, ...]`` first and adding that cost two more passes over the weights' size per weight."""
        dw_tiles = _wgrad(a[1], b[1], out) if a[1] is not None else None
        grads = []
        for g0, g1, w in self._spans(parts):
            if a[0] is not None:
                d = _wgrad(a[0][g0:g1], b[0][g0:g1], out)
            else:
                d = jnp.zeros((g1 - g0, *dw_tiles.shape[1:]), dw_tiles.dtype)
            if dw_tiles is not None:
                inside = (self.group >= g0) & (self.group < g1)
                d = d.at[jnp.where(inside, self.group - g0, g1 - g0)].add(dw_tiles, mode="drop")
            grads.append(d)
        return tuple(grads)


def grouped_ffn_forward(xs: jax.Array, sizes: jax.Array, w_gate, w_up, w_down, act: Act,
                        layouts: tuple[Layout, ...], residuals: bool = True) -> tuple[jax.Array, tuple | None]:
    """:func:`grouped_ffn`'s forward in the first of ``layouts`` that holds the sizes (:func:`layout_index`),
    chosen at run time; returns ``(y [M, D], residuals)`` for :func:`grouped_ffn_backward`. The residuals are the
    gate and up products in row order (``[M, I]`` each, the same shape for every layout), so the backward re-lays
    them out instead of recomputing three products; ``residuals=False`` (a forward that is not differentiated)
    skips them. Weights: arrays ``[G, ...]`` or tuples of parts along the expert axis."""
    M, _ = xs.shape
    wg, wu, wd = _parts(w_gate), _parts(w_up), _parts(w_down)
    G = sum(w.shape[0] for w in wg)
    dt, f = jnp.result_type(xs.dtype, wg[0].dtype), acc_dtype(xs)
    index = layout_index(sizes, layouts)

    def branch(layout):
        def run(sizes, xs, wg, wu, wd):
            lay = _Blocks(sizes, M, G, layout)
            xb = lay.blocks(xs.astype(dt))
            if layout.chunk:
                y, a, b = (lay.unblock((None, v)) for v in lay.ffn_scan(xb[1], (wg, wu, wd), act, dt, f))
                return (y, a, b) if residuals else y
            a, b = lay.matmul(xb, wg, "gcd,gdi->gci", dt), lay.matmul(xb, wu, "gcd,gdi->gci", dt)
            y = lay.matmul(_each(act, a, b), wd, "gci,gid->gcd", f)
            return (lay.unblock(y), lay.unblock(a), lay.unblock(b)) if residuals else lay.unblock(y)
        return run

    out = jax.lax.switch(index, [branch(L) for L in layouts], sizes, xs, wg, wu, wd)
    if not residuals:                   # a forward only (inference): no residual rows to lay out
        return out, None
    y, a, b = out
    return y, (index, a, b)


def grouped_ffn_backward(xs: jax.Array, sizes: jax.Array, w_gate, w_up, w_down, act: Act,
                         layouts: tuple[Layout, ...], res: tuple, ct: jax.Array) -> tuple:
    """The VJP of :func:`grouped_ffn_forward` for the cotangent ``ct [M, D]`` of ``y``: ``(dxs, dw_gate, dw_up,
    dw_down)`` in the layout the forward ran, each weight's gradient shaped as it was given (array or parts)."""
    M, _ = xs.shape
    wg, wu, wd = _parts(w_gate), _parts(w_up), _parts(w_down)
    G = sum(w.shape[0] for w in wg)
    dt, f = jnp.result_type(xs.dtype, wg[0].dtype), acc_dtype(xs)
    index, a_rows, b_rows = res

    def branch(layout):
        def run(sizes, xs, wg, wu, wd, a_rows, b_rows, ct):
            lay = _Blocks(sizes, M, G, layout)
            xb, dy = lay.blocks(xs.astype(dt)), _each(lambda v: v.astype(dt), lay.blocks(ct))
            if layout.chunk:
                dxt, grads = lay.ffn_scan_vjp(xb[1], lay.blocks(a_rows)[1], lay.blocks(b_rows)[1], dy[1],
                                              (wg, wu, wd), act, dt, f)
                return (lay.unblock((None, dxt)), *grads)
            h, act_vjp = jax.vjp(lambda a, b: _each(act, a, b), lay.blocks(a_rows), lay.blocks(b_rows))
            da, db = act_vjp(lay.matmul(dy, wd, "gcd,gid->gci", dt))
            dxb = _each(jnp.add, lay.matmul(da, wg, "gci,gdi->gcd", f), lay.matmul(db, wu, "gci,gdi->gcd", f))
            return (lay.unblock(dxb), lay.weight_grad(xb, da, wg, f), lay.weight_grad(xb, db, wu, f),
                    lay.weight_grad(h, dy, wd, f))
        return run

    dxs, dwg, dwu, dwd = jax.lax.switch(index, [branch(L) for L in layouts], sizes, xs, wg, wu, wd,
                                        a_rows, b_rows, ct)
    cast = lambda gs, ws, orig: (tuple(g.astype(w.dtype) for g, w in zip(gs, ws))  # noqa: E731
                                 if isinstance(orig, (tuple, list)) else gs[0].astype(ws[0].dtype))
    return dxs.astype(xs.dtype), cast(dwg, wg, w_gate), cast(dwu, wu, w_up), cast(dwd, wd, w_down)


def _grouped_ffn(xs, sizes, w_gate, w_up, w_down, act: Act, layouts: tuple[Layout, ...]) -> jax.Array:
    """:func:`grouped_ffn_forward` with :func:`grouped_ffn_backward` as its VJP."""

    @jax.custom_vjp
    def run(sizes, xs, wg, wu, wd):
        return grouped_ffn_forward(xs, sizes, wg, wu, wd, act, layouts, residuals=False)[0]

    def run_fwd(sizes, xs, wg, wu, wd):
        y, res = grouped_ffn_forward(xs, sizes, wg, wu, wd, act, layouts)
        return y, (sizes, xs, wg, wu, wd, res)

    def run_bwd(saved, ct):
        sizes, xs, wg, wu, wd, res = saved
        return (None, *grouped_ffn_backward(xs, sizes, wg, wu, wd, act, layouts, res, ct))

    run.defvjp(run_fwd, run_bwd)
    return run(sizes, xs, w_gate, w_up, w_down)


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
