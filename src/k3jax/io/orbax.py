"""k3jax's Orbax formats, and the one reader of model variables from them.

Two layouts hold a model's variables:

* an **export** directory ``PATH`` (:func:`save_orbax`, ``k3jax convert``)::

      PATH/config.json    the HF config (release wrapper kept), as in a safetensors checkpoint
      PATH/k3jax.json     {"format": "k3jax-orbax-1", "expert_dtype": …}
      PATH/params/        Orbax PyTree of the NNX state (a pure dict keyed by variable path)

* a **training checkpoint** of ``k3jax train`` (:mod:`k3jax.train.checkpoint`): ``RUN/checkpoints/<step>/state``, an
  Orbax PyTree ``(params, rest, optimizer state)`` — ``params`` the ``nnx.Param`` variables, ``rest`` the other
  model variables (router biases), both pure dicts — with the run's config in ``RUN/config.json``.

:func:`restore_model` reads the model from either (a training checkpoint's optimizer state is not read):
:func:`load_orbax` reads an export through it, :func:`k3jax.infer.load.load_training_run` a run. Underneath is
:func:`restore_tree`, the checked restore that the training resume uses as well. ``k3jax convert`` moves between the
export format and the release's safetensors.

Directories written before the model stored its periodic run of layers stacked (``model/layers/<i>`` for every
layer, :mod:`k3jax.nn.scan`) still load and resume: :func:`restore_tree` with a ``layout`` reads every model-variable
dict of the saved tree (the parameters, the router biases and each optimizer-state tree shaped like the
parameters) per layer and stacks the run's rows into today's layout.

The saved tree must match what it is read into: every variable present, none unknown, the same shapes; otherwise
:class:`~k3jax.io.safetensors.CheckpointError` names the variable and the directory. The one exception are
:data:`LEGACY_KEYS`, variables that older k3jax versions saved: where the target has no such variable, the saved
one is skipped (never read) and left out of the result, so checkpoints written before a variable was removed load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from k3jax.config import K3Config
from k3jax.io.safetensors import CheckpointError
from k3jax.nn.model import K3ForCausalLM
from k3jax.nn.scan import RunLayout, flat_dict, nested_dict

FORMAT = "k3jax-orbax-1"

# Variables that checkpoints of older k3jax versions hold and newer models may lack. ``qb_bounds``: the Quantile
# Balancing bounds ``[min b − 1, max b + 1]`` once stored per MoE layer (``model/layers/<i>/block_sparse_moe``);
# they are recomputed from the router bias.
LEGACY_KEYS = frozenset({"qb_bounds"})


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


SKIP = _Skip()
"""A :func:`restore_tree` target subtree: whatever the checkpoint holds there is neither checked nor read."""


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
    """Read an export directory written by :func:`save_orbax` (``dtype`` overrides the config's compute dtype)."""
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
    return restore_model(cfg, path / "params", against=str(path / "config.json"))


def restore_model(cfg: K3Config, item_dir: str | Path, *, training_state: bool = False,
                  against: str | None = None) -> K3ForCausalLM:
    """The model of ``cfg`` with its variables read from the Orbax PyTree at ``item_dir``, on the default device.

    ``item_dir`` is an export's ``params`` (the pure dict of every model variable) or, with ``training_state``, a
    training checkpoint's ``state`` (``(params, rest, optimizer state)``; the optimizer state is not read). Arrays
    are read as the model's dtypes (so a compute-dtype override casts). ``against`` names the config in errors.
    """
    abstract = nnx.eval_shape(lambda: K3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target_of(state):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            nnx.to_pure_dict(state))

    if training_state:
        graphdef, *states = nnx.split(abstract, nnx.Param, ...)
        target: Any = (target_of(states[0]), target_of(states[1]), SKIP)
    else:
        graphdef, *states = nnx.split(abstract)
        target = target_of(states[0])
    restored = restore_tree(item_dir, target, against=f"the model of {against}" if against else "the model",
                            layout=RunLayout(abstract.model.scan_plan))
    for state, pure in zip(states, restored[:2] if training_state else (restored,)):
        nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, *states)


def saved_tree(item_dir: str | Path) -> Any:
    """The tree an Orbax PyTree directory holds, as metadata (leaves carry ``shape`` and ``dtype``)."""
    item_dir = Path(item_dir).absolute()
    if not item_dir.is_dir():
        raise CheckpointError(f"{item_dir}: missing (expected an Orbax checkpoint directory)")
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            meta = ckptr.metadata(item_dir)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{item_dir}: not a readable Orbax checkpoint ({e})") from None
    meta = getattr(meta, "item_metadata", meta)
    return getattr(meta, "tree", meta)


def restore_tree(item_dir: str | Path, target: Any, *, against: str | None = None,
                 layout: RunLayout | None = None) -> Any:
    """Read the Orbax PyTree at ``item_dir`` into the structure of ``target``, checked against what was saved.

    ``target``'s leaves are arrays (restored with their sharding and dtype) or ``jax.ShapeDtypeStruct`` (restored
    as ``jax.Array`` on their sharding, or as NumPy arrays without one); a subtree may be :data:`SKIP`. Nested
    dicts, lists and tuples are compared key by key: a variable missing from the checkpoint, one the target does
    not have, or a shape that differs raises :class:`CheckpointError` naming each and ``item_dir`` — except saved
    :data:`LEGACY_KEYS` absent from the target, which are skipped and are not in the result. Other nodes (e.g. an
    optimizer state) are checked by Orbax, whose mismatch errors are raised as :class:`CheckpointError` too.
    ``layout`` (the model's :class:`~k3jax.nn.scan.RunLayout`): a tree saved with the run of layers per layer is
    read per layer and stacked (each stack placed as its target leaf is).
    """
    item_dir = Path(item_dir).absolute()
    saved = saved_tree(item_dir)
    if layout is not None and layout.plan is not None and _per_layer(saved, layout.plan.start):
        old = _map_models(target, lambda t: nested_dict(layout.unstack(flat_dict(t))))
        out = restore_tree(item_dir, old, against=against)
        return _map_models(target, lambda t, o: _restacked(layout, t, o), out)
    problems: list[str] = []
    dropped: list[tuple] = []
    item = _restore_item(saved, target, (), problems, dropped)
    if problems:
        shown = "; ".join(problems[:12]) + (f"; … {len(problems) - 12} more" if len(problems) > 12 else "")
        raise CheckpointError(f"{item_dir}: does not match {against or 'the target'}: {shown}")
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            out = ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item)))
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise CheckpointError(f"{item_dir}: does not match {against or 'the target'} ({e})") from None
    for path in dropped:
        node = out
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    return out


