"""Write a random Kimi K3 multimodal checkpoint (text model + MoonViT-V2 tower + patchmergerv2), numpy only.

write_random_multimodal_checkpoint(dir, text_config, vision_config, seed, media_cfg=None) writes
  dir/config.json               {"model_type": "kimi_k3", ..., "text_config": ..., "vision_config": ...,
                                 "media_placeholder_token_id": 163605, ...}
  dir/model.safetensors         float32: the text model of make_k3_fixture.write_random_k3_checkpoint (without its
                                dummy vision tensors) + the vision tensors of K3_VISION_SPEC.md section 2
  dir/preprocessor_config.json  {"media_proc_cfg": media_cfg or K3_MEDIA_CFG}

TINY_VISION_CONFIG is the section 11 tiny config (text_hidden_size is filled in from text_config["hidden_size"]);
K3_MEDIA_CFG the section 1.2 processor values.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
from safetensors.numpy import load_file, save_file

try:
    from make_k3_fixture import write_random_k3_checkpoint
    from reference_vision_numpy import K3_MEDIA_CFG_DEFAULT
except ImportError:  # imported as tests.make_vision_fixture
    from .make_k3_fixture import write_random_k3_checkpoint
    from .reference_vision_numpy import K3_MEDIA_CFG_DEFAULT

__all__ = ["write_random_multimodal_checkpoint", "TINY_VISION_CONFIG", "K3_MEDIA_CFG", "VISION_CONFIG_FIELDS",
           "MEDIA_PLACEHOLDER_TOKEN_ID"]

MEDIA_PLACEHOLDER_TOKEN_ID = 163605

# every field of spec 1.1 (a test config must spell them all out: REL's defaults for missing keys differ)
VISION_CONFIG_FIELDS = (
    "patch_size", "vt_hidden_size", "qkv_hidden_size", "vt_num_attention_heads", "vt_intermediate_size",
    "vt_num_hidden_layers", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time", "pos_emb_type",
    "pos_emb_interpolation_mode", "norm_type", "activation_func", "mlp_type", "attn_bias", "linear_bias",
    "patch_embed_proj_bias", "merge_kernel_size", "merge_type", "mm_projector_type", "mm_hidden_size",
    "projector_hidden_act", "projector_ln_eps", "text_hidden_size", "_attn_implementation",
)

TINY_VISION_CONFIG = {
    "patch_size": 14,
    "vt_hidden_size": 64,
    "qkv_hidden_size": 96,
    "vt_num_attention_heads": 4,
    "vt_intermediate_size": 128,
    "vt_num_hidden_layers": 2,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "pos_emb_interpolation_mode": "bilinear",
    "norm_type": "rmsnorm",
    "activation_func": "gelu_pytorch_tanh",
    "mlp_type": "mlp2",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "mm_hidden_size": 64,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "text_hidden_size": None,  # filled in from text_config["hidden_size"]
    "_attn_implementation": "eager",
}

# spec §1.2, the one copy the reference keeps (the checkpoint's preprocessor_config.json, read by both sides)
K3_MEDIA_CFG = copy.deepcopy(K3_MEDIA_CFG_DEFAULT)


def _merge_pair(v):
    if isinstance(v, (list, tuple)):
        return int(v[0]), int(v[1])
    return int(v), int(v)


def _random_vision_tensors(vc, rng):
    """Spec 2 names and general shapes; float32."""
    tensors = {}

    def put(name, arr):
        tensors[name] = np.ascontiguousarray(np.asarray(arr, dtype=np.float32))

    def linear(out_dim, in_dim):
        return rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)

    def gain(n):
        return rng.uniform(0.8, 1.2, size=(n,))

    p = int(vc["patch_size"])
    D = int(vc["vt_hidden_size"])
    Q = int(vc["qkv_hidden_size"])
    I = int(vc["vt_intermediate_size"])
    H0, W0 = int(vc["init_pos_emb_height"]), int(vc["init_pos_emb_width"])
    M = int(vc["mm_hidden_size"])
    T = int(vc["text_hidden_size"])
    kh, kw = _merge_pair(vc["merge_kernel_size"])
    K = kh * kw

    vt = "vision_tower."
    put(vt + "patch_embed.proj.weight", rng.standard_normal((D, 3, p, p)) / np.sqrt(3 * p * p))
    put(vt + "patch_embed.pos_emb.weight", 0.5 * rng.standard_normal((H0, W0, D)))
    for b in range(int(vc["vt_num_hidden_layers"])):
        bp = vt + f"encoder.blocks.{b}."
        put(bp + "norm0.weight", gain(D))
        put(bp + "wqkv.weight", linear(3 * Q, D))
        put(bp + "wo.weight", linear(D, Q))
        put(bp + "norm1.weight", gain(D))
        put(bp + "mlp.fc0.weight", linear(I, D))
        put(bp + "mlp.fc1.weight", linear(D, I))
    put(vt + "encoder.final_layernorm.weight", gain(D))
    put("mm_projector.proj.0.weight", linear(K * M, K * M))
    put("mm_projector.proj.2.weight", linear(T, K * M))
    put("mm_projector.post_norm.weight", gain(T))
    return tensors


def write_random_multimodal_checkpoint(dir, text_config, vision_config, seed, media_cfg=None):
    text_hidden = int(text_config["hidden_size"])
    vc = copy.deepcopy(dict(vision_config))
    if vc.get("text_hidden_size") is None:
        vc["text_hidden_size"] = text_hidden
    elif int(vc["text_hidden_size"]) != text_hidden:
        raise ValueError(f"vision_config.text_hidden_size={vc['text_hidden_size']} != text hidden {text_hidden}")
    missing = [k for k in VISION_CONFIG_FIELDS if k not in vc]
    if missing:
        raise ValueError(f"vision_config must spell out every field; missing {missing}")
    if int(vc["mm_hidden_size"]) != int(vc["vt_hidden_size"]):
        raise ValueError("mm_hidden_size must equal vt_hidden_size (the projector input is the tower output)")

    write_random_k3_checkpoint(dir, text_config, seed)
    path = os.path.join(dir, "model.safetensors")
    tensors = load_file(path)
    for k in [k for k in tensors if k.startswith("vision_tower.") or k.startswith("mm_projector.")]:
        del tensors[k]  # the dummy vision_tower.x.weight / mm_projector.y.weight
    tensors.update(_random_vision_tensors(vc, np.random.default_rng(seed + 7919)))
    save_file(tensors, path)

    cfg_path = os.path.join(dir, "config.json")
    with open(cfg_path) as f:
        top = json.load(f)
    top["vision_config"] = vc
    top["media_placeholder_token_id"] = MEDIA_PLACEHOLDER_TOKEN_ID
    top["image_placeholder"] = "<|kimi_image_placeholder|>"
    top["ignore_index"] = -100
    with open(cfg_path, "w") as f:
        json.dump(top, f, indent=2)

    with open(os.path.join(dir, "preprocessor_config.json"), "w") as f:
        json.dump({"media_proc_cfg": copy.deepcopy(media_cfg if media_cfg is not None else K3_MEDIA_CFG)},
                  f, indent=2)
    return dir
