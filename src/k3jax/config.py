"""K3Config: the Hugging Face ``config.json`` of ``kimi_k3`` / ``kimi_linear``, field for field.

A released K3 checkpoint directory (top-level ``model_type: kimi_k3`` with a ``text_config``) and a plain
Kimi Linear checkpoint (``model_type: kimi_linear``, e.g. transformers' ``KimiLinearConfig.save_pretrained``)
are both valid inputs as they are. K3's features are switches of this one config:

===========================  ==============================================================
feature                      switch
===========================  ==============================================================
lower-bound (safe) KDA gate  ``linear_attn_config.gate_lower_bound`` set (else softplus gate)
full-rank KDA output gate    ``linear_attn_config.use_full_rank_gate`` (else g_a/g_b low rank)
MLA output gate              ``mla_use_output_gate``
Block AttnRes                ``attn_res_block_size`` set (else plain residual stream)
SiTU-GLU                     ``hidden_act == "situ"`` (else ``"silu"``)
Latent MoE                   ``routed_expert_hidden_size`` set (+ ``latent_moe_use_norm``)
dense first layers           ``first_k_dense_replace``
===========================  ==============================================================
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config field has a value the model cannot use; the message names the field."""


_ACTS = ("silu", "situ")
RUNTIME_FIELDS = {"expert_dtype", "top_level"}
_ROUTER_ACTS = ("sigmoid", "softmax")
_TOPK_METHODS = ("noaux_tc", "greedy")
_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass
class LinearAttnConfig:
    """``text_config.linear_attn_config``: KDA settings and the (1-indexed) layer schedule."""

    kda_layers: list[int] = field(default_factory=list)
    full_attn_layers: list[int] = field(default_factory=list)
    num_heads: int = 32
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "LinearAttnConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: linear_attn_config must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d.update(self.extra)
        return d


