"""Parameter counts by component, from ``jax.eval_shape`` of the real model (no memory allocated).

Activated parameters follow the convention that reproduces Moonshot's published 104.2B for K3 (spec §10):
every weight a token touches — all non-routed weights, the top-k routed experts of each MoE layer and the
lm_head — except the input embedding table (a lookup, not a matmul).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flax import nnx

from k3jax.config import K3Config
from k3jax.nn.model import K3ForCausalLM
from k3jax.nn.scan import scan_plan


@dataclass
class ParamTable:
    components: dict[str, int]     # component → parameter count
    total: int
    activated: int
    embedding: int
    routed_experts: int            # all routed-expert weights
    routed_experts_active: int     # of which a token uses (top-k per MoE layer)


def abstract_model(cfg: K3Config) -> K3ForCausalLM:
    """The model with ``jax.ShapeDtypeStruct`` leaves (shapes and dtypes only)."""
    return nnx.eval_shape(lambda: K3ForCausalLM(cfg, rngs=nnx.Rngs(0)))


def _component(path: tuple, cfg: K3Config) -> str:
    if path[0] == "lm_head":
        return "lm_head"
    if path[:2] == ("model", "embed_tokens"):
        return "embedding"
    if path[1] not in ("layers", "run"):
        return "final norm + output AttnRes"
    i, sub = path[2], path[3]
    if path[1] == "run":                          # the stacked run's position i: layers start + i, + P, …
        i += scan_plan(cfg).start
    if sub == "self_attn":
        return "KDA layers" if cfg.layer_types[i] == "kda" else "MLA layers"
    if sub == "mlp":
        return "dense FFN"
    if sub == "block_sparse_moe":
        if path[4] == "experts":
            return "MoE routed experts"
        if path[4] == "shared_experts":
            return "MoE shared experts"
        if path[4] in ("gate", "e_score_correction_bias"):
            return "MoE router"
        return "MoE latent projections + norm"
    return "layer norms + AttnRes"


def parameter_table(cfg: K3Config) -> ParamTable:
    """Counts for ``cfg`` taken from the abstract model's variables (parameters and the router bias)."""
    _, state = nnx.split(abstract_model(cfg))
    comps: dict[str, int] = {}
    for path, var in nnx.to_flat_state(state):
        n = math.prod(var.shape)
        name = _component(path, cfg)
        comps[name] = comps.get(name, 0) + n
    total = sum(comps.values())
    routed = comps.get("MoE routed experts", 0)
    E, k = cfg.num_experts or 0, cfg.num_experts_per_token or 0
    routed_active = routed * k // E if E else 0
    embedding = comps.get("embedding", 0) if not cfg.tie_word_embeddings else 0
    activated = total - (routed - routed_active) - embedding
    return ParamTable(comps, total, activated, comps.get("embedding", 0), routed, routed_active)
