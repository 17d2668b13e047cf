"""Basic parameter holders: projections (kernels stored [in…, out…]), RMSNorm, and the router-bias variable."""

from __future__ import annotations

import math
import string

import jax
import jax.numpy as jnp
from flax import nnx


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


class BalanceState(nnx.Variable):
    """Non-trainable load-balancing state (Quantile Balancing's persistent histogram bounds)."""


class RouterBias(nnx.Variable):
    """Non-trainable state: the MoE selection bias (``e_score_correction_bias``), set by load balancing."""


def as_tuple(x: int | tuple[int, ...]) -> tuple[int, ...]:
    return (x,) if isinstance(x, int) else tuple(x)


class Proj(nnx.Module):
    """Bias-free linear map ``y = x · W`` with ``W`` of shape ``in_shape + out_shape``.

    Heads live on their own axes (e.g. ``[hidden, heads, head_dim]``), so per-head optimisers and sharding rules
    see them; the ``in_shape`` axes are contracted with the trailing axes of ``x``.
    """

    def __init__(self, in_shape: int | tuple[int, ...], out_shape: int | tuple[int, ...], *, dtype: jnp.dtype,
                 init_std: float, keys: KeyGen):
        self.in_shape, self.out_shape = as_tuple(in_shape), as_tuple(out_shape)
        shape = self.in_shape + self.out_shape
        self.kernel = nnx.Param(init_std * jax.random.normal(keys(), shape, jnp.float32).astype(dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        ni, no = len(self.in_shape), len(self.out_shape)
        letters = string.ascii_letters
        batch = letters[: x.ndim - ni]
        ins = letters[x.ndim - ni: x.ndim]
        outs = letters[x.ndim: x.ndim + no]
        return jnp.einsum(f"{batch}{ins},{ins}{outs}->{batch}{outs}", x, self.kernel[...].astype(x.dtype))

    @property
    def size(self) -> int:
        return math.prod(self.in_shape + self.out_shape)


class RMSNorm(nnx.Module):
    """``w ⊙ cast(x · rsqrt(mean(x²) + ε))`` (see :func:`k3jax.ops.norm.rms_norm`)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        from k3jax.ops.norm import rms_norm

        return rms_norm(x, self.weight[...], self.eps)
