"""Chunked KDA (spec §4.3): the training/prefill fast path, mathematically identical to
:func:`k3jax.ops.kda.kda_recurrent` (its slow reference) — intra-chunk pass in 16-token tiles, unit-triangular
solve, state carried across chunks, a recomputing custom VJP, and the variants timed in ``benchmarks/kda.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.ops.kda import HIGHEST, _check, _mm
from k3jax.ops.precision import acc_dtype


SOLVES = ("blocked", "neumann", "rowscan")
SCANS = ("fused", "scan", "affine", "associative")


def inverse_unit_lower_neumann(a_strict: jax.Array) -> jax.Array:
    """``(I + A)⁻¹`` for strictly lower-triangular ``A [..., n, n]`` by Neumann doubling.

    ``A`` is nilpotent (``Aⁿ = 0``), so ``(I + A)⁻¹ = Σ_p (−A)^p = Π_{j < log₂n} (I + P^{2^j})`` with ``P = −A``:
    ``⌈log₂ n⌉ − 1`` squarings and as many products, all dense matmuls.
    """
    n = a_strict.shape[-1]
    p = -a_strict
    t = jnp.eye(n, dtype=a_strict.dtype) + p
    for _ in range(max(0, math.ceil(math.log2(n)) - 1)):
        p = _mm("...ij,...jk->...ik", p, p)
        t = t + _mm("...ij,...jk->...ik", t, p)
    return t


def solve_unit_lower(a_strict: jax.Array, rhs: jax.Array, method: str = "blocked", block: int = 16) -> jax.Array:
    """``X = (I + A)⁻¹ R`` for strictly lower-triangular ``A [..., n, n]``, ``R [..., n, m]``, batched.

    * ``blocked`` (default): the ``block × block`` diagonal blocks are inverted by Neumann doubling, then block
      forward substitution ``X_i = D_i⁻¹ (R_i − Σ_{j<i} A_ij X_j)`` — ``n/block`` steps of dense matmuls;
    * ``neumann``: the whole ``(I + A)⁻¹`` by doubling (≈ 2 log₂n n³ FLOPs), then one matmul;
    * ``rowscan``: one row per ``lax.scan`` step, ``x_r = R_r − Σ_{s<r} A_rs x_s`` (the first version; slow).
    """
    n = a_strict.shape[-1]
    if method == "neumann":
        return _mm("...ij,...jm->...im", inverse_unit_lower_neumann(a_strict), rhs)
    if method == "rowscan":
        rows_a, rows_r = jnp.moveaxis(a_strict, -2, 0), jnp.moveaxis(rhs, -2, 0)

        def body(x, inp):
            r, a_r, rhs_r = inp
            x_r = rhs_r - jnp.einsum("...s,...sm->...m", a_r, x, precision=HIGHEST)
            return jax.lax.dynamic_update_index_in_dim(x, x_r, r, axis=-2), None

        return jax.lax.scan(body, jnp.zeros_like(rhs), (jnp.arange(n), rows_a, rows_r))[0]
    if method != "blocked":
        raise ValueError(f"solve_unit_lower: method must be one of {SOLVES}, got {method!r}")
    bl = min(block, n)
    if n % bl:
        raise ValueError(f"solve_unit_lower: block={bl} must divide n={n}")
    nb = n // bl
    at = a_strict.reshape(*a_strict.shape[:-2], nb, bl, nb, bl)
    d_inv = inverse_unit_lower_neumann(jnp.stack([at[..., i, :, i, :] for i in range(nb)], axis=-3))
    xs: list[jax.Array] = []
    for i in range(nb):
        r = rhs[..., i * bl:(i + 1) * bl, :]
        if i:
            left = a_strict[..., i * bl:(i + 1) * bl, :i * bl]
            r = r - _mm("...rs,...sm->...rm", left, jnp.concatenate(xs, axis=-2))
        xs.append(_mm("...rs,...sm->...rm", d_inv[..., i, :, :], r))
    return jnp.concatenate(xs, axis=-2)


def _tril(n: int, k: int = 0) -> jax.Array:
    return jnp.tril(jnp.ones((n, n), bool), k)


def _chunk_cumsum(g: jax.Array, how: str, sub: int = 16) -> jax.Array:
    """In-chunk cumulative sum over axis −2 of ``g [..., n, K]``: ``tiled`` (cumsum inside ``sub``-row tiles plus
    the running total of the tiles before — 2.4× faster than one ``jnp.cumsum`` over 64 rows on XLA:CPU), ``native``
    (``jnp.cumsum``) or ``matmul`` (a lower-triangular ones matmul)."""
    *lead, n, K = g.shape
    if how == "matmul":
        return _mm("rs,...sk->...rk", _tril(n).astype(g.dtype), g)
    if how == "native" or n <= sub or n % sub:
        return jnp.cumsum(g, axis=-2)
    if how != "tiled":
        raise ValueError(f"cumsum: expected 'tiled', 'native' or 'matmul', got {how!r}")
    inner = jnp.cumsum(g.reshape(*lead, n // sub, sub, K), axis=-2)
    before = jnp.cumsum(inner[..., :-1, -1:, :], axis=-3)
    before = jnp.concatenate([jnp.zeros_like(inner[..., :1, -1:, :]), before], axis=-3)
    return (inner + before).reshape(*lead, n, K)


def _kda_intra(qc, kc, vc, gc, bc, reset, *, sub: int, safe_gate: bool, solve: str, cumsum: str):
    """Everything that is parallel over chunks; inputs ``[N, n, ·]`` fp32 (N = batch·heads·chunks, q already
    scaled), ``bc [N, n]``, ``reset [N, n]`` bool or None. Returns

    * ``a_qk [.., n, n]``: ``Σ_j q_r[j] k_s[j] e^{b_r[j] − b_s[j]}`` for s ≤ r (same document);
    * ``u0, w``: ``(I + A)⁻¹ diag(β) [V | K̃]`` with ``A_rs = β_r Σ_j k_r[j] k_s[j] e^{b_r[j]−b_s[j]}`` (s < r),
      ``K̃ = k ⊙ e^{b}`` (rows still reading the incoming state S₀);
    * ``q_dec = q ⊙ e^{b}``, ``k_rest = k ⊙ e^{b_n − b}``, ``decay = e^{b_n}`` ``[.., K]``.

    Decayed Gram matrices are built from ``sub × sub`` tiles with three factors, each a bounded exponential:
    ``e^{b_r − b_s} = e^{b_r − c_i} · e^{c_i − e_j} · e^{e_j − b_s}`` for r in tile i, s in tile j, where ``c_i``
    is b at tile i's first row and ``e_j`` at tile j's last. For j < i all three are ≤ 1 (the middle one may
    underflow only where the product does). For j = i the middle factor is ``e^{c_i − e_i} ≤ e^{5(sub−1)}`` with
    K3's bounded gate (g ≥ −5: e^{75} at sub = 16, finite in fp32), so diagonal tiles are dense matmuls too;
    with an unbounded gate (``safe_gate=False``) the diagonal tiles take the exact pairwise ``e^{b_r − b_s}``.
    """
    *lead, n, K = kc.shape
    nb = n // sub
    a = kc.dtype
    b = _chunk_cumsum(gc, cumsum, sub)                                          # [.., n, K]
    bt = b.reshape(*lead, nb, sub, K)
    c, e = bt[..., :1, :], bt[..., -1:, :]                                 # [.., nb, 1, K]
    row = jnp.exp(bt - c)                                                  # e^{b_r − c_i} ∈ (0, 1]
    col = jnp.exp(e - bt)                                                  # e^{e_j − b_s} ∈ (0, 1]
    tile = jnp.arange(nb)
    keep = (tile[None, :] <= tile[:, None]) if safe_gate else (tile[None, :] < tile[:, None])  # [i, j]
    mid = jnp.where(keep[..., None], c[..., :, None, 0, :] - e[..., None, :, 0, :], -jnp.inf)
    mid = jnp.exp(mid)                                                     # [.., i, j, K]
    qt, kt = qc.reshape(*lead, nb, sub, K), kc.reshape(*lead, nb, sub, K)
    x_rows = jnp.stack([qt * row, kt * row], axis=-3)                      # [.., i, 2, r, K]
    k_col = kt * col
    # tile row i only meets column tiles j ≤ i: one matmul per i over (i+1)·sub columns, the rest zero
    gram = jnp.stack([jnp.pad(jnp.moveaxis(_mm("...jsk,...xrk->...jsxr",
                                               mid[..., i, :i + 1, None, :] * k_col[..., :i + 1, :, :],
                                               x_rows[..., i, :, :, :]), (-4, -3), (-2, -1)),
                              [(0, 0)] * (len(lead) + 2) + [(0, nb - 1 - i), (0, 0)])
                      for i in range(nb)], axis=-5)                        # [.., i, 2, r, j, s]
    if not safe_gate:
        dec = jnp.exp(jnp.minimum(bt[..., :, None, :] - bt[..., None, :, :], 0.0))  # [.., i, r, s, K]
        diag = jnp.einsum("...ixrk,...isk,...irsk->...ixrs", jnp.stack([qt, kt], axis=-3), kt, dec,
                          precision=HIGHEST)
        eye_tiles = (tile[:, None] == tile[None, :])[:, None, None, :, None]  # [i, 1, 1, j, 1]
        gram = gram + jnp.where(eye_tiles, diag[..., :, :, :, None, :], 0.0)
    gram = jnp.moveaxis(gram, -4, -5).reshape(*lead, 2, n, n)
    a_qk = jnp.where(_tril(n), gram[..., 0, :, :], 0.0)
    a_kk = jnp.where(_tril(n, -1), gram[..., 1, :, :], 0.0) * bc[..., :, None]

    ec = jnp.exp(c).reshape(*lead, nb, 1, K)                               # e^{c_i}
    q_dec = (qt * row * ec).reshape(*lead, n, K)                           # q ⊙ e^{b}
    k_dec = (kt * row * ec).reshape(*lead, n, K)                           # k ⊙ e^{b}
    b_n = b[..., -1:, :]                                                   # [.., 1, K]
    k_rest = (kt * col * jnp.exp(b_n[..., None, :, :] - e)).reshape(*lead, n, K)  # k ⊙ e^{b_n − b}
    decay = jnp.exp(b_n[..., 0, :])                                        # [.., K]
    if reset is not None:
        seg = jnp.cumsum(reset.astype(jnp.int32), axis=-1)                 # document index inside the chunk
        same = seg[..., :, None] == seg[..., None, :]
        a_qk, a_kk = jnp.where(same, a_qk, 0.0), jnp.where(same, a_kk, 0.0)
        alive = (seg == 0)[..., None].astype(a)                            # rows that still see S₀
        q_dec, k_dec = q_dec * alive, k_dec * alive
        k_rest = k_rest * (seg == seg[..., -1:])[..., None].astype(a)      # the chunk's last document only
        decay = decay * alive[..., -1, :]
    rhs = bc[..., None] * jnp.concatenate([vc, k_dec], axis=-1)            # diag(β) [V | K̃]
    sol = solve_unit_lower(a_kk, rhs, solve, block=sub)
    V = vc.shape[-1]
    return a_qk, sol[..., :V], sol[..., V:], q_dec, k_rest, decay


def _chunk_states(u0, w, k_rest, decay, S0, scan: str):
    """Carry S across chunks: ``U_c = u0_c − w_c S_c``, ``S_{c+1} = e^{b_n} ⊙ S_c + k_restᵀ U_c``.

    Inputs chunk-major ``[C, G, n, ·]`` (G = batch × heads; the scan reads them in place), ``decay [C, G, K]``,
    ``S0 [G, K, V]``. Returns ``(S_c [C, G, K, V]`` the state entering each chunk, ``U [C, G, n, V]``, final
    state)``. ``scan="associative"`` instead composes the affine maps ``S ↦ M_c S + B_c``
    (``M_c = diag(e^{b_n}) − k_restᵀ w_c``) with ``lax.associative_scan``; ``scan="affine"`` precomputes
    ``M_c, B_c`` for all chunks and scans ``S ← M_c S + B_c`` (one matmul a step).
    """
    if scan in ("associative", "affine"):
        M = decay[..., :, None] * jnp.eye(decay.shape[-1], dtype=decay.dtype) - _mm("...nk,...nj->...kj", k_rest, w)
        Bc = _mm("...nk,...nv->...kv", k_rest, u0)
    if scan == "affine":  # one [K, K] @ [K, V] per chunk in the sequential part, the rest batched
        def step(S, xs):
            return _mm("gkj,gjv->gkv", xs[0], S) + xs[1], S

        S, S_in = jax.lax.scan(step, S0, (M, Bc))
        return S_in, u0 - _mm("...nk,...kv->...nv", w, S_in), S
    if scan == "associative":
        def combine(x, y):  # apply x then y
            return _mm("...ij,...jk->...ik", y[0], x[0]), _mm("...ij,...jv->...iv", y[0], x[1]) + y[1]

        Mc, Sc = jax.lax.associative_scan(combine, (M, Bc), axis=0)
        S_after = Sc + _mm("cgkj,gjv->cgkv", Mc, S0)                      # S_{c+1} for every chunk
        S_in = jnp.concatenate([S0[None], S_after[:-1]], axis=0)
        U = u0 - _mm("...nk,...kv->...nv", w, S_in)
        return S_in, U, S_after[-1]

    def body(S, xs):
        u0_c, w_c, kr_c, d_c = xs
        U = u0_c - _mm("gnk,gkv->gnv", w_c, S)
        return d_c[..., None] * S + _mm("gnk,gnv->gkv", kr_c, U), (S, U)

    S, (S_in, U) = jax.lax.scan(body, S0, (u0, w, k_rest, decay))
    return S_in, U, S


def _chunk_outputs(q_dec, a_qk, S_in, U):
    """``o_c = q_dec S_c + a_qk U_c`` for all chunks at once."""
    return _mm("...nk,...kv->...nv", q_dec, S_in) + _mm("...ns,...sv->...nv", a_qk, U)


def _blocked(fn, xs: tuple, block: int):
    """``fn(*xs)`` over the leading axis in blocks of ``block`` rows (``lax.map``; the last block zero-padded), so
    its intermediates exist for one block at a time. ``None`` entries pass through."""
    N = next(x for x in xs if x is not None).shape[0]
    if N <= block:
        return fn(*xs)
    nblk = -(-N // block)
    pad = nblk * block - N

    def split(x):
        if x is None:
            return None
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x
        return x.reshape(nblk, block, *x.shape[1:])

    out = jax.lax.map(lambda a: fn(*a), tuple(split(x) for x in xs))
    return jax.tree.map(lambda y: y.reshape(nblk * block, *y.shape[2:])[:N], out)


def _flat(x):
    return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _intra_by_head(cfg, qc, kc, vc, gc, bc, reset):
    """``_kda_intra`` over all (chunk, head) pairs as one flat batch ``[C·G, n, ·]`` (chunks and heads as batch;
    a leading size-1 batch axis also crashes XLA:CPU 0.10's backward of this graph), in blocks of
    ``cfg.block`` pairs, back to ``[C, G, ·]``."""
    C, G = qc.shape[:2]
    out = _blocked(lambda *a: _kda_intra(*a, **cfg.intra), tuple(map(_flat, (qc, kc, vc, gc, bc, reset))),
                   cfg.block)
    return tuple(x.reshape(C, G, *x.shape[1:]) for x in out)


def _intra_vjp_by_head(cfg, qc, kc, vc, gc, bc, reset, cts):
    """Cotangents of ``_intra_by_head`` w.r.t. q, k, v, g, β, block by block: each block recomputes its own
    intermediates, so the backward's peak memory is one block's, not the whole sequence's."""
    C, G = qc.shape[:2]

    def one(q, k, v, g, b, r, *ct):
        return jax.vjp(lambda *x: _kda_intra(*x, r, **cfg.intra), q, k, v, g, b)[1](ct)

    out = _blocked(one, tuple(map(_flat, (qc, kc, vc, gc, bc, reset, *cts))), cfg.block)
    return tuple(x.reshape(C, G, *x.shape[1:]) for x in out)


def _kda_core_impl(cfg, qc, kc, vc, gc, bc, reset, S0):
    a_qk, u0, w, q_dec, k_rest, decay = _intra_by_head(cfg, qc, kc, vc, gc, bc, reset)
    S_in, U, S = _chunk_states(u0, w, k_rest, decay, S0, cfg.scan)
    return _chunk_outputs(q_dec, a_qk, S_in, U), S


def _kda_core_fwd(cfg, qc, kc, vc, gc, bc, reset, S0):
    return _kda_core_impl(cfg, qc, kc, vc, gc, bc, reset, S0), (qc, kc, vc, gc, bc, reset, S0)


def _kda_core_bwd(cfg, res, cts):
    """Recompute the intra-chunk outputs (block by block) and the chunk states (one scan), carry dS back with a
    reverse scan, then take the intra-chunk VJP block by block; the only residuals kept from the forward are its
    inputs."""
    do, dS_final = cts
    # The barrier ties the recomputation to the incoming cotangent: without it XLA would CSE this pass with the
    # forward's identical one and keep every intermediate alive from the forward to here after all.
    (qc, kc, vc, gc, bc, reset, S0), do = jax.lax.optimization_barrier((res, do))
    a_qk, u0, w, q_dec, k_rest, decay = _intra_by_head(cfg, qc, kc, vc, gc, bc, reset)
    S_in, U, _ = _chunk_states(u0, w, k_rest, decay, S0, "scan")
    d_qdec = _mm("...nv,...kv->...nk", do, S_in)
    d_aqk = _mm("...nv,...sv->...ns", do, U)
    dU_out = _mm("...ns,...nv->...sv", a_qk, do)
    dS_out = _mm("...nk,...nv->...kv", q_dec, do)

    def body(dS, xs):  # dS: gradient w.r.t. the state leaving chunk c
        dU_c, dSo_c, w_c, kr_c, d_c = xs
        dU = dU_c + _mm("gnk,gkv->gnv", kr_c, dS)
        dS_in = d_c[..., None] * dS + dSo_c - _mm("gnk,gnv->gkv", w_c, dU)
        return dS_in, (dU, dS)

    dS_last = jnp.zeros_like(S0) if dS_final is None else dS_final
    dS0, (dU, dS_out_c) = jax.lax.scan(body, dS_last, (dU_out, dS_out, w, k_rest, decay), reverse=True)
    d_krest = _mm("...nv,...kv->...nk", U, dS_out_c)
    d_decay = jnp.sum(S_in * dS_out_c, axis=-1)
    d_w = -_mm("...nv,...kv->...nk", dU, S_in)
    dq, dk, dv, dg, db = _intra_vjp_by_head(cfg, qc, kc, vc, gc, bc, reset, (d_aqk, dU, d_w, d_qdec, d_krest, d_decay))
    return dq, dk, dv, dg, db, None, dS0


_kda_core = jax.custom_vjp(_kda_core_impl, nondiff_argnums=(0,))
_kda_core.defvjp(_kda_core_fwd, _kda_core_bwd)


# ------------------------------------------------------------------------------ fused: one scan over chunk blocks
# The default path reads q, k, v, g, β in their own [B, T, H, ·] layout (and dtype) one block of ``bc`` chunks at a
# time and writes o (and, backward, the gradients) back in place, so nothing sequence-sized is ever transposed,
# cast or stored between passes: intra pass, state recurrence and outputs all run on a block that fits in cache.
def _block_heads(cfg, x, i):
    """Block ``i`` (``bc`` chunks) of ``x [B, T', H, ·]`` as chunk-major ``[bc, B·H, n, ·]`` in ``cfg.dtype``."""
    B, _, H = x.shape[:3]
    x = jax.lax.dynamic_slice_in_dim(x, i * cfg.bc * cfg.n, cfg.bc * cfg.n, axis=1).astype(cfg.dtype)
    x = jnp.moveaxis(x.reshape(B, cfg.bc, cfg.n, H, *x.shape[3:]), (1, 3), (0, 2))
    return x.reshape(cfg.bc, B * H, cfg.n, *x.shape[4:])


def _block_in(cfg, xs, i):
    """Block ``i`` of the raw inputs ``q, k, v, g [B, T', H, ·]``, ``β [B, T', H]``, ``reset [B, T'] | None`` as
    the ``_kda_intra`` inputs ``[bc, B·H, n, ·]`` (q scaled)."""
    q, k, v, g, beta, reset = xs
    B, _, H = beta.shape
    r = None
    if reset is not None:
        r = jax.lax.dynamic_slice_in_dim(reset, i * cfg.bc * cfg.n, cfg.bc * cfg.n, axis=1)
        r = jnp.broadcast_to(jnp.moveaxis(r.reshape(B, cfg.bc, 1, cfg.n), 1, 0), (cfg.bc, B, H, cfg.n))
        r = r.reshape(cfg.bc, B * H, cfg.n)
    return (_block_heads(cfg, q, i) * cfg.scale, *(_block_heads(cfg, x, i) for x in (k, v, g, beta)), r)


def _block_out(x, B: int):
    """``[bc, B·H, n, ·] -> [B, bc·n, H, ·]`` (inverse of ``_block_in``'s layout change)."""
    bc, G, n = x.shape[:3]
    x = jnp.moveaxis(x.reshape(bc, B, G // B, n, *x.shape[3:]), (0, 2), (1, 3))
    return x.reshape(B, bc * n, G // B, *x.shape[4:])


def _block_intra(cfg, xs):
    """``_kda_intra`` on one block ``[bc, G, n, ·]`` of chunks (all heads), flat over (chunk, head) pairs."""
    bc, G = xs[0].shape[:2]
    out = _kda_intra(*map(_flat, xs), **cfg.intra)
    return tuple(x.reshape(bc, G, *x.shape[1:]) for x in out)


def _fused_forward(cfg, xs, S0):
    """Returns ``(o [B, T', H, V] in cfg.dtype, final S [G, K, V], S entering each block [T'/(bc·n), G, K, V])``."""
    B, Tp, H = xs[4].shape
    nblk = Tp // (cfg.bc * cfg.n)

    def step(carry, i):
        S, o = carry
        a_qk, u0, w, q_dec, k_rest, decay = _block_intra(cfg, _block_in(cfg, xs, i))
        S_start, os = S, []
        for j in range(cfg.bc):
            U = u0[j] - _mm("gnk,gkv->gnv", w[j], S)
            os.append(_mm("gnk,gkv->gnv", q_dec[j], S) + _mm("gns,gsv->gnv", a_qk[j], U))
            S = decay[j][..., None] * S + _mm("gnk,gnv->gkv", k_rest[j], U)
        o = jax.lax.dynamic_update_slice_in_dim(o, _block_out(jnp.stack(os), B), i * cfg.bc * cfg.n, axis=1)
        return (S, o), S_start

    o0 = jnp.zeros((B, Tp, H, xs[2].shape[-1]), cfg.dtype)
    (S, o), S_starts = jax.lax.scan(step, (S0, o0), jnp.arange(nblk))
    return o, S, S_starts


def _kda_fused_impl(cfg, q, k, v, g, beta, reset, S0):
    o, S, _ = _fused_forward(cfg, (q, k, v, g, beta, reset), S0)
    return o, S


def _kda_fused_fwd(cfg, q, k, v, g, beta, reset, S0):
    o, S, S_starts = _fused_forward(cfg, (q, k, v, g, beta, reset), S0)
    return (o, S), (q, k, v, g, beta, reset, S_starts)


def _kda_fused_bwd(cfg, res, cts):
    """One reverse scan over the blocks, carrying dS: each block re-reads its inputs, re-runs its intra pass under
    ``jax.vjp``, replays its states from the stored block-entry state, carries dS back through its chunks, pulls
    the cotangents back through the intra pass and writes dq, dk, dv, dg, dβ in place. Residuals: the inputs and
    one state per block."""
    do, dS_final = cts
    (q, k, v, g, beta, reset, S_starts), do = jax.lax.optimization_barrier((res, do))
    xs = (q, k, v, g, beta, reset)
    B = beta.shape[0]
    bc, L = cfg.bc, cfg.bc * cfg.n

    def step(carry, i):
        dS, grads = carry
        x_in = _block_in(cfg, xs, i)
        r = x_in[5]
        intra, pull = jax.vjp(lambda *a: _block_intra(cfg, (*a, r)), *x_in[:5])
        a_qk, u0, w, q_dec, k_rest, decay = intra
        do_b, S = _block_heads(cfg, do, i), S_starts[i]
        S_in, U = [], []
        for j in range(bc):
            S_in.append(S)
            U.append(u0[j] - _mm("gnk,gkv->gnv", w[j], S))
            S = decay[j][..., None] * S + _mm("gnk,gnv->gkv", k_rest[j], U[j])
        d = [[None] * bc for _ in range(6)]  # cotangents of a_qk, u0, w, q_dec, k_rest, decay per chunk
        for j in reversed(range(bc)):       # dS: gradient w.r.t. the state leaving chunk j
            d[3][j] = _mm("gnv,gkv->gnk", do_b[j], S_in[j])
            d[0][j] = _mm("gnv,gsv->gns", do_b[j], U[j])
            dU = _mm("gns,gnv->gsv", a_qk[j], do_b[j]) + _mm("gnk,gkv->gnv", k_rest[j], dS)
            d[4][j] = _mm("gnv,gkv->gnk", U[j], dS)
            d[5][j] = jnp.sum(S_in[j] * dS, axis=-1)
            d[1][j], d[2][j] = dU, -_mm("gnv,gkv->gnk", dU, S_in[j])
            dS = (decay[j][..., None] * dS + _mm("gnk,gnv->gkv", q_dec[j], do_b[j])
                  - _mm("gnk,gnv->gkv", w[j], dU))
        dq, dk, dv, dg, db = pull(tuple(jnp.stack(x) for x in d))
        dq = dq * cfg.scale
        grads = tuple(jax.lax.dynamic_update_slice_in_dim(buf, _block_out(x, B).astype(buf.dtype), i * L, axis=1)
                      for buf, x in zip(grads, (dq, dk, dv, dg, db)))
        return (dS, grads), None

    dS_last = jnp.zeros_like(S_starts[0]) if dS_final is None else dS_final.astype(S_starts.dtype)
    zeros = tuple(jnp.zeros(x.shape, x.dtype) for x in xs[:5])
    (dS0, grads), _ = jax.lax.scan(step, (dS_last, zeros), jnp.arange(S_starts.shape[0]), reverse=True)
    return (*grads, None, dS0)


_kda_fused = jax.custom_vjp(_kda_fused_impl, nondiff_argnums=(0,))
_kda_fused.defvjp(_kda_fused_fwd, _kda_fused_bwd)


class _Cfg:
    """Static settings of the chunked kernel (hashable, for ``nondiff_argnums``)."""

    def __init__(self, sub: int, safe_gate: bool, solve: str, cumsum: str, scan: str, block: int,
                 n: int = 0, bc: int = 0, scale: float = 1.0, dtype=jnp.float32):
        self.intra = dict(sub=sub, safe_gate=safe_gate, solve=solve, cumsum=cumsum)
        self.scan, self.block = scan, block
        # fused path: chunk size, chunks per block, q scale, internal dtype
        self.n, self.bc, self.scale, self.dtype = n, bc, scale, jnp.dtype(dtype)
        self._key = (sub, safe_gate, solve, cumsum, scan, block, n, bc, scale, self.dtype)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Cfg) and self._key == other._key


def kda_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                scale: float | None = None, initial_state: jax.Array | None = None,
                output_final_state: bool = False, chunk_size: int = 64, sub_chunk: int = 16,
                safe_gate: bool = False, reset: jax.Array | None = None, *, solve: str = "blocked",
                cumsum: str = "tiled", scan: str | None = None, recompute: bool = True,
                block: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Chunked KDA (spec §4.3), mathematically identical to :func:`kda_recurrent`; fp32 internals.

    Per chunk of n tokens with incoming state S₀ and in-chunk cumulative log decay ``b_r = Σ_{s≤r} g_s``::

        (I + A) [U₀ | W] = diag(β) [V | K̃],  A_rs = β_r Σ_j k_r[j] k_s[j] e^{b_r[j]−b_s[j]} (s < r),  K̃ = k ⊙ e^{b}
        U = U₀ − W S₀
        o_r = (q_r ⊙ e^{b_r})ᵀ S₀ + Σ_{s≤r} (Σ_j q_r[j] k_s[j] e^{b_r[j]−b_s[j]}) u_s
        S_n = Diag(e^{b_n}) S₀ + Σ_s (k_s ⊙ e^{b_n−b_s}) u_sᵀ

    ``scan=None`` picks ``"fused"`` on CPU and ``"scan"`` on accelerators (where one intra pass over every chunk at
    once keeps the device busy; measured on an H200 before the fused path existed); ``block=None`` picks 16 pairs
    for ``"fused"`` and 1024 otherwise. ``scan="fused"``: one ``lax.scan`` over blocks of chunks. Each step reads
    one block of q, k, v, g, β straight from their ``[B, T, H, ·]`` layout (no sequence-sized transpose, cast or
    intermediate), runs the intra-chunk pass for all its (chunk, head) pairs at once (16-row tiles, see
    ``_kda_intra``; the unit-triangular solve by blocked forward substitution), then carries S through the block's
    chunks with two matmuls each and writes their outputs. ``block`` is the number of (chunk, head) pairs per step
    (``max(1, block // (B·H))`` chunks). ``scan="scan"`` runs separate passes instead — the intra pass for all
    chunks (``lax.map`` in blocks of ``block`` pairs), one state scan, one batched output pass — and ``"affine"`` /
    ``"associative"`` replace its state scan (benchmarked in ``benchmarks/kda.py``). ``safe_gate=True`` asserts
    every ``g ≥ −5`` (K3's lower-bound gate) and lets the diagonal tiles factor their exponentials too (needs
    ``sub_chunk ≤ 16``); leave it False for an unbounded (softplus) gate. T need not be a multiple of ``chunk_size``
    (zero padding leaves state and outputs exact).

    ``recompute=True`` (default) differentiates with a custom VJP that keeps only the inputs (and, fused, the state
    entering each block) and recomputes the per-chunk intermediates block by block in the backward pass;
    ``False`` lets ``jax.grad`` store them. ``solve`` and ``cumsum`` (``tiled``/``native``/``matmul``) select
    variants benchmarked in ``benchmarks/kda.py``.

    ``reset [B, T]`` (bool) zeroes the state before each marked token (packed documents): pairs of tokens from
    different documents are masked out of A and of the in-chunk attention, rows after a reset do not read S₀, and
    the chunk's outgoing state keeps only its last document.
    """
    _check(q, k, v, g, beta, initial_state)
    if chunk_size % sub_chunk:
        raise ValueError(f"kda_chunked: sub_chunk={sub_chunk} must divide chunk_size={chunk_size}")
    if safe_gate and sub_chunk > 16:
        raise ValueError(f"kda_chunked: safe_gate needs sub_chunk ≤ 16 (e^{{5·(sub−1)}} must stay finite in fp32); "
                         f"got {sub_chunk}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    n = chunk_size
    scale = K ** -0.5 if scale is None else scale
    C = max(1, math.ceil(T / n))
    pad = C * n - T
    a = acc_dtype(q, k, v)

    def prep(x):  # [B, T, H, ...] -> chunk-major [C, B·H, n, ...] fp32, zero padded at the end
        x = x.astype(a)
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x.reshape(B, C, n, H, *x.shape[3:]), (1, 3), (0, 2))  # [C, B, H, n, ...]
        return x.reshape(C, B * H, n, *x.shape[4:])

    if scan is None:
        scan = "fused" if jax.default_backend() == "cpu" else "scan"
    if block is None:
        block = 16 if scan == "fused" else 1024
    if block < 1:
        raise ValueError(f"kda_chunked: block must be ≥ 1 (chunk·head pairs per intra-chunk block); got {block}")
    if scan not in SCANS:
        raise ValueError(f"kda_chunked: scan must be one of {SCANS}, got {scan!r}")
    S0 = (jnp.zeros((B, H, K, V), a) if initial_state is None else initial_state.astype(a)).reshape(B * H, K, V)
    if scan == "fused":
        bc = min(C, max(1, block // (B * H)))                               # chunks per block
        cfg = _Cfg(sub_chunk, safe_gate, solve, cumsum, scan, block, n, bc, scale, a)
        Tp = -(-C // bc) * bc * n
        padT = lambda x: x if Tp == T else jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        r = None if reset is None else padT(reset.astype(bool))
        args = (*map(padT, (q, k, v, g, beta)), r, S0)
        o, S = _kda_fused(cfg, *args) if recompute else _kda_fused_impl(cfg, *args)
        o = o[:, :T].astype(v.dtype)
        return o, (S.reshape(B, H, K, V) if output_final_state else None)
    r = None
    if reset is not None:
        r = jnp.pad(reset.astype(bool), [(0, 0), (0, pad)]).reshape(B, C, 1, n)
        r = jnp.broadcast_to(jnp.moveaxis(r, 1, 0), (C, B, H, n)).reshape(C, B * H, n)
    cfg = _Cfg(sub_chunk, safe_gate, solve, cumsum, scan, block)
    args = (prep(q) * scale, prep(k), prep(v), prep(g), prep(beta), r, S0)
    o, S = _kda_core(cfg, *args) if recompute else _kda_core_impl(cfg, *args)
    o = jnp.moveaxis(o.reshape(C, B, H, n, V), (0, 2), (1, 3))               # [B, C, n, H, V]
    o = o.reshape(B, C * n, H, V)[:, :T].astype(v.dtype)
    return o, (S.reshape(B, H, K, V) if output_final_state else None)
