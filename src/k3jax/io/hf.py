"""Load unquantized safetensors checkpoints in the K3 release naming (spec §9.2) and transformers' Kimi Linear.

Names accepted for the same tensor (all mapped to the release naming, ``language_model.`` prefix optional):

* release / Moonshot original (what transformers' ``save_pretrained`` writes by default): separate
  ``q/k/v_conv1d``, per-expert ``experts.{e}.w1/w2/w3``, ``block_sparse_moe.*``;
* transformers in-memory naming: ``self_attn.conv1d.weight`` (q, k, v concatenated), ``self_attn.forget_gate.*``,
  ``mlp.experts.gate_up_proj [E, 2I, D]`` / ``mlp.experts.down_proj [E, D, I]``, ``mlp.gate.*`` on MoE layers;
* a dense layer's MLP under ``mlp.*`` or (transformers' save quirk) ``block_sparse_moe.{gate,up,down}_proj``;
* AttnRes ``{site}_norm.weight`` or ``{site}.norm_weight``.

Loading is strict: every expected tensor exactly once with the expected shape, nothing unknown; vision tower and
projector tensors are skipped with one log line.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import K3Config
from k3jax.io.safetensors import CheckpointError, SafetensorsFile
from k3jax.nn.model import K3ForCausalLM

log = logging.getLogger("k3jax.io")

PREFIX = "language_model."
SKIP_PREFIXES = ("vision_tower.", "mm_projector.")
# Parameters kept in fp32 whatever the model dtype (they are F32 in the release checkpoint).
FP32_LEAVES = ("q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias", "o_norm", "e_score_correction_bias")


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor: where it goes and how to convert it from the PyTorch layout."""

    param: tuple                      # path of the NNX variable
    shape: tuple[int, ...]            # expected checkpoint shape (for A_log: the number of real heads)
    kind: str                         # "linear" | "copy" | "conv" | "A_log" | "dt_bias" | "expert"
    expert: int | None = None         # index on the expert axis for kind == "expert"


