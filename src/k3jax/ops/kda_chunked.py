"""Chunked KDA (spec §4.3): the training/prefill fast path, mathematically identical to
:func:`k3jax.ops.kda.kda_recurrent` (its slow reference) — intra-chunk pass in 16-token tiles, unit-triangular
inverse, state carried across chunks, a recomputing custom VJP with a hand-written backward of the intra-chunk
pass. Two implementations share it, registered in :data:`KDA_CHUNKED_IMPLS`: ``"fused"`` (one scan over blocks of
chunks; the CPU default) and ``"scan"`` (separate passes; the accelerator default). The variants timed against
them are in ``benchmarks/kda_variants.py``; they swap the stages :class:`_Cfg` names.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.ops.kda import HIGHEST, _check, _mm
from k3jax.ops.precision import acc_dtype
from k3jax.ops.unit_lower import tri_matmul, unit_lower_inverse


def _tril(n: int, k: int = 0) -> jax.Array:
    return jnp.tril(jnp.ones((n, n), bool), k)


def _chunk_cumsum(g: jax.Array, sub: int = 16) -> jax.Array:
    """In-chunk cumulative sum over axis −2 of ``g [..., n, K]``: cumsum inside ``sub``-row tiles plus the running
    total of the tiles before (one ``jnp.cumsum`` when the chunk is a single tile or ``sub`` does not divide it)."""
    *lead, n, K = g.shape
    if n <= sub or n % sub:
        return jnp.cumsum(g, axis=-2)
    inner = jnp.cumsum(g.reshape(*lead, n // sub, sub, K), axis=-2)
    before = jnp.cumsum(inner[..., :-1, -1:, :], axis=-3)
    before = jnp.concatenate([jnp.zeros_like(inner[..., :1, -1:, :]), before], axis=-3)
    return (inner + before).reshape(*lead, n, K)


def _diag_decay(bt: jax.Array) -> jax.Array:
    """Exact in-tile decays ``e^{min(b_r − b_s, 0)}`` ``[P, nb, t, t, K]`` (the unbounded-gate diagonal tiles;
    entries above the diagonal are masked out by the callers)."""
    return jnp.exp(jnp.minimum(bt[..., :, None, :] - bt[..., None, :, :], 0.0))


def _intra_forward(q, k, v, g, beta, reset, *, sub: int, safe_gate: bool, cumsum=_chunk_cumsum,
                   inverse=unit_lower_inverse):
    """Everything that is parallel over chunks, for a flat batch of (chunk, head) pairs: ``q, k, g [P, n, K]``
    (q already scaled), ``v [P, n, V]``, ``beta [P, n]``, ``reset [P, n]`` bool or None. ``cumsum(g, sub)`` and
    ``inverse(A, sub)`` (``(I + A)⁻¹``) are the production stages unless a benchmark variant passes others. Returns
    ``(outs, saved)`` with ``outs``:

    * ``a_qk [P, n, n]``: ``Σ_j q_r[j] k_s[j] e^{b_r[j] − b_s[j]}`` for s ≤ r (same document), b = in-chunk cumsum g;
    * ``u0, w``: ``T diag(β) [V | K̃]`` with ``T = (I + A)⁻¹``, ``A_rs = β_r Σ_j k_r[j] k_s[j] e^{b_r[j]−b_s[j]}``
      (s < r) and ``K̃ = k ⊙ e^{b}`` (rows that still read the incoming state S₀);
    * ``q_dec = q ⊙ e^{b}``, ``k_rest = k ⊙ e^{b_n − b}``, ``decay = e^{b_n}`` ``[P, K]``;

    and ``saved`` the intermediates :func:`_intra_backward` needs (it is called right after a recompute, so they
    are live only inside one block).

    Decayed Gram matrices are built from ``sub × sub`` tiles with three factors, each a bounded exponential:
    ``e^{b_r − b_s} = e^{b_r − c_i} · e^{c_i − e_j} · e^{e_j − b_s}`` for r in tile i, s in tile j, where ``c_i``
    is b at tile i's first row and ``e_j`` at tile j's last. For j < i all three are ≤ 1 (the middle one may
    underflow only where the product does). For j = i the middle factor is ``e^{c_i − e_i} ≤ e^{5(sub−1)}`` with
    K3's bounded gate (g ≥ −5: e^{75} at sub = 16, finite in fp32), so diagonal tiles are dense matmuls too;
    with an unbounded gate (``safe_gate=False``) the diagonal tiles take the exact pairwise ``e^{b_r − b_s}``.
    Row tile i meets column tiles j ≤ i only: one matmul ``X̂_i Ŷ_iᵀ`` per i, with ``X̂_i = [q; k]_i ⊙ e^{b − c_i}``
    (2·sub rows) and ``Ŷ_i = k_{≤i} ⊙ e^{c_i − b}`` built as ``(k ⊙ e^{e_j − b}) ⊙ e^{c_i − e_j}``.
    """
    P, n, K = k.shape
    V = v.shape[-1]
    t = sub
    nb = n // t
    b = cumsum(g, t)                                                       # [P, n, K]
    bt = b.reshape(P, nb, t, K)
    c, e = bt[:, :, :1], bt[:, :, -1:]                                     # [P, nb, 1, K]
    row = jnp.exp(bt - c)                                                  # e^{b_r − c_i} ∈ (0, 1]
    col = jnp.exp(e - bt)                                                  # e^{e_j − b_s} ∈ (0, 1]
    tile = jnp.arange(nb)
    keep = (tile[None, :] <= tile[:, None]) if safe_gate else (tile[None, :] < tile[:, None])  # [i, j]
    mid = jnp.exp(jnp.where(keep[:, :, None], c[:, :, None, 0] - e[:, None, :, 0], -jnp.inf))  # [P, i, j, K]
    qt, kt = q.reshape(P, nb, t, K), k.reshape(P, nb, t, K)
    xs = jnp.concatenate([qt * row, kt * row], axis=2)                     # X̂: [P, nb, 2t, K]
    kc = kt * col                                                          # [P, nb, t, K]
    dec = None if safe_gate else _diag_decay(bt)
    ys, grams = [], []
    for i in range(nb):
        m = i + 1 if safe_gate else i                                  # column tiles in the one matmul
        parts = []
        ys.append((mid[:, i, :m, None, :] * kc[:, :m]).reshape(P, m * t, K) if m else None)
        if m:
            parts.append(_mm("prk,psk->prs", xs[:, i], ys[i]))
        if not safe_gate:
            parts.append(jnp.einsum("pxrk,psk,prsk->pxrs", jnp.stack([qt[:, i], kt[:, i]], 1), kt[:, i],
                                    dec[:, i], precision=HIGHEST).reshape(P, 2 * t, t))
        if i < nb - 1:
            parts.append(jnp.zeros((P, 2 * t, n - (i + 1) * t), xs.dtype))
        grams.append(jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0])
    gram = jnp.stack(grams, axis=1)                                    # [P, nb, 2t, n]
    p_qk, p_kk = gram[:, :, :t].reshape(P, n, n), gram[:, :, t:].reshape(P, n, n)
    m_qk, m_kk = _tril(n), _tril(n, -1)
    ec = jnp.exp(c)                                                        # e^{c_i}
    e_rest = col * jnp.exp(b[:, -1:, None, :] - e)                         # e^{b_n − b}
    q_dec = (xs[:, :, :t] * ec).reshape(P, n, K)                           # q ⊙ e^{b}
    k_dec = (xs[:, :, t:] * ec).reshape(P, n, K)                           # k ⊙ e^{b}
    k_rest = (kt * e_rest).reshape(P, n, K)
    decay = jnp.exp(b[:, -1])                                              # [P, K]
    alive = last = None
    if reset is not None:
        seg = jnp.cumsum(reset.astype(jnp.int32), axis=-1)                 # document index inside the chunk
        same = seg[:, :, None] == seg[:, None, :]
        m_qk, m_kk = m_qk & same, m_kk & same
        alive = (seg == 0)[..., None].astype(q.dtype)                      # rows that still see S₀
        last = (seg == seg[:, -1:])[..., None].astype(q.dtype)             # the chunk's last document
        q_dec, k_dec, k_rest = q_dec * alive, k_dec * alive, k_rest * last
        decay = decay * alive[:, -1]
    a_qk = jnp.where(m_qk, p_qk, 0.0)
    a_kk = jnp.where(m_kk, p_kk, 0.0) * beta[..., None]
    tinv = inverse(a_kk, t)
    rhs = jnp.concatenate([v, k_dec], axis=-1)                             # [V | K̃]
    x = tri_matmul(tinv * beta[:, None, :], rhs, t)                       # [U₀ | W] = T diag(β) [V | K̃]
    saved = dict(row=row, col=col, mid=mid, ec=ec, e_rest=e_rest, xs=xs, kc=kc, ys=ys, dec=dec, qt=qt, kt=kt,
                 p_kk=p_kk, m_qk=m_qk, m_kk=m_kk, alive=alive, last=last, tinv=tinv, rhs=rhs, x=x, beta=beta,
                 q_dec=q_dec, k_dec=k_dec, k_rest=k_rest, decay=decay, cumsum=cumsum, safe_gate=safe_gate)
    return (a_qk, x[..., :V], x[..., V:], q_dec, k_rest, decay), saved


def _reverse_cumsum(x: jax.Array, cumsum, sub: int) -> jax.Array:
    """``y_r = Σ_{r' ≥ r} x_{r'}`` over axis −2 (the transpose of the in-chunk ``cumsum``)."""
    return jnp.sum(x, axis=-2, keepdims=True) - cumsum(x, sub) + x


def _intra_backward(s: dict, cts) -> tuple[jax.Array, ...]:
    """VJP of :func:`_intra_forward` from its ``saved`` intermediates: cotangents of ``(a_qk, u0, w, q_dec, k_rest,
    decay)`` in, ``(dq, dk, dv, dg, dβ)`` out.

    Solve: ``dR = Tᵀ [dU₀ | dW]``, ``dA = −dR [U₀ | W]ᵀ`` (strictly lower). Each decayed Gram
    ``P_rs = Σ_j x_r[j] y_s[j] e^{b_r[j] − b_s[j]}`` pulls back through the same tiles as the forward
    (``dX̂_i = dP_i Ŷ_i``, ``dŶ_i = dP_iᵀ X̂_i``), and its log-decay gradient needs no exponential of its own:
    ``∂P_rs/∂b_r = −∂P_rs/∂b_s = x_r y_s e^{…}``, so ``db = x ⊙ dx − y ⊙ dy`` (likewise ``db = z ⊙ dz`` for
    ``z = x ⊙ e^{±b}``). ``dg`` is the reverse cumulative sum of ``db``.
    """
    d_aqk, d_u0, d_w, d_qdec, d_krest, d_decay = cts
    row, col, mid, xs, kc, qt, kt = (s[n] for n in ("row", "col", "mid", "xs", "kc", "qt", "kt"))
    beta, tinv, x, rhs = s["beta"], s["tinv"], s["x"], s["rhs"]
    P, nb, t, K = kt.shape
    n, V = nb * t, d_u0.shape[-1]
    dr = tri_matmul(tinv, jnp.concatenate([d_u0, d_w], axis=-1), t, transpose=True)   # Tᵀ dX
    d_akk = jnp.where(s["m_kk"], -_mm("prm,psm->prs", dr, x), 0.0)
    dbeta = jnp.sum(dr * rhs, axis=-1) + jnp.sum(d_akk * s["p_kk"], axis=-1)
    d_rhs = beta[..., None] * dr
    dv, d_kdec = d_rhs[..., :V], d_rhs[..., V:]
    dp = jnp.concatenate([jnp.where(s["m_qk"], d_aqk, 0.0).reshape(P, nb, t, n),
                          (d_akk * beta[..., None]).reshape(P, nb, t, n)], axis=2)  # [P, nb, 2t, n]
    dxs, dkc = [], [jnp.zeros((P, t, K), kt.dtype) for _ in range(nb)]
    for i in range(nb):
        m = i + 1 if s["safe_gate"] else i
        dx_i = jnp.zeros((P, 2 * t, K), kt.dtype)
        if m:
            dpi = dp[:, i, :, :m * t]
            dx_i = _mm("prs,psk->prk", dpi, s["ys"][i])
            dy = _mm("prs,prk->psk", dpi, xs[:, i]).reshape(P, m, t, K) * mid[:, i, :m, None, :]
            for j in range(m):
                dkc[j] = dkc[j] + dy[:, j]
        dxs.append(dx_i)
    dxs, dkc = jnp.stack(dxs, axis=1), jnp.stack(dkc, axis=1)          # [P, nb, 2t, K], [P, nb, t, K]
    dq = dxs[:, :, :t] * row
    dk = dxs[:, :, t:] * row + dkc * col
    db = xs[:, :, :t] * dxs[:, :, :t] + xs[:, :, t:] * dxs[:, :, t:] - kc * dkc
    if not s["safe_gate"]:   # exact diagonal tiles: P_ii = Σ_j x_r y_s E_rs, E = e^{b_r − b_s}
        dpd = jnp.stack([dp[:, i, :, i * t:(i + 1) * t] for i in range(nb)], axis=1).reshape(P, nb, 2, t, t)
        x2 = jnp.stack([qt, kt], axis=2)                                   # [P, nb, 2, t, K]
        dx2 = jnp.einsum("pixrs,pisk,pirsk->pixrk", dpd, kt, s["dec"], precision=HIGHEST)
        dyd = jnp.einsum("pixrs,pixrk,pirsk->pisk", dpd, x2, s["dec"], precision=HIGHEST)
        dq, dk = dq + dx2[:, :, 0], dk + dx2[:, :, 1] + dyd
        db = db + jnp.sum(x2 * dx2, axis=2) - kt * dyd
    dq, dk, db = (z.reshape(P, n, K) for z in (dq, dk, db))
    eb = (row * s["ec"]).reshape(P, n, K)                                  # e^{b}
    e_rest = s["e_rest"].reshape(P, n, K)
    if s["alive"] is not None:
        d_qdec, d_kdec, d_krest = d_qdec * s["alive"], d_kdec * s["alive"], d_krest * s["last"]
    dq = dq + d_qdec * eb
    dk = dk + d_kdec * eb + d_krest * e_rest
    rest = d_krest * s["k_rest"]
    db = db + d_qdec * s["q_dec"] + d_kdec * s["k_dec"] - rest
    db_n = jnp.sum(rest, axis=1) + d_decay * s["decay"]                    # through b_n = Σ_r g_r
    dg = _reverse_cumsum(db, s["cumsum"], t) + db_n[:, None, :]
    return dq.reshape(P, n, K), dk, dv, dg, dbeta


def _chunk_states(u0, w, k_rest, decay, S0):
    """Carry S across chunks: ``U_c = u0_c − w_c S_c``, ``S_{c+1} = e^{b_n} ⊙ S_c + k_restᵀ U_c``.

    Inputs chunk-major ``[C, G, n, ·]`` (G = batch × heads; the scan reads them in place), ``decay [C, G, K]``,
    ``S0 [G, K, V]``. Returns ``(S_c [C, G, K, V]`` the state entering each chunk, ``U [C, G, n, V]``, final
    state ``[G, K, V])``.
    """
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


def _kda_intra(q, k, v, g, beta, reset, **intra):
    """The outputs of :func:`_intra_forward` only (plain autodiff differentiates straight through it)."""
    return _intra_forward(q, k, v, g, beta, reset, **intra)[0]


def _intra_vjp(q, k, v, g, beta, reset, **intra):
    """``(outs, pull)``: :func:`_intra_forward`'s outputs and the map of their cotangents to those of
    ``(q, k, v, g, β)`` by :func:`_intra_backward` (the backward passes call it on recomputed inputs)."""
    outs, saved = _intra_forward(q, k, v, g, beta, reset, **intra)
    return outs, lambda cts: _intra_backward(saved, cts)


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
        return cfg.intra_vjp(q, k, v, g, b, r, **cfg.intra)[1](ct)

    out = _blocked(one, tuple(map(_flat, (qc, kc, vc, gc, bc, reset, *cts))), cfg.block)
    return tuple(x.reshape(C, G, *x.shape[1:]) for x in out)


def _kda_core_impl(cfg, qc, kc, vc, gc, bc, reset, S0):
    a_qk, u0, w, q_dec, k_rest, decay = _intra_by_head(cfg, qc, kc, vc, gc, bc, reset)
    S_in, U, S = cfg.states(u0, w, k_rest, decay, S0)
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
    S_in, U, _ = _chunk_states(u0, w, k_rest, decay, S0)
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
# The CPU default ("fused") reads q, k, v, g, β in their own [B, T, H, ·] layout (and dtype) one block of ``bc``
# chunks at a time and writes o (and, backward, the gradients) back in place, so nothing sequence-sized is ever
# transposed, cast or stored between passes: intra pass, state recurrence and outputs all run on a block that fits
# in cache.
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


def _replay(S, a_qk, u0, w, q_dec, k_rest, decay, outputs: bool = False):
    """Carry the state through one block's chunks ``[bc, G, ·]``: ``U_j = u0_j − w_j S``,
    ``S ← e^{b_n} ⊙ S + k_restᵀ U_j``, and (``outputs``) ``o_j = q_dec_j S + a_qk_j U_j`` while S is in cache.
    Returns ``(S entering each chunk [bc, G, K, V], U [bc, G, n, V], S out, o [bc, G, n, V] or None)``."""
    S_in, U, o = [], [], []
    for j in range(u0.shape[0]):
        S_in.append(S)
        U.append(u0[j] - _mm("gnk,gkv->gnv", w[j], S))
        if outputs:
            o.append(_mm("gnk,gkv->gnv", q_dec[j], S) + _mm("gns,gsv->gnv", a_qk[j], U[j]))
        S = decay[j][..., None] * S + _mm("gnk,gnv->gkv", k_rest[j], U[j])
    return jnp.stack(S_in), jnp.stack(U), S, (jnp.stack(o) if outputs else None)


def _fused_forward(cfg, xs, S0):
    """Returns ``(o [B, T', H, V] in cfg.dtype, final S [G, K, V], S entering each block [T'/(bc·n), G, K, V])``."""
    B, Tp, H = xs[4].shape
    nblk, L = Tp // (cfg.bc * cfg.n), cfg.bc * cfg.n

    def step(carry, i):
        S, o = carry
        x_in = _block_in(cfg, xs, i)
        bc, G = x_in[0].shape[:2]
        outs = _kda_intra(*map(_flat, x_in), **cfg.intra)
        a_qk, u0, w, q_dec, k_rest, decay = (x.reshape(bc, G, *x.shape[1:]) for x in outs)
        _, _, S_out, ob = _replay(S, a_qk, u0, w, q_dec, k_rest, decay, outputs=True)
        o = jax.lax.dynamic_update_slice_in_dim(o, _block_out(ob, B), i * L, axis=1)
        return (S_out, o), S

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
    """One reverse scan over the blocks, carrying dS: each block re-reads its inputs, recomputes its intra pass
    (:func:`_intra_forward`, intermediates kept for this block only), replays its states from the stored
    block-entry state, carries dS back through its chunks (two matmuls a chunk; the rest batched over the block),
    pulls the cotangents back through the intra pass (:func:`_intra_backward`) and writes dq, dk, dv, dg, dβ in
    place. Residuals: the inputs and one state per block.

    Per chunk (forward ``U = u0 − w S``, ``o = q_dec S + a_qk U``, ``S' = D S + k_restᵀ U``, ``D = diag(e^{b_n})``),
    from dS' and do: ``dU = a_qkᵀ do + k_rest dS'``, ``dS = D dS' + q_decᵀ do − wᵀ dU``; then
    ``d q_dec = do Sᵀ``, ``d a_qk = do Uᵀ``, ``d k_rest = U dS'ᵀ``, ``d e^{b_n} = Σ_v S ⊙ dS'``, ``dw = −dU Sᵀ``,
    ``du0 = dU``."""
    do, dS_final = cts
    # The barrier ties the recomputation to the incoming cotangent: without it XLA would CSE this pass with the
    # forward's identical one and keep every intermediate alive from the forward to here after all.
    (q, k, v, g, beta, reset, S_starts), do = jax.lax.optimization_barrier((res, do))
    xs = (q, k, v, g, beta, reset)
    B = beta.shape[0]

    def step(dS, i):
        x_in = _block_in(cfg, xs, i)
        bc, G = x_in[0].shape[:2]
        outs, pull = cfg.intra_vjp(*map(_flat, x_in), **cfg.intra)
        a_qk, u0, w, q_dec, k_rest, decay = (x.reshape(bc, G, *x.shape[1:]) for x in outs)
        S_in, U, _, _ = _replay(S_starts[i], a_qk, u0, w, q_dec, k_rest, decay)
        do_b = _block_heads(cfg, do, i)
        a_do = _mm("pns,pnv->psv", outs[0], _flat(do_b)).reshape(U.shape)      # a_qkᵀ do
        # the products with S, dS run per chunk, while that chunk's state and its gradient are in cache
        d = [[None] * bc for _ in range(5)]  # dU (= du0), dw, dq_dec, dk_rest, d decay per chunk
        for j in reversed(range(bc)):        # dS: gradient w.r.t. the state leaving chunk j
            dU = a_do[j] + _mm("gnk,gkv->gnv", k_rest[j], dS)
            d[0][j], d[1][j] = dU, -_mm("gnv,gkv->gnk", dU, S_in[j])
            d[2][j] = _mm("gnv,gkv->gnk", do_b[j], S_in[j])
            d[3][j], d[4][j] = _mm("gnv,gkv->gnk", U[j], dS), jnp.sum(S_in[j] * dS, axis=-1)
            dS = (decay[j][..., None] * dS + _mm("gnk,gnv->gkv", q_dec[j], do_b[j])
                  - _mm("gnk,gnv->gkv", w[j], dU))
        dU_f, d_w, d_qdec, d_krest, d_decay = (_flat(jnp.stack(x)) for x in d)
        d_aqk = _mm("pnv,psv->pns", _flat(do_b), _flat(U))
        dq, dk, dv, dg, db = pull((d_aqk, dU_f, d_w, d_qdec, d_krest, d_decay))
        dq = dq * cfg.scale
        return dS, tuple(_block_out(x.reshape(bc, G, *x.shape[1:]), B).astype(buf.dtype)
                         for buf, x in zip(xs, (dq, dk, dv, dg, db)))

    dS_last = jnp.zeros_like(S_starts[0]) if dS_final is None else dS_final.astype(S_starts.dtype)
    # gradients leave as the scan's stacked outputs [blocks, B, bc·n, H, ·] (written once, no zeroed buffer first)
    dS0, grads = jax.lax.scan(step, dS_last, jnp.arange(S_starts.shape[0]), reverse=True)
    grads = tuple(jnp.moveaxis(gr, 0, 1).reshape(x.shape) for gr, x in zip(grads, xs))
    return (*grads, None, dS0)


_kda_fused = jax.custom_vjp(_kda_fused_impl, nondiff_argnums=(0,))
_kda_fused.defvjp(_kda_fused_fwd, _kda_fused_bwd)


# ------------------------------------------------------------------------------------ registered implementations
class _Cfg:
    """Static settings of one kernel call (hashable: the custom VJPs' ``nondiff_argnums``) and the stages it runs,
    as class attributes — the production ones; ``benchmarks/kda_variants.py`` times others by subclassing."""

    cumsum = staticmethod(_chunk_cumsum)          # in-chunk cumulative log decay (reversed: its transpose)
    inverse = staticmethod(unit_lower_inverse)    # T = (I + A)⁻¹
    states = staticmethod(_chunk_states)          # "scan": the forward's state scan across chunks
    intra_vjp = staticmethod(_intra_vjp)          # the intra pass and its pullback, in the backward passes
    fused = staticmethod(_kda_fused)              # "fused", differentiated by its recomputing custom VJP
    separate = staticmethod(_kda_core)            # "scan", likewise

    def __init__(self, sub: int, safe_gate: bool, block: int, n: int = 0, bc: int = 0, scale: float = 1.0,
                 dtype=jnp.float32):
        self.intra = dict(sub=sub, safe_gate=safe_gate, cumsum=self.cumsum, inverse=self.inverse)
        self.block = block
        # fused path: chunk size, chunks per block, q scale, internal dtype
        self.n, self.bc, self.scale, self.dtype = n, bc, scale, jnp.dtype(dtype)
        self._key = (type(self), sub, safe_gate, block, n, bc, scale, self.dtype)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Cfg) and self._key == other._key


def _fused(q, k, v, g, beta, reset, S0, *, n: int, sub: int, safe_gate: bool, scale: float, block: int = 16,
           cfg_type: type = _Cfg):
    """``"fused"``: one ``lax.scan`` over blocks of ``max(1, block // (B·H))`` chunks (``block`` (chunk, head)
    pairs a step). Each step reads its block of q, k, v, g, β straight from their ``[B, T, H, ·]`` layout (no
    sequence-sized transpose, cast or intermediate), runs the intra-chunk pass for all its pairs at once, then
    carries S through the block's chunks with two matmuls each and writes their outputs; the custom VJP keeps the
    inputs and one state per block. Returns ``(o [B, T, H, V] in v.dtype, S [B·H, K, V])``."""
    B, T, H = beta.shape
    C = max(1, math.ceil(T / n))
    bc = min(C, max(1, block // (B * H)))                                   # chunks per block
    cfg = cfg_type(sub, safe_gate, block, n, bc, scale, S0.dtype)
    Tp = -(-C // bc) * bc * n
    padT = lambda x: x if Tp == T else jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    r = None if reset is None else padT(reset.astype(bool))
    o, S = cfg.fused(cfg, *map(padT, (q, k, v, g, beta)), r, S0)
    return o[:, :T].astype(v.dtype), S


def _separate(q, k, v, g, beta, reset, S0, *, n: int, sub: int, safe_gate: bool, scale: float,
              block: int = 1024, cfg_type: type = _Cfg):
    """``"scan"``: separate passes — the intra pass for all chunks at once (``lax.map`` in blocks of ``block``
    (chunk, head) pairs), one state scan, one batched output pass; the custom VJP keeps the inputs. Returns
    ``(o [B, T, H, V] in v.dtype, S [B·H, K, V])``."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    C = max(1, math.ceil(T / n))
    pad = C * n - T

    def prep(x):  # [B, T, H, ...] -> chunk-major [C, B·H, n, ...] fp32, zero padded at the end
        x = x.astype(S0.dtype)
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x.reshape(B, C, n, H, *x.shape[3:]), (1, 3), (0, 2))  # [C, B, H, n, ...]
        return x.reshape(C, B * H, n, *x.shape[4:])

    r = None
    if reset is not None:
        r = jnp.pad(reset.astype(bool), [(0, 0), (0, pad)]).reshape(B, C, 1, n)
        r = jnp.broadcast_to(jnp.moveaxis(r, 1, 0), (C, B, H, n)).reshape(C, B * H, n)
    cfg = cfg_type(sub, safe_gate, block)
    o, S = cfg.separate(cfg, prep(q) * scale, prep(k), prep(v), prep(g), prep(beta), r, S0)
    o = jnp.moveaxis(o.reshape(C, B, H, n, V), (0, 2), (1, 3))               # [B, C, n, H, V]
    return o.reshape(B, C * n, H, V)[:, :T].astype(v.dtype), S


KDA_CHUNKED_IMPLS = {"fused": _fused, "scan": _separate}
"""The production implementations of :func:`kda_chunked` by name (its ``impl``)."""


def default_impl() -> str:
    """The implementation :func:`kda_chunked` runs by default on this backend: ``"fused"`` on CPU, ``"scan"`` on
    accelerators (where one intra pass over every chunk at once keeps the device busy)."""
    return "fused" if jax.default_backend() == "cpu" else "scan"


def kda_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                scale: float | None = None, initial_state: jax.Array | None = None,
                output_final_state: bool = False, chunk_size: int | None = None, sub_chunk: int = 16,
                safe_gate: bool = False, reset: jax.Array | None = None, *,
                impl: str | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Chunked KDA (spec §4.3), mathematically identical to :func:`kda_recurrent`; fp32 internals.

    Per chunk of n tokens with incoming state S₀ and in-chunk cumulative log decay ``b_r = Σ_{s≤r} g_s``::

        (I + A) [U₀ | W] = diag(β) [V | K̃],  A_rs = β_r Σ_j k_r[j] k_s[j] e^{b_r[j]−b_s[j]} (s < r),  K̃ = k ⊙ e^{b}
        U = U₀ − W S₀
        o_r = (q_r ⊙ e^{b_r})ᵀ S₀ + Σ_{s≤r} (Σ_j q_r[j] k_s[j] e^{b_r[j]−b_s[j]}) u_s
        S_n = Diag(e^{b_n}) S₀ + Σ_s (k_s ⊙ e^{b_n−b_s}) u_sᵀ

    The intra-chunk pass works in ``sub_chunk``-row tiles with ``T = (I + A)⁻¹`` by blocks (see
    :func:`_intra_forward`). ``chunk_size=None`` picks 32 on CPU and 64 on accelerators. ``impl`` names one of
    :data:`KDA_CHUNKED_IMPLS` (``"fused"``: one scan over blocks of chunks; ``"scan"``: separate passes); ``None``
    picks :func:`default_impl`. Both differentiate with a custom VJP that keeps only the inputs (and, fused, the
    state entering each block) and recomputes the per-chunk intermediates block by block in the backward pass,
    pulling the cotangents back through the intra-chunk pass with its hand-written VJP (:func:`_intra_backward`).
    ``safe_gate=True`` asserts every ``g ≥ −5`` (K3's lower-bound gate) and lets the diagonal tiles factor their
    exponentials too (needs ``sub_chunk ≤ 16``); leave it False for an unbounded (softplus) gate. T need not be a
    multiple of ``chunk_size`` (zero padding leaves state and outputs exact).

    ``reset [B, T]`` (bool) zeroes the state before each marked token (packed documents): pairs of tokens from
    different documents are masked out of A and of the in-chunk attention, rows after a reset do not read S₀, and
    the chunk's outgoing state keeps only its last document.
    """
    if impl is None:
        impl = default_impl()
    if impl not in KDA_CHUNKED_IMPLS:
        raise ValueError(f"kda_chunked: impl must be one of {tuple(KDA_CHUNKED_IMPLS)}, got {impl!r}")
    return _kda_chunked(KDA_CHUNKED_IMPLS[impl], q, k, v, g, beta, scale, initial_state, output_final_state,
                        chunk_size, sub_chunk, safe_gate, reset)


def _kda_chunked(run, q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, sub_chunk,
                 safe_gate, reset):
    """:func:`kda_chunked` by the implementation ``run`` (a :data:`KDA_CHUNKED_IMPLS` entry, or a benchmark
    variant's): checks, defaults and the state's layout are shared."""
    _check(q, k, v, g, beta, initial_state)
    if chunk_size is None:
        chunk_size = 32 if jax.default_backend() == "cpu" else 64
    if chunk_size < 1 or chunk_size % sub_chunk:
        raise ValueError(f"kda_chunked: chunk_size must be a positive multiple of sub_chunk={sub_chunk}; "
                         f"got {chunk_size}")
    if safe_gate and sub_chunk > 16:
        raise ValueError(f"kda_chunked: safe_gate needs sub_chunk ≤ 16 (e^{{5·(sub−1)}} must stay finite in fp32); "
                         f"got {sub_chunk}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    a = acc_dtype(q, k, v)
    S0 = (jnp.zeros((B, H, K, V), a) if initial_state is None else initial_state.astype(a)).reshape(B * H, K, V)
    o, S = run(q, k, v, g, beta, reset, S0, n=chunk_size, sub=sub_chunk, safe_gate=safe_gate, scale=scale)
    return o, (S.reshape(B, H, K, V) if output_final_state else None)
