"""Independent float64 NumPy reference of the Kimi K3 text forward pass.

Written from /work/shared/K3_SPEC.md only (sections 1-9, 11-13). It is meant as a
slow, loop-based oracle for testing other implementations, so every step follows
the spec literally and everything is computed in float64.

Public API
----------
load_release_checkpoint(dir) -> (text_config: dict, tensors: dict[str, np.ndarray float64])
forward(text_config, tensors, input_ids, record=None, inputs_embeds=None) -> logits [T, vocab] float64

Only unquantized checkpoints are supported (routed experts stored as
``experts.{e}.w{1,2,3}.weight``).
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
from safetensors.numpy import load_file

__all__ = ["load_release_checkpoint", "forward"]


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def load_release_checkpoint(dir):
    """Read config.json + every *.safetensors file in ``dir``.

    Returns (text_config, tensors). Keys are returned without the optional
    ``language_model.`` prefix (so ``model.layers.0...`` / ``lm_head.weight``);
    ``vision_tower.*`` and ``mm_projector.*`` tensors are dropped. All arrays are float64.
    """
    with open(os.path.join(dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") == "kimi_k3" or "text_config" in cfg:
        text_config = dict(cfg["text_config"])
    else:
        text_config = dict(cfg)

    files = sorted(glob.glob(os.path.join(dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {dir}")
    raw = {}
    for fn in files:
        raw.update(load_file(fn))

    tensors = {}
    for key, val in raw.items():
        if key.startswith("vision_tower.") or key.startswith("mm_projector."):
            continue
        if key.startswith("language_model."):
            key = key[len("language_model."):]
        if key.startswith("vision_tower.") or key.startswith("mm_projector."):
            continue
        if key.endswith(".weight_packed") or key.endswith(".weight_scale"):
            raise NotImplementedError(
                f"quantized tensor {key}: this reference supports unquantized weights only")
        tensors[key] = np.asarray(val, dtype=np.float64)
    return text_config, tensors


# --------------------------------------------------------------------------------------
# Primitives
# --------------------------------------------------------------------------------------


def _sigmoid(x):
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def _silu(x):
    return x * _sigmoid(x)


def _softplus(x):
    return np.logaddexp(0.0, x)


def _softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def _linear(x, w):
    """y = x W^T with W stored PyTorch style [out, in]."""
    return x @ w.T


def _rmsnorm(x, w, eps):
    """w * x / sqrt(mean(x^2) + eps) over the last axis."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return w * (x / np.sqrt(ms + eps))


def _l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis (eps added to the SUM)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def _gated_act(a, u, cfg):
    """SiTU-GLU or SiLU-GLU, per cfg['hidden_act'] (spec 7.1)."""
    act = cfg.get("hidden_act", "silu")
    if act == "situ":
        beta = cfg.get("activation_situ_beta")
        if beta is None:
            beta = 1.0
        beta_lin = cfg.get("activation_situ_linear_beta")
        gate = beta * np.tanh(a / beta) * _sigmoid(a)
        up = u if beta_lin is None else beta_lin * np.tanh(u / beta_lin)
        return gate * up
    if act in ("silu", "swish"):
        return _silu(a) * u
    raise NotImplementedError(f"hidden_act={act!r}")


def _mlp(x, w_gate, w_up, w_down, cfg):
    return _linear(_gated_act(_linear(x, w_gate), _linear(x, w_up), cfg), w_down)


# --------------------------------------------------------------------------------------
# Helpers for tensor lookup
# --------------------------------------------------------------------------------------


def _get(tensors, name):
    if name not in tensors:
        raise KeyError(f"missing tensor {name}")
    return tensors[name]


def _layer_prefix(i):
    return f"model.layers.{i}."


