"""Accumulation dtype: fp32 for bf16/fp16/fp32 activations, fp64 when the inputs are fp64 (reference runs); and
the projection matmul with that accumulation in both directions (:func:`matmul_acc`)."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp


def acc_dtype(*xs: jax.Array) -> jnp.dtype:
    """``promote(x.dtype…, float32)`` — the dtype the release's fp32 islands (gates, solves, softmax…) run in."""
    dt = jnp.dtype(jnp.float32)
    for x in xs:
        dt = jnp.promote_types(dt, jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)
    return dt


def _dot_acc(a: jax.Array, b: jax.Array, a_axes: tuple[int, ...], b_axes: tuple[int, ...], acc) -> jax.Array:
    return jax.lax.dot_general(a, b, ((a_axes, b_axes), ((), ())), preferred_element_type=acc)


def transposed_copy(a: jax.Array) -> jax.Array:
    """``a [..., N, M]`` → ``[..., M, N]`` as a row-major copy. A plain transpose in front of a product is folded
    into the product's dimension numbers, which leaves a weight gradient's ``Σ_n x[n, i] g[n, o]`` contracting its
    operands' leading axis — a form XLA:CPU's matrix-unit (YNNPACK) dots do not take, so with bf16 operands it
    converts them to fp32 and runs at the fp32 rate (a [1024, 512]ᵀ·[1024, 1024] bf16 product: 4.6 ms, against
    1.4 ms through this copy). Splitting N into two axes before the transpose keeps it from being folded."""
    *lead, N, M = a.shape
    d = next((d for d in (8, 4, 2) if N % d == 0), None)
    if d is None:                                   # odd N: the plain transpose (XLA may fold it)
        return jnp.swapaxes(a, -1, -2)
    k = len(lead)
    split = a.reshape(*lead, N // d, d, M)
    return jnp.transpose(split, (*range(k), k + 2, k, k + 1)).reshape(*lead, M, N)


def copy_transposed_for_grad(x: jax.Array) -> bool:
    """Whether a weight gradient over ``x`` contracts :func:`transposed_copy` of it: ``x`` narrower than its
    accumulation dtype (bf16/fp16) on XLA:CPU. Accelerators' GEMMs take the leading-axis contraction as it is."""
    return jnp.dtype(x.dtype) != acc_dtype(x) and jax.default_backend() == "cpu"


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul_acc(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    """``y = x · w`` for ``x [batch…, in…]`` and ``w [in…, out…]`` of one dtype (``n_in`` contracted axes), products
    accumulated in :func:`acc_dtype` and rounded once to ``x.dtype``. The backward rounds the cotangent to
    ``x.dtype`` too, so dx and dw are products of the same form as the forward, with plain 2-operand layouts.

    Why by hand: on XLA:CPU only a bf16 × bf16 → fp32 product runs on the matrix unit (AMX: ~4× the fp32 rate),
    and autodiff's backward multiplied the fp32 cotangent by the bf16 operand at the fp32 rate; in fp32 the
    autodiff transposes of the einsum also ran slower (100m training step 15.1 → 12.8 s side by side). With bf16
    operands on XLA:CPU dw contracts a transposed copy of x (:func:`copy_transposed_for_grad`)."""
    return _dot_acc(x, w, tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)), acc_dtype(x)).astype(x.dtype)


def _matmul_acc_fwd(x, w, n_in):
    return matmul_acc(x, w, n_in), (x, w)


def _matmul_acc_bwd(n_in, res, g):
    x, w = res
    g = g.astype(x.dtype)
    acc = acc_dtype(x)
    nb, n_out = x.ndim - n_in, w.ndim - n_in
    dx = _dot_acc(g, w, tuple(range(nb, nb + n_out)), tuple(range(n_in, n_in + n_out)), acc)      # [batch…, in…]
    if copy_transposed_for_grad(x):   # [in, n]·[n, out]: a product the matrix unit takes (transposed_copy)
        n = math.prod(x.shape[:nb])
        xt = transposed_copy(x.reshape(n, -1))
        dw = _dot_acc(xt, g.reshape(n, -1), (1,), (0,), acc).reshape(w.shape)
    else:
        dw = _dot_acc(x, g, tuple(range(nb)), tuple(range(nb)), acc)                              # [in…, out…]
    return dx.astype(x.dtype), dw.astype(w.dtype)


matmul_acc.defvjp(_matmul_acc_fwd, _matmul_acc_bwd)
