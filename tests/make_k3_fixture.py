"""Write a random Kimi K3 checkpoint in the release on-disk format (spec 9.2), numpy only.

write_random_k3_checkpoint(dir, text_config, seed, prefix=True) writes
  dir/config.json        {"model_type": "kimi_k3", "architectures": [...], "text_config": ...}
  dir/model.safetensors  float32 tensors, unquantized experts (experts.{e}.w{1,2,3}.weight)

write_release_pair(mx_dir, dense_dir, text_config, seed, shards) writes the same random model twice, split over
`shards` files with a model.safetensors.index.json: once with MXFP4 experts (random E2M1 codes and E8M0 scales,
packed here from the spec's words, independently of k3jax's exporter) and once with those experts dequantized.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

__all__ = ["write_random_k3_checkpoint", "write_release_pair", "E2M1_SPEC", "pack_spec", "dequant_spec"]

# spec §9.3: bit 3 = sign, bits 0-2 index these magnitudes
E2M1_SPEC = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def pack_spec(codes):
    """codes uint8 [O, I] (values 0..15) -> weight_packed [O, I/2]: element 2j low nibble, 2j+1 high nibble."""
    O, I = codes.shape
    out = np.zeros((O, I // 2), np.uint8)
    for j in range(I // 2):
        out[:, j] = codes[:, 2 * j] | (codes[:, 2 * j + 1] << 4)
    return out


def dequant_spec(codes, scale):
    """W[o, i] = E2M1(code[o, i]) * 2**(scale[o, i // 32] - 127), written out element-wise."""
    O, I = codes.shape
    w = np.zeros((O, I), np.float64)
    for o in range(O):
        for i in range(I):
            c = int(codes[o, i])
            mag = E2M1_SPEC[c & 7]
            w[o, i] = (-mag if c & 8 else mag) * 2.0 ** (int(scale[o, i // 32]) - 127)
    return w.astype(np.float32)


def _write_shards(dir, tensors, shards):
    keys = list(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(dir, "model.safetensors"))
        return
    per = -(-len(keys) // shards)
    weight_map = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: tensors[key] for key in keys[k * per:(k + 1) * per]}
        save_file(part, os.path.join(dir, name))
        weight_map.update({key: name for key in part})
    with open(os.path.join(dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                   "weight_map": weight_map}, f)


def write_release_pair(mx_dir, dense_dir, text_config, seed, shards=3):
    """The same random model as an MXFP4 release checkpoint (mx_dir) and with dequantized experts (dense_dir)."""
    write_random_k3_checkpoint(dense_dir, text_config, seed)
    from safetensors.numpy import load_file

    dense = load_file(os.path.join(dense_dir, "model.safetensors"))
    os.remove(os.path.join(dense_dir, "model.safetensors"))
    rng = np.random.default_rng(seed + 1000)
    mx = {}
    for k in list(dense):
        if ".experts." in k and k.endswith(".weight"):
            O, I = dense[k].shape
            codes = rng.integers(0, 16, size=(O, I)).astype(np.uint8)
            scale = rng.integers(120, 128, size=(O, I // 32)).astype(np.uint8)
            mx[k[: -len("weight")] + "weight_packed"] = pack_spec(codes)
            mx[k[: -len("weight")] + "weight_scale"] = scale
            dense[k] = dequant_spec(codes, scale)
        else:
            mx[k] = dense[k]
    os.makedirs(mx_dir, exist_ok=True)
    with open(os.path.join(dense_dir, "config.json")) as f:
        top = json.load(f)
    top["text_config"]["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32,
                                                                           "type": "float"}}}}
    with open(os.path.join(mx_dir, "config.json"), "w") as f:
        json.dump(top, f, indent=2)
    _write_shards(dense_dir, dense, shards)
    _write_shards(mx_dir, mx, shards)
    return mx_dir, dense_dir


def write_random_k3_checkpoint(dir, text_config, seed, prefix=True):
    cfg = dict(text_config)
    rng = np.random.default_rng(seed)
    tensors = {}
    root = "language_model." if prefix else ""
    mp = root + "model."

    def put(name, arr):
        tensors[name] = np.ascontiguousarray(np.asarray(arr, dtype=np.float32))

    def linear(out_dim, in_dim):
        return rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)

    def gain(n):
        return rng.uniform(0.8, 1.2, size=(n,))

    H = int(cfg["hidden_size"])
    V = int(cfg["vocab_size"])
    L = int(cfg["num_hidden_layers"])
    use_attnres = cfg.get("attn_res_block_size") is not None
    la = cfg.get("linear_attn_config") or {}
    kda_layers = set(int(n) for n in la.get("kda_layers", []))

    def attnres(prefix_name):
        put(prefix_name + "_norm.weight", gain(H))
        put(prefix_name + "_proj.weight", 0.5 * rng.standard_normal((1, H)))

    put(mp + "embed_tokens.weight", rng.standard_normal((V, H)))
    put(root + "lm_head.weight", linear(V, H))
    put(mp + "norm.weight", gain(H))
    if use_attnres:
        attnres(mp + "output_attn_res")

    fk = int(cfg.get("first_k_dense_replace", 0) or 0)
    freq = int(cfg.get("moe_layer_freq", 1) or 1)

    for i in range(L):
        lp = mp + f"layers.{i}."
        put(lp + "input_layernorm.weight", gain(H))
        put(lp + "post_attention_layernorm.weight", gain(H))
        if use_attnres:
            attnres(lp + "self_attention_res")
            attnres(lp + "mlp_res")

        sa = lp + "self_attn."
        if (i + 1) in kda_layers:
            nh = int(la["num_heads"])
            d = int(la["head_dim"])
            W = int(la["short_conv_kernel_size"])
            P = nh * d
            for n in ("q", "k", "v"):
                put(sa + f"{n}_proj.weight", linear(P, H))
                put(sa + f"{n}_conv1d.weight", rng.standard_normal((P, 1, W)) / np.sqrt(W))
            put(sa + "f_a_proj.weight", linear(d, H))
            put(sa + "f_b_proj.weight", linear(P, d))
            put(sa + "b_proj.weight", linear(nh, H))
            a_log = np.zeros(2 * nh)
            a_log[:nh] = rng.uniform(-1.0, 1.0, size=(nh,))
            put(sa + "A_log", a_log)
            put(sa + "dt_bias", rng.standard_normal((P,)))
            if la.get("use_full_rank_gate", False):
                put(sa + "g_proj.weight", linear(P, H))
            else:
                put(sa + "g_a_proj.weight", linear(d, H))
                put(sa + "g_b_proj.weight", linear(P, d))
            put(sa + "o_norm.weight", gain(d))
            put(sa + "o_proj.weight", linear(H, P))
        else:
            nh = int(cfg["num_attention_heads"])
            dn = int(cfg["qk_nope_head_dim"])
            dr = int(cfg["qk_rope_head_dim"])
            dv = int(cfg["v_head_dim"])
            rkv = int(cfg["kv_lora_rank"])
            rq = cfg.get("q_lora_rank")
            if rq is not None:
                rq = int(rq)
                put(sa + "q_a_proj.weight", linear(rq, H))
                put(sa + "q_a_layernorm.weight", gain(rq))
                put(sa + "q_b_proj.weight", linear(nh * (dn + dr), rq))
            else:
                put(sa + "q_proj.weight", linear(nh * (dn + dr), H))
            put(sa + "kv_a_proj_with_mqa.weight", linear(rkv + dr, H))
            put(sa + "kv_a_layernorm.weight", gain(rkv))
            put(sa + "kv_b_proj.weight", linear(nh * (dn + dv), rkv))
            if cfg.get("mla_use_output_gate", False):
                put(sa + "g_proj.weight", linear(nh * dv, H))
            put(sa + "o_proj.weight", linear(H, nh * dv))

        is_moe = bool(cfg.get("num_experts")) and i >= fk and i % freq == 0
        if not is_moe:
            I = int(cfg["intermediate_size"])
            put(lp + "mlp.gate_proj.weight", linear(I, H))
            put(lp + "mlp.up_proj.weight", linear(I, H))
            put(lp + "mlp.down_proj.weight", linear(H, I))
        else:
            bp = lp + "block_sparse_moe."
            E = int(cfg["num_experts"])
            Ie = int(cfg["moe_intermediate_size"])
            lat = cfg.get("routed_expert_hidden_size")
            Din = int(lat) if lat is not None else H
            put(bp + "gate.weight", linear(E, H))
            put(bp + "gate.e_score_correction_bias", 0.3 * rng.standard_normal((E,)))
            if lat is not None:
                put(bp + "routed_expert_down_proj.weight", linear(Din, H))
                if cfg.get("latent_moe_use_norm", False):
                    put(bp + "routed_expert_norm.weight", gain(Din))
                put(bp + "routed_expert_up_proj.weight", linear(H, Din))
            for e in range(E):
                ep = bp + f"experts.{e}."
                put(ep + "w1.weight", linear(Ie, Din))
                put(ep + "w3.weight", linear(Ie, Din))
                put(ep + "w2.weight", linear(Din, Ie))
            ns = int(cfg.get("num_shared_experts", 0) or 0)
            if ns > 0:
                Is = ns * Ie
                sp = bp + "shared_experts."
                put(sp + "gate_proj.weight", linear(Is, H))
                put(sp + "up_proj.weight", linear(Is, H))
                put(sp + "down_proj.weight", linear(H, Is))

    # dummy multimodal tensors that a text loader must ignore
    put("vision_tower.x.weight", rng.standard_normal((4, 4)))
    put("mm_projector.y.weight", rng.standard_normal((4, 4)))

    os.makedirs(dir, exist_ok=True)
    top = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": cfg,
    }
    with open(os.path.join(dir, "config.json"), "w") as f:
        json.dump(top, f, indent=2)
    save_file(tensors, os.path.join(dir, "model.safetensors"))
    return dir