def _attnres_params(tensors, prefix):
    """Returns the folded pseudo-query w = norm.weight * proj.weight[0] for a site.

    ``prefix`` is e.g. 'model.layers.3.mlp_res' or 'model.output_attn_res'.
    Also accepts the alternative '{site}.norm_weight' / '{site}.proj_weight' names.
    """
    cands = [(prefix + "_norm.weight", prefix + "_proj.weight"),
             (prefix + ".norm_weight", prefix + ".proj_weight")]
    for nk, pk in cands:
        if nk in tensors and pk in tensors:
            wn = tensors[nk].reshape(-1)
            wp = tensors[pk].reshape(-1)
            return wn * wp
    raise KeyError(f"missing AttnRes tensors for {prefix}")


# --------------------------------------------------------------------------------------
# AttnRes Mix (spec 6.1)
# --------------------------------------------------------------------------------------


def _mix(blocks, p, w, eps):
    """Mix(blocks, p): softmax over the K+1 candidates of RMS-normalized scores."""
    cands = list(blocks) + [p]
    V = np.stack(cands, axis=0)  # [K+1, T, H]
    rms_inv = 1.0 / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + eps)
    scores = np.sum((V * rms_inv) * w, axis=-1)  # [K+1, T]
    pi = _softmax(scores, axis=0)  # over candidates
    return np.sum(pi[:, :, None] * V, axis=0)


# --------------------------------------------------------------------------------------
# KDA (spec 4.2)
# --------------------------------------------------------------------------------------


def _causal_depthwise_conv(u, kernel):
    """u [T, C], kernel [C, W]; z_t = sum_j kernel[:, j] * u_{t-W+1+j} (zeros before start)."""
    T, C = u.shape
    W = kernel.shape[1]
    z = np.zeros_like(u)
    for t in range(T):
        acc = np.zeros(C)
        for j in range(W):
            src = t - W + 1 + j
            if src >= 0:
                acc = acc + kernel[:, j] * u[src]
        z[t] = acc
    return z


def _conv_kernel(tensors, name):
    c = _get(tensors, name)
    if c.ndim == 3:  # [C, 1, W]
        c = c[:, 0, :]
    return c


def _kda_recurrence(q, k, v, alpha, beta):
    """Token-by-token gated delta rule (spec 4.2 step 6).

    q, k: [T, nh, d_k]; v: [T, nh, d_v]; alpha (multiplicative decay): [T, nh, d_k];
    beta: [T, nh]. State S[h] is [d_k, d_v], S_0 = 0. Returns o [T, nh, d_v].
    """
    T, nh, dk = k.shape
    dv = v.shape[2]
    o = np.zeros((T, nh, dv))
    S = np.zeros((nh, dk, dv))
    for t in range(T):
        for h in range(nh):
            S[h] = alpha[t, h][:, None] * S[h]          # decay along the key axis
            v_hat = S[h].T @ k[t, h]                     # prediction
            S[h] = S[h] + beta[t, h] * np.outer(k[t, h], v[t, h] - v_hat)  # delta write
            o[t, h] = S[h].T @ q[t, h]                   # read after write
    return o


