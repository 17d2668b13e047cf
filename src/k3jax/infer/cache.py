"""Decode caches (spec §4.4, §5.3): constant-size KDA state, per-token MLA latent.

Per KDA layer: the recurrent state ``S [B, H, K, V]`` (fp32) and the conv windows — the last W−1 projected
q, k, v inputs ``[B, W−1, H·K]`` (activation dtype). Per MLA layer: the normalised latent ``c_kv [B, L, kv_lora_rank]``
and the raw shared key part ``k_r [B, L, qk_rope_head_dim]`` (activation dtype), preallocated to a length bucket L.
AttnRes mixes blocks of the same token only, so it needs no cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.config import K3Config

MIN_BUCKET = 256


def length_bucket(n: int, chunk: int, minimum: int = MIN_BUCKET) -> int:
    """The preallocated cache length for ``n`` tokens: the next power of two ≥ n (≥ ``minimum``), a multiple of
    the prefill ``chunk``."""
    L = max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))
    return -(-L // chunk) * chunk


def init_cache(cfg: K3Config, batch: int, length: int) -> list[tuple[jax.Array, ...]]:
    """Zero caches for ``batch`` sequences of up to ``length`` tokens, one tuple per layer."""
    dt = jnp.dtype(cfg.dtype)
    f32 = jnp.promote_types(dt, jnp.float32)
    out = []
    for kind in cfg.layer_types:
        if kind == "kda":
            lac = cfg.linear_attn_config
            H, D, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
            win = lambda: jnp.zeros((batch, W - 1, H * D), dt)  # noqa: E731
            out.append((jnp.zeros((batch, H, D, D), f32), win(), win(), win()))
        else:
            out.append((jnp.zeros((batch, length, cfg.kv_lora_rank), dt),
                        jnp.zeros((batch, length, cfg.qk_rope_head_dim), dt)))
    return out


def cache_bytes(caches, context: int | None = None) -> dict[str, int]:
    """Bytes held per sequence, by kind. With ``context`` the MLA part counts ``context`` tokens of the bucket
    (what a cache of exactly that length holds); otherwise the whole preallocated bucket."""
    res = {"kda_recurrent_state": 0, "kda_conv_state": 0, "mla_latent_cache": 0}
    for c in caches:
        B = c[0].shape[0]
        if len(c) == 4:
            res["kda_recurrent_state"] += c[0].nbytes // B
            res["kda_conv_state"] += sum(x.nbytes for x in c[1:]) // B
        else:
            per_tok = sum(x.nbytes // (B * x.shape[1]) for x in c)
            res["mla_latent_cache"] += per_tok * (c[0].shape[1] if context is None else context)
    res["total"] = sum(res.values())
    return res
