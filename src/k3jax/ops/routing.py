"""MoE routing (spec §7.3): score function, bias-corrected top-k selection, gating weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype


def router_topk(logits: jax.Array, bias: jax.Array | None, k: int, activation: str = "sigmoid",
                renormalize: bool = True, scaling_factor: float = 1.0, n_group: int = 1,
                topk_group: int = 1) -> tuple[jax.Array, jax.Array]:
    """Select ``k`` experts per token; returns ``(weights [N, k] fp32, idx [N, k] int32)``.

    ``s = σ(ℓ)`` (or softmax), ``idx = topk(s + bias)`` — the bias only chooses — ``w = s[idx]``, then
    ``w / (Σw + 1e-20)`` when ``renormalize`` and k > 1, then ``· scaling_factor``. With ``n_group > 1`` the
    groups whose top-2 biased scores sum highest are kept (``topk_group`` of them), the rest masked.
    """
    lf = logits.astype(acc_dtype(logits))
    if activation == "sigmoid":
        s = jax.nn.sigmoid(lf)
    elif activation == "softmax":
        s = jax.nn.softmax(lf, axis=-1)
    else:
        raise ValueError(f"moe_router_activation_func: expected 'sigmoid' or 'softmax', got {activation!r}")
    choice = s if bias is None else s + bias.astype(lf.dtype)
    if n_group > 1:
        N, E = choice.shape
        grouped = choice.reshape(N, n_group, E // n_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, min(2, E // n_group))[0], axis=-1)   # [N, n_group]
        _, keep = jax.lax.top_k(group_score, topk_group)
        gmask = jnp.zeros((N, n_group), bool).at[jnp.arange(N)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(gmask, E // n_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if renormalize and k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * scaling_factor, idx.astype(jnp.int32)


def expert_counts(idx: jax.Array, num_experts: int) -> jax.Array:
    """Tokens routed to each expert: ``[E]`` int32 from ``idx [..., k]``."""
    return jnp.zeros((num_experts,), jnp.int32).at[idx.reshape(-1)].add(1)
