"""Typed decode caches (spec §4.4, §5.3), registered as pytrees; batch row ``b`` of every field is slot ``b``.

* :class:`KDACache` — one per KDA layer: the recurrent state ``state [B, H, K, V]`` (fp32, constant size) and
  the short-conv windows ``conv_q, conv_k, conv_v [B, W−1, H·K]`` (the last W−1 projected inputs).
* :class:`MLACache` — one per MLA layer: the normalised latent ``c_kv [B, L, kv_lora_rank]`` and the raw shared
  key part ``k_r [B, L, qk_rope_head_dim]``, preallocated to ``L`` tokens. The layer reaches it only through
  :meth:`MLACache.append` and :meth:`MLACache.attend`, so a paged layout can replace it behind the same methods.
* :class:`Cache` — the model's: ``layers`` (one of the above per decoder layer) and ``lengths [B]`` int32, the
  tokens each slot holds (the position of its next token). AttnRes mixes blocks of one token only: no cache.

Slots are independent: :meth:`Cache.read_slots`, :meth:`Cache.write_slots`, :meth:`Cache.reset_slots` and
:meth:`Cache.copy_slot` touch only the rows they name (what a serving scheduler needs to insert and evict).
"""

from __future__ import annotations

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp

from k3jax.config import K3Config
from k3jax.ops.attention import mla_latent_attention


def _slot_ids(slots) -> jax.Array:
    return jnp.atleast_1d(jnp.asarray(slots, jnp.int32))


class _SlotRows:
    """Slot operations for caches whose every field is batch-major ``[B, …]``."""

    def read_slots(self, slots):
        """The rows ``slots`` (int or ``[n]``) as a cache of batch ``n``."""
        idx = _slot_ids(slots)
        return jax.tree.map(lambda x: x[idx], self)

    def write_slots(self, slots, rows):
        """This cache with rows ``slots`` replaced by the batch of ``rows`` (same type, batch ``n``)."""
        idx = _slot_ids(slots)
        return jax.tree.map(lambda x, r: x.at[idx].set(r.astype(x.dtype)), self, rows)

    def reset_slots(self, slots):
        """This cache with rows ``slots`` zeroed (an empty sequence)."""
        idx = _slot_ids(slots)
        return jax.tree.map(lambda x: x.at[idx].set(jnp.zeros((), x.dtype)), self)

    def copy_slot(self, src, dst):
        """This cache with slot ``dst`` a copy of slot ``src``."""
        return self.write_slots(dst, self.read_slots(src))

    @property
    def batch(self) -> int:
        return jax.tree.leaves(self)[0].shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDACache(_SlotRows):
    state: jax.Array        # [B, H, K, V] fp32
    conv_q: jax.Array       # [B, W−1, H·K]
    conv_k: jax.Array
    conv_v: jax.Array

    @property
    def windows(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.conv_q, self.conv_k, self.conv_v


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLACache(_SlotRows):
    c_kv: jax.Array         # [B, L, kv_lora_rank]
    k_r: jax.Array          # [B, L, qk_rope_head_dim]

    @property
    def capacity(self) -> int:
        return self.c_kv.shape[1]

    def append(self, c_kv: jax.Array, k_r: jax.Array, pos: jax.Array, n_new: jax.Array) -> "MLACache":
        """Write a chunk's latents ``c_kv [B, T, R]``, ``k_r [B, T, Dr]`` at positions ``pos[b] + t`` for the
        first ``n_new[b]`` tokens of row b (padding rows leave what the cache held: a slot given no tokens is
        untouched)."""
        T = c_kv.shape[1]

        def write(buf, new, p, n):
            old = jax.lax.dynamic_slice_in_dim(buf, p, T, 0)
            new = jnp.where((jnp.arange(T) < n)[:, None], new.astype(buf.dtype), old)
            return jax.lax.dynamic_update_slice_in_dim(buf, new, p, 0)

        return MLACache(jax.vmap(write)(self.c_kv, c_kv, pos, n_new), jax.vmap(write)(self.k_r, k_r, pos, n_new))

    def attend(self, q_latent: jax.Array, q_rope: jax.Array, q_pos: jax.Array, kv_len: jax.Array,
               scale: float) -> jax.Array:
        """Absorbed attention of ``q_latent [B, T, N, R]``, ``q_rope [B, T, N, Dr]`` at ``q_pos [B, T]`` over the
        first ``kv_len [B]`` cached tokens (see :func:`k3jax.ops.attention.mla_latent_attention`)."""
        return mla_latent_attention(q_latent, q_rope, self.c_kv, self.k_r, q_pos, kv_len, scale)


LayerCache = Union[KDACache, MLACache]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache(_SlotRows):
    layers: tuple            # one KDACache / MLACache per decoder layer
    lengths: jax.Array       # [B] int32: tokens held per slot

    def advance(self, layers: tuple, n_new: jax.Array) -> "Cache":
        return Cache(tuple(layers), self.lengths + n_new.astype(self.lengths.dtype))

    @property
    def capacity(self) -> int:
        """Token capacity of the MLA caches (0 for a model without MLA layers)."""
        return next((c.capacity for c in self.layers if isinstance(c, MLACache)), 0)


def init_cache(cfg: K3Config, batch: int, max_len: int) -> Cache:
    """Empty caches for ``batch`` slots of up to ``max_len`` tokens each (KDA state fp32, the rest in the
    activation dtype)."""
    dt = jnp.dtype(cfg.dtype)
    f32 = jnp.promote_types(dt, jnp.float32)
    layers = []
    for kind in cfg.layer_types:
        if kind == "kda":
            lac = cfg.linear_attn_config
            H, D, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
            win = lambda: jnp.zeros((batch, W - 1, H * D), dt)  # noqa: E731
            layers.append(KDACache(jnp.zeros((batch, H, D, D), f32), win(), win(), win()))
        else:
            layers.append(MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank), dt),
                                   jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dt)))
    return Cache(tuple(layers), jnp.zeros((batch,), jnp.int32))


def cache_bytes(cache: Cache, context: int | None = None) -> dict[str, int]:
    """Bytes held per sequence, by kind. With ``context`` the MLA part counts ``context`` tokens of the buffer
    (what a cache of exactly that length holds); otherwise the whole preallocated buffer."""
    res = {"kda_recurrent_state": 0, "kda_conv_state": 0, "mla_latent_cache": 0}
    for c in cache.layers:
        B = c.batch
        if isinstance(c, KDACache):
            res["kda_recurrent_state"] += c.state.nbytes // B
            res["kda_conv_state"] += sum(x.nbytes for x in c.windows) // B
        else:
            per_tok = sum(x.nbytes // (B * x.shape[1]) for x in (c.c_kv, c.k_r))
            res["mla_latent_cache"] += per_tok * (c.capacity if context is None else context)
    res["total"] = sum(res.values())
    return res