def _kda(x, tensors, pre, cfg):
    la = cfg["linear_attn_config"]
    nh = int(la["num_heads"])
    d = int(la["head_dim"])
    T = x.shape[0]
    P = nh * d

    def proj_conv(name):
        u = _linear(x, _get(tensors, pre + f"{name}_proj.weight"))
        k = _conv_kernel(tensors, pre + f"{name}_conv1d.weight")
        return _silu(_causal_depthwise_conv(u, k)).reshape(T, nh, d)

    q = proj_conv("q")
    k = proj_conv("k")
    v = proj_conv("v")
    k = _l2norm(k)
    q = _l2norm(q) * (d ** -0.5)

    # decay gate
    f = _linear(_linear(x, _get(tensors, pre + "f_a_proj.weight")),
                _get(tensors, pre + "f_b_proj.weight")).reshape(T, nh, d)
    A_log = _get(tensors, pre + "A_log").reshape(-1)
    if A_log.shape[0] < nh:
        raise ValueError(f"A_log has {A_log.shape[0]} entries < num_heads {nh}")
    if np.any(A_log[nh:] != 0):
        raise ValueError("A_log padding tail is not zero")
    A_log = A_log[:nh]
    dt_bias = _get(tensors, pre + "dt_bias").reshape(nh, d)
    rate = np.exp(A_log)[None, :, None]  # [1, nh, 1]
    lb = la.get("gate_lower_bound")
    if lb is not None:
        gamma = float(lb) * _sigmoid(rate * (f + dt_bias[None]))
    else:
        gamma = -rate * _softplus(f + dt_bias[None])
    alpha = np.exp(gamma)  # [T, nh, d]

    beta = _sigmoid(_linear(x, _get(tensors, pre + "b_proj.weight")))  # [T, nh]

    o = _kda_recurrence(q, k, v, alpha, beta)

    # output gate
    if la.get("use_full_rank_gate", False):
        g = _linear(x, _get(tensors, pre + "g_proj.weight"))
    else:
        g = _linear(_linear(x, _get(tensors, pre + "g_a_proj.weight")),
                    _get(tensors, pre + "g_b_proj.weight"))
    g = g.reshape(T, nh, d)
    w_on = _get(tensors, pre + "o_norm.weight").reshape(-1)
    o = _rmsnorm(o, w_on, float(cfg["rms_norm_eps"])) * _sigmoid(g)
    return _linear(o.reshape(T, P), _get(tensors, pre + "o_proj.weight"))


# --------------------------------------------------------------------------------------
# MLA (spec 5.2, NoPE)
# --------------------------------------------------------------------------------------


def _mla(x, tensors, pre, cfg):
    T = x.shape[0]
    nh = int(cfg["num_attention_heads"])
    dn = int(cfg["qk_nope_head_dim"])
    dr = int(cfg["qk_rope_head_dim"])
    dv = int(cfg["v_head_dim"])
    r_kv = int(cfg["kv_lora_rank"])
    dqk = dn + dr
    lora_eps = 1e-6
    if not cfg.get("mla_use_nope", True):
        raise NotImplementedError("mla_use_nope=false (RoPE MLA) is not part of K3")

    if cfg.get("q_lora_rank") is not None:
        cq = _rmsnorm(_linear(x, _get(tensors, pre + "q_a_proj.weight")),
                      _get(tensors, pre + "q_a_layernorm.weight"), lora_eps)
        Q = _linear(cq, _get(tensors, pre + "q_b_proj.weight"))
    else:
        Q = _linear(x, _get(tensors, pre + "q_proj.weight"))
    Q = Q.reshape(T, nh, dqk)
    q_n, q_r = Q[:, :, :dn], Q[:, :, dn:]

    ckr = _linear(x, _get(tensors, pre + "kv_a_proj_with_mqa.weight"))  # [T, r_kv + dr]
    c_kv = _rmsnorm(ckr[:, :r_kv], _get(tensors, pre + "kv_a_layernorm.weight"), lora_eps)
    k_r = ckr[:, r_kv:]  # [T, dr], not normalized, shared across heads
    KV = _linear(c_kv, _get(tensors, pre + "kv_b_proj.weight")).reshape(T, nh, dn + dv)
    k_n, v = KV[:, :, :dn], KV[:, :, dn:]

    scale = dqk ** -0.5
    o = np.zeros((T, nh, dv))
    for h in range(nh):
        for t in range(T):
            s = np.empty(t + 1)
            for tau in range(t + 1):
                s[tau] = (q_n[t, h] @ k_n[tau, h] + q_r[t, h] @ k_r[tau]) * scale
            p = _softmax(s)
            o[t, h] = p @ v[: t + 1, h]
    o = o.reshape(T, nh * dv)
    if cfg.get("mla_use_output_gate", False):
        o = o * _sigmoid(_linear(x, _get(tensors, pre + "g_proj.weight")))
    return _linear(o, _get(tensors, pre + "o_proj.weight"))


