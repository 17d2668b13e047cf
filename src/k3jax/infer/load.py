"""Load a model (and its tokenizer) for inference from whatever the user points at."""

from __future__ import annotations

import json
from pathlib import Path

from flax import nnx

from k3jax.config import ConfigError, K3Config, resolve_config
from k3jax.io.orbax import load_orbax, restore_model
from k3jax.nn.model import K3ForCausalLM
from k3jax.text.tokenizer import load_tokenizer


class ModelLoadError(ValueError):
    """The path is not a preset, a training run, an Orbax export or a release checkpoint."""


def load_training_run(run: str | Path, step: int | None = None, *, dtype: str | None = None) -> K3ForCausalLM:
    """The model of a ``k3jax train`` output directory at its latest (or given) checkpoint: params and router
    biases, read by :func:`k3jax.io.orbax.restore_model`; the optimizer state is not read."""
    run = Path(run).absolute()
    cfg = K3Config.from_json(run / "config.json")
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    ck = run / "checkpoints"
    steps = sorted(int(p.name) for p in ck.iterdir() if p.is_dir() and p.name.isdigit()) if ck.is_dir() else []
    if not steps:
        raise ModelLoadError(f"{ck}: no finished checkpoint (expected numbered step directories)")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ModelLoadError(f"{ck}: no checkpoint for step {step}; have {steps}")
    return restore_model(cfg, ck / str(step) / "state", training_state=True, against=str(run / "config.json"))


def load_model(spec: str, *, dtype: str | None = None, seed: int = 0, vision: bool = False):
    """``(model, tokenizer, description)`` for what ``spec`` names. An existing path wins over a preset name (the
    precedence of :func:`k3jax.config.resolve_config`): a ``k3jax train`` run directory, an Orbax export
    (``k3jax.json``) or a release / Kimi Linear checkpoint directory (safetensors); else a preset (random weights,
    ``seed``); else :class:`~k3jax.config.ConfigError` listing the presets. ``vision=True``: the multimodal
    model of a release checkpoint with a ``vision_config`` (:class:`~k3jax.vision.model.K3ForConditionalGeneration`)."""
    p = Path(spec)
    if vision and not (p.is_dir() and any(p.glob("*.safetensors"))):
        raise ModelLoadError(f"{spec}: images need a release checkpoint directory (safetensors with vision_tower.* "
                             f"and a vision_config in config.json)")
    if not p.exists():
        cfg = resolve_config(spec)
        if dtype:
            cfg = cfg.replace(dtype=dtype)
        return K3ForCausalLM(cfg, rngs=nnx.Rngs(seed)), load_tokenizer(None), f"preset {spec} (random weights)"
    if not p.is_dir():
        raise ModelLoadError(f"{p}: expected a directory (training run, Orbax export or release checkpoint)")
    if (p / "train_config.json").exists():
        model = load_training_run(p, dtype=dtype)
        tok_spec = json.loads((p / "train_config.json").read_text()).get("tokenizer", "bytes")
        return model, load_tokenizer(tok_spec), f"training run {p}"
    if (p / "k3jax.json").exists():
        return load_orbax(p, dtype=dtype), _dir_tokenizer(p), f"Orbax export {p}"
    if any(p.glob("*.safetensors")):
        from k3jax.io.hf import load_pretrained

        return load_pretrained(p, dtype=dtype, vision=vision), _dir_tokenizer(p), f"release checkpoint {p}"
    raise ModelLoadError(f"{p}: not a k3jax training run (train_config.json), an Orbax export (k3jax.json) or a "
                         f"checkpoint directory (*.safetensors)")


def _dir_tokenizer(p: Path):
    if (p / "tiktoken.model").exists() or (p / "tokenizer.json").exists():
        return load_tokenizer(p)
    return load_tokenizer(None)


__all__ = ["load_model", "load_training_run", "ModelLoadError", "ConfigError"]
