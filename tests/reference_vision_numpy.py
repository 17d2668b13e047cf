"""Independent float64 NumPy reference of the Kimi K3 vision path (MoonViT-V2 + patchmergerv2 + splice + processor).

Written from /work/shared/K3_VISION_SPEC.md only. Slow and literal on purpose: it is an oracle for testing other
implementations, so every step follows the spec's formulas and everything after the uint8 image stage is float64.

Public API
----------
process_image(image, media_cfg) -> (pixel_values float64 [N, 3, p, p], grid_thw (1, gh, gw), orig_size (W, H))
image_prompt_text(orig_size) -> "<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>"
bilinear_matrix(n_out, n_in) -> [n_out, n_in]                  half-pixel (align_corners=False) weights, spec 3.2
gelu_tanh(z), gelu_erf(z)                                      the two GELUs (ViT MLP / projector)
vision_tower(vision_config, tensors, pixel_values, grid_thws, eps) -> merged [sum_i h_i w_i / 4, 4, D]
project(vision_config, tensors, merged) -> features [N, text_hidden]
image_features(vision_config, tensors, pixel_values, grid_thws, eps) -> project(vision_tower(...))
splice_embeddings(embed_table, input_ids, features_list, pad_id=163605) -> [T', H]
multimodal_logits(text_config, tensors, input_ids, features_list, pad_id=163605) -> logits [T', vocab]
load_vision_checkpoint(dir) -> (vision_config, media_cfg, tensors)   tensors: float64, release names of spec 2

``tensors`` use the release names (``vision_tower.patch_embed.proj.weight`` ... ``mm_projector.post_norm.weight``).
``eps`` is the ViT RMSNorm epsilon (spec 4.3): 2**-23 for the release on torch >= 2.7, 2**-7 to reproduce
mlx-vlm 0.7.10. Pass it explicitly; ``None`` means ``vision_config.get("vt_norm_eps", 2**-23)``.
"""

from __future__ import annotations

import glob
import json
import math
import os

import numpy as np

__all__ = [
    "MEDIA_PAD_ID", "VT_NORM_EPS_DEFAULT", "K3_MEDIA_CFG_DEFAULT",
    "process_image", "image_prompt_text", "bilinear_matrix", "gelu_tanh", "gelu_erf",
    "vision_tower", "project", "image_features", "splice_embeddings", "multimodal_logits",
    "load_vision_checkpoint",
]

MEDIA_PAD_ID = 163605
VT_NORM_EPS_DEFAULT = 2.0 ** -23

# spec 1.2 (used by load_vision_checkpoint when a checkpoint has no preprocessor_config.json)
K3_MEDIA_CFG_DEFAULT = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 65536,
    "patch_limit_on_one_side": 512,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "fixed_output_tokens": None,
    "transparent_bg_config": {
        "pattern": "chessboard",
        "chessboard_square_size": 8,
        "chessboard_square_on_top_left": True,
        "chessboard_white_value": 255,
        "chessboard_gray_value": 180,
    },
    "transparent_bg_fill_stage": "after_resize",
    "in_patch_limit_each_frame": 16384,
    "sample_fps": 8.0,
    "temporal_merge_kernel_size": 4,
}


# ======================================================================================
# Section 8: image processor
# ======================================================================================


def _pair(v):
    if isinstance(v, (list, tuple)):
        if len(v) != 2:
            raise ValueError(f"merge_kernel_size must be a scalar or a pair, got {v!r}")
        return int(v[0]), int(v[1])
    return int(v), int(v)


def _has_alpha(img):
    """An A band or a `transparency` entry (spec 8.1)."""
    return img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or img.info.get("transparency") is not None