@dataclass
class K3Config:
    """The text model's configuration; field names and meanings are those of the HF ``text_config``.

    Only ``dtype`` has k3jax meaning beyond HF: the dtype parameters are created in and activations run in.
    """

    vocab_size: int = 163840
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    intermediate_size: int = 11008
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attn_res_block_size: int | None = None
    linear_attn_config: LinearAttnConfig | None = None
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    num_experts: int | None = None
    num_experts_per_token: int | None = None
    num_shared_experts: int = 0
    moe_intermediate_size: int | None = None
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = None
    use_cache: bool = True
    model_type: str = "kimi_linear"
    # k3jax runtime choices (not part of the HF config): how routed experts are held — None (same as ``dtype``),
    # "bfloat16"/"float32"/"float64", or "mxfp4" (packed 4-bit + E8M0 scales, dequantized inside the expert matmul).
    expert_dtype: str | None = None
    # The release's top-level fields (architectures, token ids, vision_config…) when read from a kimi_k3 file.
    top_level: dict[str, Any] | None = field(default=None, repr=False)
    # Everything else found in the file (HF boilerplate such as id2label); kept so a config round-trips.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = LinearAttnConfig.from_dict(self.linear_attn_config)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "K3Config":
        """Build from a ``config.json`` dict: a ``kimi_k3`` release (uses ``text_config``) or ``kimi_linear``."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        top_type = d.get("model_type")
        top_level = None
        if "text_config" in d:
            top_level = {k: v for k, v in d.items() if k != "text_config"}
            if top_type not in (None, "kimi_k3"):
                raise ConfigError(f"{source}: model_type {top_type!r} with a text_config; expected 'kimi_k3'")
            text = dict(d["text_config"])
            # The release repeats token ids at the top level; the text tower's own values win.
            for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
                if k not in text and k in d:
                    text[k] = d[k]
            d = text
            source = f"{source} (text_config)"
        mt = d.get("model_type", "kimi_linear")
        if mt != "kimi_linear":
            raise ConfigError(
                f"{source}: model_type is {mt!r}; k3jax reads 'kimi_k3' (with text_config) or 'kimi_linear'"
            )
        d = _normalise_hf_aliases(d)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"} - RUNTIME_FIELDS
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        known["top_level"] = top_level
        if "torch_dtype" in extra and "dtype" not in known:
            known["dtype"] = extra["torch_dtype"]
        if isinstance(known.get("linear_attn_config"), dict):
            known["linear_attn_config"] = LinearAttnConfig.from_dict(known["linear_attn_config"], source)
        cfg = cls(**known, extra=extra)
        cfg.validate(source)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "K3Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no config.json")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=str(path))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "K3Config":
        """One of :func:`preset_names` (``k3``, ``kimi-linear-48b``, ``tiny``, ``100m``, ``test``), fields
        overridable. A name or a path, as users give it: :func:`resolve_config`."""
        if name not in preset_names():
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(preset_names())}")
        text = resources.files("k3jax").joinpath("presets", f"{name}.json").read_text()
        d = json.loads(text)
        cfg = cls.from_dict(d, source=f"preset {name}")
        return cfg.replace(**overrides) if overrides else cfg

    def replace(self, **changes: Any) -> "K3Config":
        """A copy with ``changes`` applied and validated."""
        new = dataclasses.replace(self, **changes)
        new.validate("override")
        return new

    def to_release_dict(self) -> dict[str, Any]:
        """The full ``config.json``: the ``kimi_k3`` wrapper with ``text_config`` when read from one, else the
        plain ``kimi_linear`` dict."""
        text = self.to_dict()
        if self.top_level is None:
            return text
        return {**self.top_level, "text_config": text}

    def to_dict(self) -> dict[str, Any]:
        """The ``kimi_linear`` text config as a JSON-able dict (HF field names)."""
        d = {}
        for f in dataclasses.fields(self):
            if f.name == "extra" or f.name in RUNTIME_FIELDS:
                continue
            v = getattr(self, f.name)
            d[f.name] = v.to_dict() if isinstance(v, LinearAttnConfig) else v
        d.update(self.extra)
        return d

    # ------------------------------------------------------------------ derived
    @property
    def layer_types(self) -> list[str]:
        """Per 0-based layer: ``"kda"`` or ``"mla"``, driven by the 1-indexed lists (never by a formula)."""
        if self.linear_attn_config is None:
            return ["mla"] * self.num_hidden_layers
        kda = set(self.linear_attn_config.kda_layers)
        return ["kda" if (i + 1) in kda else "mla" for i in range(self.num_hidden_layers)]

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts is not None
            and self.num_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def kda_gate(self) -> str:
        """``"lower_bound"`` (K3: γ = λ·σ(e^A (f+dt))) or ``"softplus"`` (Kimi Linear: γ = −e^A softplus(f+dt))."""
        lac = self.linear_attn_config
        return "lower_bound" if lac is not None and lac.gate_lower_bound is not None else "softplus"

    @property
    def qk_head_dim(self) -> int:
        return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)

    @property
    def latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_in_dim(self) -> int:
        """Width the routed experts work in: the latent width for LatentMoE, else ``hidden_size``."""
        return self.routed_expert_hidden_size if self.latent_moe else self.hidden_size

    @property
    def attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    # ------------------------------------------------------------------ validation
    def validate(self, source: str = "config") -> None:
        """Raise :class:`ConfigError` naming the field and what was expected."""

        def bad(fieldname: str, msg: str) -> None:
            raise ConfigError(f"{source}: {fieldname}: {msg}")

        def pos_int(fieldname: str, v: Any, allow_none: bool = False) -> None:
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(fieldname, f"expected a positive integer, got {v!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            pos_int(name, getattr(self, name))
        pos_int("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}, "
                f"got {self.num_key_value_heads}")
        if self.hidden_act not in _ACTS:
            bad("hidden_act", f"expected one of {_ACTS}, got {self.hidden_act!r}")
        if self.hidden_act == "situ":
            for name in ("activation_situ_beta", "activation_situ_linear_beta"):
                v = getattr(self, name)
                if v is not None and (not isinstance(v, (int, float)) or not v > 0):
                    bad(name, f"expected a positive number or null, got {v!r}")
        if not isinstance(self.rms_norm_eps, (int, float)) or not 0 < self.rms_norm_eps < 1:
            bad("rms_norm_eps", f"expected a number in (0, 1), got {self.rms_norm_eps!r}")
        if self.dtype not in _DTYPES:
            bad("dtype", f"expected one of {_DTYPES}, got {self.dtype!r}")
        if self.expert_dtype is not None and self.expert_dtype not in _DTYPES + ("mxfp4",):
            bad("expert_dtype", f"expected one of {_DTYPES + ('mxfp4',)} or null, got {self.expert_dtype!r}")
        if self.expert_dtype == "mxfp4" and self.num_experts:
            for name in ("expert_in_dim", "moe_intermediate_size"):
                if getattr(self, name) % 32:
                    bad("expert_dtype", f"mxfp4 needs {name}={getattr(self, name)} to be a multiple of 32")
        L = self.num_hidden_layers

        # ---- layer schedule
        lac = self.linear_attn_config
        if lac is not None:
            for name in ("kda_layers", "full_attn_layers"):
                lst = getattr(lac, name)
                if not isinstance(lst, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in lst):
                    bad(f"linear_attn_config.{name}", f"expected a list of 1-indexed layer numbers, got {lst!r}")
                out = [x for x in lst if not 1 <= x <= L]
                if out:
                    bad(f"linear_attn_config.{name}", f"entries {out} outside 1..{L} (lists are 1-indexed)")
                if len(set(lst)) != len(lst):
                    dup = sorted({x for x in lst if lst.count(x) > 1})
                    bad(f"linear_attn_config.{name}", f"repeats layers {dup}")
            both = sorted(set(lac.kda_layers) & set(lac.full_attn_layers))
            if both:
                bad("linear_attn_config", f"layers {both} are in both kda_layers and full_attn_layers")
            missing = sorted(set(range(1, L + 1)) - set(lac.kda_layers) - set(lac.full_attn_layers))
            if missing:
                bad("linear_attn_config", f"layers {missing} (1-indexed) are in neither kda_layers nor "
                    f"full_attn_layers; every one of the {L} layers must be scheduled")
            pos_int("linear_attn_config.num_heads", lac.num_heads)
            pos_int("linear_attn_config.head_dim", lac.head_dim)
            pos_int("linear_attn_config.short_conv_kernel_size", lac.short_conv_kernel_size)
            lb = lac.gate_lower_bound
            if lb is not None and (not isinstance(lb, (int, float)) or not -5.0 <= lb < 0.0):
                bad("linear_attn_config.gate_lower_bound", f"expected a number in [-5, 0), got {lb!r}")
        # ---- MLA
        if "mla" in self.layer_types:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                pos_int(name, getattr(self, name))
            pos_int("q_lora_rank", self.q_lora_rank, allow_none=True)
            r = self.qk_rope_head_dim
            if not isinstance(r, int) or r < 0:
                bad("qk_rope_head_dim", f"expected an integer >= 0, got {r!r}")
            if not self.mla_use_nope:
                bad("mla_use_nope", "k3jax implements NoPE MLA only (K3 and Kimi Linear); got false")
        # ---- attention residuals
        if self.attn_res_block_size is not None:
            pos_int("attn_res_block_size", self.attn_res_block_size)
        # ---- FFNs
        fk = self.first_k_dense_replace
        if not isinstance(fk, int) or not 0 <= fk <= L:
            bad("first_k_dense_replace", f"expected an integer in [0, {L}], got {fk!r}")
        pos_int("moe_layer_freq", self.moe_layer_freq)
        if any(not self.is_moe_layer(i) for i in range(L)):
            pos_int("intermediate_size", self.intermediate_size)
        if self.num_experts is not None and self.num_experts > 0 and self.moe_layers:
            pos_int("num_experts", self.num_experts)
            pos_int("num_experts_per_token", self.num_experts_per_token)
            pos_int("moe_intermediate_size", self.moe_intermediate_size)
            if self.num_experts_per_token > self.num_experts:
                bad("num_experts_per_token", f"must be <= num_experts={self.num_experts}, "
                    f"got {self.num_experts_per_token}")
            if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
                bad("num_shared_experts", f"expected an integer >= 0, got {self.num_shared_experts!r}")
            pos_int("routed_expert_hidden_size", self.routed_expert_hidden_size, allow_none=True)
            if self.moe_router_activation_func not in _ROUTER_ACTS:
                bad("moe_router_activation_func", f"expected one of {_ROUTER_ACTS}, "
                    f"got {self.moe_router_activation_func!r}")
            if self.topk_method not in _TOPK_METHODS:
                bad("topk_method", f"expected one of {_TOPK_METHODS}, got {self.topk_method!r}")
            pos_int("num_expert_group", self.num_expert_group)
            pos_int("topk_group", self.topk_group)
            if self.num_experts % self.num_expert_group:
                bad("num_expert_group", f"must divide num_experts={self.num_experts}, got {self.num_expert_group}")
            if self.topk_group > self.num_expert_group:
                bad("topk_group", f"must be <= num_expert_group={self.num_expert_group}, got {self.topk_group}")
            if self.use_grouped_topk and self.num_expert_group > 1:
                per_group = self.num_experts // self.num_expert_group
                if self.num_experts_per_token > self.topk_group * per_group:
                    bad("topk_group", "the selected groups hold fewer experts than num_experts_per_token")
            if not isinstance(self.routed_scaling_factor, (int, float)) or not math.isfinite(
                    self.routed_scaling_factor):
                bad("routed_scaling_factor", f"expected a finite number, got {self.routed_scaling_factor!r}")
        if self.num_nextn_predict_layers not in (0, None):
            bad("num_nextn_predict_layers", f"multi-token prediction is not part of K3; expected 0, "
                f"got {self.num_nextn_predict_layers!r}")
        if self.tie_word_embeddings not in (False, True):
            bad("tie_word_embeddings", f"expected true or false, got {self.tie_word_embeddings!r}")


def _normalise_hf_aliases(d: dict[str, Any]) -> dict[str, Any]:
    """Map transformers' ``KimiLinearConfig`` attribute names onto the release's ``config.json`` names."""
    d = dict(d)
    aliases = {
        "num_local_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
        "norm_topk_prob": "moe_renormalize",
        "n_group": "num_expert_group",
    }
    for alt, name in aliases.items():
        if alt in d:
            v = d.pop(alt)
            d.setdefault(name, v)
    if "model_max_length" in d and "max_position_embeddings" not in d:
        d["max_position_embeddings"] = d["model_max_length"]
    # transformers may carry the schedule as ``layer_types`` (0-indexed) with flattened KDA fields instead.
    lt = d.get("layer_types")
    if d.get("linear_attn_config") is None and isinstance(lt, list) and "linear_attention" in lt:
        d["linear_attn_config"] = {
            "kda_layers": [i + 1 for i, t in enumerate(lt) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(lt) if t != "linear_attention"],
            "num_heads": d.get("linear_num_heads", 32),
            "head_dim": d.get("linear_head_dim", 128),
            "short_conv_kernel_size": d.get("linear_conv_kernel_dim", 4),
        }
    mlt = d.get("mlp_layer_types")
    if isinstance(mlt, list) and "first_k_dense_replace" not in d:
        dense = [t == "dense" for t in mlt]
        d["first_k_dense_replace"] = dense.index(False) if False in dense else len(dense)
    return d


def preset_names() -> list[str]:
    """The presets shipped in ``k3jax/presets/``: ``k3`` (the release), ``kimi-linear-48b``, and the small ``100m``,
    ``tiny`` (the demo's) and ``test`` (every K3 feature at test size)."""
    return ["k3", "kimi-linear-48b", "tiny", "100m", "test"]


def resolve_config(name_or_path: str | Path) -> K3Config:
    """The config a user names — on the command line (``k3jax params/inspect/generate``, ``--preset``) or as
    ``TrainConfig.model`` — with one precedence:

    1. an **existing path** wins: a ``config.json`` file, or a directory holding one (a checkpoint, an Orbax
       export, a training run), read with :meth:`K3Config.from_json` (a directory without one raises
       ``FileNotFoundError``);
    2. else a **preset name** (:func:`preset_names`);
    3. else :class:`ConfigError` listing the presets.
    """
    p = Path(name_or_path)
    if p.exists():
        return K3Config.from_json(p)
    if str(name_or_path) in preset_names():
        return K3Config.from_preset(str(name_or_path))
    raise ConfigError(f"{str(name_or_path)!r}: neither a preset ({', '.join(preset_names())}) nor an existing path "
                      f"(a config.json or a directory holding one)")
