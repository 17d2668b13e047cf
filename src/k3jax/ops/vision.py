"""Pure functions of the MoonViT-V2 vision tower (K3_VISION_SPEC §3–6), each fast path beside a slow reference.

Everything takes *packed* patches: the rows of one or several images (and padding) in one static-length array,
with per-row integer metadata computed on the host (:mod:`k3jax.vision.packing`): position-embedding taps,
RoPE coordinates, segment ids and merge indices. Nothing here depends on an image's size, so one compiled program
serves every image that fits its bucket.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype


def gelu_tanh(x: jax.Array) -> jax.Array:
    """``½x(1 + tanh(√(2/π)(x + 0.044715x³)))`` (the ViT MLP's activation, computed in fp32)."""
    xf = x.astype(acc_dtype(x))
    y = 0.5 * xf * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (xf + 0.044715 * xf ** 3)))
    return y.astype(x.dtype)


def gelu_erf(x: jax.Array) -> jax.Array:
    """``½x(1 + erf(x/√2))`` (the projector's exact GELU, computed in fp32)."""
    xf = x.astype(acc_dtype(x))
    return (0.5 * xf * (1.0 + jax.lax.erf(xf / math.sqrt(2.0)))).astype(x.dtype)


def time_table(frames: int, dim: int, dtype=jnp.float32) -> jax.Array:
    """``E [frames, dim]``: ``sin(τ·ω_k)`` for k < dim/2, ``cos(τ·ω_{k−dim/2})`` after, ``ω_k = 10000^(−k/(dim/2))``."""
    half = dim // 2
    f = dtype
    omega = 10000.0 ** (-jnp.arange(half, dtype=f) / half)
    ang = jnp.arange(frames, dtype=f)[:, None] * omega[None, :]
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)


def position_embedding(grid: jax.Array, taps: jax.Array, weights: jax.Array) -> jax.Array:
    """``pos [L, D]`` of packed rows: the bilinear resize of the learned grid ``[H₀, W₀, D]`` read at each row's
    four taps (``taps [L, 4]`` flat grid indices, ``weights [L, 4]``: products of the separable half-pixel weights,
    spec §3.2). Equal to :func:`bilinear_resize_reference` at the row's (r, c)."""
    H0, W0, D = grid.shape
    flat = grid.reshape(H0 * W0, D).astype(acc_dtype(grid))
    return jnp.einsum("lk,lkd->ld", weights.astype(flat.dtype), jnp.take(flat, taps, axis=0))


def add_time_term(pos: jax.Array, frame: jax.Array, time_on: jax.Array, frames: int) -> jax.Array:
    """``pos + E[frame]`` on rows with ``time_on`` (``frame [L]`` int32, ``time_on [L]`` bool)."""
    E = time_table(frames, pos.shape[-1], pos.dtype)
    return pos + jnp.where(time_on[:, None], jnp.take(E, frame, axis=0), 0.0)


def bilinear_resize_reference(grid: jax.Array, h: int, w: int) -> jax.Array:
    """Slow reference: ``[H₀, W₀, D] → [h, w, D]`` with dense half-pixel bilinear matrices (``align_corners=False``,
    no antialias), ``S = R_h · G · R_wᵀ`` per channel."""
    def matrix(n_out: int, n_in: int) -> jax.Array:
        a = jnp.arange(n_out, dtype=f)
        s = jnp.maximum(0.0, (a + 0.5) * n_in / n_out - 0.5)
        i0 = jnp.floor(s).astype(jnp.int32)
        i0 = jnp.minimum(i0, n_in - 1)
        i1 = jnp.minimum(i0 + 1, n_in - 1)
        lam = s - i0
        return jax.nn.one_hot(i0, n_in) * (1 - lam)[:, None] + jax.nn.one_hot(i1, n_in) * lam[:, None]

    f = acc_dtype(grid)
    H0, W0, _ = grid.shape
    if (h, w) == (H0, W0):
        return grid.astype(f)
    return jnp.einsum("ay,yxd,bx->abd", matrix(h, H0).astype(f), grid.astype(f), matrix(w, W0).astype(f))


