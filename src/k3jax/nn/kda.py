"""KDA layer (spec §4.2): projections, short convs, gates, the KDA recurrence, gated output norm."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.nn.layers import KeyGen, Proj
from k3jax.ops.kda import causal_conv1d, kda_gate_lower_bound, kda_gate_softplus, kda_recurrent, kda_step
from k3jax.ops.kda_chunked import kda_chunked
from k3jax.ops.norm import gated_rms_norm, l2_norm
from k3jax.ops.precision import acc_dtype


class KDAttention(nnx.Module):
    """Kimi Delta Attention over ``x [B, T, hidden]`` (already normed) → ``[B, T, hidden]``.

    q/k/v: projection → depthwise causal conv → silu → heads; q, k L2-normed, q·K^(−1/2) (in the kernel);
    γ = gate(f_b(f_a(x)) + dt_bias), β = σ(b(x)); o = KDA(q, k, v, γ, β); o = GN(o, g(x)); out = o_proj(o).
    """

    def __init__(self, cfg: K3Config, *, keys: KeyGen):
        lac = cfg.linear_attn_config
        H, nh, hd, W = cfg.hidden_size, lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
        dt, std = jnp.dtype(cfg.dtype), cfg.initializer_range
        f32 = jnp.promote_types(dt, jnp.float32)  # fp32 parameters of the release (fp64 in reference runs)
        self.num_heads, self.head_dim, self.eps = nh, hd, cfg.rms_norm_eps
        self.gate_kind = cfg.kda_gate
        self.lower_bound = lac.gate_lower_bound
        self.full_rank_gate = bool(lac.use_full_rank_gate)
        P = nh * hd
        self.q_proj = Proj(H, (nh, hd), dtype=dt, init_std=std, keys=keys)
        self.k_proj = Proj(H, (nh, hd), dtype=dt, init_std=std, keys=keys)
        self.v_proj = Proj(H, (nh, hd), dtype=dt, init_std=std, keys=keys)
        bound = 1.0 / math.sqrt(W)  # PyTorch's default Conv1d init for a depthwise kernel (fan_in = W)
        conv = lambda: nnx.Param(jax.random.uniform(keys(), (P, W), f32, -bound, bound))  # noqa: E731
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(), conv(), conv()
        self.f_a_proj = Proj(H, hd, dtype=dt, init_std=std, keys=keys)
        self.f_b_proj = Proj(hd, (nh, hd), dtype=dt, init_std=std, keys=keys)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(keys(), (nh,), f32, 1.0, 16.0)))
        dt0 = jnp.exp(jax.random.uniform(keys(), (nh, hd), f32, math.log(1e-3), math.log(1e-1)))
        dt0 = jnp.maximum(dt0, 1e-4)
        self.dt_bias = nnx.Param(dt0 + jnp.log(-jnp.expm1(-dt0)))  # softplus⁻¹(dt)
        self.b_proj = Proj(H, nh, dtype=dt, init_std=std, keys=keys)
        if self.full_rank_gate:
            self.g_proj = Proj(H, (nh, hd), dtype=dt, init_std=std, keys=keys)
        else:
            self.g_a_proj = Proj(H, hd, dtype=dt, init_std=std, keys=keys)
            self.g_b_proj = Proj(hd, (nh, hd), dtype=dt, init_std=std, keys=keys)
        self.o_norm = nnx.Param(jnp.ones((hd,), jnp.promote_types(dt, jnp.float32)))
        self.o_proj = Proj((nh, hd), H, dtype=dt, init_std=std, keys=keys)

    def gate(self, x: jax.Array) -> jax.Array:
        """Activated log-decay γ ``[B, T, nh, hd]`` (fp32)."""
        f = self.f_b_proj(self.f_a_proj(x))
        if self.gate_kind == "lower_bound":
            return kda_gate_lower_bound(f, self.dt_bias[...], self.A_log[...], self.lower_bound)
        return kda_gate_softplus(f, self.dt_bias[...], self.A_log[...])

    def __call__(self, x: jax.Array, *, kernel: str = "chunked", segment_ids: jax.Array | None = None) -> jax.Array:
        """``segment_ids [B, T]``: packed documents; KDA state and conv windows restart where the id changes."""
        B, T, _ = x.shape
        nh, hd = self.num_heads, self.head_dim
        reset = None
        if segment_ids is not None:
            reset = jnp.concatenate([jnp.zeros((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)

        def qkv(proj: Proj, w: nnx.Param) -> jax.Array:
            u = proj(x).reshape(B, T, nh * hd)
            y, _ = causal_conv1d(u, w[...], reset=reset)
            return y.reshape(B, T, nh, hd)

        q, k, v = qkv(self.q_proj, self.q_conv1d), qkv(self.k_proj, self.k_conv1d), qkv(self.v_proj, self.v_conv1d)
        q, k = l2_norm(q), l2_norm(k)
        g = self.gate(x)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(acc_dtype(x)))
        if kernel == "chunked":
            o, _ = kda_chunked(q, k, v, g, beta, safe_gate=self.gate_kind == "lower_bound", reset=reset)
        elif kernel == "recurrent":
            o, _ = kda_recurrent(q, k, v, g, beta, reset=reset)
        else:
            raise ValueError(f"kernel: expected 'chunked' or 'recurrent', got {kernel!r}")
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = gated_rms_norm(o.astype(x.dtype), gate, self.o_norm[...], self.eps)
        return self.o_proj(o)

    def cached(self, x: jax.Array, state: tuple[jax.Array, ...], pos: jax.Array, n_new: jax.Array
               ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """KDA for ``x [B, T, hidden]`` continuing from ``state = (S [B, nh, K, V] fp32, conv windows of q, k, v
        [B, W−1, nh·hd])``; only the first ``n_new[b]`` tokens of row b are real. Padding leaves the state alone
        (decay 0 and β = 0 there; the conv window keeps the last W−1 real inputs). T = 1 runs :func:`kda_step`,
        longer chunks :func:`kda_chunked`. ``pos`` is unused (KDA has no positions). Returns ``(y, new state)``."""
        del pos
        B, T, _ = x.shape
        nh, hd = self.num_heads, self.head_dim
        S, *windows = state
        valid = jnp.arange(T)[None, :] < n_new[:, None]                              # [B, T]

        def qkv(proj: Proj, w: nnx.Param, window: jax.Array) -> tuple[jax.Array, jax.Array]:
            u = proj(x).reshape(B, T, nh * hd)
            y, _ = causal_conv1d(u, w[...], state=window)
            xp = jnp.concatenate([window, u.astype(window.dtype)], axis=1)          # [B, W−1+T, P]
            keep = n_new[:, None] + jnp.arange(window.shape[1])[None, :]             # last W−1 real inputs
            return y.reshape(B, T, nh, hd), jnp.take_along_axis(xp, keep[:, :, None], axis=1)

        (q, wq), (k, wk), (v, wv) = (qkv(self.q_proj, self.q_conv1d, windows[0]),
                                     qkv(self.k_proj, self.k_conv1d, windows[1]),
                                     qkv(self.v_proj, self.v_conv1d, windows[2]))
        q, k = l2_norm(q), l2_norm(k)
        g = jnp.where(valid[..., None, None], self.gate(x), 0.0)
        beta = jnp.where(valid[..., None], jax.nn.sigmoid(self.b_proj(x).astype(acc_dtype(x))), 0.0)
        if T == 1:
            o, S = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)
            o = o[:, None]
        else:
            o, S = kda_chunked(q, k, v, g, beta, initial_state=S, output_final_state=True,
                               safe_gate=self.gate_kind == "lower_bound")
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = gated_rms_norm(o.astype(x.dtype), gate, self.o_norm[...], self.eps)
        return self.o_proj(o), (S, wq, wk, wv)
