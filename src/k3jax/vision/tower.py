"""MoonViT-V2 tower and patchmergerv2 projector as NNX modules (K3_VISION_SPEC §2–6), over the pure ops in
:mod:`k3jax.ops.vision`. Variables follow the release names (``vision_tower.patch_embed.proj.weight`` →
``vision_tower.patch_embed.proj.kernel [3p², D]``, …); nothing has a bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.nn.layers import KeyGen, Proj, RMSNorm, param
from k3jax.ops.vision import add_time_term, gelu_erf, gelu_tanh, packed_attention, position_embedding, rope2d, \
    sd2_tpool
from k3jax.vision.config import VisionConfig
from k3jax.vision.packing import PackedPatches


def _proj(i: int, o: int, dt, keys: KeyGen) -> Proj:
    return Proj(i, o, axes=(None, None), dtype=dt, init_std=i ** -0.5, keys=keys, muon=None)


class PatchEmbed(nnx.Module):
    """``x = P_flat · W_peᵀ + pos``: the stride-p conv as one matrix, plus the ``divided_fixed`` position term."""

    def __init__(self, cfg: VisionConfig, dt, keys: KeyGen):
        self.proj = _proj(cfg.patch_dim, cfg.vt_hidden_size, dt, keys)
        self.pos_emb = param((0.02 * jax.random.normal(keys(), (cfg.init_pos_emb_height, cfg.init_pos_emb_width,
                                                                cfg.vt_hidden_size))).astype(dt), (None, None, None))
        self.frames = cfg.init_pos_emb_time

    def __call__(self, p: PackedPatches) -> jax.Array:
        x = self.proj(p.pixels.astype(self.proj.kernel.dtype))
        pos = position_embedding(self.pos_emb[...], p.taps, p.tap_weights)
        pos = add_time_term(pos, p.frame, p.time_on, self.frames)
        return (x.astype(pos.dtype) + pos).astype(x.dtype)


class VisionMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, dt, keys: KeyGen):
        self.fc0 = _proj(cfg.vt_hidden_size, cfg.vt_intermediate_size, dt, keys)
        self.fc1 = _proj(cfg.vt_intermediate_size, cfg.vt_hidden_size, dt, keys)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc1(gelu_tanh(self.fc0(x)))


class VisionBlock(nnx.Module):
    """``x += wo(attn(RoPE(q), RoPE(k), v))`` on ``RMS(x; norm0)``, then ``x += fc1(gelu_tanh(fc0(RMS(x; norm1))))``."""

    def __init__(self, cfg: VisionConfig, dt, keys: KeyGen):
        D, Q = cfg.vt_hidden_size, cfg.qkv_hidden_size
        self.n, self.d = cfg.vt_num_attention_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.norm0 = RMSNorm(D, cfg.vt_norm_eps, dtype=dt)
        self.wqkv = _proj(D, 3 * Q, dt, keys)
        self.wo = _proj(Q, D, dt, keys)
        self.norm1 = RMSNorm(D, cfg.vt_norm_eps, dtype=dt)
        self.mlp = VisionMLP(cfg, dt, keys)

    def __call__(self, x: jax.Array, p: PackedPatches, attn_block: int) -> jax.Array:
        L = x.shape[0]
        qkv = self.wqkv(self.norm0(x)).reshape(L, 3, self.n, self.d)
        q = rope2d(qkv[:, 0], p.rows, p.cols, self.theta)
        k = rope2d(qkv[:, 1], p.rows, p.cols, self.theta)
        o = packed_attention(q, k, qkv[:, 2], p.segment_ids, attn_block)
        x = x + self.wo(o.reshape(L, self.n * self.d))
        return x + self.mlp(self.norm1(x))


class VisionEncoderStack(nnx.Module):
    def __init__(self, cfg: VisionConfig, dt, keys: KeyGen):
        self.blocks = nnx.List([VisionBlock(cfg, dt, keys) for _ in range(cfg.vt_num_hidden_layers)])
        self.final_layernorm = RMSNorm(cfg.vt_hidden_size, cfg.vt_norm_eps, dtype=dt)   # an RMSNorm (spec §4.4)


class VisionTower(nnx.Module):
    """Packed patches (one bucket) → merged tokens ``[L/4, 4, D]`` (sd2_tpool, slot-major TL TR BL BR)."""

    def __init__(self, cfg: VisionConfig, *, dtype: str = "float32", keys: KeyGen | None = None):
        cfg.validate()
        dt = jnp.dtype(dtype)
        keys = keys or KeyGen(jax.random.key(0))
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg, dt, keys)
        self.encoder = VisionEncoderStack(cfg, dt, keys)

    def __call__(self, p: PackedPatches, *, attn_block: int = 512) -> jax.Array:
        x = self.patch_embed(p)
        for blk in self.encoder.blocks:
            x = blk(x, p, attn_block)
        x = self.encoder.final_layernorm(x)
        return sd2_tpool(x, p.merge_index, p.merge_weight)


class Projector(nnx.Module):
    """patchmergerv2: ``RMS(gelu_erf(z · proj.0ᵀ) · proj.2ᵀ; post_norm, 1e-5)`` on ``z [N, 4M]`` (slot-major)."""

    def __init__(self, cfg: VisionConfig, *, dtype: str = "float32", keys: KeyGen | None = None):
        dt = jnp.dtype(dtype)
        keys = keys or KeyGen(jax.random.key(1))
        m4 = cfg.merge * cfg.mm_hidden_size
        self.proj = nnx.List([_proj(m4, m4, dt, keys), _proj(m4, cfg.text_hidden_size, dt, keys)])
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.projector_ln_eps, dtype=dt)

    def __call__(self, merged: jax.Array) -> jax.Array:
        z = merged.reshape(merged.shape[0], -1)
        return self.post_norm(self.proj[1](gelu_erf(self.proj[0](z))))
