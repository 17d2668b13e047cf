"""Gated NoPE multi-head latent attention (spec §5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.nn.layers import KeyGen, Proj, RMSNorm
from k3jax.ops.attention import mla_attention, mla_latent_attention

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm are built without an eps in the release (spec §3)


class MLAttention(nnx.Module):
    """``x [B, T, hidden]`` (normed) → ``[B, T, hidden]``.

    c_q = RMSNorm(x W_qa) (or no q LoRA), Q = c_q W_qb → (q_n, q_r); [c_kv | k_r] = x W_kva, c_kv normed;
    [k_n | v] = c_kv W_kvb; softmax((q_n·k_n + q_r·k_r)/√(d_n+d_r)) v; optional σ(x W_g) gate; o_proj.
    """

    def __init__(self, cfg: K3Config, *, keys: KeyGen):
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        dn, dr, dv, r_kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        dt, std = jnp.dtype(cfg.dtype), cfg.initializer_range
        self.nh, self.dn, self.dr, self.dv, self.r_kv = nh, dn, dr, dv, r_kv
        self.scale = (dn + dr) ** -0.5
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Proj(H, cfg.q_lora_rank, dtype=dt, init_std=std, keys=keys)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dtype=dt)
            self.q_b_proj = Proj(cfg.q_lora_rank, (nh, dn + dr), dtype=dt, init_std=std, keys=keys)
        else:
            self.q_proj = Proj(H, (nh, dn + dr), dtype=dt, init_std=std, keys=keys)
        self.kv_a_proj_with_mqa = Proj(H, r_kv + dr, dtype=dt, init_std=std, keys=keys)
        self.kv_a_layernorm = RMSNorm(r_kv, LORA_NORM_EPS, dtype=dt)
        self.kv_b_proj = Proj(r_kv, (nh, dn + dv), dtype=dt, init_std=std, keys=keys)
        self.output_gate = bool(cfg.mla_use_output_gate)
        if self.output_gate:
            self.g_proj = Proj(H, (nh, dv), dtype=dt, init_std=std, keys=keys)
        self.o_proj = Proj((nh, dv), H, dtype=dt, init_std=std, keys=keys)

    def queries(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        return q[..., : self.dn], q[..., self.dn:]

    def latent(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The per-token cache content: normalised latent ``c_kv [.., r_kv]`` and the raw shared key ``k_r``."""
        ckv = self.kv_a_proj_with_mqa(x)
        return self.kv_a_layernorm(ckv[..., : self.r_kv]), ckv[..., self.r_kv:]

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
        q_n, q_r = self.queries(x)
        c_kv, k_r = self.latent(x)
        kv = self.kv_b_proj(c_kv)
        k_n, v = kv[..., : self.dn], kv[..., self.dn:]
        o = mla_attention(q_n, q_r, k_n, k_r, v, self.scale, segment_ids)        # [B, T, nh, dv]
        if self.output_gate:
            o = o * jax.nn.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def cached(self, x: jax.Array, cache: tuple[jax.Array, jax.Array], pos: jax.Array, n_new: jax.Array
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention for ``x [B, T, hidden]`` at positions ``pos[b] + t`` against a latent cache, absorbed form.

        ``cache = (c_kv [B, L, kv_lora_rank], k_r [B, L, qk_rope_head_dim])``; the first ``n_new[b]`` tokens of
        row b are real (the rest padding, written but masked until overwritten). Writes this chunk's latents at
        ``pos``, then attends over positions ``< pos + n_new`` (causally) without expanding keys or values.
        Returns ``(y [B, T, hidden], new cache)``.
        """
        c_cache, r_cache = cache
        q_n, q_r = self.queries(x)
        c_kv, k_r = self.latent(x)
        write = jax.vmap(lambda buf, new, p: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), p, 0))
        c_cache, r_cache = write(c_cache, c_kv, pos), write(r_cache, k_r, pos)
        w = self.kv_b_proj.kernel[...]                                            # [R, nh, dn + dv]
        f32 = jnp.promote_types(x.dtype, jnp.float32)
        q_lat = jnp.einsum("btnd,rnd->btnr", q_n.astype(f32), w[..., : self.dn].astype(f32),
                           precision=jax.lax.Precision.HIGHEST)
        T = x.shape[1]
        q_pos = pos[:, None] + jnp.arange(T, dtype=pos.dtype)[None, :]
        o_lat = mla_latent_attention(q_lat, q_r, c_cache, r_cache, q_pos, pos + n_new, self.scale)
        o = jnp.einsum("btnr,rnd->btnd", o_lat, w[..., self.dn:].astype(f32),
                       precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
        if self.output_gate:
            o = o * jax.nn.sigmoid(self.g_proj(x))
        return self.o_proj(o), (c_cache, r_cache)
