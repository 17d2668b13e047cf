"""Context parallelism: sequences split along time over a mesh's ``context`` axis (C ranks, T/C tokens each).

Per-token work (projections, norms, AttnRes, MoE) needs no communication; the three places where tokens meet are
done here, each in ``shard_map``:

* **KDA** (:func:`kda_context_parallel`). The state recurrence is affine in the state: a shard maps its entry
  state to ``S_out = M · S_in + S̃`` with ``M = Π_t (I − β_t k_t k_tᵀ) Diag(α_t)`` ``[H, K, K]`` and ``S̃`` the
  state the shard reaches from zero ``[H, K, V]``. One chunked pass with the value widened by K columns computes
  both: values ``[v | 0]`` from the entry state ``[0 | I]`` end in ``[S̃ | M]``, and the widened outputs are
  ``[o⁰_t | M_tᵀ q_t]`` — the outputs from a zero entry state and each query pulled back to the entry state. One
  all-gather of ``(M, S̃)`` per layer (bytes independent of T), a prefix scan over the ranks gives every rank its
  entry state ``E_r`` (``E_{r+1} = M_r E_r + S̃_r``, ``E_0`` = the initial state), and the outputs are
  ``o_t = o⁰_t + (M_tᵀ q_t)ᵀ E_r`` — no second pass over the shard. Gradients are JAX's autodiff of the
  ``shard_map``: the chunked kernel's own VJP per rank, and the all-gather's transpose (a reduce-scatter of the
  summaries' cotangents, again independent of T) carries the reverse-direction summaries.
* **The short conv** (:func:`causal_conv1d_context_parallel`): the W−1 token halo comes from the previous rank by
  ``ppermute``; halo tokens before a document start (packed rows) are masked.
* **MLA** (:func:`mla_attention_context_parallel`): the per-token latent (``c_kv ‖ k_r``, 576 values for K3) and
  the segment ids are all-gathered; each rank expands keys and values and attends from its own queries, causally
  by global position and within documents.

Batch rows may be split over the data-like axes at the same time (``ContextParallel.batch_axes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k3jax.parallel.mesh import inner_mesh
from k3jax.ops.attention import mla_attention
from k3jax.ops.kda import causal_conv1d
from k3jax.ops.kda_chunked import kda_chunked
from k3jax.ops.precision import acc_dtype

AXIS = "context"
_DATA_LIKE = ("data", "fsdp")


@dataclass(frozen=True)
class ContextParallel:
    """Where sequences are split: ``mesh``'s ``axis`` (time) and, for the batch rows, the data-like axes that
    divide the batch. Passed to the model's call (``model(ids, cp=...)``); hashable (static under jit)."""
    mesh: Mesh
    axis: str = AXIS

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis] if self.axis in self.mesh.axis_names else 1

    @property
    def active(self) -> bool:
        return self.size > 1

    def batch_axes(self, batch: int) -> tuple[str, ...] | None:
        """The data-like mesh axes a batch of ``batch`` rows is split over (None: rows not split)."""
        axes = tuple(a for a in _DATA_LIKE if a in self.mesh.axis_names and self.mesh.shape[a] > 1)
        n = math.prod(self.mesh.shape[a] for a in axes)
        return axes if axes and batch % n == 0 else None

    def spec(self, batch: int, ndim: int) -> P:
        """``[B, T, …]`` arrays: rows over the data-like axes, time over the context axis."""
        return P(self.batch_axes(batch), self.axis, *([None] * (ndim - 2)))

    def constrain(self, x: jax.Array) -> jax.Array:
        """Lay ``x [B, T, …]`` out as :meth:`spec` says (per-token work then stays on the rank owning the token)."""
        return jax.lax.with_sharding_constraint(x, jax.NamedSharding(self.mesh, self.spec(x.shape[0], x.ndim)))


