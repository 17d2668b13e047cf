"""Per-Head Muon for matrices (``optax.contrib.muon``) + AdamW for everything else; LR schedules; clipping.

Muon orthogonalises each matrix's update. Which parameters are matrices, and how, is metadata set where each
parameter is created (:mod:`k3jax.nn.layers`): ``var.muon`` is None (AdamW), ``"matrix"`` (the first
``var.fan_in`` axes are the input) or ``"batched"`` (axes named ``heads`` / ``experts`` in ``var.axes`` are batch
axes). Attention projections keep a separate heads axis — KDA/MLA q, k, v, g ``[in, heads, head_dim]``,
o ``[heads, head_dim, out]``, MLA q_b/kv_b ``[rank, heads, d]`` — so ``MuonDimensionNumbers`` names only the
reduction and output axes and Newton–Schulz runs per head; routed experts ``[E, in, out]`` per expert. Updates
are scaled to Moonlight's RMS (``consistent_rms=0.2``: 0.2·√max(fan_in, fan_out)). AdamW takes embeddings, the
head, norms and gains, AttnRes vectors, conv kernels, A_log, dt_bias. Weight decay is decoupled for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import optax
from optax.contrib import MuonDimensionNumbers as MDN

BATCH_AXES = ("heads", "experts")


def muon_dims(var) -> MDN | None:
    """The Muon dimension numbers of a parameter (an ``nnx.Variable`` with ``axes`` / ``muon`` / ``fan_in``
    metadata), or None for AdamW."""
    kind = getattr(var, "muon", None)
    if kind is None:
        return None
    axes = tuple(var.axes)
    fan_in = int(getattr(var, "fan_in", 1))
    batch = {i for i, a in enumerate(axes) if a in BATCH_AXES} if kind == "batched" else set()
    red = tuple(i for i in range(fan_in) if i not in batch)
    out = tuple(i for i in range(fan_in, len(axes)) if i not in batch)
    if not red or not out:
        raise ValueError(f"muon: a {kind} parameter with axes {axes} (fan_in {fan_in}) has no matrix")
    one = lambda t: t[0] if len(t) == 1 else t  # noqa: E731
    return MDN(reduction_axis=one(red), output_axis=one(out))


def muon_dims_tree(state) -> dict:
    """``MuonDimensionNumbers`` (or None) for every parameter of an ``nnx.State``, nested like its pure dict."""
    from k3jax.parallel.rules import metadata_tree

    return metadata_tree(state, muon_dims)


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


def make_optimizer(dims, steps: int, c: OptimConfig) -> optax.GradientTransformation:
    """Clip by global norm, then Muon / AdamW by parameter: ``dims`` is :func:`muon_dims_tree` of the parameters
    (a pure dict of ``MuonDimensionNumbers`` or None, the parameters' structure)."""
    muon = optax.contrib.muon(
        learning_rate=schedule(c.lr, steps, c), weight_decay=c.weight_decay,
        adam_learning_rate=schedule(c.adam_lr, steps, c), adam_weight_decay=c.weight_decay,
        muon_weight_dimension_numbers=lambda _: dims, consistent_rms=c.consistent_rms)
    return optax.chain(optax.clip_by_global_norm(c.clip_norm), muon)


def muon_partition(state) -> dict[str, list[str]]:
    """Which parameters of an ``nnx.State`` get Muon and which AdamW (dotted paths) — for reports and tests."""
    from flax import nnx

    out: dict[str, list[str]] = {"muon": [], "adamw": []}
    for path, var in nnx.to_flat_state(state):
        out["muon" if muon_dims(var) else "adamw"].append(".".join(map(str, path)))
    return out
