"""Variants of the chunked KDA that ``benchmarks/kda.py`` times against the production kernel
(:func:`k3jax.ops.kda_chunked.kda_chunked`). Each swaps one stage of a registered implementation (the stages
:class:`k3jax.ops.kda_chunked._Cfg` names) or its block size; everything else is the production code:

* ``solve``: how ``T = (I + A)⁻¹`` is formed — ``"neumann"`` (doubling over the whole matrix, ≈ 2 log₂n n³
  FLOPs) or ``"rowscan"`` (one row per ``lax.scan`` step, the first version's way) instead of by blocks;
* ``cumsum="native"``: one ``jnp.cumsum`` over the chunk instead of 16-row tiles;
* ``scan="associative"`` (separate-pass implementation only): the state scan across chunks composes the affine
  maps ``S ↦ M_c S + B_c`` (``M_c = diag(e^{b_n}) − k_restᵀ w_c``) with ``lax.associative_scan``;
* ``intra_vjp="autodiff"``: the backward passes pull the cotangents through the intra-chunk pass with
  ``jax.vjp`` of its forward instead of its hand-written VJP;
* ``recompute=False``: no custom VJP — ``jax.grad`` of the same forward stores every intermediate;
* ``block``: (chunk, head) pairs per step (``"fused"``, default 16) or per ``lax.map`` block (``"scan"``, 1024).

Their figures are in ``benchmarks/results_kda*.json``; variants measured before and dropped since (LAPACK
``triangular_solve``, a triangular-matmul cumsum, an affine precomputed state scan, the first version of the
kernel) keep their rows there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops import kda_chunked as kc
from k3jax.ops.kda import HIGHEST, _mm
from k3jax.ops.unit_lower import inverse_unit_lower_neumann

KEYS = ("block", "solve", "cumsum", "scan", "intra_vjp", "recompute")
"""The keyword arguments :func:`kda_variant` takes beyond :func:`kda_chunked`'s (``impl`` included)."""


def rowscan_inverse(a_strict: jax.Array, block: int = 16) -> jax.Array:
    """``(I + A)⁻¹`` by forward substitution on the identity, one row per ``lax.scan`` step:
    ``x_r = e_r − Σ_{s<r} A_rs x_s`` (``block`` unused)."""
    n = a_strict.shape[-1]
    rhs = jnp.broadcast_to(jnp.eye(n, dtype=a_strict.dtype), a_strict.shape)
    rows_a, rows_r = jnp.moveaxis(a_strict, -2, 0), jnp.moveaxis(rhs, -2, 0)

    def body(x, inp):
        r, a_r, rhs_r = inp
        x_r = rhs_r - jnp.einsum("...s,...sm->...m", a_r, x, precision=HIGHEST)
        return jax.lax.dynamic_update_index_in_dim(x, x_r, r, axis=-2), None

    return jax.lax.scan(body, jnp.zeros_like(rhs), (jnp.arange(n), rows_a, rows_r))[0]


def neumann_inverse(a_strict: jax.Array, block: int = 16) -> jax.Array:
    """``(I + A)⁻¹`` by Neumann doubling over the whole matrix (``block`` unused)."""
    return inverse_unit_lower_neumann(a_strict)


def native_cumsum(g: jax.Array, sub: int = 16) -> jax.Array:
    """The in-chunk cumulative sum as one ``jnp.cumsum`` over axis −2 (``sub`` unused)."""
    return jnp.cumsum(g, axis=-2)


def associative_states(u0, w, k_rest, decay, S0):
    """:func:`k3jax.ops.kda_chunked._chunk_states` by ``lax.associative_scan`` over the chunks' affine maps
    ``S ↦ M_c S + B_c``: ``(S entering each chunk, U, final S)``."""
    M = decay[..., :, None] * jnp.eye(decay.shape[-1], dtype=decay.dtype) - _mm("...nk,...nj->...kj", k_rest, w)
    Bc = _mm("...nk,...nv->...kv", k_rest, u0)

    def combine(x, y):  # apply x then y
        return _mm("...ij,...jk->...ik", y[0], x[0]), _mm("...ij,...jv->...iv", y[0], x[1]) + y[1]

    Mc, Sc = jax.lax.associative_scan(combine, (M, Bc), axis=0)
    S_after = Sc + _mm("cgkj,gjv->cgkv", Mc, S0)                          # S_{c+1} for every chunk
    S_in = jnp.concatenate([S0[None], S_after[:-1]], axis=0)
    return S_in, u0 - _mm("...nk,...kv->...nv", w, S_in), S_after[-1]


def autodiff_intra_vjp(q, k, v, g, beta, reset, **intra):
    """The intra-chunk pass's outputs and their pullback by ``jax.vjp`` of its forward."""
    return jax.vjp(lambda *a: kc._kda_intra(*a, reset, **intra), q, k, v, g, beta)


SOLVES = {"neumann": neumann_inverse, "rowscan": rowscan_inverse}
CUMSUMS = {"native": native_cumsum}
SCANS = {"associative": associative_states}
INTRA_VJPS = {"autodiff": autodiff_intra_vjp}


def _stage(table: dict, what: str, name: str | None):
    if name is not None and name not in table:
        raise ValueError(f"kda_variant: {what} must be one of {tuple(table)} or None, got {name!r}")
    return None if name is None else staticmethod(table[name])


@functools.cache
def variant_cfg(solve: str | None = None, cumsum: str | None = None, scan: str | None = None,
                intra_vjp: str | None = None, recompute: bool = True) -> type:
    """The :class:`k3jax.ops.kda_chunked._Cfg` subclass running the named stages (``None``: the production one);
    ``_Cfg`` itself when every stage is the production one."""
    stages = {"inverse": _stage(SOLVES, "solve", solve), "cumsum": _stage(CUMSUMS, "cumsum", cumsum),
              "states": _stage(SCANS, "scan", scan), "intra_vjp": _stage(INTRA_VJPS, "intra_vjp", intra_vjp)}
    if not recompute:
        stages.update(fused=staticmethod(kc._kda_fused_impl), separate=staticmethod(kc._kda_core_impl))
    stages = {k: v for k, v in stages.items() if v is not None}
    return type("VariantCfg", (kc._Cfg,), stages) if stages else kc._Cfg


def kda_variant(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=None,
                sub_chunk=16, safe_gate=False, reset=None, *, impl: str | None = None, block: int | None = None,
                solve: str | None = None, cumsum: str | None = None, scan: str | None = None,
                intra_vjp: str | None = None, recompute: bool = True):
    """:func:`kda_chunked` with the given stages swapped (see the module docstring); ``scan`` implies
    ``impl="scan"``. With none given it is the production kernel."""
    if impl is None:
        impl = "scan" if scan is not None else kc.default_impl()
    if impl not in kc.KDA_CHUNKED_IMPLS:
        raise ValueError(f"kda_variant: impl must be one of {tuple(kc.KDA_CHUNKED_IMPLS)}, got {impl!r}")
    if scan is not None and impl != "scan":
        raise ValueError(f"kda_variant: scan={scan!r} replaces the state scan of impl='scan', not of {impl!r}")
    kw = {"cfg_type": variant_cfg(solve, cumsum, scan, intra_vjp, recompute)}
    if block is not None:
        kw["block"] = block
    run = functools.partial(kc.KDA_CHUNKED_IMPLS[impl], **kw)
    return kc._kda_chunked(run, q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, sub_chunk,
                           safe_gate, reset)
