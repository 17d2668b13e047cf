"""MXFP4 (``mxfp4-pack-quantized``, spec §9.3): E2M1 elements in groups of 32 along the input axis, E8M0 scales.

* ``weight_packed`` uint8 ``[..., O, I/2]``: byte j holds element 2j in its low nibble, 2j+1 in its high nibble;
  a nibble is sign (bit 3) + magnitude index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
* ``weight_scale`` uint8 ``[..., O, I/32]``: ``2^(u8 − 127)`` (255 would be NaN in OCP-MX and is rejected).
* ``W[o, i] = E2M1(code[o, i]) · 2^(scale[o, ⌊i/32⌋] − 127)``.

Quantization follows the release's scale rule: the shared exponent is amax/4 rounded to the nearest power of two
(up when the mantissa is ≥ 1.5), so a group's maximum lands in [3, 6)·2^e and never clips (the spec's "~[2.83, 5.66]" describes
the same rule loosely); elements round to
the nearest E2M1 value, ties to the even code. Not idempotent for groups that peak at exactly 6·2^k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def mxfp4_dequantize(packed: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """``packed [..., O, I/2] u8``, ``scale [..., O, I/32] u8`` → ``W [..., O, I]`` in ``dtype`` (exact for bf16/fp32)."""
    packed = jnp.asarray(packed)
    lo = jnp.take(jnp.asarray(E2M1), (packed & 0xF).astype(jnp.int32))
    hi = jnp.take(jnp.asarray(E2M1), (packed >> 4).astype(jnp.int32))
    vals = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)    # [..., O, I]
    exp = jnp.asarray(scale).astype(jnp.int32) - 127
    g = vals.reshape(*vals.shape[:-1], -1, GROUP) * jnp.ldexp(jnp.float32(1.0), exp)[..., None]
    return g.reshape(vals.shape).astype(dtype)


def mxfp4_dequantize_np(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Host version of :func:`mxfp4_dequantize` (for loading experts dequantized)."""
    vals = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.float32)
    vals[..., 0::2] = E2M1[packed & 0xF]
    vals[..., 1::2] = E2M1[packed >> 4]
    g = vals.reshape(*vals.shape[:-1], -1, GROUP) * np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127)[..., None]
    return g.reshape(vals.shape).astype(dtype)


def release_scale_exponent(amax: np.ndarray) -> np.ndarray:
    """Shared exponent per group: ``round_pow2(amax / 4)``, rounding up when the mantissa is ≥ 1.5."""
    with np.errstate(divide="ignore"):
        m, e = np.frexp(amax.astype(np.float64) / 4.0)        # amax/4 = m · 2^e, m ∈ [0.5, 1)
    # m ∈ [0.5, 1) ↔ mantissa 2m ∈ [1, 2); the power of two is 2^(e−1), or 2^e when 2m ≥ 1.5
    return (e - 1 + (2 * m >= 1.5)).astype(np.int32)


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``W [..., O, I]`` → ``(packed [..., O, I/2] u8, scale [..., O, I/32] u8)`` with the release's scale rule."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % GROUP:
        raise ValueError(f"mxfp4: input axis {w.shape[-1]} is not a multiple of {GROUP}")
    g = w.reshape(*w.shape[:-1], -1, GROUP)
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, release_scale_exponent(amax), -127)
    exp = np.clip(exp, -127, 127)
    x = g / np.ldexp(np.float64(1.0), exp)[..., None]
    mags = E2M1[:8]
    a = np.minimum(np.abs(x), 6.0)
    # nearest magnitude, ties to the even code (codes are ordered by magnitude)
    d = np.abs(a[..., None] - mags)                                           # [..., 8]
    best = d.min(-1, keepdims=True)
    cand = d == best
    even_first = np.where(cand & (np.arange(8) % 2 == 0), 1, 0) + np.where(cand, 1, 0)
    code = np.argmax(even_first, axis=-1).astype(np.uint8)
    code = code | np.where((x < 0) & (code > 0), 8, 0).astype(np.uint8)
    code = code.reshape(w.shape)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return packed, (exp + 127).astype(np.uint8)


def mxfp4_quantize_traced(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Traceable :func:`mxfp4_quantize` (same scale rule; ties go to the lower code) — for initialising packed
    experts inside ``jax.eval_shape``/``jit``. Export uses the numpy version."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    amax = jnp.max(jnp.abs(g), -1)
    m, e = jnp.frexp(amax / 4.0)
    exp = jnp.where(amax > 0, e - 1 + (2 * m >= 1.5), -127).astype(jnp.int32)
    x = g / jnp.ldexp(jnp.float32(1.0), exp)[..., None]
    mags = jnp.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    code = jnp.argmin(jnp.abs(jnp.minimum(jnp.abs(x), 6.0)[..., None] - mags), -1).astype(jnp.uint8)
    code = (code | jnp.where((x < 0) & (code > 0), 8, 0).astype(jnp.uint8)).reshape(w.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.astype(jnp.uint8), (exp + 127).astype(jnp.uint8)
