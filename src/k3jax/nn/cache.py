"""Typed decode caches (spec §4.4, §5.3), registered as pytrees; batch row ``b`` of every field is slot ``b``.

* :class:`KDACache` — one per KDA layer: the recurrent state ``state [B, H, K, V]`` (fp32, constant size) and
  the short-conv windows ``conv_q, conv_k, conv_v [B, W−1, H·K]`` (the last W−1 projected inputs).
* :class:`MLACache` — one per MLA layer: the normalised latent ``c_kv [B, L, kv_lora_rank]`` and the raw shared
  key part ``k_r [B, L, qk_rope_head_dim]``, preallocated to ``L`` tokens. The layer reaches it only through
  :meth:`MLACache.append` and :meth:`MLACache.attend`, so the paged layout replaces it behind the same methods.
* :class:`PagedMLACache` — the same content in a pool of fixed-size pages shared by every slot
  (``c_kv [P, page, R]``, ``k_r [P, page, Dr]``) and a page table ``[B, max_pages]`` per slot (the server's layout:
  memory follows the tokens held, not ``B × L``).
* :class:`KDAPending` — what a KDA layer returns from a recording forward (speculative verification): the state
  and windows before the chunk and the chunk's per-token inputs (:class:`KDARecord`); :meth:`Cache.accept` keeps
  a prefix of the chunk by replaying it, so a slot holds one state plus T recorded inputs, not T states.
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
from k3jax.ops.attention import mla_latent_attention, mla_paged_latent_attention
from k3jax.ops.kda import conv_window_advance, kda_replay


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
class KDARecord:
    """A KDA layer's per-token inputs over a chunk of T tokens — what rebuilds its state and conv windows after any
    prefix of the chunk: the key (after conv, silu and L2 norm) ``k [B, T, H, K]``, the value ``v [B, T, H, V]``,
    the activated log-decay ``g [B, T, H, K]`` and ``beta [B, T, H]`` (both zero at padding tokens), and the
    projected inputs of the three short convs ``x_q, x_k, x_v [B, T, H·K]`` (before the conv)."""

    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    x_q: jax.Array
    x_k: jax.Array
    x_v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDAPending:
    """A KDA layer's cache after a recording forward: the state and windows ``before`` the chunk and the chunk's
    ``record``. :meth:`accept` gives the :class:`KDACache` after its first ``n[b]`` tokens."""

    before: KDACache
    record: KDARecord

    def accept(self, n: jax.Array) -> KDACache:
        """``n [B]`` int in ``[0, T]``: the state replayed over the first n tokens (:func:`kda_replay`), each conv
        window advanced by their inputs (:func:`conv_window_advance`)."""
        r, b = self.record, self.before
        n = jnp.asarray(n, jnp.int32)
        return KDACache(kda_replay(b.state, r.k, r.v, r.g, r.beta, n).astype(b.state.dtype),
                        *(conv_window_advance(w, x, n) for w, x in zip(b.windows, (r.x_q, r.x_k, r.x_v))))

    @property
    def batch(self) -> int:
        return self.before.batch


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedMLACache:
    """A paged MLA latent cache: pages ``c_kv [P, page, R]``, ``k_r [P, page, Dr]`` shared by all slots, and
    ``page_table [B, max_pages]`` int32 (token τ of slot b at ``page_table[b, τ // page]``, offset ``τ % page``).

    Slot operations act on page-table rows; the pool is shared, so :meth:`read_slots` views the same pool and
    :meth:`write_slots` takes the pool from the rows written (what a one-slot prefill wrote into it). Which pages
    a slot owns is the allocator's business (:class:`k3jax.infer.scheduler.PageAllocator`)."""

    c_kv: jax.Array
    k_r: jax.Array
    page_table: jax.Array

    @property
    def page_size(self) -> int:
        return self.c_kv.shape[1]

    @property
    def num_pages(self) -> int:
        return self.c_kv.shape[0]

    @property
    def capacity(self) -> int:
        """Tokens one slot can address (``max_pages × page``)."""
        return self.page_table.shape[1] * self.page_size

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    def with_page_table(self, page_table: jax.Array) -> "PagedMLACache":
        return PagedMLACache(self.c_kv, self.k_r, jnp.asarray(page_table, jnp.int32))

    @property
    def pool(self) -> tuple[jax.Array, jax.Array]:
        """The shared pages ``(c_kv [P, page, R], k_r [P, page, Dr])``."""
        return self.c_kv, self.k_r

    def with_pool(self, c_kv: jax.Array, k_r: jax.Array) -> "PagedMLACache":
        """These page-table rows over the pages ``c_kv``, ``k_r`` (another view's pool, e.g. after its append)."""
        if c_kv.shape != self.c_kv.shape or k_r.shape != self.k_r.shape:
            raise ValueError(f"with_pool: pool {c_kv.shape}, {k_r.shape} != {self.c_kv.shape}, {self.k_r.shape}")
        return PagedMLACache(c_kv, k_r, self.page_table)

    def read_slots(self, slots) -> "PagedMLACache":
        return PagedMLACache(self.c_kv, self.k_r, self.page_table[_slot_ids(slots)])

    def write_slots(self, slots, rows: "PagedMLACache") -> "PagedMLACache":
        return PagedMLACache(rows.c_kv, rows.k_r, self.page_table.at[_slot_ids(slots)].set(rows.page_table))

    def reset_slots(self, slots) -> "PagedMLACache":
        """Nothing to clear: a slot's tokens are masked by its length, its pages are handed out again."""
        return self

    def copy_slot(self, src, dst) -> "PagedMLACache":
        """Slot ``dst`` addresses the pages of ``src`` (shared, not copied)."""
        return self.write_slots(dst, self.read_slots(src))

    def copy_page(self, src, dst) -> "PagedMLACache":
        """This pool with page ``dst`` a copy of page ``src`` (copy-on-write of a shared partial page)."""
        return PagedMLACache(self.c_kv.at[dst].set(self.c_kv[src]), self.k_r.at[dst].set(self.k_r[src]),
                             self.page_table)

    def gather(self, pages: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
        """The first ``length`` tokens held in ``pages [n]`` (in order): ``c_kv [length, R]``, ``k_r [length, Dr]``."""
        return tuple(x[pages].reshape(-1, x.shape[-1])[:length] for x in (self.c_kv, self.k_r))

    def append(self, c_kv: jax.Array, k_r: jax.Array, pos: jax.Array, n_new: jax.Array) -> "PagedMLACache":
        """Scatter the first ``n_new[b]`` tokens of ``c_kv [B, T, R]``, ``k_r [B, T, Dr]`` to positions
        ``pos[b] + t`` through the page table; padding tokens are dropped (their index points past the pool)."""
        B, T, _ = c_kv.shape
        P, page = self.num_pages, self.page_size
        tpos = pos[:, None] + jnp.arange(T, dtype=pos.dtype)[None, :]                   # [B, T]
        slot_page = jnp.take_along_axis(self.page_table, jnp.clip(tpos // page, 0, self.page_table.shape[1] - 1),
                                        axis=1)
        valid = jnp.arange(T)[None, :] < n_new[:, None]
        flat = jnp.where(valid, slot_page * page + tpos % page, P * page).reshape(-1)   # out of range → dropped

        def put(pool, new):
            rows = pool.reshape(P * page, -1).at[flat].set(new.reshape(B * T, -1).astype(pool.dtype), mode="drop")
            return rows.reshape(pool.shape)

        return PagedMLACache(put(self.c_kv, c_kv), put(self.k_r, k_r), self.page_table)

    def attend(self, q_latent: jax.Array, q_rope: jax.Array, q_pos: jax.Array, kv_len: jax.Array,
               scale: float) -> jax.Array:
        return mla_paged_latent_attention(q_latent, q_rope, self.c_kv, self.k_r, self.page_table, q_pos, kv_len,
                                          scale)


LayerCache = Union[KDACache, MLACache, PagedMLACache, KDAPending]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache:
    layers: tuple            # one KDACache / MLACache / PagedMLACache per decoder layer
    lengths: jax.Array       # [B] int32: tokens held per slot

    def read_slots(self, slots) -> "Cache":
        """The rows ``slots`` (int or ``[n]``) as a cache of batch ``n``."""
        idx = _slot_ids(slots)
        return Cache(tuple(c.read_slots(idx) for c in self.layers), self.lengths[idx])

    def write_slots(self, slots, rows: "Cache") -> "Cache":
        """This cache with rows ``slots`` replaced by the batch of ``rows`` (same layout, batch ``n``)."""
        idx = _slot_ids(slots)
        return Cache(tuple(c.write_slots(idx, r) for c, r in zip(self.layers, rows.layers)),
                     self.lengths.at[idx].set(rows.lengths))

    def reset_slots(self, slots) -> "Cache":
        """This cache with rows ``slots`` emptied (zero state, windows and length)."""
        idx = _slot_ids(slots)
        return Cache(tuple(c.reset_slots(idx) for c in self.layers), self.lengths.at[idx].set(0))

    def copy_slot(self, src, dst) -> "Cache":
        """This cache with slot ``dst`` a copy of slot ``src``."""
        return self.write_slots(dst, self.read_slots(src))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def kda_rows(self, slot) -> tuple[KDACache, ...]:
        """Slot ``slot``'s recurrent state and conv windows in every KDA layer (batch 1 each, layer order): what a
        prefix-cache checkpoint holds."""
        idx = _slot_ids(slot)
        return tuple(c.read_slots(idx) for c in self.layers if isinstance(c, KDACache))

    def with_kda_rows(self, slot, rows: tuple[KDACache, ...]) -> "Cache":
        """This cache with slot ``slot``'s KDA state and windows replaced by ``rows`` (from :meth:`kda_rows`)."""
        idx, it = _slot_ids(slot), iter(rows)
        return Cache(tuple(c.write_slots(idx, next(it)) if isinstance(c, KDACache) else c for c in self.layers),
                     self.lengths)

    def copy_page(self, src, dst) -> "Cache":
        """Every paged MLA layer with page ``dst`` a copy of page ``src``."""
        return Cache(tuple(c.copy_page(src, dst) if isinstance(c, PagedMLACache) else c for c in self.layers),
                     self.lengths)

    def with_page_table(self, page_table: jax.Array) -> "Cache":
        """Every paged MLA layer addressing ``page_table [B, max_pages]`` (one table for all layers)."""
        return Cache(tuple(c.with_page_table(page_table) if isinstance(c, PagedMLACache) else c
                           for c in self.layers), self.lengths)

    def advance(self, layers: tuple, n_new: jax.Array) -> "Cache":
        return Cache(tuple(layers), self.lengths + n_new.astype(self.lengths.dtype))

    @property
    def pending(self) -> bool:
        """Whether this is a recording forward's cache (KDA layers :class:`KDAPending`, lengths not advanced)."""
        return any(isinstance(c, KDAPending) for c in self.layers)

    def accept(self, n: jax.Array) -> "Cache":
        """Keep the first ``n[b]`` tokens of the chunk a recording forward (``model(…, kda_record=True)``) ran on
        each slot: KDA layers replay them from the state before the chunk, MLA layers keep what they appended (the
        latents past ``lengths + n`` are masked by the length and overwritten later); lengths advance by n."""
        n = jnp.asarray(n, jnp.int32)
        return Cache(tuple(c.accept(n) if isinstance(c, KDAPending) else c for c in self.layers),
                     self.lengths + n.astype(self.lengths.dtype))

    def kda_records(self) -> tuple[KDARecord, ...]:
        """The records of a pending cache's KDA layers (layer order)."""
        return tuple(c.record for c in self.layers if isinstance(c, KDAPending))

    @property
    def capacity(self) -> int:
        """Token capacity of one slot's MLA caches (0 for a model without MLA layers)."""
        return next((c.capacity for c in self.layers if isinstance(c, (MLACache, PagedMLACache))), 0)


def init_cache(cfg: K3Config, batch: int, max_len: int) -> Cache:
    """Empty caches for ``batch`` slots of up to ``max_len`` tokens each (KDA state fp32, the rest in the
    activation dtype)."""
    dt = jnp.dtype(cfg.dtype)
    layers = [_kda_layer_cache(cfg, batch) if kind == "kda" else
              MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank), dt),
                       jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dt))
              for kind in cfg.layer_types]
    return Cache(tuple(layers), jnp.zeros((batch,), jnp.int32))


