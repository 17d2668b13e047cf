"""Sharding rules: parameter path + shape → logical axes → ``NamedSharding`` on a mesh.

Layers never name mesh axes. A parameter's logical axes come from its path (table below); ``LOGICAL_TO_MESH`` maps
logical axes to mesh axes (``data, fsdp, expert, tensor``). An axis whose size the mesh axis does not divide stays
unsharded. Activations: the batch axis is split over ``data`` (and ``fsdp``); inside the MoE the token axis is split
over every data-like axis plus ``expert`` (``k3jax.parallel.ep``); XLA propagates the rest.

=================================  ============================  ===========================================
parameter (path contains)          shape                         logical axes
=================================  ============================  ===========================================
``experts``                        [E, …]                        (experts, …)
``embed_tokens``                   [vocab, hidden]               (vocab, embed)
``lm_head``                        [hidden, vocab]               (embed, vocab)
``o_proj``, ``down_proj``,         [heads, head_dim, hidden] /   (heads, -, embed) / (mlp, embed)
``routed_expert_up_proj``          [in, hidden]
other kernels with a heads axis    [in, heads, head_dim]         (embed, heads, -)
other 2-D kernels                  [in, out]                     (embed, mlp)
short-conv weights                 [channels, W]                 (heads, -)
vectors, gains, biases             [n]                           replicated
=================================  ============================  ===========================================
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LOGICAL_TO_MESH = {"experts": "expert", "vocab": "tensor", "heads": "tensor", "mlp": "tensor", "embed": "fsdp",
                   "batch": ("data", "fsdp")}
_OUTPUT_SIDE = ("o_proj", "down_proj", "routed_expert_up_proj")


def logical_axes(path: tuple, shape: tuple[int, ...]) -> tuple[str | None, ...]:
    """Logical axis names of the parameter at ``path`` (strings of the NNX / pure-dict path) with ``shape``."""
    names = [str(p) for p in path]
    n = len(shape)
    if n <= 1:
        return (None,) * n
    if "experts" in names:
        return ("experts",) + (None,) * (n - 1)
    if "embed_tokens" in names:
        return ("vocab", "embed")
    if "lm_head" in names:
        return ("embed", "vocab")
    if any(k.endswith("conv1d") for k in names):
        return ("heads",) + (None,) * (n - 1)
    if any(k in names for k in _OUTPUT_SIDE):
        return ("heads", None, "embed") if n == 3 else ("mlp", "embed")
    if n == 3:
        return ("embed", "heads", None)
    if n == 2:
        return ("embed", "mlp")
    return (None,) * n


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    out = []
    for a, dim in zip(axes, shape):
        m = LOGICAL_TO_MESH.get(a) if a else None
        if isinstance(m, str) and m in mesh.axis_names and mesh.shape[m] > 1 and dim % mesh.shape[m] == 0:
            out.append(m)
        else:
            out.append(None)
    return P(*out)


def param_sharding(path: tuple, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> NamedSharding:
    """The ``NamedSharding`` of the parameter at ``path`` with ``shape``."""
    return NamedSharding(mesh, spec_for(logical_axes(path, shape), shape, mesh))


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


def shard_pure(tree, mesh: jax.sharding.Mesh):
    """Place every array of a pure (nested dict) parameter tree by :func:`param_sharding` of its key path."""
    def place(path, x):
        keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        return jax.device_put(x, param_sharding(keys, tuple(x.shape), mesh))

    return jax.tree_util.tree_map_with_path(place, tree)
