"""Per-Head Muon for matrices (``optax.contrib.muon``) + AdamW for everything else; LR schedules; clipping.

Muon orthogonalises each matrix's update. Attention projections are stored with a separate heads axis —
KDA/MLA q, k, v, g ``[in, heads, head_dim]``, o ``[heads, head_dim, out]``, MLA q_b/kv_b ``[rank, heads, d]`` — and
``MuonDimensionNumbers`` names only the reduction and output axes, so Newton–Schulz runs per head (heads are a
batch axis). Routed experts ``[E, in, out]`` are per-expert matrices the same way. Updates are scaled to
Moonlight's RMS (``consistent_rms=0.2``: 0.2·√max(fan_in, fan_out)). AdamW takes embeddings, the head, norms and
gains, AttnRes vectors, conv kernels, A_log, dt_bias. Weight decay is decoupled for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import optax
from optax.contrib import MuonDimensionNumbers as MDN

PER_HEAD_IN = {"q_proj", "k_proj", "v_proj", "g_proj", "q_b_proj", "kv_b_proj"}   # [in, heads, d]


def muon_dims(path: tuple, shape: tuple[int, ...]) -> MDN | None:
    """The Muon dimension numbers for the parameter at ``path`` (an NNX state path), or None for AdamW."""
    names = [str(p) for p in path]
    leaf, parent = names[-1], names[-2] if len(names) > 1 else ""
    if "embed_tokens" in names or parent == "lm_head" or len(shape) < 2:
        return None
    if leaf != "kernel" and parent != "experts":
        return None                      # AttnRes vectors, conv kernels, norms, A_log, dt_bias
    if parent == "experts":              # [E, in, out]: one matrix per expert
        return MDN(reduction_axis=1, output_axis=2)
    if len(shape) == 3 and parent in PER_HEAD_IN:
        return MDN(reduction_axis=0, output_axis=2)          # heads are axis 1 (batch)
    if len(shape) == 3 and parent == "o_proj":
        return MDN(reduction_axis=1, output_axis=2)          # [heads, head_dim, out]: heads batch
    if len(shape) == 3 and parent == "f_b_proj":
        return MDN(reduction_axis=0, output_axis=(1, 2))     # low-rank decay gate: one matrix
    if len(shape) == 2:
        return MDN(reduction_axis=0, output_axis=1)
    return None


@dataclass
class OptimConfig:
    lr: float = 2e-2                   # Muon learning rate
    adam_lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    schedule: str = "cosine"           # "cosine" | "wsd" | "constant"
    decay_fraction: float = 0.2        # WSD: final fraction of steps spent decaying
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0
    consistent_rms: float = 0.2


def schedule(peak: float, steps: int, c: OptimConfig) -> optax.Schedule:
    warm = max(0, min(c.warmup_steps, steps - 1))
    end = peak * c.min_lr_ratio
    if c.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(steps, warm + 1), end)
    if c.schedule == "wsd":
        decay = max(1, int(steps * c.decay_fraction))
        stable = max(0, steps - warm - decay)
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warm) if warm else optax.constant_schedule(peak),
                                     optax.constant_schedule(peak), optax.linear_schedule(peak, end, decay)],
                                    [warm, warm + stable])
    if c.schedule == "constant":
        if not warm:
            return optax.constant_schedule(peak)
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), optax.constant_schedule(peak)], [warm])
    raise ValueError(f"schedule: expected 'cosine', 'wsd' or 'constant', got {c.schedule!r}")


def dims_tree(params):
    """``MuonDimensionNumbers`` (or None) for every leaf of a pure-dict parameter tree."""
    import jax

    return jax.tree_util.tree_map_with_path(
        lambda kp, x: muon_dims(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in kp), x.shape), params)


def make_optimizer(params, steps: int, c: OptimConfig) -> optax.GradientTransformation:
    """Clip by global norm, then Muon (per-head dims) / AdamW by parameter."""
    dims = dims_tree(params)
    muon = optax.contrib.muon(
        learning_rate=schedule(c.lr, steps, c), weight_decay=c.weight_decay,
        adam_learning_rate=schedule(c.adam_lr, steps, c), adam_weight_decay=c.weight_decay,
        muon_weight_dimension_numbers=lambda _: dims, consistent_rms=c.consistent_rms)
    return optax.chain(optax.clip_by_global_norm(c.clip_norm), muon)


def muon_partition(params) -> dict[str, list[str]]:
    """Which parameters get Muon (with their dims) and which AdamW — for reports and tests."""
    import jax

    out: dict[str, list[str]] = {"muon": [], "adamw": []}
    for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in kp)
        d = muon_dims(path, x.shape)
        out["muon" if d else "adamw"].append(".".join(map(str, path)))
    return out


def count_muon(params) -> tuple[int, int]:
    p = muon_partition(params)
    return len(p["muon"]), len(p["adamw"])

