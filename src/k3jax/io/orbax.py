"""The training checkpoint format: an Orbax checkpoint of the model's variables beside its ``config.json``.

Layout of a directory ``PATH``::

    PATH/config.json    the HF config (release wrapper kept), as in a safetensors checkpoint
    PATH/k3jax.json     {"format": "k3jax-orbax-1", "expert_dtype": …}
    PATH/params/        Orbax StandardCheckpointer of the NNX state (a pure dict keyed by parameter path)

Training checkpoints store their model variables under the same ``params`` layout, so :func:`load_orbax` reads
either, and ``k3jax convert`` moves between this format and the release's safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx

from k3jax.config import K3Config
from k3jax.io.safetensors import CheckpointError
from k3jax.nn.model import K3ForCausalLM

FORMAT = "k3jax-orbax-1"


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "k3jax.json").exists()


def save_orbax(model: K3ForCausalLM, path: str | Path) -> Path:
    """Write ``model`` (config + every variable, packed experts included) as an Orbax checkpoint directory."""
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (path / "config.json").write_text(json.dumps(cfg.to_release_dict(), indent=2))
    (path / "k3jax.json").write_text(json.dumps({"format": FORMAT, "expert_dtype": cfg.expert_dtype}))
    state = nnx.to_pure_dict(nnx.state(model))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", state, force=True)
    return path


def load_orbax(path: str | Path, *, dtype: str | None = None) -> K3ForCausalLM:
    """Read a directory written by :func:`save_orbax` (or a training checkpoint's model part)."""
    path = Path(path).absolute()
    meta_file = path / "k3jax.json"
    if not meta_file.exists():
        raise CheckpointError(f"{path}: no k3jax.json — not a k3jax Orbax checkpoint")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file}: format {meta.get('format')!r}, expected {FORMAT!r}")
    cfg = K3Config.from_json(path / "config.json").replace(expert_dtype=meta.get("expert_dtype"))
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    abstract = nnx.eval_shape(lambda: K3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    target = nnx.to_pure_dict(state)
    if not (path / "params").exists():
        raise CheckpointError(f"{path / 'params'}: missing (Orbax variables of the model)")
    with ocp.StandardCheckpointer() as ckptr:
        try:
            restored = ckptr.restore(path / "params", target)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"{path / 'params'}: does not match {path / 'config.json'} ({e})") from None
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