def _kda_layer_cache(cfg: K3Config, batch: int) -> KDACache:
    dt = jnp.dtype(cfg.dtype)
    lac = cfg.linear_attn_config
    H, D, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    win = lambda: jnp.zeros((batch, W - 1, H * D), dt)  # noqa: E731
    return KDACache(jnp.zeros((batch, H, D, D), jnp.promote_types(dt, jnp.float32)), win(), win(), win())


def init_paged_cache(cfg: K3Config, slots: int, num_pages: int, page_size: int, max_len: int) -> Cache:
    """Caches for a slot pool: KDA state and conv windows per slot, and per MLA layer a pool of ``num_pages``
    pages of ``page_size`` tokens with a page table of ``ceil(max_len / page_size)`` entries per slot (all zero:
    the allocator fills it)."""
    dt = jnp.dtype(cfg.dtype)
    max_pages = -(-max_len // page_size)
    # a table per layer: one buffer shared by several leaves could not be donated to a jitted step
    layers = [_kda_layer_cache(cfg, slots) if kind == "kda" else
              PagedMLACache(jnp.zeros((num_pages, page_size, cfg.kv_lora_rank), dt),
                            jnp.zeros((num_pages, page_size, cfg.qk_rope_head_dim), dt),
                            jnp.zeros((slots, max_pages), jnp.int32))
              for kind in cfg.layer_types]
    return Cache(tuple(layers), jnp.zeros((slots,), jnp.int32))


def page_bytes(cfg: K3Config) -> int:
    """Bytes of one token of MLA latent cache over all MLA layers (``(kv_lora_rank + qk_rope_head_dim)`` values
    per MLA layer)."""
    n_mla = sum(1 for k in cfg.layer_types if k != "kda")
    return n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * jnp.dtype(cfg.dtype).itemsize


def slot_state_bytes(cfg: K3Config) -> int:
    """Bytes of one slot's constant-size KDA part (recurrent state fp32 + conv windows) over all KDA layers."""
    c = _kda_layer_cache(cfg, 1)
    return sum(1 for k in cfg.layer_types if k == "kda") * sum(x.nbytes for x in jax.tree.leaves(c))


def kda_record_bytes(cfg: K3Config, T: int) -> int:
    """Bytes of one slot's :class:`KDARecord` over all KDA layers for a chunk of ``T`` tokens: per token and layer
    the key and log-decay ``H·K`` each and β ``H`` in fp32, the value ``H·V`` and the three conv inputs ``3·H·K``
    in the activation dtype."""
    lac = cfg.linear_attn_config
    H, D = lac.num_heads, lac.head_dim
    act = jnp.dtype(cfg.dtype).itemsize
    f32 = jnp.dtype(jnp.promote_types(cfg.dtype, jnp.float32)).itemsize
    per_token = (2 * H * D + H) * f32 + (H * D + 3 * H * D) * act
    return sum(1 for k in cfg.layer_types if k == "kda") * T * per_token


def cache_bytes(cache: Cache, context: int | None = None) -> dict[str, int]:
    """Bytes held per sequence, by kind. With ``context`` the MLA part counts ``context`` tokens of the buffer
    (what a cache of exactly that length holds); otherwise the whole preallocated buffer."""
    res = {"kda_recurrent_state": 0, "kda_conv_state": 0, "mla_latent_cache": 0}
    for c in cache.layers:
        B = c.batch
        if isinstance(c, KDACache):
            res["kda_recurrent_state"] += c.state.nbytes // B
            res["kda_conv_state"] += sum(x.nbytes for x in c.windows) // B
        elif isinstance(c, PagedMLACache):
            per_tok = sum(x.nbytes // (c.num_pages * c.page_size) for x in (c.c_kv, c.k_r))
            res["mla_latent_cache"] += per_tok * (c.capacity if context is None else context)
        else:
            per_tok = sum(x.nbytes // (B * x.shape[1]) for x in (c.c_kv, c.k_r))
            res["mla_latent_cache"] += per_tok * (c.capacity if context is None else context)
    res["total"] = sum(res.values())
    return res