def _pad_time(x: jax.Array | None, pad: int, value=0) -> jax.Array | None:
    if x is None or not pad:
        return x
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def _padded_len(T: int, C: int) -> int:
    return -(-T // C) * C


# ------------------------------------------------------------------------------------------------------ KDA
def kda_shard_summary(q, k, v, g, beta, *, scale: float, reset=None, **kernel) -> tuple[jax.Array, ...]:
    """One shard's pass from a zero state with the value widened by K: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``,
    ``beta [B, T, H]`` → ``(o⁰ [B, T, H, V], q̂ [B, T, H, K], M [B, H, K, K], S̃ [B, H, K, V])`` fp32, with
    ``S_out = M S_in + S̃`` and ``o_t = o⁰_t + q̂_tᵀ S_in`` for any entry state ``S_in`` (``q̂_t = M_tᵀ q_t·scale``,
    ``M_t`` the product of the transitions up to t)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    a = acc_dtype(q, k, v)
    vw = jnp.concatenate([v.astype(a), jnp.zeros((B, T, H, K), a)], axis=-1)
    s0 = jnp.concatenate([jnp.zeros((B, H, K, V), a), jnp.broadcast_to(jnp.eye(K, dtype=a), (B, H, K, K))], -1)
    o, S = kda_chunked(q, k, vw, g, beta, scale=scale, initial_state=s0, output_final_state=True, reset=reset,
                       **kernel)
    return o[..., :V].astype(a), o[..., V:].astype(a), S[..., V:], S[..., :V]


def entry_states(M: jax.Array, St: jax.Array, S0: jax.Array) -> jax.Array:
    """The prefix scan over ranks: ``M [C, …, K, K]``, ``S̃ [C, …, K, V]``, ``S0 [..., K, V]`` → ``E [C+1, …, K, V]``
    with ``E_0 = S0``, ``E_{r+1} = M_r E_r + S̃_r`` (C is a mesh axis size: a short unrolled loop)."""
    E = [S0]
    for r in range(M.shape[0]):
        E.append(jnp.einsum("...kj,...jv->...kv", M[r], E[-1], precision=jax.lax.Precision.HIGHEST) + St[r])
    return jnp.stack(E)


def kda_context_parallel(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                         cp: ContextParallel, *, scale: float | None = None, initial_state: jax.Array | None = None,
                         output_final_state: bool = False, reset: jax.Array | None = None, safe_gate: bool = False,
                         chunk_size: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    """:func:`~k3jax.ops.kda_chunked.kda_chunked` with time split over ``cp``'s axis (module docstring).

    Same shapes and results: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``, ``initial_state
    [B, H, K, V]``, ``reset [B, T]`` bool (packed documents, may cross ranks) → ``(o [B, T, H, V] in v.dtype,
    final state [B, H, K, V] fp32 or None)``. T need not divide by the rank count (the end is padded with
    identity transitions: g = 0, β = 0). Per layer the ranks exchange ``C·B·H·K·(K+V)`` fp32 values, whatever T."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = cp.size
    scale = K ** -0.5 if scale is None else scale
    a = acc_dtype(q, k, v)
    pad = _padded_len(T, C) - T
    q, k, v, g, beta = (_pad_time(x, pad) for x in (q, k, v, g, beta))
    reset = _pad_time(reset, pad, False)
    S0 = jnp.zeros((B, H, K, V), a) if initial_state is None else initial_state.astype(a)
    ax = cp.axis
    kernel = {"safe_gate": safe_gate, "chunk_size": chunk_size}

    def local(q, k, v, g, beta, reset, S0):
        o0, qh, M, St = kda_shard_summary(q, k, v, g, beta, scale=scale, reset=reset, **kernel)
        Ms, Sts = jax.lax.all_gather(M, ax), jax.lax.all_gather(St, ax)      # [C, B, H, K, K], [C, B, H, K, V]
        E = entry_states(Ms, Sts, S0)
        r = jax.lax.axis_index(ax)
        mine = jax.lax.dynamic_index_in_dim(E, r, keepdims=False)
        o = o0 + jnp.einsum("bthk,bhkv->bthv", qh, mine, precision=jax.lax.Precision.HIGHEST)
        return o.astype(v.dtype), jax.lax.dynamic_index_in_dim(E, r + 1)       # this rank's exit state [1, …]

    b = cp.batch_axes(B)
    t4, t3 = P(b, ax, None, None), P(b, ax, None)
    st = P(b, None, None, None)
    # check_vma=False: the chunked kernel's scans carry no varying-axis types. Every output is per rank (the exit
    # states come back stacked over ranks), so no replicated output's cotangent is counted C times.
    f = jax.shard_map(local, mesh=inner_mesh(cp.mesh), check_vma=False,
                      in_specs=(t4, t4, t4, t4, t3, None if reset is None else P(b, ax), st),
                      out_specs=(t4, P(ax, b, None, None, None)))
    o, exits = f(q, k, v, g, beta, reset, S0)
    return o[:, :T], (exits[-1] if output_final_state else None)


# ------------------------------------------------------------------------------------------------ short conv
def causal_conv1d_context_parallel(x: jax.Array, weight: jax.Array, cp: ContextParallel,
                                   reset: jax.Array | None = None, activation: str | None = "silu") -> jax.Array:
    """:func:`~k3jax.ops.kda.causal_conv1d` (from a zero window) with time split over ``cp``'s axis: ``x [B, T, C]``,
    ``weight [C, W]``, ``reset [B, T]`` → ``y [B, T, C]``. Each rank takes the previous rank's last W−1 inputs as
    its window (``ppermute``); window tokens before a document start in the window are zeroed."""
    B, T, Ch = x.shape
    W = weight.shape[-1]
    Cr = cp.size
    pad = _padded_len(T, Cr) - T
    x = _pad_time(x, pad)
    reset = _pad_time(reset, pad, False)
    ax = cp.axis
    if (T + pad) // Cr < W - 1:
        raise ValueError(f"context parallel conv: {(T + pad) // Cr} tokens per rank, fewer than the conv's "
                         f"window of {W - 1}")
    perm = [(i, i + 1) for i in range(Cr - 1)]

    def local(x, w, r):
        halo = jax.lax.ppermute(x[:, -(W - 1):], ax, perm)                  # rank 0 receives zeros
        if r is not None:
            hr = jax.lax.ppermute(r[:, -(W - 1):].astype(jnp.int32), ax, perm)
            later = jnp.cumsum(hr[:, ::-1], axis=1)[:, ::-1] - hr            # resets after each window position
            halo = jnp.where((later == 0)[..., None], halo, 0)
        y, _ = causal_conv1d(x, w, state=halo, activation=activation, reset=r)
        return y

    b = cp.batch_axes(B)
    f = jax.shard_map(local, mesh=inner_mesh(cp.mesh), check_vma=False,
                      in_specs=(P(b, ax, None), P(), None if reset is None else P(b, ax)), out_specs=P(b, ax, None))
    return f(x, weight, reset)[:, :T]


# ------------------------------------------------------------------------------------------------------- MLA
def mla_attention_context_parallel(q_nope: jax.Array, q_rope: jax.Array, c_kv: jax.Array, k_rope: jax.Array,
                                   expand: Callable[[jax.Array], tuple[jax.Array, jax.Array]], expand_params,
                                   scale: float, cp: ContextParallel,
                                   segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal MLA (:func:`~k3jax.ops.attention.mla_attention`) with time split over ``cp``'s axis.

    ``q_nope [B, T, N, Dn]``, ``q_rope [B, T, N, Dr]`` (this rank's queries), latent ``c_kv [B, T, R]`` and
    ``k_rope [B, T, Dr]``; ``expand(params, c_kv) → (k_nope [.., N, Dn], v [.., N, Dv])`` (the ``kv_b``
    projection, with ``expand_params`` its weights). Each rank all-gathers the latent (R + Dr values per token) and
    the segment ids, expands keys and values for the whole sequence and attends from its T/C queries.
    Returns ``[B, T, N, Dv]``."""
    B, T = q_nope.shape[:2]
    C = cp.size
    pad = _padded_len(T, C) - T
    q_nope, q_rope, c_kv, k_rope = (_pad_time(x, pad) for x in (q_nope, q_rope, c_kv, k_rope))
    if segment_ids is not None:
        segment_ids = _pad_time(segment_ids, pad, -1)
    ax = cp.axis
    Tl = (T + pad) // C

    def local(qn, qr, ckv, kr, params, seg):
        ckv_all = jax.lax.all_gather(ckv, ax, axis=1, tiled=True)               # [B, T, R]
        kr_all = jax.lax.all_gather(kr, ax, axis=1, tiled=True)
        k_n, v = expand(params, ckv_all)
        seg_all = None if seg is None else jax.lax.all_gather(seg, ax, axis=1, tiled=True)
        start = jax.lax.axis_index(ax) * Tl
        return mla_attention(qn, qr, k_n, kr_all, v, scale, segment_ids=seg, kv_segment_ids=seg_all,
                             q_offset=start)

    b = cp.batch_axes(B)
    t4, t3 = P(b, ax, None, None), P(b, ax, None)
    rep = jax.tree.map(lambda _: P(), expand_params)
    f = jax.shard_map(local, mesh=inner_mesh(cp.mesh), check_vma=False,
                      in_specs=(t4, t4, t3, t3, rep, None if segment_ids is None else P(b, ax)), out_specs=t4)
    return f(q_nope, q_rope, c_kv, k_rope, expand_params, segment_ids)[:, :T]