# --------------------------------------------------------------------------------------
# FFNs (spec 7)
# --------------------------------------------------------------------------------------


def _is_moe_layer(i, cfg):
    if not cfg.get("num_experts"):
        return False
    fk = int(cfg.get("first_k_dense_replace", 0) or 0)
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    return i >= fk and i % freq == 0


def _dense_ffn(x, tensors, i, cfg):
    lp = _layer_prefix(i)
    for sub in ("mlp.", "block_sparse_moe."):
        names = [lp + sub + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj")]
        if all(n in tensors for n in names):
            return _mlp(x, tensors[names[0]], tensors[names[1]], tensors[names[2]], cfg)
    raise KeyError(f"missing dense FFN tensors for layer {i}")


def _topk_indices(scores, k):
    """Indices of the k largest entries, ties broken by lower index."""
    order = np.argsort(-scores, kind="stable")
    return order[:k]


def _moe(x, tensors, i, cfg):
    pre = _layer_prefix(i) + "block_sparse_moe."
    T, H = x.shape
    E = int(cfg["num_experts"])
    k = int(cfg["num_experts_per_token"])
    scaling = float(cfg.get("routed_scaling_factor", 1.0) or 1.0)
    renorm = bool(cfg.get("moe_renormalize", True))
    act = cfg.get("moe_router_activation_func", "sigmoid")
    n_group = int(cfg.get("num_expert_group", 1) or 1)
    topk_group = int(cfg.get("topk_group", 1) or 1)
    latent = cfg.get("routed_expert_hidden_size")
    eps = float(cfg["rms_norm_eps"])

    W_r = _get(tensors, pre + "gate.weight")
    bias_key = pre + "gate.e_score_correction_bias"
    bias = tensors[bias_key].reshape(-1) if bias_key in tensors else np.zeros(E)

    logits = _linear(x, W_r)  # [T, E]
    if act == "sigmoid":
        s_all = _sigmoid(logits)
    elif act == "softmax":
        s_all = _softmax(logits, axis=-1)
    else:
        raise NotImplementedError(f"moe_router_activation_func={act!r}")

    if latent is not None:
        z = _linear(x, _get(tensors, pre + "routed_expert_down_proj.weight"))
    else:
        z = x

    out_dim = z.shape[1]
    y = np.zeros((T, out_dim))
    for t in range(T):
        s = s_all[t]
        sel = s + bias
        if n_group > 1 and topk_group < n_group:
            gs = E // n_group
            grp = sel.reshape(n_group, gs)
            gscore = np.array([np.sum(np.sort(g)[::-1][:2]) for g in grp])
            keep = _topk_indices(gscore, topk_group)
            mask = np.full(E, -np.inf)
            for gi in keep:
                mask[gi * gs:(gi + 1) * gs] = 0.0
            sel = sel + mask
        idx = _topk_indices(sel, k)
        w = s[idx].copy()
        if renorm and k > 1:
            w = w / (np.sum(w) + 1e-20)
        w = w * scaling
        acc = np.zeros(out_dim)
        for j, e in enumerate(idx):
            ep = pre + f"experts.{int(e)}."
            h = _gated_act(_get(tensors, ep + "w1.weight") @ z[t],
                           _get(tensors, ep + "w3.weight") @ z[t], cfg)
            acc = acc + w[j] * (_get(tensors, ep + "w2.weight") @ h)
        y[t] = acc

    if latent is not None:
        if cfg.get("latent_moe_use_norm", False):
            y = _rmsnorm(y, _get(tensors, pre + "routed_expert_norm.weight"), eps)
        y = _linear(y, _get(tensors, pre + "routed_expert_up_proj.weight"))

    if int(cfg.get("num_shared_experts", 0) or 0) > 0:
        sp = pre + "shared_experts."
        y = y + _mlp(x, _get(tensors, sp + "gate_proj.weight"), _get(tensors, sp + "up_proj.weight"),
                     _get(tensors, sp + "down_proj.weight"), cfg)
    return y


# --------------------------------------------------------------------------------------
# Whole model (spec 2)
# --------------------------------------------------------------------------------------


def _is_kda_layer(i, cfg):
    la = cfg.get("linear_attn_config")
    if not la:
        return False
    return (i + 1) in [int(n) for n in la.get("kda_layers", [])]


def forward(text_config, tensors, input_ids, record=None, inputs_embeds=None):
    """Full K3 text forward for one sequence. Returns logits [T, vocab] float64.

    inputs_embeds: optional [T, H] array used instead of ``embed_tokens[input_ids]`` (e.g. text
      embeddings with image features spliced in); ``input_ids`` is then ignored and may be None.
    record: optional dict; filled with
      record["attnres_candidates"]: list of (layer_index | "output", "attn"|"ffn"|"output", K+1)
      record["blocks0"]: the first sealed block (the token embedding), [T, H]
    """
    cfg = text_config
    eps = float(cfg["rms_norm_eps"])
    L = int(cfg["num_hidden_layers"])
    B = cfg.get("attn_res_block_size")

    if record is not None:
        record["attnres_candidates"] = []
        record["blocks0"] = None

    if inputs_embeds is not None:
        x = np.array(inputs_embeds, dtype=np.float64)
        if x.ndim != 2:
            raise ValueError(f"inputs_embeds must be [T, H], got shape {x.shape}")
    else:
        ids = np.asarray(input_ids).reshape(-1).astype(np.int64)
        emb = _get(tensors, "model.embed_tokens.weight")
        x = emb[ids].astype(np.float64)

    def attn_fn(i, h):
        pre = _layer_prefix(i) + "self_attn."
        if _is_kda_layer(i, cfg):
            return _kda(h, tensors, pre, cfg)
        return _mla(h, tensors, pre, cfg)

    def ffn_fn(i, h):
        if _is_moe_layer(i, cfg):
            return _moe(h, tensors, i, cfg)
        return _dense_ffn(h, tensors, i, cfg)

    if B is None:
        # plain pre-norm residual stream
        for i in range(L):
            lp = _layer_prefix(i)
            x = x + attn_fn(i, _rmsnorm(x, _get(tensors, lp + "input_layernorm.weight"), eps))
            x = x + ffn_fn(i, _rmsnorm(x, _get(tensors, lp + "post_attention_layernorm.weight"), eps))
        h = x
    else:
        B = int(B)
        blocks = []
        p = x
        for i in range(L):
            lp = _layer_prefix(i)
            # 2. attention-site read
            if blocks:
                w = _attnres_params(tensors, lp + "self_attention_res")
                a = _mix(blocks, p, w, eps)
                if record is not None:
                    record["attnres_candidates"].append((i, "attn", len(blocks) + 1))
            else:
                a = p
            # 3. seal
            empty = False
            if i % B == 0:
                blocks.append(p)
                if record is not None and record["blocks0"] is None:
                    record["blocks0"] = p.copy()
                p = None
                empty = True
            # 4-5. attention
            y = attn_fn(i, _rmsnorm(a, _get(tensors, lp + "input_layernorm.weight"), eps))
            p = y if empty else p + y
            # 6. FFN-site read
            w = _attnres_params(tensors, lp + "mlp_res")
            m = _mix(blocks, p, w, eps)
            if record is not None:
                record["attnres_candidates"].append((i, "ffn", len(blocks) + 1))
            # 7. FFN
            p = p + ffn_fn(i, _rmsnorm(m, _get(tensors, lp + "post_attention_layernorm.weight"), eps))
        w = _attnres_params(tensors, "model.output_attn_res")
        h = _mix(blocks, p, w, eps)
        if record is not None:
            record["attnres_candidates"].append(("output", "output", len(blocks) + 1))

    h = _rmsnorm(h, _get(tensors, "model.norm.weight"), eps)
    return _linear(h, _get(tensors, "lm_head.weight"))
