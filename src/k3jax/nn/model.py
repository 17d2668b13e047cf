"""Decoder layer, Block AttnRes stream (spec §2, §6) and the causal LM."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.nn.kda import KDAttention
from k3jax.nn.layers import KeyGen, Proj, RMSNorm
from k3jax.nn.mla import MLAttention
from k3jax.nn.moe import MLP, MoE
from k3jax.ops.balance import QBSettings
from k3jax.ops.attnres import attnres_mix


class AttnResSite(nnx.Module):
    """One AttnRes read: the norm gain ``{site}_norm.weight [H]`` and pseudo-query ``{site}_proj.weight [1, H]``.

    The pseudo-query starts at zero, so every read starts as a uniform average of its candidates.
    """

    def __init__(self, cfg: K3Config):
        dt = jnp.dtype(cfg.dtype)
        self.eps = cfg.rms_norm_eps
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), dt))
        self.proj = nnx.Param(jnp.zeros((1, cfg.hidden_size), dt))

    def __call__(self, blocks: list[jax.Array], partial: jax.Array) -> jax.Array:
        return attnres_mix(blocks, partial, self.norm[...], self.proj[...], self.eps)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: K3Config, idx: int, *, keys: KeyGen):
        dt = jnp.dtype(cfg.dtype)
        self.idx = idx
        self.kind = cfg.layer_types[idx]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dt)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dt)
        self.self_attn = KDAttention(cfg, keys=keys) if self.kind == "kda" else MLAttention(cfg, keys=keys)
        self.is_moe = cfg.is_moe_layer(idx)
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg, keys=keys)
        else:
            self.mlp = MLP(cfg, cfg.hidden_size, cfg.intermediate_size, keys=keys)
        self.attn_res = cfg.attn_res
        if self.attn_res:
            self.block_size = cfg.attn_res_block_size
            self.self_attention_res = AttnResSite(cfg)
            self.mlp_res = AttnResSite(cfg)

    def attention(self, a: jax.Array, segment_ids: jax.Array | None, kda_kernel: str) -> jax.Array:
        h = self.input_layernorm(a)
        if self.kind == "kda":
            return self.self_attn(h, kernel=kda_kernel, segment_ids=segment_ids)
        return self.self_attn(h, segment_ids=segment_ids)

    def ffn(self, m: jax.Array, moe_grouped: bool, balance: QBSettings | None) -> tuple[jax.Array, tuple | None]:
        h = self.post_attention_layernorm(m)
        if self.is_moe:
            y, counts, new_bias = self.block_sparse_moe(h, grouped=moe_grouped, balance=balance)
            return y, (counts, new_bias)
        return self.mlp(h), None

    def __call__(self, x: jax.Array, blocks: list[jax.Array], *, segment_ids: jax.Array | None = None,
                 kda_kernel: str = "chunked", moe_grouped: bool = True, balance: QBSettings | None = None
                 ) -> tuple[jax.Array, list[jax.Array], tuple | None]:
        """Returns ``(output partial sum, blocks, (expert counts, QB bias for the next step) or None)``."""
        return self.residual_stream(x, blocks, lambda a: self.attention(a, segment_ids, kda_kernel),
                                    moe_grouped, balance)

    def cached(self, x: jax.Array, blocks: list[jax.Array], cache: tuple, pos: jax.Array, n_new: jax.Array
               ) -> tuple[jax.Array, list[jax.Array], tuple]:
        """The layer over a chunk that continues a cached sequence (see ``KDAttention.cached``/``MLAttention.cached``);
        returns ``(output partial sum, blocks, new cache)``."""
        new = []

        def attend(a: jax.Array) -> jax.Array:
            y, c = self.self_attn.cached(self.input_layernorm(a), cache, pos, n_new)
            new.append(c)
            return y

        x, blocks, _ = self.residual_stream(x, blocks, attend, True, None)
        return x, blocks, new[0]

    def residual_stream(self, x: jax.Array, blocks: list[jax.Array], attend, moe_grouped: bool,
                        balance: QBSettings | None) -> tuple[jax.Array, list[jax.Array], tuple | None]:
        """Spec §2 steps 1–8: AttnRes reads (or a plain residual), attention via ``attend``, then the FFN."""
        if not self.attn_res:
            x = x + attend(x)
            y, counts = self.ffn(x, moe_grouped, balance)
            return x + y, blocks, counts
        p = x
        a = self.self_attention_res(blocks, p) if blocks else p          # identity only at layer 0
        sealed = self.idx % self.block_size == 0
        if sealed:                                                       # seal after the read, before attention
            blocks = blocks + [p]
        y = attend(a)
        p = y if sealed else p + y                                       # the partial sum restarts after a seal
        m = self.mlp_res(blocks, p)
        f, counts = self.ffn(m, moe_grouped, balance)
        return p + f, blocks, counts


class CausalLMOutput(NamedTuple):
    logits: jax.Array              # [B, T, vocab]
    expert_counts: jax.Array       # [n_moe_layers, num_experts] int32 (tokens routed to each expert)
    balance_bias: jax.Array | None = None   # [n_moe_layers, num_experts] fp32: Quantile Balancing's next bias


class K3Model(nnx.Module):
    """Embedding → decoder layers (KDA/MLA × dense/MoE, AttnRes stream) → output read → final norm."""

    def __init__(self, cfg: K3Config, *, keys: KeyGen):
        dt = jnp.dtype(cfg.dtype)
        self.embed_tokens = nnx.Param(
            (cfg.initializer_range * jax.random.normal(keys(), (cfg.vocab_size, cfg.hidden_size),
                                                       jnp.float32)).astype(dt))
        self.layers = nnx.List([DecoderLayer(cfg, i, keys=keys) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dt)
        self.attn_res = cfg.attn_res
        if self.attn_res:
            self.output_attn_res = AttnResSite(cfg)

    def __call__(self, input_ids: jax.Array, *, segment_ids: jax.Array | None = None, kda_kernel: str = "chunked",
                 moe_grouped: bool = True, balance: QBSettings | None = None) -> tuple[jax.Array, list[tuple]]:
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        blocks: list[jax.Array] = []
        counts = []
        for layer in self.layers:
            x, blocks, c = layer(x, blocks, segment_ids=segment_ids, kda_kernel=kda_kernel, moe_grouped=moe_grouped,
                                 balance=balance)
            if c is not None:
                counts.append(c)
        if self.attn_res:
            x = self.output_attn_res(blocks, x)
        return self.norm(x), counts

    def cached(self, input_ids: jax.Array, caches: list[tuple], pos: jax.Array, n_new: jax.Array
               ) -> tuple[jax.Array, list[tuple]]:
        """Final hidden states ``[B, T, hidden]`` of a chunk continuing cached sequences, and the new caches."""
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        blocks: list[jax.Array] = []
        new = []
        for layer, cache in zip(self.layers, caches):
            x, blocks, c = layer.cached(x, blocks, cache, pos, n_new)
            new.append(c)
        if self.attn_res:
            x = self.output_attn_res(blocks, x)
        return self.norm(x), new


class K3ForCausalLM(nnx.Module):
    """The K3 / Kimi Linear text model. ``model(input_ids [B, T] int32)`` → logits ``[B, T, vocab]``."""

    def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs | None = None):
        cfg.validate()
        keys = KeyGen(rngs.params() if rngs is not None else jax.random.key(0))
        self.config = cfg
        self.model = K3Model(cfg, keys=keys)
        if not cfg.tie_word_embeddings:
            self.lm_head = Proj(cfg.hidden_size, cfg.vocab_size, dtype=jnp.dtype(cfg.dtype),
                                init_std=cfg.initializer_range, keys=keys)

    def forward(self, input_ids: jax.Array, *, segment_ids: jax.Array | None = None, kda_kernel: str = "chunked",
                moe_grouped: bool = True, balance: QBSettings | None = None) -> CausalLMOutput:
        """Logits and per-MoE-layer expert token counts (what load balancing consumes); with ``balance`` also
        each MoE layer's Quantile Balancing bias for the next step (computed from this batch, not used on it). ``segment_ids [B, T]`` marks packed documents."""
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids: expected integer ids of shape [B, T], got {input_ids.dtype}{input_ids.shape}")
        h, counts = self.model(input_ids, segment_ids=segment_ids, kda_kernel=kda_kernel, moe_grouped=moe_grouped,
                               balance=balance)
        logits = self.head(h)
        E = self.config.num_experts or 0
        c = jnp.stack([x[0] for x in counts]) if counts else jnp.zeros((0, E), jnp.int32)
        nb = jnp.stack([x[1] for x in counts]) if (counts and balance is not None) else None
        return CausalLMOutput(logits, c, nb)

    def head(self, h: jax.Array) -> jax.Array:
        """Logits ``[..., vocab]`` from final hidden states."""
        if self.config.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", h, self.model.embed_tokens[...].astype(h.dtype))
        return self.lm_head(h)

    def forward_cached(self, input_ids: jax.Array, caches: list[tuple], pos: jax.Array, n_new: jax.Array
                       ) -> tuple[jax.Array, list[tuple]]:
        """Logits ``[B, T, vocab]`` for a chunk of ``input_ids [B, T]`` at positions ``pos[b] + t`` continuing the
        sequences held in ``caches`` (one per layer, see :mod:`k3jax.infer.cache`); row b's first ``n_new[b]``
        tokens are real. Returns the logits and the updated caches."""
        h, new = self.model.cached(input_ids, caches, pos, n_new)
        return self.head(h), new

    def __call__(self, input_ids: jax.Array, **kw) -> jax.Array:
        return self.forward(input_ids, **kw).logits
