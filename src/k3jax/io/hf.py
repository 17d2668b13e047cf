"""Load safetensors checkpoints in the K3 release naming (spec §9.2, MXFP4 experts) and transformers' Kimi Linear.

Names accepted for the same tensor (all mapped to the release naming, ``language_model.`` prefix optional):

* release / Moonshot original (what transformers' ``save_pretrained`` writes by default): separate
  ``q/k/v_conv1d``, per-expert ``experts.{e}.w1/w2/w3``, ``block_sparse_moe.*``;
* transformers in-memory naming: ``self_attn.conv1d.weight`` (q, k, v concatenated), ``self_attn.forget_gate.*``,
  ``mlp.experts.gate_up_proj [E, 2I, D]`` / ``mlp.experts.down_proj [E, D, I]``, ``mlp.gate.*`` on MoE layers;
* a dense layer's MLP under ``mlp.*`` or (transformers' save quirk) ``block_sparse_moe.{gate,up,down}_proj``;
* AttnRes ``{site}_norm.weight`` or ``{site}.norm_weight``.

Loading is strict and all-or-nothing: every header is checked (every expected tensor exactly once, expected shape
and dtype, nothing unknown) before any data is read, and the model is assembled only when every tensor converted.
Vision tower and projector tensors are skipped with one log line. A weight is MXFP4 exactly when
``….weight_packed`` + ``….weight_scale`` exist. Tensors stream one at a time from a memory map straight to their
device (and ``NamedSharding`` when a mesh is given); routed experts are written in place into a donated stacked
buffer, so host memory never holds more than one tensor beyond the memory-mapped shard being read.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import K3Config
from k3jax.io.safetensors import CheckpointError, SafetensorsFile
from k3jax.nn.model import K3ForCausalLM
from k3jax.nn.scan import RunLayout, scan_plan
from k3jax.ops.mx import GROUP, mxfp4_dequantize, mxfp4_quantize

log = logging.getLogger("k3jax.io")

PREFIX = "language_model."
SKIP_PREFIXES = ("vision_tower.", "mm_projector.")


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
    """Where a release-named tensor comes from: a file, the stored key, an optional slice of a fused tensor, and
    for MXFP4 the ``weight_scale`` companion of a ``weight_packed`` key."""

    def __init__(self, file: SafetensorsFile, key: str, part: Callable[[np.ndarray], np.ndarray] | None = None):
        self.file, self.key, self.part = file, key, part
        self.scale: _Source | None = None

    def where(self) -> str:
        return f"{self.key!r} in {self.file.path}"

    def shape(self) -> tuple[int, ...]:
        if self.part is None:
            return self.file.shape(self.key)
        return self.part(np.empty(self.file.shape(self.key), np.bool_)).shape

    def dtype(self) -> np.dtype:
        return self.file.dtype(self.key)

    def load(self) -> np.ndarray:
        a = self.file.get(self.key)
        return self.part(a) if self.part is not None else a


def expected_vision_tensors(v) -> dict[str, Spec]:
    """Release key → :class:`Spec` of every ``vision_tower.*`` / ``mm_projector.*`` tensor (spec §2), for a
    :class:`~k3jax.vision.config.VisionConfig` ``v``; parameter paths are those of
    :class:`~k3jax.vision.model.K3ForConditionalGeneration`."""
    D, Q, I, p, M4 = v.vt_hidden_size, v.qkv_hidden_size, v.vt_intermediate_size, v.patch_size, 4 * v.mm_hidden_size
    T = v.text_hidden_size
    out = {"vision_tower.patch_embed.proj.weight": Spec(("vision_tower", "patch_embed", "proj", "kernel"),
                                                        (D, 3, p, p), "patch"),
           "vision_tower.patch_embed.pos_emb.weight": Spec(("vision_tower", "patch_embed", "pos_emb"),
                                                           (v.init_pos_emb_height, v.init_pos_emb_width, D), "copy")}
    for b in range(v.vt_num_hidden_layers):
        k, path = f"vision_tower.encoder.blocks.{b}", ("vision_tower", "encoder", "blocks", b)
        out[f"{k}.norm0.weight"] = Spec(path + ("norm0", "weight"), (D,), "copy")
        out[f"{k}.wqkv.weight"] = Spec(path + ("wqkv", "kernel"), (3 * Q, D), "linear")
        out[f"{k}.wo.weight"] = Spec(path + ("wo", "kernel"), (D, Q), "linear")
        out[f"{k}.norm1.weight"] = Spec(path + ("norm1", "weight"), (D,), "copy")
        out[f"{k}.mlp.fc0.weight"] = Spec(path + ("mlp", "fc0", "kernel"), (I, D), "linear")
        out[f"{k}.mlp.fc1.weight"] = Spec(path + ("mlp", "fc1", "kernel"), (D, I), "linear")
    out["vision_tower.encoder.final_layernorm.weight"] = Spec(("vision_tower", "encoder", "final_layernorm",
                                                               "weight"), (D,), "copy")
    out["mm_projector.proj.0.weight"] = Spec(("mm_projector", "proj", 0, "kernel"), (M4, M4), "linear")
    out["mm_projector.proj.2.weight"] = Spec(("mm_projector", "proj", 1, "kernel"), (T, M4), "linear")
    out["mm_projector.post_norm.weight"] = Spec(("mm_projector", "post_norm", "weight"), (T,), "copy")
    return out


def _canonical(bare: str, cfg: K3Config, f: SafetensorsFile, key: str) -> list[tuple[str, _Source]]:
    """Release-format name(s) for the stored ``key`` (``bare``: without the prefix); fused tensors expand.

    MXFP4 halves keep a ``#packed`` / ``#scale`` suffix on the logical ``….weight`` name until they are paired.
    """
    for half in ("packed", "scale"):
        if bare.endswith(f".weight_{half}"):
            return [(bare[: -len(f"_{half}")] + f"#{half}", _Source(f, key))]
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


def _is_float(dt: np.dtype) -> bool:
    return np.issubdtype(dt, np.floating) or dt.name == "bfloat16"


def _check_header(name: str, spec: Spec, src: _Source, cfg: K3Config) -> None:
    """Shape and dtype checks that need no data (run for every tensor before anything is read)."""
    shape, dt = tuple(src.shape()), src.dtype()
    if src.scale is not None:                                   # MXFP4 pair
        o, i = spec.shape
        sshape, sdt = tuple(src.scale.shape()), src.scale.dtype()
        if dt != np.uint8 or sdt != np.uint8:
            raise CheckpointError(f"tensor {name!r}: weight_packed ({src.where()}) and weight_scale "
                                  f"({src.scale.where()}) must be U8, got {dt} / {sdt}")
        if i % GROUP or shape != (o, i // 2) or sshape != (o, i // GROUP):
            raise CheckpointError(f"tensor {name!r}: weight_packed {list(shape)} ({src.where()}) / weight_scale "
                                  f"{list(sshape)} do not match the config's logical [{o}, {i}]: expected "
                                  f"[{o}, {i // 2}] / [{o}, {i // GROUP}]")
        return
    if not _is_float(dt):
        raise CheckpointError(f"tensor {name!r} ({src.where()}): dtype {dt}, expected a floating-point tensor")
    if spec.kind == "A_log":
        nh = spec.shape[0]
        n = int(np.prod(shape))
        if not (len(shape) == 1 and n >= nh) and shape != (1, 1, nh, 1):
            raise CheckpointError(f"tensor {name!r} ({src.where()}): shape {list(shape)}, expected [{nh}], a "
                                  f"zero-padded [N>{nh}] or [1, 1, {nh}, 1]")
    elif shape != spec.shape:
        raise CheckpointError(f"tensor {name!r} ({src.where()}): shape {list(shape)}, expected {list(spec.shape)}")


def _convert(name: str, spec: Spec, src: _Source, target: str) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Read one tensor and bring it to the parameter layout. For experts ``target`` is the expert dtype:
    ``"mxfp4"`` returns ``(packed, scale)`` in the PyTorch layout, anything else a dense ``[in, out]`` array."""
    if src.scale is not None:
        packed, scale = src.load(), src.scale.load()
        if np.any(scale == 255):
            o, g = np.argwhere(scale == 255)[0]
            raise CheckpointError(f"tensor {name!r}: weight_scale byte 255 (NaN in E8M0) at [{o}, {g}] "
                                  f"({src.scale.where()})")
        return packed, scale                       # dequantized on device when the target is dense
    a = src.load()
    if spec.kind == "A_log":
        nh = spec.shape[0]
        flat = a.reshape(-1)
        if np.any(flat[nh:] != 0):
            raise CheckpointError(f"tensor {name!r} ({src.where()}): padding entries A_log[{nh}:] must be zero")
        return flat[:nh]
    if spec.kind == "expert":
        return mxfp4_quantize(a) if target == "mxfp4" else a.T
    if spec.kind == "linear":
        return a.T
    if spec.kind == "conv":
        return a[:, 0, :]
    if spec.kind == "patch":                       # conv [D, 3, p, p] → kernel [3p², D], flat index ch·p² + i·p + j
        return a.reshape(a.shape[0], -1).T
    return a


def checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint directory and the index's weight map (when there is an index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise CheckpointError(f"{index}: names {missing[:3]} which do not exist in {path}")
        return [path / f for f in files], weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files, None


@dataclass
class LoadPlan:
    """Every expected tensor's source, validated from the headers alone."""

    cfg: K3Config
    expected: dict[str, Spec]
    sources: dict[str, _Source]
    files: list[SafetensorsFile]
    prefixed: bool
    mxfp4: bool                       # the checkpoint stores routed experts packed
    vision: object = None             # the VisionConfig when the vision tensors are loaded too


def plan_load(path: str | Path, cfg: K3Config, vision=None) -> LoadPlan:
    """Open every shard's header and match its tensors to the config; raise on anything missing, duplicated,
    unknown, misshapen or of the wrong dtype before a single tensor is read. With ``vision`` (a
    :class:`~k3jax.vision.config.VisionConfig`) the ``vision_tower.*`` / ``mm_projector.*`` tensors are matched with
    the same checks; without, they are skipped."""
    path = Path(path)
    paths, weight_map = checkpoint_files(path)
    files = [SafetensorsFile(p) for p in paths]
    if weight_map is not None:
        by_name = {f.path.name: f for f in files}
        for key, fname in weight_map.items():
            if key not in by_name[fname].keys():
                raise CheckpointError(f"{path / 'model.safetensors.index.json'}: lists tensor {key!r} in {fname}, "
                                      f"which does not contain it")
    all_keys = [k for f in files for k in f.keys()]
    prefixed = any(k.startswith(PREFIX) for k in all_keys)
    expected = expected_tensors(cfg)
    vexpected = expected_vision_tensors(vision) if vision is not None else {}
    found: dict[str, _Source] = {}
    vfound: dict[str, _Source] = {}
    skipped = 0
    unknown: list[str] = []
    for f in files:
        for key in f.keys():
            bare = key
            if key.startswith(SKIP_PREFIXES):
                if vision is None:
                    skipped += 1
                elif key not in vexpected:
                    unknown.append(f"{key!r} in {f.path}")
                elif key in vfound:
                    raise CheckpointError(f"tensor {key!r} appears twice: {vfound[key].where()} and "
                                          f"{_Source(f, key).where()}")
                else:
                    vfound[key] = _Source(f, key)
                continue
            if prefixed:
                if not key.startswith(PREFIX):
                    unknown.append(f"{key!r} in {f.path}")
                    continue
                bare = key[len(PREFIX):]
            if bare.startswith(SKIP_PREFIXES):
                skipped += 1
                continue
            for name, src in _canonical(bare, cfg, f, key):
                logical = name.split("#")[0]
                if logical not in expected:
                    unknown.append(src.where())
                    continue
                if name in found:
                    raise CheckpointError(f"tensor {name.replace('#', '_')!r} appears twice: {found[name].where()} "
                                          f"and {src.where()}")
                found[name] = src
    if skipped:
        log.info("skipped %d vision_tower/mm_projector tensors (text model only)", skipped)
    if unknown:
        raise CheckpointError(f"{len(unknown)} tensors the config does not expect, e.g. {unknown[:3]} "
                              f"(config: {path / 'config.json'})")
    # pair MXFP4 halves
    mx = False
    for name in [n for n in found if n.endswith("#packed")]:
        logical = name[: -len("#packed")]
        scale = found.pop(logical + "#scale", None)
        packed = found.pop(name)
        if scale is None:
            raise CheckpointError(f"tensor {logical + '_packed'!r} ({packed.where()}) has no matching weight_scale")
        if logical in found:
            raise CheckpointError(f"tensor {logical!r} appears twice: {found[logical].where()} and {packed.where()}")
        if expected[logical].kind != "expert":
            raise CheckpointError(f"tensor {logical!r} ({packed.where()}) is MXFP4, but only routed experts may be")
        packed.scale = scale
        found[logical] = packed
        mx = True
    orphans = [n for n in found if n.endswith("#scale")]
    if orphans:
        raise CheckpointError(f"weight_scale without weight_packed: {found[orphans[0]].where()}")
    missing = [n for n in expected if n not in found]
    if missing:
        raise CheckpointError(f"{len(missing)} expected tensors missing from {path}, e.g. "
                              f"{[PREFIX + m if prefixed else m for m in missing[:3]]}")
    vmissing = [n for n in vexpected if n not in vfound]
    if vmissing:
        raise CheckpointError(f"{len(vmissing)} vision tensors missing from {path}, e.g. {vmissing[:3]} "
                              f"(load with vision=False for the text model alone)")
    for name, spec in expected.items():
        _check_header(name, spec, found[name], cfg)
    for name, spec in vexpected.items():
        _check_header(name, spec, vfound[name], cfg)
    if vision is not None:
        expected = {**{n: _prefixed(s) for n, s in expected.items()}, **vexpected}
        found = {**found, **vfound}
    return LoadPlan(cfg, expected, found, files, prefixed, mx, vision)


