"""FFNs (spec §7): the gated dense MLP and the (Stable Latent) MoE block."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.nn.layers import KeyGen, PackedWeight, Proj, RMSNorm, RouterBias, param
from k3jax.ops.grouped import moe_grouped, moe_per_token
from k3jax.parallel.ep import ExpertParallel
from k3jax.ops.mx import mxfp4_dequantize, mxfp4_quantize_traced
from k3jax.ops.precision import acc_dtype
from k3jax.ops.routing import expert_counts, router_topk
from k3jax.ops.situ import glu


def activation(cfg: K3Config):
    """The config's gated activation as ``act(gate_preact, up_preact)``."""
    return functools.partial(glu, hidden_act=cfg.hidden_act, beta=cfg.activation_situ_beta,
                             beta_lin=cfg.activation_situ_linear_beta)


class MLP(nnx.Module):
    """Gated MLP ``act(x W_g, x W_u) W_d`` (dense layers and the shared experts)."""

    def __init__(self, cfg: K3Config, hidden: int, intermediate: int, *, keys: KeyGen):
        proj = functools.partial(Proj, dtype=jnp.dtype(cfg.dtype), init_std=cfg.initializer_range, keys=keys)
        self.act = activation(cfg)
        self.gate_proj = proj(hidden, intermediate, axes=("embed", "mlp"))
        self.up_proj = proj(hidden, intermediate, axes=("embed", "mlp"))
        self.down_proj = proj(intermediate, hidden, axes=("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Experts(nnx.Module):
    """Routed experts stacked on a leading expert axis: ``w1, w3 [E, D, I]`` (gate, up), ``w2 [E, I, D]``.

    With ``expert_dtype="mxfp4"`` they are held as the release stores them — ``{w}_packed [E, O, I/2]`` and
    ``{w}_scale [E, O, I/32]`` uint8 in the PyTorch ``[out, in]`` layout — and dequantized inside the jitted expert
    matmul (groups along the input axis, dequantized before the transpose).
    """

    def __init__(self, cfg: K3Config, *, keys: KeyGen):
        E, D, I = cfg.num_experts, cfg.expert_in_dim, cfg.moe_intermediate_size
        std = cfg.initializer_range
        self.packed = cfg.expert_dtype == "mxfp4"
        if self.packed:
            for name, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
                w = std * jax.random.normal(keys(), (E, o, i), jnp.float32)
                p, s = mxfp4_quantize_traced(w)
                setattr(self, f"{name}_packed", PackedWeight(p, axes=("experts", None, None)))
                setattr(self, f"{name}_scale", PackedWeight(s, axes=("experts", None, None)))
            return
        edt = jnp.dtype(cfg.expert_dtype or cfg.dtype)
        init = lambda shape: param(  # noqa: E731
            (std * jax.random.normal(keys(), shape, jnp.float32)).astype(edt), ("experts", None, None),
            muon="batched", fan_in=2)          # [E, in, out]: one matrix per expert
        self.w1, self.w3, self.w2 = init((E, D, I)), init((E, D, I)), init((E, I, D))

    def weights(self, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(w1, w3 [E, D, I], w2 [E, I, D])`` in ``dtype`` (dequantized when packed)."""
        if not self.packed:
            return self.w1[...].astype(dtype), self.w3[...].astype(dtype), self.w2[...].astype(dtype)
        deq = lambda n: jnp.swapaxes(  # noqa: E731
            mxfp4_dequantize(getattr(self, f"{n}_packed")[...], getattr(self, f"{n}_scale")[...], dtype), -1, -2)
        return deq("w1"), deq("w3"), deq("w2")


class MoE(nnx.Module):
    """``block_sparse_moe``: router on full-width x; routed experts (in a latent space when LatentMoE);
    fp32 combine; latent RMSNorm; latent up-projection; plus the full-width shared experts.

    Returns ``(y [B, T, hidden], RoutingStats)``.
    """

    def __init__(self, cfg: K3Config, *, keys: KeyGen):
        H, E = cfg.hidden_size, cfg.num_experts
        dt, std = jnp.dtype(cfg.dtype), cfg.initializer_range
        self.cfg_route = dict(k=cfg.num_experts_per_token, activation=cfg.moe_router_activation_func,
                              renormalize=cfg.moe_renormalize, scaling_factor=cfg.routed_scaling_factor,
                              n_group=cfg.num_expert_group if cfg.use_grouped_topk else 1,
                              topk_group=cfg.topk_group if cfg.use_grouped_topk else 1)
        self.use_bias = cfg.topk_method == "noaux_tc"
        self.num_experts = E
        self.act = activation(cfg)
        proj = functools.partial(Proj, dtype=dt, init_std=std, keys=keys)
        self.gate = proj(H, E, axes=("embed", "router"))        # every token needs every score: not split
        self.e_score_correction_bias = RouterBias(jnp.zeros((E,), jnp.promote_types(dt, jnp.float32)),
                                                  axes=(None,))
        self.top_k = cfg.num_experts_per_token
        self.latent = cfg.latent_moe
        if self.latent:
            L = cfg.routed_expert_hidden_size
            self.routed_expert_down_proj = proj(H, L, axes=("embed", "latent"))
            self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps, dtype=dt) if cfg.latent_moe_use_norm else None
            self.routed_expert_up_proj = proj(L, H, axes=("latent", "embed"))
        self.experts = Experts(cfg, keys=keys)
        n_sh = cfg.num_shared_experts
        self.shared_experts = MLP(cfg, H, n_sh * cfg.moe_intermediate_size, keys=keys) if n_sh else None

    def router_logits(self, x: jax.Array) -> jax.Array:
        f = acc_dtype(x)
        return jnp.einsum("nd,de->ne", x.astype(f), self.gate.kernel[...].astype(f),
                          precision=jax.lax.Precision.HIGHEST)

    def __call__(self, x: jax.Array, *, grouped: bool = True, ep: ExpertParallel | None = None,
                 router_scores: bool = False) -> tuple[jax.Array, "RoutingStats"]:
        """``x [B, T, hidden]`` → ``(y [B, T, hidden], RoutingStats)``. ``ep``: routed experts over a mesh's
        expert axis; ``grouped=False`` runs the per-token reference; ``router_scores`` also returns the
        (gradient-free) sigmoid scores that Quantile Balancing solves from (training only)."""
        B, T, H = x.shape
        xf = x.reshape(B * T, H)
        logits = self.router_logits(xf)
        bias = self.e_score_correction_bias[...] if self.use_bias else None
        w, idx = router_topk(logits, bias, **self.cfg_route)
        z = self.routed_expert_down_proj(xf) if self.latent else xf
        weights = self.experts.weights(z.dtype)
        fn = moe_grouped if grouped else moe_per_token
        if ep is not None and ep.active:
            y = ep(z, idx, w, *weights, self.act).astype(x.dtype)
        elif ep is not None:                             # a mesh without an expert axis: each device its own tokens
            y = ep.local(fn, z, idx, w, *weights, self.act).astype(x.dtype)
        else:
            y = fn(z, idx, w, *weights, self.act).astype(x.dtype)
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf)
        scores = jax.nn.sigmoid(jax.lax.stop_gradient(logits)).astype(jnp.float32) if router_scores else None
        return y.reshape(B, T, H), RoutingStats(expert_counts(idx, self.num_experts), scores)


class RoutingStats(NamedTuple):
    """What one MoE layer reports about its routing: ``counts [E]`` int32 (tokens per expert) and, when asked
    for, ``scores [N, E]`` fp32 sigmoid router scores (no gradient) for the balancing step in ``train/``."""
    counts: jax.Array
    scores: jax.Array | None = None