def rope2d(x: jax.Array, rows: jax.Array, cols: jax.Array, theta: float = 10000.0) -> jax.Array:
    """2D RoPE on ``x [L, n, d]`` (spec §4.1): pair j = (2j, 2j+1) rotates by ``φ_j``, ``φ_{2m} = col·θ_m``,
    ``φ_{2m+1} = row·θ_m``, ``θ_m = theta^(−4m/d)``; the same angles for every head. Computed in fp32."""
    L, n, d = x.shape
    f = acc_dtype(x)
    m = jnp.arange(d // 4, dtype=f)
    th = theta ** (-4.0 * m / d)                                            # [d/4]
    phi = jnp.stack([cols.astype(f)[:, None] * th, rows.astype(f)[:, None] * th], axis=-1)
    phi = phi.reshape(L, d // 2)                                            # x, y interleaved
    cos, sin = jnp.cos(phi)[:, None, :], jnp.sin(phi)[:, None, :]
    xf = x.astype(f).reshape(L, n, d // 2, 2)
    a, b = xf[..., 0], xf[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(L, n, d).astype(x.dtype)


def packed_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Slow reference: ``softmax(q kᵀ/√d + B) v`` per head over all rows at once, ``B = 0`` within a segment and
    ``−∞`` across (``q, k, v [L, n, d]``, ``segment_ids [L]``). Softmax in fp32."""
    d = q.shape[-1]
    f = acc_dtype(q)
    s = jnp.einsum("qhd,khd->hqk", q.astype(f), k.astype(f)) / math.sqrt(d)
    same = segment_ids[:, None] == segment_ids[None, :]
    p = jax.nn.softmax(jnp.where(same[None], s, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v.astype(f)).astype(q.dtype)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                     block: int = 512) -> jax.Array:
    """:func:`packed_attention_reference` with the queries in blocks of ``block`` rows (``lax.map``; the last block
    padded), so the score buffer is ``[n, block, L]`` instead of ``[n, L, L]``; the block-diagonal mask keeps every
    image (and the padding, its own segment) to itself. Matmuls in the input dtype with fp32 accumulation, softmax
    in fp32."""
    L, n, d = q.shape
    if L <= block:
        return _attend(q, k, v, segment_ids, segment_ids)
    nb = -(-L // block)
    pad = nb * block - L
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    sp = jnp.pad(segment_ids, (0, pad), constant_values=-1)
    out = jax.lax.map(lambda a: _attend(a[0], k, v, a[1], segment_ids),
                      (qp.reshape(nb, block, n, d), sp.reshape(nb, block)))
    return out.reshape(nb * block, n, d)[:L]


def _attend(q, k, v, q_seg, k_seg):
    d = q.shape[-1]
    f = acc_dtype(q)
    s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=f) / math.sqrt(d)
    # a finite floor: a padded query row with no key of its segment stays finite (and is sliced off); for every
    # real row (it always sees itself) exp(floor − max) is exactly 0, as with −∞
    s = jnp.where((q_seg[:, None] == k_seg[None, :])[None], s, jnp.finfo(f).min / 2)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hqk,khd->qhd", p.astype(v.dtype), v, preferred_element_type=f).astype(q.dtype)


def sd2_tpool(x: jax.Array, index: jax.Array, frame_weight: jax.Array) -> jax.Array:
    """sd2_tpool merge of packed rows (spec §5): ``out[m, s] = Σ_τ frame_weight[m, τ] · x[index[m, τ, s]]`` →
    ``[M, 4, D]``; slot s = 2kᵢ + kⱼ (TL, TR, BL, BR), the weights 1/t over an image's t frames (0 for padding)."""
    g = jnp.take(x.astype(acc_dtype(x)), index, axis=0)                    # [M, T0, 4, D]
    return jnp.einsum("mt,mtsd->msd", frame_weight.astype(g.dtype), g).astype(x.dtype)
