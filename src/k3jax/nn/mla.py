"""Gated NoPE multi-head latent attention (spec §5)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.nn.cache import MLACache, PagedMLACache
from k3jax.nn.layers import KeyGen, Proj, RMSNorm, TokenGroups
from k3jax.ops.attention import mla_attention
from k3jax.parallel.context import ContextParallel, mla_attention_context_parallel

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm are built without an eps in the release (spec §3)


class MLAttention(nnx.Module):
    """``x [B, T, hidden]`` (normed) → ``[B, T, hidden]``.

    c_q = RMSNorm(x W_qa) (or no q LoRA), Q = c_q W_qb → (q_n, q_r); [c_kv | k_r] = x W_kva, c_kv normed;
    [k_n | v] = c_kv W_kvb; softmax((q_n·k_n + q_r·k_r)/√(d_n+d_r)) v; optional σ(x W_g) gate; o_proj.

    With a cache, token-wise parts (:meth:`queries`, :meth:`latent`, :meth:`absorb`, :meth:`expand`,
    :meth:`output`) and the per-sequence append + attention (:meth:`attend_cache`) are separate methods, shared by
    :meth:`__call__` and :meth:`forward_groups` (several row groups, the token-wise parts run once on all tokens).
    """

    def __init__(self, cfg: K3Config, *, keys: KeyGen):
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        dn, dr, dv, r_kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        dt, std = jnp.dtype(cfg.dtype), cfg.initializer_range
        proj = functools.partial(Proj, dtype=dt, init_std=std, keys=keys)
        self.nh, self.dn, self.dr, self.dv, self.r_kv = nh, dn, dr, dv, r_kv
        self.scale = (dn + dr) ** -0.5
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = proj(H, cfg.q_lora_rank, axes=("embed", "q_lora"))
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dtype=dt)
            self.q_b_proj = proj(cfg.q_lora_rank, (nh, dn + dr), axes=("q_lora", "heads", None))
        else:
            self.q_proj = proj(H, (nh, dn + dr), axes=("embed", "heads", None))
        self.kv_a_proj_with_mqa = proj(H, r_kv + dr, axes=("embed", "kv_lora"))
        self.kv_a_layernorm = RMSNorm(r_kv, LORA_NORM_EPS, dtype=dt)
        self.kv_b_proj = proj(r_kv, (nh, dn + dv), axes=("kv_lora", "heads", None))
        self.output_gate = bool(cfg.mla_use_output_gate)
        if self.output_gate:
            self.g_proj = proj(H, (nh, dv), axes=("embed", "heads", None))
        self.o_proj = proj((nh, dv), H, axes=("heads", None, "embed"))

    def queries(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        return q[..., : self.dn], q[..., self.dn:]

    def latent(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The per-token cache content: normalised latent ``c_kv [.., r_kv]`` and the raw shared key ``k_r``."""
        ckv = self.kv_a_proj_with_mqa(x)
        return self.kv_a_layernorm(ckv[..., : self.r_kv]), ckv[..., self.r_kv:]

    def absorb(self, q_n: jax.Array, dtype) -> jax.Array:
        """Queries moved into the latent space: ``q_lat = q_n W_k`` ``[.., T, nh, r_kv]`` (fp32 or wider; ``dtype``:
        the activations')."""
        f32 = jnp.promote_types(dtype, jnp.float32)
        return jnp.einsum("btnd,rnd->btnr", q_n.astype(f32), self.kv_b_proj.kernel[...][..., : self.dn].astype(f32),
                          precision=jax.lax.Precision.HIGHEST)

    def expand(self, o_lat: jax.Array, dtype) -> jax.Array:
        """Latent outputs back to the heads' values: ``o = o_lat W_v`` ``[.., T, nh, dv]`` in ``dtype``."""
        f32 = jnp.promote_types(dtype, jnp.float32)
        return jnp.einsum("btnr,rnd->btnd", o_lat, self.kv_b_proj.kernel[...][..., self.dn:].astype(f32),
                          precision=jax.lax.Precision.HIGHEST).astype(dtype)

    def attend_cache(self, q_lat: jax.Array, q_r: jax.Array, c_kv: jax.Array, k_r: jax.Array, cache: MLACache,
                     pos: jax.Array, n_new: jax.Array) -> tuple[jax.Array, MLACache]:
        """The sequence mixing of one row group against its cache: append the chunk's latents ``c_kv [B, T, R]``,
        ``k_r [B, T, Dr]`` at ``pos[b] + t`` (first ``n_new[b]`` tokens), then the absorbed attention of
        ``q_lat [B, T, nh, R]``, ``q_r`` over positions ``< pos + n_new``, causal → ``(o_lat [B, T, nh, R],
        new cache)``."""
        T = q_lat.shape[1]
        cache = cache.append(c_kv, k_r, pos, n_new)
        q_pos = pos[:, None] + jnp.arange(T, dtype=pos.dtype)[None, :]
        return cache.attend(q_lat, q_r, q_pos, pos + n_new, self.scale), cache

    def output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """Heads ``o [.., T, nh, dv]`` → optional σ(x W_g) gate → o_proj → ``[.., T, hidden]``."""
        if self.output_gate:
            o = o * jax.nn.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def __call__(self, x: jax.Array, *, cache: MLACache | None = None, pos: jax.Array | None = None,
                 n_new: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 cp: ContextParallel | None = None) -> tuple[jax.Array, MLACache | None]:
        """``x [B, T, hidden]`` → ``(y [B, T, hidden], new cache or None)``.

        Without a cache: causal attention over the sequence in expanded form (``segment_ids [B, T]`` keeps packed
        documents apart). With ``cache`` (:class:`MLACache`): the chunk sits at positions ``pos[b] + t`` and only
        its first ``n_new[b]`` tokens are real; their latents are appended (padding writes nothing), then it
        attends over positions ``< pos + n_new`` causally in absorbed form — the queries move into the latent
        space (``q_n W_k``), keys and values are never expanded per head.

        ``cp`` (without a cache): time split over the mesh's context axis; each rank all-gathers the latent.
        """
        q_n, q_r = self.queries(x)
        c_kv, k_r = self.latent(x)
        if cache is None and cp is not None and cp.active:
            def expand(w, c):
                kv = jnp.einsum("btr,rnd->btnd", c, w.astype(c.dtype))
                return kv[..., : self.dn], kv[..., self.dn:]

            o = mla_attention_context_parallel(q_n, q_r, c_kv, k_r, expand, self.kv_b_proj.kernel[...],
                                               self.scale, cp, segment_ids)
        elif cache is None:
            kv = self.kv_b_proj(c_kv)
            k_n, v = kv[..., : self.dn], kv[..., self.dn:]
            o = mla_attention(q_n, q_r, k_n, k_r, v, self.scale, segment_ids)        # [B, T, nh, dv]
        else:
            B, T = x.shape[:2]
            if n_new is None:
                n_new = jnp.full((B,), T, jnp.int32)
            o_lat, cache = self.attend_cache(self.absorb(q_n, x.dtype), q_r, c_kv, k_r, cache, pos, n_new)
            o = self.expand(o_lat, x.dtype)
        return self.output(o, x), cache

    def forward_groups(self, x: jax.Array, groups: TokenGroups, caches: tuple[MLACache | PagedMLACache, ...],
                       pos: tuple[jax.Array, ...], n_new: tuple[jax.Array, ...]
                       ) -> tuple[jax.Array, tuple[MLACache | PagedMLACache, ...]]:
        """Several row groups in one call: ``x [1, N, hidden]`` holds every group's tokens (:class:`TokenGroups`);
        the projections, the absorption (``q_n W_k``, ``o_lat W_v``) and the output run once on all N tokens, the
        append + attention (:meth:`attend_cache`) per group at ``pos[g] [B_g]`` with ``n_new[g]``.

        Paged caches share one page pool: group g appends into the pool group g−1 returned, and every returned
        cache carries the final pool (each group's page-table rows, all groups' tokens), so writing the groups'
        caches back into the slot pool in any order keeps every token. Returns ``(y [1, N, hidden], caches)``."""
        q_n, q_r = self.queries(x)
        c_kv, k_r = self.latent(x)
        q_lat = self.absorb(q_n, x.dtype)
        outs, new = [], []
        pool = None                                                       # the shared pages, threaded
        for i, (c, p, n) in enumerate(zip(caches, pos, n_new, strict=True)):
            paged = isinstance(c, PagedMLACache)
            if paged and pool is not None:
                c = c.with_pool(*pool)
            part = lambda a: groups.part(a, i)  # noqa: E731
            o_lat, c = self.attend_cache(part(q_lat), part(q_r), part(c_kv), part(k_r), c, p, n)
            if paged:
                pool = c.pool
            outs.append(o_lat)
            new.append(c)
        new = [c.with_pool(*pool) if isinstance(c, PagedMLACache) else c for c in new]
        return self.output(self.expand(groups.join(outs), x.dtype), x), tuple(new)
