"""Write the release checkpoint format: ``config.json``, ``model.safetensors.index.json`` and size-bounded shards.

A model read from a ``kimi_k3`` config is written as the release is (``language_model.`` prefix, the wrapper
config with ``text_config``, ``A_log`` zero-padded to the KDA head dim); a ``kimi_linear`` model in transformers'
original naming (no prefix, ``A_log [1, 1, H, 1]``), which ``KimiLinearForCausalLM.from_pretrained`` reads.
Routed experts are written as MXFP4 ``weight_packed``/``weight_scale`` when the model holds them packed (bytes
copied verbatim) or when ``expert_format="mxfp4"`` (quantized with the release's scale rule, spec §9.3).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from flax import nnx

from k3jax.io.hf import PREFIX, Spec, expected_tensors
from k3jax.io.safetensors import CheckpointError, write_safetensors
from k3jax.nn.model import K3ForCausalLM
from k3jax.nn.scan import RunLayout, scan_plan
from k3jax.ops.mx import mxfp4_quantize

RELEASE_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "targets": ["Linear"],
        "weights": {"num_bits": 4, "group_size": 32, "type": "float", "symmetric": True, "strategy": "group",
                    "scale_dtype": "torch.uint8", "dynamic": False, "observer": "minmax"},
        "input_activations": None, "output_activations": None}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``5_000_000_000``, ``"5GB"``, ``"500MiB"`` → bytes."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(size)
    if not m or (m.group(2) or "").upper() not in _UNITS:
        raise ValueError(f"shard_size: expected bytes or a size like '5GB', got {size!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


class _Row:
    """Row ``j`` of a stacked array, sliced only when read (``np.asarray``, an expert's ``[e]``, ``.shape``)."""

    def __init__(self, stack, j: int):
        self.stack, self.j = stack, j
        self.shape, self.dtype = tuple(stack.shape[1:]), stack.dtype

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.stack[self.j])
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, e):
        return self.stack[self.j][e]


def _ckpt_tensors(model: K3ForCausalLM, name: str, spec: Spec, params: dict, release: bool,
                  mxfp4: bool) -> dict[str, np.ndarray]:
    """The checkpoint tensor(s) for one expected name (two for an MXFP4 expert weight)."""
    cfg = model.config
    if spec.kind == "expert":
        base = spec.param[:-1]
        w = spec.param[-1]
        packed = params.get(base + (w + "_packed",))
        if packed is not None:                                     # held packed: copy the bytes verbatim
            p, s = np.asarray(packed[spec.expert]), np.asarray(params[base + (w + "_scale",)][spec.expert])
            if mxfp4:
                return {name + "_packed": p, name + "_scale": s}
            from k3jax.ops.mx import mxfp4_dequantize_np

            return {name: mxfp4_dequantize_np(p, s, np.float32).astype(np.dtype(cfg.dtype))}
        dense = np.asarray(params[spec.param][spec.expert]).T    # [out, in]
        if mxfp4:
            p, s = mxfp4_quantize(dense.astype(np.float32))
            return {name + "_packed": p, name + "_scale": s}
        return {name: np.ascontiguousarray(dense)}
    a = np.asarray(params[spec.param])
    if spec.kind == "linear":
        o, i = spec.shape
        return {name: np.ascontiguousarray(a.reshape(i, o).T)}
    if spec.kind == "conv":
        return {name: np.ascontiguousarray(a[:, None, :])}
    if spec.kind == "A_log":
        if not release:
            return {name: a.reshape(1, 1, -1, 1)}
        n = max(a.shape[0], cfg.linear_attn_config.head_dim)   # the release pads 96 heads to 128 = head_dim
        return {name: np.concatenate([a, np.zeros(n - a.shape[0], a.dtype)])}
    if spec.kind == "dt_bias":
        return {name: a.reshape(-1)}
    return {name: a.reshape(spec.shape)}


def save_pretrained(model: K3ForCausalLM, path: str | Path, *, shard_size: int | str = "5GB",
                    expert_format: str | None = None) -> Path:
    """Write ``model`` as a checkpoint directory; returns the path.

    ``expert_format``: ``"mxfp4"`` or ``"dense"``; default MXFP4 when the model holds packed experts or its config
    carries the release's MXFP4 ``quantization_config``, else dense. Shards hold at most ``shard_size`` bytes
    (a tensor bigger than that gets a shard of its own); each is written to a temporary name and renamed.
    """
    cfg = model.config
    path = Path(path)
    check_export_target(path)
    path.mkdir(parents=True, exist_ok=True)
    limit = parse_size(shard_size)
    qc = cfg.quantization_config or {}
    if expert_format is None:
        expert_format = "mxfp4" if (cfg.expert_dtype == "mxfp4" or qc.get("format") == "mxfp4-pack-quantized") \
            else "dense"
    if expert_format not in ("mxfp4", "dense"):
        raise ValueError(f"expert_format: expected 'mxfp4' or 'dense', got {expert_format!r}")
    mxfp4 = expert_format == "mxfp4" and bool(cfg.moe_layers)
    release = cfg.top_level is not None
    _, state = nnx.split(model)
    # per-layer names: the stacked run's rows (k3jax.nn.scan) read one layer at a time as each shard is written
    params = RunLayout(scan_plan(cfg)).unstack({p: v[...] for p, v in nnx.to_flat_state(state)}, row=_Row)
    expected = expected_tensors(cfg)

    # Plan shards from shapes alone, then materialise one shard at a time.
    def nbytes(name: str, spec: Spec) -> int:
        if spec.kind == "expert" and mxfp4:
            o, i = spec.shape
            return o * i // 2 + o * i // 32
        if spec.kind == "expert":
            return int(np.prod(spec.shape)) * np.dtype(params[spec.param].dtype).itemsize
        return int(np.prod(params[spec.param].shape)) * np.dtype(params[spec.param].dtype).itemsize

    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in expected.items():
        n = nbytes(name, spec)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    total = len(shards)
    weight_map: dict[str, str] = {}
    total_size = 0
    for k, names in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{total:05d}.safetensors" if total > 1 else "model.safetensors"
        tensors: dict[str, np.ndarray] = {}
        for name in names:
            for key, arr in _ckpt_tensors(model, name, expected[name], params, release, mxfp4).items():
                key = (PREFIX + key) if release else key
                tensors[key] = arr
                weight_map[key] = fname
                total_size += arr.nbytes
        write_safetensors(path / fname, tensors, {"format": "pt"})
        del tensors
    written = set(weight_map.values())
    for stale in path.glob("model*.safetensors"):        # shards of an earlier export into the same directory
        if stale.name not in written:
            stale.unlink()
    if total > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    else:
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
    conf = cfg.to_release_dict()
    text = conf["text_config"] if release else conf
    if mxfp4:
        text["quantization_config"] = text.get("quantization_config") or RELEASE_QUANTIZATION
    else:
        text.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(conf, indent=2))
    return path


def check_export_target(path: Path) -> None:
    if path.exists() and any(path.iterdir()) and not (path / "config.json").exists():
        raise CheckpointError(f"{path}: exists and is not a checkpoint directory; refusing to write into it")
