"""The vision tower's ``vision_config`` and the processor's ``media_proc_cfg`` (K3_VISION_SPEC §1).

k3jax builds the K3 tower only — RMSNorm, no biases, ``divided_fixed`` position embedding, ``sd2_tpool`` merge,
``patchmergerv2`` projector. The release code's defaults for a *missing* key (LayerNorm, biases on) describe the
K2.5 tower, so a config that omits them is rejected by name rather than silently building a different model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3jax.config import ConfigError

# nn.RMSNorm(D) without eps on torch >= 2.7: the opmath type's epsilon, 2^-23, in fp32/bf16/fp16 (spec §4.3).
VT_NORM_EPS_TORCH = 2.0 ** -23
VT_NORM_EPS_MLX_VLM = 2.0 ** -7       # what mlx-vlm 0.7.10 hard-codes (and old torch in bf16)
MEDIA_PAD = "<|media_pad|>"
MEDIA_PAD_ID = 163605
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

# field: (what K3 uses, what the release code does when the key is missing)
_REQUIRED = ("patch_size", "vt_hidden_size", "vt_num_attention_heads", "vt_intermediate_size",
             "vt_num_hidden_layers", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time",
             "merge_kernel_size", "mm_hidden_size")
_MUST = {"pos_emb_type": ("divided_fixed", None), "norm_type": ("rmsnorm", "layernorm"),
         "mlp_type": ("mlp2", "mlp2"), "merge_type": ("sd2_tpool", None),
         "mm_projector_type": ("patchmergerv2", None), "attn_bias": (False, True), "linear_bias": (False, True),
         "patch_embed_proj_bias": (False, True), "pos_emb_interpolation_mode": ("bilinear", "bilinear"),
         "activation_func": ("gelu_pytorch_tanh", None)}


@dataclass
class VisionConfig:
    """MoonViT-V2 + patchmergerv2. ``vt_norm_eps`` is k3jax's field (the release has none): default 2⁻²³."""

    patch_size: int = 14
    vt_hidden_size: int = 1024
    qkv_hidden_size: int = 1536
    vt_num_attention_heads: int = 12
    vt_intermediate_size: int = 4096
    vt_num_hidden_layers: int = 27
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    mm_hidden_size: int = 1024
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    vt_norm_eps: float = VT_NORM_EPS_TORCH
    rope_theta: float = 10000.0
    rope_max_grid: int = 512
    media_placeholder_token_id: int = MEDIA_PAD_ID
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2

    @property
    def merge(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "vision_config", text_hidden_size: int | None = None,
                  media_placeholder_token_id: int | None = None) -> "VisionConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing {', '.join(missing)} (spell out every vision field)")
        for k, (want, default) in _MUST.items():
            got = d.get(k, default)
            if got != want:
                how = f"{got!r}" if k in d else f"missing (the release code then uses {default!r})"
                raise ConfigError(f"{source}.{k}: k3jax builds the K3 tower ({k}={want!r}); got {how}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        known.setdefault("qkv_hidden_size", d["vt_hidden_size"])
        if "text_hidden_size" not in known and text_hidden_size is not None:
            known["text_hidden_size"] = text_hidden_size
        if media_placeholder_token_id is not None:
            known["media_placeholder_token_id"] = media_placeholder_token_id
        mk = known["merge_kernel_size"]
        known["merge_kernel_size"] = tuple(mk) if isinstance(mk, (list, tuple)) else (mk, mk)
        cfg = cls(**known, extra={k: v for k, v in d.items() if k not in names})
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "vision_config") -> None:
        for k in ("patch_size", "vt_hidden_size", "qkv_hidden_size", "vt_num_attention_heads",
                  "vt_intermediate_size", "vt_num_hidden_layers", "init_pos_emb_height", "init_pos_emb_width",
                  "init_pos_emb_time", "mm_hidden_size", "text_hidden_size"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{source}.{k}: expected a positive integer, got {v!r}")
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            raise ConfigError(f"{source}.qkv_hidden_size: {self.qkv_hidden_size} is not divisible by "
                              f"vt_num_attention_heads {self.vt_num_attention_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"{source}: head dim {self.head_dim} must be a multiple of 4 (2D RoPE: x and y pairs)")
        if self.merge_kernel_size != (2, 2):
            raise ConfigError(f"{source}.merge_kernel_size: k3jax implements sd2_tpool with [2, 2], got "
                              f"{list(self.merge_kernel_size)}")
        if self.mm_hidden_size != self.vt_hidden_size:
            raise ConfigError(f"{source}.mm_hidden_size: {self.mm_hidden_size} != vt_hidden_size "
                              f"{self.vt_hidden_size} (the projector reads the tower's output)")
        if self.vt_hidden_size % 2:
            raise ConfigError(f"{source}.vt_hidden_size: must be even (sin/cos time table)")
        for k in ("vt_norm_eps", "projector_ln_eps"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1:
                raise ConfigError(f"{source}.{k}: expected a float in (0, 1), got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d["merge_kernel_size"] = list(self.merge_kernel_size)
        d.update({k: v for k, (want, _) in _MUST.items()})
        return {**self.extra, **d}


@dataclass
class MediaConfig:
    """The image processor's settings (``preprocessor_config.json`` → ``media_proc_cfg``; K3 values as defaults)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    transparent_bg: dict | None = field(default_factory=lambda: {
        "pattern": "chessboard", "chessboard_square_size": 8, "chessboard_square_on_top_left": True,
        "chessboard_white_value": 255, "chessboard_gray_value": 180})
    fill_stage: str = "after_resize"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "media_proc_cfg") -> "MediaConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        kw: dict[str, Any] = {}
        for k in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
            if k in d:
                v = d[k]
                if k == "merge_kernel_size" and isinstance(v, (list, tuple)):
                    v = v[0] if len(set(v)) == 1 else v
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ConfigError(f"{source}.{k}: expected a positive integer, got {v!r}")
                kw[k] = v
        for k in ("image_mean", "image_std"):
            if k in d:
                v = d[k]
                if not (isinstance(v, (list, tuple)) and len(v) == 3 and all(isinstance(x, (int, float)) for x in v)):
                    raise ConfigError(f"{source}.{k}: expected three numbers, got {v!r}")
                if k == "image_std" and min(v) <= 0:
                    raise ConfigError(f"{source}.image_std: must be positive, got {v!r}")
                kw[k] = tuple(float(x) for x in v)
        if "transparent_bg_config" in d:
            bg = d["transparent_bg_config"]
            if bg is not None and (not isinstance(bg, dict) or bg.get("pattern") != "chessboard"):
                raise ConfigError(f"{source}.transparent_bg_config: expected null or a chessboard pattern, got {bg!r}")
            kw["transparent_bg"] = bg
        if "transparent_bg_fill_stage" in d:
            st = d["transparent_bg_fill_stage"]
            if st not in ("after_resize", "before_resize"):
                raise ConfigError(f"{source}.transparent_bg_fill_stage: expected 'after_resize' or 'before_resize', "
                                  f"got {st!r}")
            kw["fill_stage"] = st
        if d.get("fixed_output_tokens") is not None:
            raise ConfigError(f"{source}.fixed_output_tokens: only null (NaViT sizes) is supported, got "
                              f"{d['fixed_output_tokens']!r}")
        return cls(**kw)

    @classmethod
    def from_dir(cls, path: str | Path) -> "MediaConfig":
        """``preprocessor_config.json`` in ``path`` (its ``media_proc_cfg``), else the K3 defaults."""
        f = Path(path) / "preprocessor_config.json"
        if not f.exists():
            return cls()
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{f}: not valid JSON ({e})") from None
        return cls.from_dict(d.get("media_proc_cfg", d) if isinstance(d, dict) else d, source=str(f))


def vision_config_of(top: dict[str, Any] | None, text_hidden_size: int, source: str = "config") -> VisionConfig | None:
    """The :class:`VisionConfig` of a release ``config.json`` (its top level), or None when it has none."""
    if not top or "vision_config" not in top or top["vision_config"] is None:
        return None
    return VisionConfig.from_dict(top["vision_config"], source=f"{source}.vision_config",
                                  text_hidden_size=text_hidden_size,
                                  media_placeholder_token_id=top.get("media_placeholder_token_id"))
