"""NoPE multi-head latent attention core (spec §5.2): scores, causal/segment mask, fp32 softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.precision import acc_dtype

HIGHEST = jax.lax.Precision.HIGHEST


def mla_attention(q_nope: jax.Array, q_rope: jax.Array, k_nope: jax.Array, k_rope: jax.Array, v: jax.Array,
                  scale: float, segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal MLA in expanded form.

    ``s_{tτ} = (q_nᵗ·k_nᵗ + q_r·k_r) · scale`` per head; ``k_r`` is one vector per token shared by all heads
    (never rotated: NoPE). Softmax over τ ≤ t (and same segment, when ``segment_ids [B, T]`` is given) in fp32.

    Shapes: ``q_nope [B, T, N, Dn]``, ``q_rope [B, T, N, Dr]``, ``k_nope [B, T, N, Dn]``, ``k_rope [B, T, Dr]``,
    ``v [B, T, N, Dv]`` → ``[B, T, N, Dv]`` in ``v.dtype``.
    """
    f32 = acc_dtype(q_nope, k_nope, v)
    s = jnp.einsum("btnd,bsnd->bnts", q_nope, k_nope, precision=HIGHEST, preferred_element_type=f32)
    if q_rope.shape[-1]:
        s = s + jnp.einsum("btnd,bsd->bnts", q_rope, k_rope, precision=HIGHEST, preferred_element_type=f32)
    s = s * scale
    T = q_nope.shape[1]
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bnts,bsnd->btnd", p, v.astype(f32), precision=HIGHEST, preferred_element_type=f32)
    return o.astype(v.dtype)
