"""FFNs (spec §7): the gated dense MLP and the (Stable Latent) MoE block."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.nn.layers import BalanceState, KeyGen, PackedWeight, Proj, RMSNorm, RouterBias
from k3jax.ops.grouped import moe_grouped, moe_per_token
from k3jax.ops.balance import QBSettings, quantile_balance_update
from k3jax.parallel.ep import moe_expert_parallel
from k3jax.parallel.mesh import current_expert_parallel
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
        dt, std = jnp.dtype(cfg.dtype), cfg.initializer_range
        self.act = activation(cfg)
        self.gate_proj = Proj(hidden, intermediate, dtype=dt, init_std=std, keys=keys)
        self.up_proj = Proj(hidden, intermediate, dtype=dt, init_std=std, keys=keys)
        self.down_proj = Proj(intermediate, hidden, dtype=dt, init_std=std, keys=keys)

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
                setattr(self, f"{name}_packed", PackedWeight(p))
                setattr(self, f"{name}_scale", PackedWeight(s))
            return
        edt = jnp.dtype(cfg.expert_dtype or cfg.dtype)
        init = lambda shape: nnx.Param(  # noqa: E731
            (std * jax.random.normal(keys(), shape, jnp.float32)).astype(edt))
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

    Returns ``(y [B, T, hidden], counts [E] int32)``.
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
        self.gate = Proj(H, E, dtype=dt, init_std=std, keys=keys)
        self.e_score_correction_bias = RouterBias(jnp.zeros((E,), jnp.promote_types(dt, jnp.float32)))
        self.qb_bounds = BalanceState(jnp.asarray([-1.0, 1.0], jnp.float32))   # [min b − 1, max b + 1]
        self.top_k = cfg.num_experts_per_token
        self.latent = cfg.latent_moe
        if self.latent:
            L = cfg.routed_expert_hidden_size
            self.routed_expert_down_proj = Proj(H, L, dtype=dt, init_std=std, keys=keys)
            self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps, dtype=dt) if cfg.latent_moe_use_norm else None
            self.routed_expert_up_proj = Proj(L, H, dtype=dt, init_std=std, keys=keys)
        self.experts = Experts(cfg, keys=keys)
        n_sh = cfg.num_shared_experts
        self.shared_experts = MLP(cfg, H, n_sh * cfg.moe_intermediate_size, keys=keys) if n_sh else None

    def router_logits(self, x: jax.Array) -> jax.Array:
        f = acc_dtype(x)
        return jnp.einsum("nd,de->ne", x.astype(f), self.gate.kernel[...].astype(f),
                          precision=jax.lax.Precision.HIGHEST)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(weights [N, k] fp32, idx [N, k])`` for ``x [N, hidden]``; router logits in fp32."""
        bias = self.e_score_correction_bias[...] if self.use_bias else None
        return router_topk(self.router_logits(x), bias, **self.cfg_route)

    def balance_update(self, x: jax.Array, qb: QBSettings) -> jax.Array:
        """Quantile Balancing's bias ``[E]`` for the next step from tokens ``x [N, hidden]`` (not used on them)."""
        scores = jax.nn.sigmoid(jax.lax.stop_gradient(self.router_logits(x))).astype(jnp.float32)
        return quantile_balance_update(scores, self.e_score_correction_bias[...], self.top_k, qb.bins, qb.passes)

    def __call__(self, x: jax.Array, *, grouped: bool = True, balance: QBSettings | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Returns ``(y, counts [E], next QB bias [E] or None)``."""
        B, T, H = x.shape
        xf = x.reshape(B * T, H)
        w, idx = self.route(xf)
        new_bias = self.balance_update(xf, balance) if balance is not None else None
        z = self.routed_expert_down_proj(xf) if self.latent else xf
        ep = current_expert_parallel()
        if ep is not None and ep.mesh.shape["expert"] > 1:
            y = moe_expert_parallel(z, idx, w, *self.experts.weights(z.dtype), self.act, mesh=ep.mesh,
                                    method=ep.method, capacity_factor=ep.capacity_factor,
                                    exchange=ep.exchange).astype(x.dtype)
        else:
            fn = moe_grouped if grouped else moe_per_token
            y = fn(z, idx, w, *self.experts.weights(z.dtype), self.act).astype(x.dtype)
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf)
        return y.reshape(B, T, H), expert_counts(idx, self.num_experts), new_bias
