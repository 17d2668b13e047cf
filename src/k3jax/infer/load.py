"""Load a model (and its tokenizer) for inference from whatever the user points at."""

from __future__ import annotations

import json
from pathlib import Path

from flax import nnx

from k3jax.config import ConfigError, K3Config, preset_names
from k3jax.infer.tokenizer import load_tokenizer
from k3jax.nn.model import K3ForCausalLM


class ModelLoadError(ValueError):
    """The path is not a preset, a training run, an Orbax export or a release checkpoint."""


def load_training_run(run: Path, step: int | None = None) -> K3ForCausalLM:
    """The model of a ``k3jax train`` output directory at its latest (or given) checkpoint: params and router
    biases; the optimizer state is not read."""
    import orbax.checkpoint as ocp

    cfg = K3Config.from_json(run / "config.json")
    ck = run / "checkpoints"
    steps = sorted(int(p.name) for p in ck.iterdir() if p.is_dir() and p.name.isdigit()) if ck.is_dir() else []
    if not steps:
        raise ModelLoadError(f"{ck}: no finished checkpoint (expected numbered step directories)")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ModelLoadError(f"{ck}: no checkpoint for step {step}; have {steps}")
    abstract = nnx.eval_shape(lambda: K3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params_st, rest_st = nnx.split(abstract, nnx.Param, ...)
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(ck / str(step) / "state")
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
        saved = ckptr.restore(ck / str(step) / "state", _restore_target(tree))
    params, rest = (saved[0], saved[1]) if isinstance(saved, (list, tuple)) else (saved["0"], saved["1"])
    nnx.replace_by_pure_dict(params_st, params)
    nnx.replace_by_pure_dict(rest_st, rest)
    return nnx.merge(graphdef, params_st, rest_st)


def _restore_target(tree):
    """Restore every array of the saved tree as a plain (host-local) array."""
    import jax
    import numpy as np

    def leaf(m):
        shape, dtype = getattr(m, "shape", None), getattr(m, "dtype", None)
        return m if shape is None else jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))

    return jax.tree.map(leaf, tree, is_leaf=lambda m: hasattr(m, "shape"))


def load_model(spec: str, *, dtype: str | None = None, seed: int = 0):
    """``(model, tokenizer, description)`` for a preset name (random weights), a ``k3jax train`` run directory,
    an Orbax export (``k3jax.json``) or a release / Kimi Linear checkpoint directory (safetensors)."""
    p = Path(spec)
    if spec in preset_names() and not p.exists():
        cfg = K3Config.from_preset(spec)
        if dtype:
            cfg = cfg.replace(dtype=dtype)
        return K3ForCausalLM(cfg, rngs=nnx.Rngs(seed)), load_tokenizer(None), f"preset {spec} (random weights)"
    if not p.exists():
        raise ModelLoadError(f"--model {spec!r}: neither a preset ({', '.join(preset_names())}) nor an existing path")
    if not p.is_dir():
        raise ModelLoadError(f"{p}: expected a directory (training run, Orbax export or release checkpoint)")
    if (p / "train_config.json").exists():
        model = load_training_run(p)
        tok_spec = json.loads((p / "train_config.json").read_text()).get("tokenizer", "bytes")
        return model, load_tokenizer(tok_spec), f"training run {p}"
    if (p / "k3jax.json").exists():
        from k3jax.io.orbax import load_orbax

        return load_orbax(p, dtype=dtype), _dir_tokenizer(p), f"Orbax export {p}"
    if any(p.glob("*.safetensors")):
        from k3jax.io.hf import load_pretrained

        return load_pretrained(p, dtype=dtype), _dir_tokenizer(p), f"release checkpoint {p}"
    raise ModelLoadError(f"{p}: not a k3jax training run (train_config.json), an Orbax export (k3jax.json) or a "
                         f"checkpoint directory (*.safetensors)")


def _dir_tokenizer(p: Path):
    if (p / "tiktoken.model").exists() or (p / "tokenizer.json").exists():
        return load_tokenizer(p)
    return load_tokenizer(None)


__all__ = ["load_model", "load_training_run", "ModelLoadError", "ConfigError"]