def _chessboard(H, W, bg_cfg):
    """uint8 [H, W, 3]; pixel (y, x) is gray iff floor(y/s) + floor(x/s) is odd (top-left white by default)."""
    pattern = bg_cfg.get("pattern", "chessboard")
    if pattern != "chessboard":
        raise NotImplementedError(f"transparent_bg_config.pattern={pattern!r}")
    s = int(bg_cfg.get("chessboard_square_size", 8))
    white = int(bg_cfg.get("chessboard_white_value", 255))
    gray = int(bg_cfg.get("chessboard_gray_value", 180))
    on_top_left = bool(bg_cfg.get("chessboard_square_on_top_left", True))
    bg = np.zeros((H, W, 3), np.uint8)
    for y in range(H):
        for x in range(W):
            odd = ((y // s) + (x // s)) % 2 == 1
            if not on_top_left:  # (not specified by the spec) swap colours: top-left gray
                odd = not odd
            bg[y, x, :] = gray if odd else white
    return bg


def _to_rgb(img, media_cfg):
    """Composite alpha images on the background (fp32, uint8 truncation); other images -> convert("RGB")."""
    from PIL import Image

    bg_cfg = media_cfg.get("transparent_bg_config")
    if bg_cfg is None or not _has_alpha(img):
        return img.convert("RGB")
    rgba = np.asarray(img.convert("RGBA"))
    H, W = rgba.shape[:2]
    bg = _chessboard(H, W, bg_cfg).astype(np.float32)
    alpha = rgba[..., 3:4].astype(np.float32) / np.float32(255.0)
    rgb = rgba[..., :3].astype(np.float32)
    out = alpha * rgb + (np.float32(1.0) - alpha) * bg  # all float32
    return Image.fromarray(out.astype(np.uint8), "RGB")   # truncation toward zero


def _target_size(W, H, media_cfg):
    """Spec 8.2: (W', H') after the resize, and the padded (W'', H'')."""
    p = int(media_cfg["patch_size"])
    kh, kw = _pair(media_cfg["merge_kernel_size"])
    B = media_cfg.get("in_patch_limit")
    S = media_cfg.get("patch_limit_on_one_side")
    scale = 1.0
    if B is not None:
        scale = min(scale, math.sqrt(float(B) / (max(1, W // p) * max(1, H // p))))
    if S is not None:
        scale = min(scale, float(S) * p / W, float(S) * p / H)
    Wr = max(1, int(math.floor(W * scale)))
    Hr = max(1, int(math.floor(H * scale)))
    if S is not None:
        Wr = min(Wr, int(S) * p)
        Hr = min(Hr, int(S) * p)
    fw, fh = kw * p, kh * p
    Wp = -(-Wr // fw) * fw
    Hp = -(-Hr // fh) * fh
    return (Wr, Hr), (Wp, Hp)


def process_image(image, media_cfg):
    """One image -> (pixel_values float64 [gh*gw, 3, p, p], (1, gh, gw), (W, H) original size)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.open(image)
        image.load()
    if media_cfg.get("fixed_output_tokens") is not None:
        raise NotImplementedError("fixed_output_tokens is not specified")
    p = int(media_cfg["patch_size"])
    W, H = image.size
    (Wr, Hr), (Wp, Hp) = _target_size(W, H, media_cfg)

    stage = media_cfg.get("transparent_bg_fill_stage", "after_resize")
    if stage == "after_resize":
        # resize in the original mode (Pillow itself: premultiplied RGBA, nearest for P/1 images), then fill
        rgb = _to_rgb(image.resize((Wr, Hr), Image.Resampling.BICUBIC), media_cfg)
    elif stage == "before_resize":
        rgb = _to_rgb(image, media_cfg).resize((Wr, Hr), Image.Resampling.BICUBIC)
    else:
        raise ValueError(f"transparent_bg_fill_stage={stage!r}")

    arr = np.asarray(rgb, dtype=np.uint8)
    assert arr.shape == (Hr, Wr, 3), arr.shape
    padded = np.zeros((Hp, Wp, 3), np.uint8)  # black pad right / bottom
    padded[:Hr, :Wr] = arr

    mean = np.asarray(media_cfg["image_mean"], np.float64)
    std = np.asarray(media_cfg["image_std"], np.float64)
    v = (padded.astype(np.float64) / 255.0 - mean) / std  # [Hp, Wp, 3]

    gh, gw = Hp // p, Wp // p
    pv = np.zeros((gh * gw, 3, p, p), np.float64)
    for r in range(gh):
        for c in range(gw):
            n = r * gw + c
            for ch in range(3):
                pv[n, ch] = v[p * r:p * (r + 1), p * c:p * (c + 1), ch]
    return pv, (1, gh, gw), (W, H)


def image_prompt_text(orig_size):
    W, H = orig_size
    return f"<|media_begin|>image {int(W)}x{int(H)}<|media_content|><|media_pad|><|media_end|>"


# ======================================================================================
# Primitives
# ======================================================================================


def bilinear_matrix(n_out, n_in):
    """1-D bilinear, align_corners=False (half-pixel), no antialias; same formula up and down (spec 3.2)."""
    R = np.zeros((n_out, n_in), np.float64)
    for a in range(n_out):
        s = max(0.0, (a + 0.5) * n_in / n_out - 0.5)
        i0 = int(math.floor(s))
        i1 = min(i0 + 1, n_in - 1)
        lam = s - i0
        R[a, i0] += 1.0 - lam
        R[a, i1] += lam
    return R


def gelu_tanh(z):
    z = np.asarray(z, np.float64)
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_erf(z):
    z = np.asarray(z, np.float64)
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def _rmsnorm(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def _get(tensors, name):
    if name not in tensors:
        raise KeyError(f"missing tensor {name}")
    return np.asarray(tensors[name], np.float64)


def _grids(grid_thws):
    g = np.asarray(grid_thws, dtype=np.int64).reshape(-1, 3)
    return [(int(t), int(h), int(w)) for t, h, w in g]


def _check_supported(vc):
    """Reject configs this reference (and the bias-free tensor list of spec 2) does not describe.

    Missing keys get REL's defaults (spec 1.1), so a partial config fails loudly here instead of silently
    building a different model.
    """
    want = {
        "norm_type": ("layernorm", "rmsnorm"),
        "mlp_type": ("mlp2", "mlp2"),
        "pos_emb_type": (None, "divided_fixed"),
        "pos_emb_interpolation_mode": ("bilinear", "bilinear"),
        "merge_type": (None, "sd2_tpool"),
        "mm_projector_type": (None, "patchmergerv2"),
    }
    for key, (default, ok) in want.items():
        val = vc.get(key, default)
        if val != ok:
            raise NotImplementedError(f"vision_config[{key!r}]={val!r}: only {ok!r} is implemented")
    for key in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
        if vc.get(key, True):
            raise NotImplementedError(f"vision_config[{key!r}] is true (or missing -> REL default true): "
                                      "biases are not implemented (K3 has none)")


# ======================================================================================
# Sections 3-5: tower
# ======================================================================================


def _time_table(T0, D):
    """E[tau, k] = sin(tau w_k) (k < D/2), cos(tau w_{k-D/2}) (k >= D/2), w_k = 10000^(-k/(D/2))."""
    half = D // 2
    E = np.zeros((T0, D), np.float64)
    for tau in range(T0):
        for k in range(half):
            w = 10000.0 ** (-k / half)
            E[tau, k] = math.sin(tau * w)
            E[tau, k + half] = math.cos(tau * w)
    return E


def _pos_embedding(G, t, h, w, T0):
    """[t*h*w, D] position term of one grid entry (spec 3.2-3.3)."""
    H0, W0, D = G.shape
    if (h, w) == (H0, W0):
        S = G
    else:
        Rh = bilinear_matrix(h, H0)
        Rw = bilinear_matrix(w, W0)
        S = np.einsum("ay,bx,yxd->abd", Rh, Rw, G)
    S = S.reshape(h * w, D)  # token r*w + c
    if t == 1:
        return S.copy()       # no time term for stills
    if t > T0:
        raise ValueError(f"t={t} > init_pos_emb_time={T0}")
    E = _time_table(T0, D)
    return np.concatenate([S + E[tau][None, :] for tau in range(t)], axis=0)


def _rope_angles(rows, cols, d):
    """phi [L, d/2]: phi_{2m} = col * theta_m, phi_{2m+1} = row * theta_m, theta_m = 10000^(-4m/d)."""
    if d % 4:
        raise ValueError(f"head dim {d} not divisible by 4")
    L = rows.shape[0]
    phi = np.zeros((L, d // 2), np.float64)
    for m in range(d // 4):
        theta = 10000.0 ** (-4.0 * m / d)
        phi[:, 2 * m] = cols * theta
        phi[:, 2 * m + 1] = rows * theta
    return phi


def _apply_rope(u, phi):
    """u [L, n, d]; pair j = dims (2j, 2j+1) rotated by phi_j (same for every head)."""
    out = np.empty_like(u)
    c = np.cos(phi)[:, None, :]
    s = np.sin(phi)[:, None, :]
    ue, uo = u[..., 0::2], u[..., 1::2]
    out[..., 0::2] = ue * c - uo * s
    out[..., 1::2] = ue * s + uo * c
    return out


def _block(x, tensors, b, vc, rows, cols, mask, eps):
    pre = f"vision_tower.encoder.blocks.{b}."
    L, D = x.shape
    n = int(vc["vt_num_attention_heads"])
    Q = int(vc.get("qkv_hidden_size") or D)
    d = Q // n
    if d * n != Q:
        raise ValueError(f"qkv_hidden_size {Q} not divisible by {n} heads")

    u = _rmsnorm(x, _get(tensors, pre + "norm0.weight"), eps)
    qkv = u @ _get(tensors, pre + "wqkv.weight").T  # [L, 3Q]
    q = qkv[:, 0:Q].reshape(L, n, d)
    k = qkv[:, Q:2 * Q].reshape(L, n, d)
    v = qkv[:, 2 * Q:3 * Q].reshape(L, n, d)
    phi = _rope_angles(rows, cols, d)
    q = _apply_rope(q, phi)
    k = _apply_rope(k, phi)

    o = np.zeros((L, n, d), np.float64)
    scale = d ** -0.5
    for h in range(n):
        s = (q[:, h, :] @ k[:, h, :].T) * scale + mask
        o[:, h, :] = _softmax(s, axis=-1) @ v[:, h, :]
    x = x + o.reshape(L, Q) @ _get(tensors, pre + "wo.weight").T

    u = _rmsnorm(x, _get(tensors, pre + "norm1.weight"), eps)
    hmid = gelu_tanh(u @ _get(tensors, pre + "mlp.fc0.weight").T)
    x = x + hmid @ _get(tensors, pre + "mlp.fc1.weight").T
    return x


def vision_tower(vision_config, tensors, pixel_values, grid_thws, eps):
    """MoonViT-V2 + sd2_tpool. Returns merged tokens [sum_i (h_i/kh)(w_i/kw), kh*kw, D] float64."""
    vc = vision_config
    _check_supported(vc)
    if eps is None:
        eps = float(vc.get("vt_norm_eps", VT_NORM_EPS_DEFAULT))
    eps = float(eps)
    grids = _grids(grid_thws)
    P = np.asarray(pixel_values, np.float64)
    Ltot = P.shape[0]
    if sum(t * h * w for t, h, w in grids) != Ltot:
        raise ValueError(f"grid_thws {grids} do not cover {Ltot} patches")

    # 3.1 patch embedding
    W_pe = _get(tensors, "vision_tower.patch_embed.proj.weight")
    D = W_pe.shape[0]
    x = P.reshape(Ltot, -1) @ W_pe.reshape(D, -1).T

    # 3.2-3.3 position embedding; RoPE positions; block-diagonal mask
    G = _get(tensors, "vision_tower.patch_embed.pos_emb.weight")
    T0 = int(vc.get("init_pos_emb_time", 4))
    pos, rows, cols = [], [], []
    mask = np.full((Ltot, Ltot), -np.inf)
    start = 0
    for t, h, w in grids:
        if h > 512 or w > 512:
            raise ValueError(f"grid {h}x{w} exceeds the 512x512 RoPE table")
        pos.append(_pos_embedding(G, t, h, w, T0))
        for _tau in range(t):
            for r in range(h):
                for c in range(w):
                    rows.append(r)
                    cols.append(c)
        mask[start:start + t * h * w, start:start + t * h * w] = 0.0
        start += t * h * w
    x = x + np.concatenate(pos, axis=0)
    rows = np.asarray(rows, np.float64)
    cols = np.asarray(cols, np.float64)

    # 4 encoder
    nb = int(vc["vt_num_hidden_layers"])
    for b in range(nb):
        x = _block(x, tensors, b, vc, rows, cols, mask, eps)
    x = _rmsnorm(x, _get(tensors, "vision_tower.encoder.final_layernorm.weight"), eps)

    # 5 sd2_tpool
    kh, kw = _pair(vc.get("merge_kernel_size", [2, 2]))
    out = []
    start = 0
    for t, h, w in grids:
        if h % kh or w % kw:
            raise ValueError(f"grid {h}x{w} not divisible by merge kernel {kh}x{kw}")
        X = x[start:start + t * h * w].reshape(t, h, w, D)
        start += t * h * w
        Xb = np.mean(X, axis=0)
        Z = np.zeros(((h // kh) * (w // kw), kh * kw, D), np.float64)
        for a in range(h // kh):
            for bb in range(w // kw):
                for ki in range(kh):
                    for kj in range(kw):
                        Z[a * (w // kw) + bb, ki * kw + kj, :] = Xb[kh * a + ki, kw * bb + kj, :]
        out.append(Z)
    return np.concatenate(out, axis=0)


# ======================================================================================
# Section 6: projector
# ======================================================================================


def project(vision_config, tensors, merged):
    """patchmergerv2: y = RMS(gelu_erf(z proj.0^T) proj.2^T; post_norm, projector_ln_eps)."""
    vc = vision_config
    eps = float(vc.get("projector_ln_eps", 1e-5))
    Z = np.asarray(merged, np.float64)
    z = Z.reshape(Z.shape[0], -1)  # z[s*D + c], slot-major
    y = gelu_erf(z @ _get(tensors, "mm_projector.proj.0.weight").T)
    y = y @ _get(tensors, "mm_projector.proj.2.weight").T
    return _rmsnorm(y, _get(tensors, "mm_projector.post_norm.weight"), eps)


def image_features(vision_config, tensors, pixel_values, grid_thws, eps):
    return project(vision_config, tensors, vision_tower(vision_config, tensors, pixel_values, grid_thws, eps))


# ======================================================================================
# Section 7: splicing
# ======================================================================================


def splice_embeddings(embed_table, input_ids, features_list, pad_id=MEDIA_PAD_ID):
    """Text embeddings with every image's feature rows spliced in at its pad token(s).

    Accepts one pad per image (each pad expands into N_i rows) or N_i pre-expanded pads per image (rows replaced
    1:1). Only non-pad ids are looked up in ``embed_table`` (pad ids need not be valid rows).
    """
    ids = np.asarray(input_ids).reshape(-1).astype(np.int64)
    feats = [np.asarray(f, np.float64) for f in features_list]
    Hdim = embed_table.shape[1]
    for i, f in enumerate(feats):
        if f.ndim != 2 or f.shape[1] != Hdim:
            raise ValueError(f"features {i} have shape {f.shape}, expected [N, {Hdim}]")
    Ns = [f.shape[0] for f in feats]
    n_pad = int(np.sum(ids == pad_id))
    if n_pad == len(feats):
        expanded = True          # release form (if all N_i == 1 both forms coincide)
    elif n_pad == sum(Ns):
        expanded = False         # pre-expanded form
    else:
        raise ValueError(f"{n_pad} media pad tokens but {len(feats)} images with {sum(Ns)} feature rows")

    flat = np.concatenate(feats, axis=0) if feats else np.zeros((0, Hdim))
    rows = []
    img = 0
    row = 0
    for tok in ids:
        if tok == pad_id:
            if expanded:
                for r in range(Ns[img]):
                    rows.append(feats[img][r])
                img += 1
            else:
                rows.append(flat[row])
                row += 1
        else:
            rows.append(np.asarray(embed_table[int(tok)], np.float64))
    if not rows:
        return np.zeros((0, Hdim), np.float64)
    return np.stack(rows, axis=0)


def multimodal_logits(text_config, tensors, input_ids, features_list, pad_id=MEDIA_PAD_ID):
    """Text forward (tests/reference_k3_numpy.py) on the spliced embedding sequence. Returns [T', vocab]."""
    try:
        from reference_k3_numpy import forward
    except ImportError:  # imported as tests.reference_vision_numpy
        from .reference_k3_numpy import forward
    emb = tensors["model.embed_tokens.weight"]
    x = splice_embeddings(emb, input_ids, features_list, pad_id=pad_id)
    return forward(text_config, tensors, None, inputs_embeds=x)


# ======================================================================================
# Loading
# ======================================================================================


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bf16"}


def _read_safetensors(fn, keep):
    """{name: float64 array} for the names of one safetensors file for which keep(name) holds.

    Reads the format directly (8-byte little-endian header length, JSON header, raw little-endian data) so that
    BF16 tensors (release vision weights, which numpy has no dtype for) load too: bf16 = high 16 bits of f32.
    """
    with open(fn, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or not keep(name):
            continue
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise NotImplementedError(f"{name}: dtype {info['dtype']}")
        a, b = info["data_offsets"]
        shape = tuple(info["shape"])
        raw = np.fromfile(fn, dtype=np.uint8, count=b - a, offset=base + a)
        if dt == "bf16":
            arr = (raw.view("<u2").astype(np.uint32) << 16).view("<f4")
        else:
            arr = raw.view(np.dtype(dt).newbyteorder("<"))
        out[name] = arr.astype(np.float64).reshape(shape)
    return out


def load_vision_checkpoint(dir):
    """config.json vision_config, preprocessor_config.json media_proc_cfg (spec 1.2 values when the file is
    absent) and the float64 ``vision_tower.*`` / ``mm_projector.*`` tensors of every *.safetensors in ``dir``."""
    with open(os.path.join(dir, "config.json")) as f:
        cfg = json.load(f)
    if "vision_config" not in cfg:
        raise KeyError(f"{dir}/config.json has no vision_config")
    vision_config = dict(cfg["vision_config"])

    pp = os.path.join(dir, "preprocessor_config.json")
    if os.path.exists(pp):
        with open(pp) as f:
            pcfg = json.load(f)
        media_cfg = dict(pcfg.get("media_proc_cfg", pcfg))
    else:
        media_cfg = json.loads(json.dumps(K3_MEDIA_CFG_DEFAULT))

    files = sorted(glob.glob(os.path.join(dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {dir}")
    tensors = {}
    for fn in files:
        tensors.update(_read_safetensors(
            fn, lambda k: k.startswith("vision_tower.") or k.startswith("mm_projector.")))
    if not tensors:
        raise KeyError(f"no vision_tower.* / mm_projector.* tensors in {dir}")
    return vision_config, media_cfg, tensors
