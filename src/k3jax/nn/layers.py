"""Basic parameter holders: projections (kernels stored [in…, out…]), RMSNorm, and the router-bias variable.

Every variable carries its **logical axes** as metadata (``var.axes``: one name or None per dimension, e.g.
``("embed", "heads", None)``), set where it is created; :mod:`k3jax.parallel.rules` maps the names to mesh axes.
Matrices also say how Per-Head Muon treats them (``var.muon``): ``None`` (AdamW), ``"matrix"`` (one matrix: the
first ``var.fan_in`` axes are its input) or ``"batched"`` (axes named ``heads`` / ``experts`` are batch axes, one
matrix each). :func:`k3jax.train.optim.muon_dims` reads these; no code infers them from parameter paths.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.ops.precision import matmul_acc


class KeyGen:
    """Fresh PRNG keys for parameter init: ``keys()`` → ``fold_in(base, n)`` for n = 0, 1, 2, …

    Cheap under ``jax.eval_shape`` (one traced fold_in per parameter), unlike drawing from ``nnx.Rngs``.
    """

    def __init__(self, key: jax.Array):
        self.key, self.count = key, 0

    def __call__(self) -> jax.Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


class PackedWeight(nnx.Variable):
    """Non-trainable packed storage (MXFP4 ``weight_packed`` / ``weight_scale`` bytes)."""


class RouterBias(nnx.Variable):
    """Non-trainable state: the MoE selection bias (``e_score_correction_bias``), set by load balancing."""


Axes = tuple  # logical axis names, one (str or None) per dimension
BATCH_AXES = ("heads", "experts")      # per-head / per-expert Muon batches over these


def param(value: jax.Array, axes: Axes, *, muon: str | None = None, fan_in: int = 1) -> nnx.Param:
    """An ``nnx.Param`` with its logical ``axes`` (and Muon treatment, see the module docstring) as metadata."""
    if len(axes) != value.ndim:
        raise ValueError(f"param: {len(axes)} logical axes {axes} for a {value.ndim}-d value {value.shape}")
    if muon not in (None, "matrix", "batched"):
        raise ValueError(f"param: muon must be None, 'matrix' or 'batched', got {muon!r}")
    return nnx.Param(value, axes=tuple(axes), muon=muon, fan_in=fan_in)


def as_tuple(x: int | tuple[int, ...]) -> tuple[int, ...]:
    return (x,) if isinstance(x, int) else tuple(x)


class Proj(nnx.Module):
    """Bias-free linear map ``y = x · W`` with ``W`` of shape ``in_shape + out_shape``.

    Heads live on their own axes (e.g. ``[hidden, heads, head_dim]``), so per-head optimisers and sharding rules
    see them; the ``in_shape`` axes are contracted with the trailing axes of ``x``. ``axes``: the kernel's logical
    axes (inputs then outputs); ``muon``: ``"batched"`` (per head when an axis is named ``heads``), ``"matrix"``
    or ``None`` (AdamW).
    """

    def __init__(self, in_shape: int | tuple[int, ...], out_shape: int | tuple[int, ...], *, axes: Axes,
                 dtype: jnp.dtype, init_std: float, keys: KeyGen, muon: str | None = "batched"):
        self.in_shape, self.out_shape = as_tuple(in_shape), as_tuple(out_shape)
        shape = self.in_shape + self.out_shape
        if muon == "batched" and not any(a in BATCH_AXES for a in axes):
            muon = "matrix"
        self.kernel = param(init_std * jax.random.normal(keys(), shape, jnp.float32).astype(dtype), axes,
                            muon=muon, fan_in=len(self.in_shape))

    def __call__(self, x: jax.Array) -> jax.Array:
        # accumulated in fp32 (bf16 activations: one rounding of the fp32 sum, as accelerators' GEMMs do), the
        # backward's two products in the same form (see matmul_acc)
        return matmul_acc(x, self.kernel[...].astype(x.dtype), len(self.in_shape))

    @property
    def size(self) -> int:
        return math.prod(self.in_shape + self.out_shape)


class RMSNorm(nnx.Module):
    """``w ⊙ cast(x · rsqrt(mean(x²) + ε))`` (see :func:`k3jax.ops.norm.rms_norm`)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype):
        self.eps = eps
        self.weight = param(jnp.ones((dim,), dtype), (None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        from k3jax.ops.norm import rms_norm

        return rms_norm(x, self.weight[...], self.eps)


class TokenGroups:
    """Row groups of shapes ``(B_g, T_g)`` laid out as one token axis: each group flattened row-major, the groups
    concatenated, ``N = Σ_g B_g·T_g`` tokens — what a grouped forward runs its token-wise work on (``[1, N, …]``,
    one read of every weight) while the sequence mixing runs per group on ``[B_g, T_g, …]`` views."""

    def __init__(self, shapes):
        self.shapes = tuple((int(b), int(t)) for b, t in shapes)
        self.offsets = [0]
        for b, t in self.shapes:
            self.offsets.append(self.offsets[-1] + b * t)

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def n_tokens(self) -> int:
        return self.offsets[-1]

    def part(self, x: jax.Array, g: int) -> jax.Array:
        """Group ``g`` of ``x [1, N, …]`` as ``[B_g, T_g, …]``."""
        (b, t), lo = self.shapes[g], self.offsets[g]
        return x[0, lo:lo + b * t].reshape(b, t, *x.shape[2:])

    def split(self, x: jax.Array) -> list[jax.Array]:
        """``x [1, N, …]`` → one ``[B_g, T_g, …]`` per group."""
        return [self.part(x, g) for g in range(len(self))]

    def join(self, xs) -> jax.Array:
        """One ``[B_g, T_g, …]`` per group → ``[1, N, …]`` (the inverse of :meth:`split`)."""
        if len(xs) != len(self):
            raise ValueError(f"TokenGroups.join: {len(xs)} arrays for {len(self)} groups")
        for g, (x, s) in enumerate(zip(xs, self.shapes)):
            if tuple(x.shape[:2]) != s:
                raise ValueError(f"TokenGroups.join: group {g} has shape {x.shape}, expected rows {s}")
        flat = [x.reshape(-1, *x.shape[2:]) for x in xs]
        return (flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=0))[None]