def _prefixed(spec: Spec) -> Spec:
    """The text tensor's spec inside :class:`~k3jax.vision.model.K3ForConditionalGeneration`."""
    return Spec(("language_model",) + spec.param, spec.shape, spec.kind, spec.expert)


@jax.jit
def _dequantize_t(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """MXFP4 ``[O, I/2]`` + ``[O, I/32]`` → dense ``[I, O]`` fp32 (dequantize, then transpose)."""
    return mxfp4_dequantize(packed, scale, jnp.float32).T


@functools.partial(jax.jit, donate_argnums=0)
def _set_row(buf: jax.Array, row: jax.Array, at: tuple) -> jax.Array:
    row = row.astype(buf.dtype).reshape((1,) * len(at) + row.shape)
    return jax.lax.dynamic_update_slice(buf, row, tuple(at) + (np.int32(0),) * (buf.ndim - len(at)))


@functools.partial(jax.jit, donate_argnums=0)
def _set_row_explicit(buf: jax.Array, row: jax.Array, at: tuple) -> jax.Array:
    # on a mesh with Explicit axes the update must name its output sharding; a scatter can (10× slower on CPU)
    return buf.at[tuple(at)].set(row.astype(buf.dtype), out_sharding=buf.aval.sharding)


def _set_at(buf: jax.Array, row: jax.Array, at: tuple[int, ...]) -> jax.Array:
    """``buf[at] = row`` in place (the buffer is donated): ``at`` the leading indices (an expert, a stacked run's
    row, or both)."""
    mesh = getattr(buf.sharding, "mesh", None)
    explicit = mesh is not None and any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    return (_set_row_explicit if explicit else _set_row)(buf, row, tuple(np.int32(i) for i in at))


def _progress(total: int, enabled: bool | None, label: str):
    """A rich progress bar over shards (on a terminal, or when asked)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    enabled = sys.stderr.isatty() if enabled is None else enabled
    p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 disable=not enabled, transient=False)
    return p, p.add_task(label, total=total)


def load_pretrained(path: str | Path, *, dtype: str | None = None, expert_dtype: str | None = None,
                    mesh: jax.sharding.Mesh | None = None, progress: bool | None = None, vision: bool = False,
                    vt_norm_eps: float | None = None):
    """``config.json`` + safetensors → :class:`K3ForCausalLM` (the text model; vision tensors skipped), or with
    ``vision=True`` a :class:`~k3jax.vision.model.K3ForConditionalGeneration` (the config's ``vision_config``; the
    ``vision_tower.*`` / ``mm_projector.*`` tensors checked like the text ones). ``vt_norm_eps`` overrides the ViT
    RMSNorm ε (default 2⁻²³, torch ≥ 2.7; 2⁻⁷ reproduces mlx-vlm 0.7.10).

    ``dtype`` overrides the config's activation/parameter dtype; ``expert_dtype`` chooses how routed experts are
    held: ``"bfloat16"``/``"float32"`` (dequantized) or ``"mxfp4"`` (packed, ~4.25 bits per weight, dequantized
    inside the expert matmul). Default: ``"mxfp4"`` when the checkpoint stores MXFP4 experts, else ``dtype``.
    With a ``mesh``, every tensor is placed straight into its ``NamedSharding`` (rules in :mod:`k3jax.parallel`).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    cfg = K3Config.from_json(path / "config.json")
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    vcfg = None
    if vision:
        from k3jax.vision.config import vision_config_of

        vcfg = vision_config_of(cfg.top_level, cfg.hidden_size, source=str(path / "config.json"))
        if vcfg is None:
            raise CheckpointError(f"{path / 'config.json'}: no vision_config, so there is no vision tower to load "
                                  f"(load with vision=False)")
        if vt_norm_eps is not None:
            import dataclasses

            vcfg = dataclasses.replace(vcfg, vt_norm_eps=float(vt_norm_eps))
            vcfg.validate("vt_norm_eps")
    plan = plan_load(path, cfg, vcfg)
    if expert_dtype is None and plan.mxfp4:
        expert_dtype = "mxfp4"
    if expert_dtype is not None:
        cfg = cfg.replace(expert_dtype=expert_dtype)
    target_experts = cfg.expert_dtype or cfg.dtype

    if vcfg is not None:
        from k3jax.vision.model import K3ForConditionalGeneration

        abstract = nnx.eval_shape(lambda: K3ForConditionalGeneration(cfg, vcfg, rngs=nnx.Rngs(0)))
    else:
        abstract = nnx.eval_shape(lambda: K3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    targets = {p: var for p, var in nnx.to_flat_state(state)}

    def sharding_of(p: tuple, shape: tuple[int, ...]):
        if mesh is None:
            return jax.devices()[0]
        from k3jax.parallel.rules import named_sharding, variable_axes

        return named_sharding(variable_axes(targets[p]), shape, mesh)

    layout = RunLayout(scan_plan(cfg))

    def put(p: tuple, a, at: tuple[int, ...] = ()) -> None:
        """The tensor of per-layer path ``p`` (``at``: its expert's row) into its stored variable."""
        to, j = layout.stored(p)
        var = targets[to]             # fp32 islands (conv, A_log, dt_bias, o_norm, router bias) are fp32 here
        at = (() if j is None else (j,)) + at
        if not at:
            values[to] = jax.device_put(np.asarray(a, dtype=var.dtype).reshape(var.shape), sharding_of(to, var.shape))
            return
        if to not in values:
            values[to] = jax.device_put(jnp.zeros(var.shape, var.dtype), sharding_of(to, var.shape))
        row = a if isinstance(a, jax.Array) else np.asarray(a, dtype=var.dtype).reshape(var.shape[len(at):])
        values[to] = _set_at(values[to], jax.device_put(row), at)

    values: dict[tuple, jax.Array] = {}
    by_file: dict[Path, list[str]] = {}
    for name, src in plan.sources.items():
        by_file.setdefault(src.file.path, []).append(name)
    bar, task = _progress(len(plan.files), progress, f"loading {path.name}")
    with bar:
        for f in plan.files:
            for name in by_file.get(f.path, []):
                spec, src = plan.expected[name], plan.sources[name]
                a = _convert(name, spec, src, target_experts)
                if spec.kind != "expert":
                    put(spec.param, a)
                    continue
                if isinstance(a, tuple) and target_experts != "mxfp4":
                    a = _dequantize_t(jax.device_put(a[0]), jax.device_put(a[1]))
                parts = {spec.param: a} if not isinstance(a, tuple) else {
                    spec.param[:-1] + (spec.param[-1] + "_packed",): a[0],
                    spec.param[:-1] + (spec.param[-1] + "_scale",): a[1]}
                for p, arr in parts.items():
                    put(p, jax.device_put(arr), (spec.expert,))
            f.close()
            bar.advance(task)
    items = []
    for p, var in targets.items():
        if p not in values:
            raise CheckpointError(f"internal: parameter {'.'.join(map(str, p))} has no checkpoint tensor")
        items.append((p, var.replace(values[p])))
    return nnx.merge(graphdef, nnx.from_flat_state(items))
