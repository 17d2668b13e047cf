"""The router-bias update of a training step (spec §7.3), from the routing statistics the MoE layers report.

The model only reports (:class:`k3jax.nn.moe.RoutingStats`: expert counts and, when asked, router scores); this
module decides the next bias and writes it into the model's router-bias variables, used from the next step on:

* ``quantile`` — Quantile Balancing (:func:`k3jax.ops.balance.quantile_balance_update`: integer histograms of
  the required biases, the k/n quantile per expert, ``passes`` fixed-point passes on the same batch);
* ``sign`` — DeepSeek-V3's ``b += γ·sign(mean load − load)`` from the counts;
* ``none`` — the bias stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from k3jax.ops.balance import quantile_balance_update, sign_update

METHODS = ("quantile", "sign", "none")


@dataclass(frozen=True)
class BalanceConfig:
    method: str = "quantile"
    bins: int = 1000
    passes: int = 3
    gamma: float = 1e-3

    @property
    def needs_scores(self) -> bool:
        """Whether the forward must return router scores (Quantile Balancing solves from them)."""
        return self.method == "quantile"


def next_bias(bias: jax.Array, counts: jax.Array, scores: jax.Array | None, k: int, c: BalanceConfig) -> jax.Array:
    """The bias ``[E]`` for the next step from this step's ``counts [E]`` / ``scores [N, E]``."""
    if c.method == "quantile":
        return quantile_balance_update(scores, bias, k, c.bins, c.passes).astype(bias.dtype)
    if c.method == "sign":
        return sign_update(bias, counts, c.gamma).astype(bias.dtype)
    return bias


def update_router_biases(model, out, c: BalanceConfig) -> None:
    """Write the next step's bias into every MoE layer of ``model`` (a :class:`K3ForCausalLM`) from the
    forward's output ``out`` (its ``expert_counts`` and ``router_scores``, MoE layers in order)."""
    if c.method == "none":
        return
    k = model.config.num_experts_per_token
    new = []
    for j, b in enumerate(model.get_router_biases()):
        scores = out.router_scores[j] if out.router_scores is not None else None
        new.append(next_bias(b, out.expert_counts[j], scores, k, c))
    model.set_router_biases(new)
