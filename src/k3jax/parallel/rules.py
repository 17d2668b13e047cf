"""Sharding rules: parameter path + shape → ``NamedSharding`` on a mesh.

Current rules: routed experts (stacked on a leading expert axis) are split over the mesh's ``expert`` axis when it
divides the expert count; everything else is replicated. Data/fsdp/tensor rules arrive with expert parallelism.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def param_sharding(path: tuple, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> NamedSharding:
    """The ``NamedSharding`` of the parameter at ``path`` (a tuple of NNX path entries) with ``shape``."""
    if "experts" in path and "expert" in mesh.axis_names and shape and shape[0] % mesh.shape["expert"] == 0:
        return NamedSharding(mesh, P("expert", *([None] * (len(shape) - 1))))
    return NamedSharding(mesh, P())


def shard_pure(tree, mesh: jax.sharding.Mesh):
    """Place every array of a pure (nested dict) parameter tree by :func:`param_sharding` of its key path."""
    def place(path, x):
        keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        return jax.device_put(x, param_sharding(keys, tuple(x.shape), mesh))

    return jax.tree_util.tree_map_with_path(place, tree)
