"""What a configuration costs, before buying hardware: parameters, weight bytes, decode state, all-to-all buffers
and FLOPs per token. Everything is derived from the config and ``jax.eval_shape`` of the real model.

Conventions (stated in the output):

* activated parameters: every weight a token touches except the input embedding table (spec §10; K3 → 104.19B);
* decode state per sequence: KDA recurrent state fp32 ``[H, K, V]`` per KDA layer, conv windows of the last W−1
  projected q/k/v in the activation dtype (bf16), MLA cache ``kv_lora_rank + qk_rope_head_dim`` values per token per
  MLA layer in bf16; compared with an all-MLA model (every layer caches the latent) and a plain multi-head cache
  of the same head dims (``n_heads × (d_qk + d_v)`` per token per layer);
* all-to-all receive buffer per rank: tokens × dispatched width (the latent width for LatentMoE) × 2 bytes;
  MoonEP receives exactly S×K tokens, a dropless ragged exchange must provision for the worst case S×K×R;
* FLOPs: 2 per multiply-add; forward = 2 × activated params + attention over the context (MLA: causal average
  T/2 during training, T during decode; KDA: chunked-form state and in-chunk work, constant in T);
  training = 3 × forward (forward + backward).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flax import nnx

from k3jax.config import K3Config
from k3jax.params import abstract_model, parameter_table

CONTEXTS = (4096, 131072, 1048576)
KDA_CHUNK = 64


def weight_bytes(cfg: K3Config) -> dict[str, int]:
    """Bytes of the weights in bf16 (fp32 where the release keeps fp32) and with MXFP4 routed experts."""
    out = {}
    for label, expert_dtype in (("bf16", None), ("mxfp4_experts", "mxfp4")):
        c = cfg.replace(dtype="bfloat16", expert_dtype=expert_dtype if cfg.num_experts else None)
        if expert_dtype == "mxfp4" and cfg.num_experts and (c.expert_in_dim % 32 or c.moe_intermediate_size % 32):
            continue
        _, state = nnx.split(abstract_model(c))
        out[label] = int(sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for _, v in nnx.to_flat_state(state)))
    return out


def decode_state(cfg: K3Config, contexts=CONTEXTS, act_bytes: int = 2) -> dict[str, dict[str, int]]:
    """Per-sequence decode state in bytes at each context length."""
    n_kda = cfg.layer_types.count("kda")
    n_mla = cfg.layer_types.count("mla")
    L = cfg.num_hidden_layers
    lac = cfg.linear_attn_config
    kda_state = conv = 0
    if lac is not None and n_kda:
        kda_state = n_kda * lac.num_heads * lac.head_dim * lac.head_dim * 4
        conv = n_kda * 3 * (lac.short_conv_kernel_size - 1) * lac.num_heads * lac.head_dim * act_bytes
    latent = (cfg.kv_lora_rank or 0) + (cfg.qk_rope_head_dim or 0)
    mha_per_tok = cfg.num_attention_heads * (cfg.qk_head_dim + (cfg.v_head_dim or 0)) * act_bytes
    res = {}
    for T in contexts:
        mla = n_mla * latent * act_bytes * T
        res[str(T)] = {
            "kda_recurrent_state": kda_state, "kda_conv_state": conv, "mla_latent_cache": mla,
            "total": kda_state + conv + mla,
            "all_mla_model": L * latent * act_bytes * T,
            "plain_mha_cache": L * mha_per_tok * T,
        }
    return res


def all_to_all(cfg: K3Config, S: int, K: int | None, R: int, act_bytes: int = 2) -> dict[str, Any]:
    """Receive buffer per expert-parallel rank: MoonEP (exactly S×K) vs dropless worst case (S×K×R)."""
    K = K or cfg.num_experts_per_token or 0
    width = cfg.expert_in_dim
    return {"S": S, "K": K, "R": R, "dispatch_width": width, "bytes_per_value": act_bytes,
            "moonep_tokens": S * K, "moonep_bytes": S * K * width * act_bytes,
            "dropless_worst_tokens": S * K * R, "dropless_worst_bytes": S * K * R * width * act_bytes}


def flops_per_token(cfg: K3Config, train_seq: int = 4096, contexts=CONTEXTS,
                    activated: int | None = None) -> dict[str, Any]:
    """FLOPs per token: training at ``train_seq`` and decode at each context length."""
    act = parameter_table(cfg).activated if activated is None else activated
    n_kda = cfg.layer_types.count("kda")
    n_mla = cfg.layer_types.count("mla")
    lac = cfg.linear_attn_config
    kda_tok = 0
    if lac is not None:
        Kd = lac.head_dim
        # chunked form per token per head: state reads/writes (w·S, q·S, kᵀU: ≈ 6·K·V) and in-chunk tiles (≈ 4·C·K)
        kda_tok = n_kda * lac.num_heads * (6 * Kd * Kd + 4 * KDA_CHUNK * Kd)
    nh, dqk, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim or 0

    def mla_expanded(T: float) -> float:
        return n_mla * nh * 2 * (dqk + dv) * T

    fwd_train = 2 * act + mla_expanded(train_seq / 2) + kda_tok
    r, dr = cfg.kv_lora_rank or 0, cfg.qk_rope_head_dim or 0
    decode = {}
    for T in contexts:
        # absorbed MLA over the latent cache: scores over r_kv + d_rope, values over r_kv, per head
        mla_dec = n_mla * nh * 2 * (r + dr + r) * T
        kda_dec = (n_kda * lac.num_heads * 8 * lac.head_dim * lac.head_dim) if lac is not None else 0
        decode[str(T)] = int(2 * act + mla_dec + kda_dec)
    return {"training_seq": train_seq, "forward": int(fwd_train), "training": int(3 * fwd_train),
            "decode": decode}


def inspect_config(cfg: K3Config, *, S: int = 4096, K: int | None = None, R: int = 32, cp: int | None = None,
                   seq_len: int = 32768) -> dict[str, Any]:
    """The whole report as a JSON-able dict (top-level ``total_params`` and ``activated_params``); with ``cp``
    also :func:`context_parallel` for ``seq_len``."""
    t = parameter_table(cfg)
    extra = {"context_parallel": context_parallel(cfg, cp, seq_len)} if cp else {}
    return {**extra,
        "total_params": t.total,
        "activated_params": t.activated,
        "activated_convention": "all weights a token touches (top-k routed experts, lm_head) except the input "
                                "embedding table",
        "components": dict(sorted(t.components.items(), key=lambda kv: -kv[1])),
        "routed_expert_params": t.routed_experts,
        "weight_bytes": weight_bytes(cfg),
        "decode_state_bytes_per_sequence": decode_state(cfg),
        "all_to_all_receive_per_rank": all_to_all(cfg, S, K, R) if cfg.num_experts else None,
        "flops_per_token": flops_per_token(cfg, activated=t.activated),
        "layers": {"kda": cfg.layer_types.count("kda"), "mla": cfg.layer_types.count("mla"),
                   "moe": len(cfg.moe_layers)},
    }


def context_parallel(cfg: K3Config, ranks: int, seq_len: int, batch: int = 1) -> dict[str, Any]:
    """Communication of context parallelism over ``ranks`` (:mod:`k3jax.parallel.context`), bytes each rank sends
    into one layer's collective (fp32) and receives from it, for ``batch`` sequences of ``seq_len`` tokens.

    * KDA: the all-gather of the shard summary ``(M [H, K, K], S̃ [H, K, V])`` — independent of ``seq_len``;
    * MLA: the all-gather of the latent ``c_kv ‖ k_r`` (``kv_lora_rank + qk_rope_head_dim`` values per token) of
      the rank's ``seq_len / ranks`` tokens — grows with ``seq_len``;
    * the short conv's halo: W−1 projected q/k/v inputs per row from the previous rank (``ppermute``)."""
    lac = cfg.linear_attn_config
    H, K, V = lac.num_heads, lac.head_dim, lac.head_dim
    kda_send = batch * H * K * (K + V) * 4
    per_rank = -(-seq_len // ranks)
    mla_send = batch * per_rank * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    halo = batch * (lac.short_conv_kernel_size - 1) * 3 * H * K * 4
    n_kda, n_mla = cfg.layer_types.count("kda"), cfg.layer_types.count("mla")
    return {
        "ranks": ranks, "seq_len": seq_len, "batch": batch, "tokens_per_rank": per_rank,
        "kda_summary_send_per_layer": kda_send, "kda_summary_recv_per_layer": kda_send * (ranks - 1),
        "kda_conv_halo_per_layer": halo,
        "mla_latent_send_per_layer": mla_send, "mla_latent_recv_per_layer": mla_send * (ranks - 1),
        "kda_layers": n_kda, "mla_layers": n_mla,
        "total_recv_per_rank": n_kda * (kda_send * (ranks - 1) + halo) + n_mla * mla_send * (ranks - 1),
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return str(n)
