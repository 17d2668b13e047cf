"""Unit lower-triangular algebra for the chunked KDA (spec §4.3): ``(I + A)⁻¹`` for a strictly lower-triangular
``A`` by blocks (diagonal-block inverses by Neumann doubling, then block forward substitution), and products with a
block lower-triangular matrix that skip its zero blocks. Other ways to invert (a row scan; Neumann doubling of the
whole matrix) are benchmark variants, in ``benchmarks/kda_variants.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.ops.kda import _mm


def inverse_unit_lower_neumann(a_strict: jax.Array) -> jax.Array:
    """``(I + A)⁻¹`` for strictly lower-triangular ``A [..., n, n]`` by Neumann doubling.

    ``A`` is nilpotent (``Aⁿ = 0``), so ``(I + A)⁻¹ = Σ_p (−A)^p = Π_{j < log₂n} (I + P^{2^j})`` with ``P = −A``:
    ``⌈log₂ n⌉ − 1`` squarings and as many products, all dense matmuls.
    """
    n = a_strict.shape[-1]
    p = -a_strict
    t = jnp.eye(n, dtype=a_strict.dtype) + p
    for _ in range(max(0, math.ceil(math.log2(n)) - 1)):
        p = _mm("...ij,...jk->...ik", p, p)
        t = t + _mm("...ij,...jk->...ik", t, p)
    return t


def _diagonal_block_inverses(a_strict: jax.Array, block: int) -> tuple[int, int, jax.Array]:
    """``(bl, nb, D⁻¹ [..., nb, bl, bl])``: the inverses of the ``bl × bl`` diagonal blocks of ``I + A`` (Neumann
    doubling), ``bl = min(block, n)``."""
    n = a_strict.shape[-1]
    bl = min(block, n)
    if n % bl:
        raise ValueError(f"kda_chunked: block={bl} must divide n={n}")
    nb = n // bl
    diag = [a_strict[..., i * bl:(i + 1) * bl, i * bl:(i + 1) * bl] for i in range(nb)]
    return bl, nb, inverse_unit_lower_neumann(jnp.stack(diag, axis=-3))


def unit_lower_inverse(a_strict: jax.Array, block: int = 16) -> jax.Array:
    """``T = (I + A)⁻¹`` for strictly lower-triangular ``A [..., n, n]`` (T is unit lower-triangular): the
    ``block × block`` diagonal blocks ``D_i⁻¹`` by Neumann doubling, then block row by block row
    ``T_{i, <i} = −D_i⁻¹ (A_{i, <i} T_{<i, <i})`` — ``n/block − 1`` steps of two small matmuls.
    """
    bl, nb, d_inv = _diagonal_block_inverses(a_strict, block)
    t = d_inv[..., 0, :, :]                                                # T_{<1, <1}
    for i in range(1, nb):
        left = a_strict[..., i * bl:(i + 1) * bl, :i * bl]                 # A_{i, <i}
        off = -_mm("...rs,...sc->...rc", d_inv[..., i, :, :], _mm("...rs,...sc->...rc", left, t))
        top = jnp.concatenate([t, jnp.zeros((*t.shape[:-1], bl), t.dtype)], axis=-1)
        t = jnp.concatenate([top, jnp.concatenate([off, d_inv[..., i, :, :]], axis=-1)], axis=-2)
    return t


def tri_matmul(low: jax.Array, x: jax.Array, block: int, transpose: bool = False) -> jax.Array:
    """``L x`` (or ``Lᵀ x``) for block lower-triangular ``L [P, n, n]``, ``x [P, n, m]``: one matmul per
    ``block`` rows of the result over the blocks that can be non-zero (``(1 + … + nb)/nb²`` of the dense work)."""
    n = low.shape[-1]
    block = min(block, n)
    nb = n // block
    out = []
    for i in range(nb):
        r = slice(i * block, (i + 1) * block)
        if transpose:   # (Lᵀ x)_i = Σ_{j ≥ i} L_jiᵀ x_j
            out.append(_mm("psr,psm->prm", low[:, i * block:, r], x[:, i * block:]))
        else:           # (L x)_i = Σ_{j ≤ i} L_ij x_j
            out.append(_mm("prs,psm->prm", low[:, r, :(i + 1) * block], x[:, :(i + 1) * block]))
    return jnp.concatenate(out, axis=1)
