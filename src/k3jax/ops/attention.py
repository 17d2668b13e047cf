"""NoPE multi-head latent attention core (spec §5.2): scores, causal/segment mask, fp32 softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype

HIGHEST = jax.lax.Precision.HIGHEST


# Above this many score entries per (batch, head) — T·S — the queries go in blocks (mla_attention's q_block).
QUERY_BLOCK_FROM = 2048 * 2048
QUERY_BLOCK = 512


def mla_attention(q_nope: jax.Array, q_rope: jax.Array, k_nope: jax.Array, k_rope: jax.Array, v: jax.Array,
                  scale: float, segment_ids: jax.Array | None = None, *, kv_segment_ids: jax.Array | None = None,
                  q_offset: jax.Array | int = 0, q_block: int | None = None) -> jax.Array:
    """Causal MLA in expanded form.

    ``s_{tτ} = (q_nᵗ·k_nᵗ + q_r·k_r) · scale`` per head; ``k_r`` is one vector per token shared by all heads
    (never rotated: NoPE). Softmax over τ ≤ t (and same segment, when ``segment_ids [B, T]`` is given) in fp32.

    Shapes: ``q_nope [B, T, N, Dn]``, ``q_rope [B, T, N, Dr]``, ``k_nope [B, S, N, Dn]``, ``k_rope [B, S, Dr]``,
    ``v [B, S, N, Dv]`` → ``[B, T, N, Dv]`` in ``v.dtype``. Usually S = T; queries that are a slice of the
    sequence (context parallelism) sit at positions ``q_offset + t`` with ``segment_ids [B, T]`` their own ids and
    ``kv_segment_ids [B, S]`` the keys' (default: ``segment_ids``).

    Long sequences (T·S > ``QUERY_BLOCK_FROM``, or ``q_block`` given) go ``q_block`` queries at a time, each block
    rematerialised in the backward pass: peak score memory ``B·N·q_block·S`` instead of ``B·N·T·S``, the same
    per-row softmax (so the same values).
    """
    T, S = q_nope.shape[1], k_nope.shape[1]
    if q_block is None and T * S > QUERY_BLOCK_FROM:
        q_block = QUERY_BLOCK
    dtype = v.dtype
    # head-major keys [B, N, S, Dn + Dr] (the shared k_r repeated per head) and values [B, N, S, Dv]: one
    # score product per head over row-major operands — the per-head [B, S, N, D] layout made XLA:CPU's batched
    # products run a transposing copy each (100m's [4, 256] MLA: forward 13 → 8 ms, fwd+bwd 36 → 18 ms)
    N = k_nope.shape[2]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :].astype(k_nope.dtype),
                                                  (*k_rope.shape[:2], N, k_rope.shape[-1]))], axis=-1)
    k, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
    if q_block is not None and q_block < T:
        o = _mla_attention_query_blocks(q, k, vh, scale, segment_ids, kv_segment_ids, q_offset, q_block)
    else:
        o = _mla_attention_dense(q, k, vh, scale, segment_ids, kv_segment_ids, q_offset)
    return o.astype(dtype)


def _mla_attention_dense(q, k, v, scale, segment_ids, kv_segment_ids, q_offset):
    """``q [B, T, N, D]`` (nope and rope parts side by side), head-major ``k [B, N, S, D]``, ``v [B, N, S, Dv]`` →
    ``[B, T, N, Dv]`` fp32 (or wider)."""
    f32 = acc_dtype(q, k, v)
    s = jnp.einsum("btnd,bnsd->bnts", q, k, precision=HIGHEST, preferred_element_type=f32) * scale
    T, S = q.shape[1], k.shape[2]
    mask = (jnp.arange(S)[None, :] <= q_offset + jnp.arange(T)[:, None])[None, None]
    if segment_ids is not None:
        kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (segment_ids[:, None, :, None] == kv_seg[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bnts,bnsd->btnd", p, v.astype(f32), precision=HIGHEST, preferred_element_type=f32)


def _mla_attention_query_blocks(q, k, v, scale, segment_ids, kv_segment_ids, q_offset, q_block):
    """:func:`mla_attention` over blocks of ``q_block`` queries (T padded up to a multiple; the padding rows copy
    the last row's segment id, so none is fully masked, and are dropped)."""
    B, T = q.shape[:2]
    n = -(-T // q_block)
    pad = n * q_block - T
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids

    def blocks(x, mode="constant"):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode=mode)
        return jnp.moveaxis(x.reshape(B, n, q_block, *x.shape[2:]), 1, 0)        # [n, B, q_block, …]

    qs = (blocks(q), None if segment_ids is None else blocks(segment_ids, "edge"))
    offsets = q_offset + q_block * jnp.arange(n)

    @jax.checkpoint
    def one(args):
        qb, seg, off = args
        return _mla_attention_dense(qb, k, v, scale, seg, kv_seg, off)

    o = jax.lax.map(one, (*qs, offsets))                                             # [n, B, q_block, N, Dv]
    o = jnp.moveaxis(o, 0, 1).reshape(B, n * q_block, *o.shape[3:])
    return o[:, :T]


def _online_softmax_latent(ql, qr, fetch, n_blocks, block, q_pos, kv_len):
    """The blockwise online-softmax loop shared by the contiguous and the paged latent attention: ``fetch(j)``
    returns key block j as ``(c [B, block, R], k_r [B, block, Dr])`` fp32 (keys ``j·block …``)."""
    B, T, N, R = ql.shape
    f32 = jnp.float32

    def body(j, carry):
        m, l, acc = carry
        start = j * block
        c, kr = fetch(j)
        s = jnp.einsum("btnr,bsr->btns", ql, c, precision=HIGHEST)
        if qr.shape[-1]:
            s = s + jnp.einsum("btnd,bsd->btns", qr, kr, precision=HIGHEST)
        pos = start + jnp.arange(block)
        ok = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < kv_len[:, None, None])  # [B,T,blk]
        s = jnp.where(ok[:, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("btns,bsr->btnr", p, c, precision=HIGHEST)
        return m_new, l, acc

    init = (jnp.full((B, T, N), -jnp.inf, f32), jnp.zeros((B, T, N), f32), jnp.zeros((B, T, N, R), f32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def mla_latent_attention(q_latent: jax.Array, q_rope: jax.Array, c_kv: jax.Array, k_rope: jax.Array,
                         q_pos: jax.Array, kv_len: jax.Array, scale: float, block: int = 512) -> jax.Array:
    """MLA in absorbed form over a latent cache, blockwise with an online softmax (never a full score matrix).

    With ``k_n = c_kv W_kᵀ`` and ``v = c_kv W_v`` per head, ``q_n·k_n = (q_n W_k)·c_kv``, so the queries are
    brought into the latent space once (``q_latent = q_n W_k``, per head) and keys/values are never expanded:
    ``s = (q_latent·c_kv + q_r·k_r) · scale``, ``o_latent = softmax(s) c_kv``; the caller applies ``W_v``.

    ``q_latent [B, T, N, R]``, ``q_rope [B, T, N, Dr]``, cache ``c_kv [B, L, R]``, ``k_rope [B, L, Dr]``;
    ``q_pos [B, T]`` each query's position (it sees keys ``τ ≤ q_pos``), ``kv_len [B]`` filled cache length
    (keys ``τ ≥ kv_len`` are masked). Key blocks of ``block`` (dividing L) are visited only up to ``max(kv_len)``,
    so the work grows with the context actually used, not the cache's bucket. Returns ``o_latent [B, T, N, R]``
    fp32; peak extra memory ``B·T·N·block`` scores.
    """
    L = c_kv.shape[1]
    if L % block:
        block = L
    f32 = jnp.float32

    def fetch(j):
        c = jax.lax.dynamic_slice_in_dim(c_kv, j * block, block, axis=1).astype(f32)       # [B, blk, R]
        return c, jax.lax.dynamic_slice_in_dim(k_rope, j * block, block, axis=1).astype(f32)

    n_blocks = (jnp.max(kv_len) + block - 1) // block
    return _online_softmax_latent(q_latent.astype(f32) * scale, q_rope.astype(f32) * scale, fetch, n_blocks,
                                  block, q_pos, kv_len)


def paged_block_pages(max_pages: int, page_size: int, block: int = 512) -> int:
    """Pages per attention block: the most pages (dividing ``max_pages``) whose tokens fit in ``block``."""
    best = 1
    for d in range(1, max_pages + 1):
        if max_pages % d == 0 and d * page_size <= max(block, page_size):
            best = d
    return best


def mla_paged_latent_attention(q_latent: jax.Array, q_rope: jax.Array, pool_c_kv: jax.Array, pool_k_rope: jax.Array,
                               page_table: jax.Array, q_pos: jax.Array, kv_len: jax.Array, scale: float,
                               block: int = 512) -> jax.Array:
    """:func:`mla_latent_attention` over a **paged** latent cache.

    The cache is a pool of fixed-size pages ``pool_c_kv [P, page, R]``, ``pool_k_rope [P, page, Dr]`` shared by all
    sequences; ``page_table [B, max_pages]`` int32 lists row b's pages in order (token τ of row b lives at
    ``pool[page_table[b, τ // page], τ % page]``; entries past the sequence may name any page, they are masked).
    Each key block gathers only its pages, so memory traffic follows the used context. Returns
    ``o_latent [B, T, N, R]`` fp32.
    """
    _, page, _ = pool_c_kv.shape
    max_pages = page_table.shape[1]
    ppb = paged_block_pages(max_pages, page, block)
    blk = ppb * page
    B = page_table.shape[0]
    f32 = jnp.float32

    def fetch(j):
        pages = jax.lax.dynamic_slice_in_dim(page_table, j * ppb, ppb, axis=1)              # [B, ppb]
        c = pool_c_kv[pages].reshape(B, blk, -1).astype(f32)
        return c, pool_k_rope[pages].reshape(B, blk, -1).astype(f32)

    n_blocks = (jnp.max(kv_len) + blk - 1) // blk
    return _online_softmax_latent(q_latent.astype(f32) * scale, q_rope.astype(f32) * scale, fetch, n_blocks,
                                  blk, q_pos, kv_len)
