"""Accumulation dtype: fp32 for bf16/fp16/fp32 activations, fp64 when the inputs are fp64 (reference runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def acc_dtype(*xs: jax.Array) -> jnp.dtype:
    """``promote(x.dtype…, float32)`` — the dtype the release's fp32 islands (gates, solves, softmax…) run in."""
    dt = jnp.dtype(jnp.float32)
    for x in xs:
        dt = jnp.promote_types(dt, jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)
    return dt