def expected_tensors(cfg: K3Config) -> dict[str, Spec]:
    """Release-format key (no ``language_model.`` prefix) → :class:`Spec`, for every tensor the model needs."""
    H = cfg.hidden_size
    out: dict[str, Spec] = {}

    def lin(key: str, path: tuple, o: int, i: int) -> None:
        out[key + ".weight"] = Spec(path + ("kernel",), (o, i), "linear")

    def copy(key: str, path: tuple, shape: tuple[int, ...]) -> None:
        out[key] = Spec(path, shape, "copy")

    copy("model.embed_tokens.weight", ("model", "embed_tokens"), (cfg.vocab_size, H))
    copy("model.norm.weight", ("model", "norm", "weight"), (H,))
    if not cfg.tie_word_embeddings:
        lin("lm_head", ("lm_head",), cfg.vocab_size, H)
    if cfg.attn_res:
        copy("model.output_attn_res_norm.weight", ("model", "output_attn_res", "norm"), (H,))
        copy("model.output_attn_res_proj.weight", ("model", "output_attn_res", "proj"), (1, H))
    for i, kind in enumerate(cfg.layer_types):
        k = f"model.layers.{i}"
        p = ("model", "layers", i)
        copy(f"{k}.input_layernorm.weight", p + ("input_layernorm", "weight"), (H,))
        copy(f"{k}.post_attention_layernorm.weight", p + ("post_attention_layernorm", "weight"), (H,))
        if cfg.attn_res:
            for site in ("self_attention_res", "mlp_res"):
                copy(f"{k}.{site}_norm.weight", p + (site, "norm"), (H,))
                copy(f"{k}.{site}_proj.weight", p + (site, "proj"), (1, H))
        a, ap = f"{k}.self_attn", p + ("self_attn",)
        if kind == "kda":
            lac = cfg.linear_attn_config
            nh, hd, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
            P = nh * hd
            for n in ("q", "k", "v"):
                lin(f"{a}.{n}_proj", ap + (f"{n}_proj",), P, H)
                out[f"{a}.{n}_conv1d.weight"] = Spec(ap + (f"{n}_conv1d",), (P, 1, W), "conv")
            lin(f"{a}.f_a_proj", ap + ("f_a_proj",), hd, H)
            lin(f"{a}.f_b_proj", ap + ("f_b_proj",), P, hd)
            out[f"{a}.A_log"] = Spec(ap + ("A_log",), (nh,), "A_log")
            out[f"{a}.dt_bias"] = Spec(ap + ("dt_bias",), (P,), "dt_bias")
            lin(f"{a}.b_proj", ap + ("b_proj",), nh, H)
            if lac.use_full_rank_gate:
                lin(f"{a}.g_proj", ap + ("g_proj",), P, H)
            else:
                lin(f"{a}.g_a_proj", ap + ("g_a_proj",), hd, H)
                lin(f"{a}.g_b_proj", ap + ("g_b_proj",), P, hd)
            copy(f"{a}.o_norm.weight", ap + ("o_norm",), (hd,))
            lin(f"{a}.o_proj", ap + ("o_proj",), H, P)
        else:
            nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
            r_kv = cfg.kv_lora_rank
            if cfg.q_lora_rank is not None:
                lin(f"{a}.q_a_proj", ap + ("q_a_proj",), cfg.q_lora_rank, H)
                copy(f"{a}.q_a_layernorm.weight", ap + ("q_a_layernorm", "weight"), (cfg.q_lora_rank,))
                lin(f"{a}.q_b_proj", ap + ("q_b_proj",), nh * (dn + dr), cfg.q_lora_rank)
            else:
                lin(f"{a}.q_proj", ap + ("q_proj",), nh * (dn + dr), H)
            lin(f"{a}.kv_a_proj_with_mqa", ap + ("kv_a_proj_with_mqa",), r_kv + dr, H)
            copy(f"{a}.kv_a_layernorm.weight", ap + ("kv_a_layernorm", "weight"), (r_kv,))
            lin(f"{a}.kv_b_proj", ap + ("kv_b_proj",), nh * (dn + dv), r_kv)
            if cfg.mla_use_output_gate:
                lin(f"{a}.g_proj", ap + ("g_proj",), nh * dv, H)
            lin(f"{a}.o_proj", ap + ("o_proj",), H, nh * dv)
        if cfg.is_moe_layer(i):
            m, mp = f"{k}.block_sparse_moe", p + ("block_sparse_moe",)
            E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_dim
            lin(f"{m}.gate", mp + ("gate",), E, H)
            copy(f"{m}.gate.e_score_correction_bias", mp + ("e_score_correction_bias",), (E,))
            if cfg.latent_moe:
                lin(f"{m}.routed_expert_down_proj", mp + ("routed_expert_down_proj",), D, H)
                if cfg.latent_moe_use_norm:
                    copy(f"{m}.routed_expert_norm.weight", mp + ("routed_expert_norm", "weight"), (D,))
                lin(f"{m}.routed_expert_up_proj", mp + ("routed_expert_up_proj",), H, D)
            for e in range(E):
                for w, shape in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
                    out[f"{m}.experts.{e}.{w}.weight"] = Spec(mp + ("experts", w), shape, "expert", e)
            if cfg.num_shared_experts:
                S = cfg.num_shared_experts * cfg.moe_intermediate_size
                s, sp = f"{m}.shared_experts", mp + ("shared_experts",)
                lin(f"{s}.gate_proj", sp + ("gate_proj",), S, H)
                lin(f"{s}.up_proj", sp + ("up_proj",), S, H)
                lin(f"{s}.down_proj", sp + ("down_proj",), H, S)
        else:
            f, fp = f"{k}.mlp", p + ("mlp",)
            lin(f"{f}.gate_proj", fp + ("gate_proj",), cfg.intermediate_size, H)
            lin(f"{f}.up_proj", fp + ("up_proj",), cfg.intermediate_size, H)
            lin(f"{f}.down_proj", fp + ("down_proj",), H, cfg.intermediate_size)
    return out


