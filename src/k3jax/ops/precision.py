"""Accumulation dtype: fp32 for bf16/fp16/fp32 activations, fp64 when the inputs are fp64 (reference runs); and
the low-precision matmul with fp32 accumulation in both directions (:func:`lowp_matmul`)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def acc_dtype(*xs: jax.Array) -> jnp.dtype:
    """``promote(x.dtype…, float32)`` — the dtype the release's fp32 islands (gates, solves, softmax…) run in."""
    dt = jnp.dtype(jnp.float32)
    for x in xs:
        dt = jnp.promote_types(dt, jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)
    return dt



LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _dot32(a: jax.Array, b: jax.Array, a_axes: tuple[int, ...], b_axes: tuple[int, ...]) -> jax.Array:
    return jax.lax.dot_general(a, b, ((a_axes, b_axes), ((), ())), preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def lowp_matmul(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    """``y = x · w`` for bf16/fp16 ``x [batch…, in…]`` and ``w [in…, out…]`` (``n_in`` contracted axes), products
    accumulated in fp32 and rounded once to ``x.dtype``. The backward rounds the cotangent to ``x.dtype`` too, so
    both of its products are low-precision × low-precision with fp32 accumulation, like the forward: on XLA:CPU
    only those run on the matrix unit (AMX: a bf16 × bf16 → fp32 GEMM ~4× the fp32 rate), while autodiff's
    backward multiplies the fp32 cotangent by the bf16 operand at the fp32 rate."""
    return _dot32(x, w, tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))).astype(x.dtype)


def _lowp_fwd(x, w, n_in):
    return lowp_matmul(x, w, n_in), (x, w)


def _lowp_bwd(n_in, res, g):
    x, w = res
    g = g.astype(x.dtype)
    nb, n_out = x.ndim - n_in, w.ndim - n_in
    dx = _dot32(g, w, tuple(range(nb, nb + n_out)), tuple(range(n_in, n_in + n_out)))          # [batch…, in…]
    dw = _dot32(x, g, tuple(range(nb)), tuple(range(nb)))                                      # [in…, out…]
    return dx.astype(x.dtype), dw.astype(w.dtype)


lowp_matmul.defvjp(_lowp_fwd, _lowp_bwd)
