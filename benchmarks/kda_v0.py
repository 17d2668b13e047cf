"""The first chunked KDA (k3jax before issue 7), kept only as a contender in ``benchmarks/kda.py`` so the table can
say what the rewrite bought: per-chunk tiles with the chunk axis as a separate batch axis, a decayed Gram matrix
over all tile pairs, a row-by-row ``lax.scan`` triangular solve, ``jnp.cumsum``, and a cross-chunk scan doing
four matmuls per chunk; differentiated by plain ``jax.grad`` (every intermediate stored).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.ops.kda import HIGHEST, _check, _mm
from k3jax.ops.precision import acc_dtype


def _decayed_gram(x: jax.Array, y: jax.Array, b: jax.Array, sub: int, safe_gate: bool) -> jax.Array:
    """``M[r, s] = Σ_j x_r[j] y_s[j] exp(b_r[j] − b_s[j])`` for ``s ≤ r`` (0 above), per chunk, fp32.

    ``x, y, b [..., n, K]``, ``b`` the in-chunk cumulative log decay (non-increasing in r). Built from
    ``sub × sub`` tiles, each a dense matmul:

    * tile (i, j), i > j: factor through ``e_j`` = ``b`` at the last row of sub-tile j,
      ``(x_r ⊙ e^{b_r − e_j}) · (y_s ⊙ e^{e_j − b_s})`` — both factors ≤ 1 for any gate, nothing can overflow;
    * diagonal tiles with ``safe_gate`` (log-decay ≥ −5 per token): factor through the tile's first row
      ``f``, ``e^{b_f − b_s} ≤ e^{5·(sub−1)}`` (≤ e^{75} for sub = 16, finite in fp32);
    * diagonal tiles otherwise (unbounded gate, e.g. softplus): the exact pairwise ``e^{b_r − b_s}``.

    ``e^{b_r}·e^{−b_s}`` is never formed across a whole chunk (|b| reaches 320 in 64 tokens at γ = −5).
    """
    *lead, n, K = x.shape
    nb = n // sub
    bt = b.reshape(*lead, nb, sub, K)
    e = bt[..., -1, :]                                                     # [..., nb, K]
    # Off-diagonal tiles. Rows r of tiles ≤ j would get e^{positive}; they are discarded, so clamp them at 1.
    xs = x[..., None, :, :] * jnp.exp(jnp.minimum(b[..., None, :, :] - e[..., :, None, :], 0.0))  # [.., nb, n, K]
    ys = y.reshape(*lead, nb, sub, K) * jnp.exp(e[..., :, None, :] - bt)  # [..., nb, sub, K]
    off = _mm("...jrk,...jsk->...rjs", xs, ys)                             # [..., n, nb, sub]
    off = off.reshape(*lead, nb, sub, nb, sub)
    xt = x.reshape(*lead, nb, sub, K)
    yt = y.reshape(*lead, nb, sub, K)
    if safe_gate:
        f = bt[..., :1, :]
        diag = _mm("...irk,...isk->...irs", xt * jnp.exp(bt - f), yt * jnp.exp(f - bt))
    else:
        dec = jnp.exp(jnp.minimum(bt[..., :, None, :] - bt[..., None, :, :], 0.0))  # [..., nb, sub, sub, K]
        diag = jnp.sum(xt[..., :, None, :] * yt[..., None, :, :] * dec, axis=-1)
    tile = jnp.arange(nb)
    lower_tiles = (tile[:, None] > tile[None, :])[:, None, :, None]        # [nb, 1, nb, 1]
    eye_tiles = (tile[:, None] == tile[None, :])[:, None, :, None]
    in_tile_lower = jnp.tril(jnp.ones((sub, sub), bool))                    # s ≤ r inside a tile
    diag_full = diag[..., :, :, None, :]                                    # [..., nb, sub, 1, sub]
    m = jnp.where(lower_tiles, off, 0.0) + jnp.where(eye_tiles & in_tile_lower[None, :, None, :], diag_full, 0.0)
    return m.reshape(*lead, n, n)


def solve_unit_lower(a_strict: jax.Array, rhs: jax.Array) -> jax.Array:
    """``X = (I + A)⁻¹ R`` for strictly lower-triangular ``A [..., n, n]``, ``R [..., n, m]``: forward substitution,
    one row per step of a ``lax.scan`` (``x_r = R_r − Σ_{s<r} A_rs x_s``), batched over the leading axes.

    Pure XLA ops (no LAPACK custom call), exact like a triangular solve, differentiable through the scan.
    """
    n = a_strict.shape[-1]
    rows_a = jnp.moveaxis(a_strict, -2, 0)                                # [n, ..., n]
    rows_r = jnp.moveaxis(rhs, -2, 0)                                     # [n, ..., m]

    def body(x, inp):
        r, a_r, rhs_r = inp
        x_r = rhs_r - jnp.einsum("...s,...sm->...m", a_r, x, precision=HIGHEST)
        return jax.lax.dynamic_update_index_in_dim(x, x_r, r, axis=-2), None

    x, _ = jax.lax.scan(body, jnp.zeros_like(rhs), (jnp.arange(n), rows_a, rows_r))
    return x


def kda_chunked_v0(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                scale: float | None = None, initial_state: jax.Array | None = None,
                output_final_state: bool = False, chunk_size: int = 64, sub_chunk: int = 16,
                safe_gate: bool = False, reset: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Chunked KDA (spec §4.3), mathematically identical to :func:`kda_recurrent`; fp32 internals.

    Per chunk of n tokens with incoming state S₀ and in-chunk cumulative log decay ``b_r = Σ_{s≤r} g_s``::

        (I + A) U = diag(β) (V − K̃ S₀),  A_rs = β_r Σ_j k_r[j] k_s[j] e^{b_r[j]−b_s[j]} (s < r),  K̃ = k ⊙ e^{b}
        o_r = (q_r ⊙ e^{b_r})ᵀ S₀ + Σ_{s≤r} (Σ_j q_r[j] k_s[j] e^{b_r[j]−b_s[j]}) u_s
        S_n = Diag(e^{b_n}) S₀ + Σ_s (k_s ⊙ e^{b_n−b_s}) u_sᵀ

    All chunks' ``(I + A)⁻¹ diag(β) [V | K̃]`` are solved at once (unit lower-triangular); a ``lax.scan`` over
    chunks then carries S with small matmuls. ``safe_gate=True`` asserts every ``g ≥ −5`` (K3's lower-bound
    gate) and lets the diagonal 16-token tiles factor their exponentials too; leave it False for an unbounded
    (softplus) gate. T need not be a multiple of ``chunk_size`` (zero padding leaves state and outputs exact).

    ``reset [B, T]`` (bool) zeroes the state before each marked token (packed documents): pairs of tokens from
    different documents are masked out of A and of the in-chunk attention, rows after a reset do not read S₀, and
    the chunk's outgoing state keeps only its last document.
    """
    _check(q, k, v, g, beta, initial_state)
    if chunk_size % sub_chunk:
        raise ValueError(f"kda_chunked: sub_chunk={sub_chunk} must divide chunk_size={chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    n = chunk_size
    scale = K ** -0.5 if scale is None else scale
    C = max(1, math.ceil(T / n))
    pad = C * n - T
    a = acc_dtype(q, k, v)

    def prep(x):  # [B, T, H, ...] -> [B, H, C, n, ...] fp32, zero padded at the end
        x = x.astype(a)
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(B, H, C, n, *x.shape[3:])

    qc, kc, vc, gc, bc = prep(q) * scale, prep(k), prep(v), prep(g), prep(beta)
    b = jnp.cumsum(gc, axis=-2)                                            # [B, H, C, n, K]
    b_last = b[..., -1:, :]                                                # [B, H, C, 1, K]

    a_kk = bc[..., :, None] * _decayed_gram(kc, kc, b, sub_chunk, safe_gate)
    a_kk = jnp.where(jnp.tril(jnp.ones((n, n), bool), -1), a_kk, 0.0)      # strictly lower
    a_qk = _decayed_gram(qc, kc, b, sub_chunk, safe_gate)                  # lower incl. diagonal
    alive = last_alive = None
    if reset is not None:
        r = jnp.pad(reset.astype(jnp.int32), [(0, 0), (0, pad)]).reshape(B, 1, C, n)
        seg = jnp.cumsum(r, axis=-1)                                       # document index inside the chunk
        same = seg[..., :, None] == seg[..., None, :]
        a_kk, a_qk = jnp.where(same, a_kk, 0.0), jnp.where(same, a_qk, 0.0)
        alive = (seg == 0)[..., None].astype(a)                            # rows that still see S₀
        last_alive = alive[..., -1, :]                                     # [B, 1, C, 1]
        qc_s0, kc_s0 = qc * alive, kc * alive
        k_rest_mask = (seg == seg[..., -1:])[..., None].astype(a)          # tokens of the chunk's last document
    else:
        qc_s0, kc_s0 = qc, kc

    k_dec = kc_s0 * jnp.exp(b)                                             # K̃ = k ⊙ e^{b}   (≤ |k|)
    rhs = bc[..., None] * jnp.concatenate([vc, k_dec], axis=-1)            # diag(β) [V | K̃]
    sol = solve_unit_lower(a_kk, rhs)
    u0, w = sol[..., :V], sol[..., V:]                                     # U = u0 − w S₀
    q_dec = qc_s0 * jnp.exp(b)                                             # q ⊙ e^{b}
    k_rest = kc * jnp.exp(b_last - b)                                      # k ⊙ e^{b_n − b}
    decay_n = jnp.exp(b_last[..., 0, :])                                   # [B, H, C, K]
    if reset is not None:
        k_rest = k_rest * k_rest_mask
        decay_n = decay_n * last_alive

    S0 = jnp.zeros((B, H, K, V), a) if initial_state is None else initial_state.astype(a)
    cm = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731  chunk-major for the scan

    def body(S, xs):
        u0_c, w_c, qd_c, aqk_c, kr_c, dn_c = xs
        U = u0_c - _mm("bhnk,bhkv->bhnv", w_c, S)
        o = _mm("bhnk,bhkv->bhnv", qd_c, S) + _mm("bhns,bhsv->bhnv", aqk_c, U)
        S = dn_c[..., None] * S + _mm("bhnk,bhnv->bhkv", kr_c, U)
        return S, o

    S, o = jax.lax.scan(body, S0, (cm(u0), cm(w), cm(q_dec), cm(a_qk), cm(k_rest), cm(decay_n)))
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, C * n, V)[:, :, :T]            # [B, H, T, V]
    o = jnp.moveaxis(o, 1, 2).astype(v.dtype)
    return o, (S if output_final_state else None)