# ------------------------------------------------------------------------------------------- key aliases
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ATTNRES_ALT = re.compile(r"(self_attention_res|mlp_res|output_attn_res)\.(norm|proj)_weight$")

Loader = Callable[[], np.ndarray]


class _Source:
    """Where a release-named tensor comes from: a file, the stored key, and an optional slice of a fused tensor."""

    def __init__(self, file: SafetensorsFile, key: str, part: Callable[[np.ndarray], np.ndarray] | None = None):
        self.file, self.key, self.part = file, key, part

    def where(self) -> str:
        return f"{self.key!r} in {self.file.path}"

    def load(self) -> np.ndarray:
        a = self.file.get(self.key)
        return self.part(a) if self.part is not None else a


def _canonical(bare: str, cfg: K3Config, f: SafetensorsFile, key: str) -> list[tuple[str, _Source]]:
    """Release-format name(s) for the stored ``key`` (``bare``: without the prefix); fused tensors expand."""
    k = bare.replace(".self_attn.forget_gate.", ".self_attn.")
    k = _ATTNRES_ALT.sub(lambda m: f"{m.group(1)}_{m.group(2)}.weight", k)
    m = _LAYER.match(k)
    if m is not None and int(m.group(1)) < cfg.num_hidden_layers:
        i = int(m.group(1))
        if cfg.is_moe_layer(i):
            k = k.replace(f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe.")
        else:
            k = k.replace(f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp.")
        base = f"model.layers.{i}"
        if k == f"{base}.self_attn.conv1d.weight" and cfg.linear_attn_config is not None:
            P = cfg.linear_attn_config.num_heads * cfg.linear_attn_config.head_dim
            if f.shape(key)[0] != 3 * P:
                raise CheckpointError(f"{f.path}: tensor {key!r}: fused conv has {f.shape(key)[0]} channels, "
                                      f"expected 3×{P}")
            return [(f"{base}.self_attn.{n}_conv1d.weight", _Source(f, key, lambda a, j=j: a[j * P:(j + 1) * P]))
                    for j, n in enumerate("qkv")]
        moe = f"{base}.block_sparse_moe.experts"
        if k in (f"{moe}.gate_up_proj", f"{moe}.down_proj") and cfg.num_experts:
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            if f.shape(key)[0] != E:
                raise CheckpointError(f"{f.path}: tensor {key!r}: {f.shape(key)[0]} experts, expected {E}")
            if k.endswith("gate_up_proj"):
                res = []
                for e in range(E):
                    res.append((f"{moe}.{e}.w1.weight", _Source(f, key, lambda a, e=e: a[e, :I])))
                    res.append((f"{moe}.{e}.w3.weight", _Source(f, key, lambda a, e=e: a[e, I:])))
                return res
            return [(f"{moe}.{e}.w2.weight", _Source(f, key, lambda a, e=e: a[e])) for e in range(E)]
    return [(k, _Source(f, key))]


def _convert(name: str, spec: Spec, a: np.ndarray, where: str) -> np.ndarray:
    """Checkpoint layout → parameter layout (before the final reshape to the parameter's shape)."""
    if not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
        raise CheckpointError(f"tensor {name!r} ({where}): dtype {a.dtype}, expected a floating-point tensor")
    if spec.kind == "A_log":
        nh = spec.shape[0]
        flat = a.reshape(-1)
        if a.ndim not in (1, 4) or flat.size < nh or (a.ndim == 4 and flat.size != a.shape[2]):
            raise CheckpointError(f"tensor {name!r} ({where}): shape {list(a.shape)}, expected [{nh}], a zero-padded "
                                  f"[N>{nh}] or [1, 1, {nh}, 1]")
        if np.any(flat[nh:] != 0):
            raise CheckpointError(f"tensor {name!r} ({where}): padding entries A_log[{nh}:] must be zero")
        return flat[:nh]
    if tuple(a.shape) != spec.shape:
        raise CheckpointError(f"tensor {name!r} ({where}): shape {list(a.shape)}, expected {list(spec.shape)}")
    if spec.kind in ("linear", "expert"):
        return a.T
    if spec.kind == "conv":
        return a[:, 0, :]
    return a


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (via ``model.safetensors.index.json`` when present)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise CheckpointError(f"{index}: names {missing[:3]} which do not exist in {path}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def load_state(path: str | Path, cfg: K3Config) -> dict[tuple, np.ndarray]:
    """Read and convert every expected tensor: parameter path → numpy array (parameter layout, file dtype)."""
    path = Path(path)
    files = [SafetensorsFile(p) for p in checkpoint_files(path)]
    all_keys = [k for f in files for k in f.keys()]
    prefixed = any(k.startswith(PREFIX) for k in all_keys)
    expected = expected_tensors(cfg)
    found: dict[str, _Source] = {}
    skipped = 0
    unknown: list[str] = []
    for f in files:
        for key in f.keys():
            bare = key
            if prefixed:
                if not key.startswith(PREFIX):
                    if key.startswith(SKIP_PREFIXES):
                        skipped += 1
                        continue
                    unknown.append(f"{key!r} in {f.path}")
                    continue
                bare = key[len(PREFIX):]
            if bare.startswith(SKIP_PREFIXES):
                skipped += 1
                continue
            for name, src in _canonical(bare, cfg, f, key):
                if name not in expected:
                    unknown.append(src.where())
                    continue
                if name in found:
                    raise CheckpointError(f"tensor {name!r} appears twice: {found[name].where()} and {src.where()}")
                found[name] = src
    if skipped:
        log.info("skipped %d vision_tower/mm_projector tensors (text model only)", skipped)
    if unknown:
        raise CheckpointError(f"{len(unknown)} tensors the config does not expect, e.g. {unknown[:3]} "
                              f"(config: {path / 'config.json'})")
    missing = [n for n in expected if n not in found]
    if missing:
        raise CheckpointError(f"{len(missing)} expected tensors missing from {path}, e.g. "
                              f"{[PREFIX + m if prefixed else m for m in missing[:3]]}")
    params: dict[tuple, np.ndarray] = {}
    experts: dict[tuple, list[np.ndarray | None]] = {}
    for name, spec in expected.items():
        src = found[name]
        a = _convert(name, spec, src.load(), src.where())
        if spec.kind == "expert":
            experts.setdefault(spec.param, [None] * cfg.num_experts)[spec.expert] = a
        else:
            params[spec.param] = a
    for p, lst in experts.items():
        params[p] = np.stack(lst)
    for f in files:
        f.close()
    return params


def load_pretrained(path: str | Path, *, dtype: str | None = None) -> K3ForCausalLM:
    """``config.json`` + safetensors → :class:`K3ForCausalLM` (``dtype`` overrides the config's ``dtype``)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    cfg = K3Config.from_json(path / "config.json")
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    arrays = load_state(path, cfg)
    abstract = nnx.eval_shape(lambda: K3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    items = []
    for p, var in nnx.to_flat_state(state):
        if p not in arrays:
            raise CheckpointError(f"internal: parameter {'.'.join(map(str, p))} has no checkpoint tensor")
        a = arrays[p]
        dt = jnp.promote_types(var.dtype, jnp.float32) if p[-1] in FP32_LEAVES or (len(p) > 1 and p[-2] in FP32_LEAVES) else var.dtype
        items.append((p, var.replace(jnp.asarray(a.reshape(var.shape), dtype=dt))))
    return nnx.merge(graphdef, nnx.from_flat_state(items))