def _is_models(tree: Any) -> bool:
    """Whether ``tree`` is a dict of model variables (``{"model": {"layers": …}, …}``, a vision model's
    ``language_model`` too)."""
    if not isinstance(tree, dict):
        return False
    node = tree.get("language_model", tree)
    return isinstance(node, dict) and isinstance(node.get("model"), dict) and (
        "layers" in node["model"] or "run" in node["model"])


def _per_layer(saved: Any, start: int) -> bool:
    """Whether a saved tree holds the run's first layer per layer (``model/layers/<start>``, no ``model/run``)."""
    if _is_models(saved):
        node = saved.get("language_model", saved)["model"]
        return "run" not in node and str(start) in {str(k) for k in node.get("layers", ())}
    items = saved.values() if isinstance(saved, dict) else saved if isinstance(saved, (list, tuple)) else ()
    return any(_per_layer(v, start) for v in items)


def _map_models(tree: Any, fn, other: Any = None) -> Any:
    """``tree`` with every model-variable dict ``d`` replaced by ``fn(d)``; with ``other`` (a tree of the same
    structure outside the model dicts): ``fn(d, o)`` with ``other``'s node at the same place, and ``other``'s
    leaves elsewhere."""
    call = (lambda d, o: fn(d)) if other is None else fn
    if _is_models(tree):
        return call(tree, other)
    if isinstance(tree, dict):
        return {k: _map_models(v, fn, None if other is None else other[k]) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_map_models(v, fn, None if other is None else other[i]) for i, v in enumerate(tree)]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree if other is None else other


def _restacked(layout: RunLayout, target: dict, per_layer: dict) -> dict:
    """A restored per-layer dict in the target's stacked layout, each stack placed as its target leaf is."""
    want = flat_dict(target)
    out = {}
    for path, a in layout.stack(flat_dict(per_layer)).items():
        sharding = getattr(want[path], "sharding", None)
        out[path] = jax.device_put(a, sharding) if sharding is not None and hasattr(a, "shape") else a
    return nested_dict(out)


def _name(path: tuple) -> str:
    return "/".join(str(k) for k in path) or "(root)"


def _describe(m: Any) -> str:
    shape = getattr(m, "shape", None)
    if shape is not None:
        return f"shape {list(shape)}"
    return type(m).__name__ if not isinstance(m, (dict, list, tuple)) else f"a {type(m).__name__} of {len(m)}"


def _skipped(saved: Any) -> Any:
    """``saved``'s structure with every leaf a placeholder (Orbax leaves those unread)."""
    if isinstance(saved, dict):
        return {k: _skipped(v) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        return type(saved)(_skipped(v) for v in saved)
    return saved if saved is None else ocp.PLACEHOLDER


def _restore_item(saved: Any, target: Any, path: tuple, problems: list[str], dropped: list[tuple]) -> Any:
    """The restore item for ``target``: its own leaves where the checkpoint has them, placeholders for skipped
    saved subtrees (``SKIP``, legacy keys); every other difference goes to ``problems``."""
    if target is SKIP:
        return _skipped(saved)
    if isinstance(target, dict):
        if not isinstance(saved, dict):
            problems.append(f"{_name(path)}: saved {_describe(saved)}, expected a mapping")
            return target
        saved_keys = {str(k): k for k in saved}
        target_keys = {str(k) for k in target}
        out = {}
        for k, t in target.items():
            if str(k) not in saved_keys:
                problems.append(f"missing {_name(path + (k,))}" + (f" ({_describe(t)})" if hasattr(t, "shape") else ""))
                continue
            out[k] = _restore_item(saved[saved_keys[str(k)]], t, path + (k,), problems, dropped)
        for sk, s in saved.items():
            if str(sk) in target_keys:
                continue
            if str(sk) in LEGACY_KEYS:
                out[sk] = _skipped(s)
                dropped.append(path + (sk,))
            else:
                problems.append(f"unknown {_name(path + (sk,))} ({_describe(s)})")
        return out
    if type(target) in (list, tuple):                    # not namedtuples: those are Orbax's to compare
        if not isinstance(saved, (list, tuple)) or len(saved) != len(target):
            problems.append(f"{_name(path)}: saved {_describe(saved)}, expected a sequence of {len(target)}")
            return target
        return type(target)(_restore_item(s, t, path + (i,), problems, dropped)
                            for i, (s, t) in enumerate(zip(saved, target)))
    if hasattr(target, "shape") and hasattr(target, "dtype"):
        shape = getattr(saved, "shape", None)
        if shape is None:
            problems.append(f"{_name(path)}: saved {_describe(saved)}, expected an array of shape {list(target.shape)}")
        elif tuple(shape) != tuple(target.shape):
            problems.append(f"{_name(path)}: saved shape {list(shape)}, expected {list(target.shape)}")
    return target
