"""Sharding rules: a parameter's logical axes (metadata set where it is created, ``var.axes``) → mesh axes.

Layers never name mesh axes. Each variable carries one logical name (or None) per dimension; ``LOGICAL_TO_MESH``
maps names to mesh axes (``data, fsdp, expert, tensor``); names not in the table (``q_lora``, ``kv_lora``,
``gate_rank``, ``router``, …) and None stay unsplit, as does any dimension the mesh axis does not divide.
Activations: the batch axis is split over ``data`` (and ``fsdp``); inside the MoE the token axis is split over
every data-like axis plus ``expert`` (``k3jax.parallel.ep``); XLA propagates the rest.

=====================  =========  ==========================================================================
logical axis           mesh axis  where
=====================  =========  ==========================================================================
``experts``            expert     routed experts ``[E, …]``
``vocab``              tensor     embedding rows, lm_head columns
``heads``              tensor     attention heads (q/k/v/g/o, kv_b, q_b, conv channels, A_log, dt_bias)
``mlp``, ``latent``    tensor     dense / shared-expert intermediate; the LatentMoE latent width
``embed``              fsdp       the hidden size as a matrix dimension
``layers``             stage      the stacked run of layers ``[repeats, …]`` (:mod:`k3jax.nn.scan`): under
                                  pipeline parallelism each stage holds its own layers (when the stages divide
                                  the run evenly; otherwise the stacks stay whole on every stage)
=====================  =========  ==========================================================================
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LOGICAL_TO_MESH = {"experts": "expert", "vocab": "tensor", "heads": "tensor", "mlp": "tensor", "latent": "tensor",
                   "embed": "fsdp", "layers": "stage", "batch": ("data", "fsdp")}


def variable_axes(var: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axes a variable was created with (all None for a variable without them)."""
    axes = getattr(var, "axes", None)
    ndim = len(var.shape)
    if axes is None:
        return (None,) * ndim
    if len(axes) != ndim:
        raise ValueError(f"logical axes {axes} do not match the variable's shape {tuple(var.shape)}")
    return tuple(axes)


def metadata_tree(state: nnx.State, fn) -> dict:
    """``fn(variable)`` for every variable of ``state``, nested like ``nnx.to_pure_dict(state)``."""
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = fn(var)
    return out


def axes_tree(state: nnx.State) -> dict:
    """Logical axes of every variable of ``state`` (a pure dict of tuples, like ``nnx.to_pure_dict``)."""
    return metadata_tree(state, variable_axes)


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    out = []
    for a, dim in zip(axes, shape):
        m = LOGICAL_TO_MESH.get(a) if a else None
        if isinstance(m, str) and m in mesh.axis_names and mesh.shape[m] > 1 and dim % mesh.shape[m] == 0:
            out.append(m)
        else:
            out.append(None)
    return P(*out)


def named_sharding(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> NamedSharding:
    """The ``NamedSharding`` of an array with logical ``axes`` and ``shape``."""
    return NamedSharding(mesh, spec_for(axes, shape, mesh))


def batch_sharding(mesh: jax.sharding.Mesh, batch: int) -> NamedSharding:
    """Inputs ``[B, …]``: the batch axis over the data-like axes that divide it."""
    axes = tuple(a for a in LOGICAL_TO_MESH["batch"] if a in mesh.axis_names and mesh.shape[a] > 1)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return NamedSharding(mesh, P(axes if axes and batch % size == 0 else None))


def replicate_unplaced(tree, mesh: jax.sharding.Mesh):
    """Arrays of ``tree`` not already laid out on ``mesh`` (e.g. an optimizer's step counter) → replicated on it."""
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(x):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, jax.sharding.NamedSharding) and sh.mesh == mesh:
            return x
        return jax.device_put(x, rep)

    return jax.tree.map(place, tree)


def shard_pure(tree, axes: dict, mesh: jax.sharding.Mesh):
    """Place every array of a pure (nested dict) tree by its logical axes (``axes``: :func:`axes_tree` of the
    state the tree came from)."""
    return jax.tree.map(lambda x, a: jax.device_put(x, named_sharding(a, tuple(x.shape), mesh)), tree, axes,
                        is_leaf=lambda x: hasattr(x, "shape"))
