"""Explicit reshards between a parameter's layout and a *whole-block* layout (Per-Head Muon under FSDP/TP).

Newton–Schulz needs whole matrices. With Per-Head Muon the unit is one head's (or one expert's) block, so instead
of gathering a parameter on every device, its heads/experts axis can be split over the devices while the matrix
axes are made whole: every device then holds whole blocks, spread evenly. XLA's partitioner does not always find
that reshard by itself (it falls back to gathering the whole array and slicing), so :func:`to_blocks` /
:func:`from_blocks` spell it out in ``shard_map``, one collective per mesh axis that moves:

* an axis that splits a matrix dimension in the parameter's layout → one ``all_to_all`` moving the split to the
  block axis (each device sends away the blocks it will not own and receives the rest of the ones it will);
* an axis the parameter is replicated over → a local slice of the block axis (no communication);
* an axis that splits a matrix dimension but cannot split the block axis (it does not divide it) → an
  ``all_gather`` of that dimension over that axis only.

``from_blocks`` runs the inverse steps in reverse order. Only the last kind gathers, and only one mesh axis's worth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

CANDIDATES = ("expert", "fsdp", "tensor", "data", "context")


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclass(frozen=True)
class BlockPlan:
    """How one array moves between ``home`` (its layout) and ``block`` (``target`` split over the mesh, the other
    dimensions whole): ``steps`` of ``(kind, mesh axis, other dimension)`` with kind ``"a2a"``, ``"slice"`` or
    ``"gather"``. Hashable: it is static under jit."""
    mesh: Mesh
    shape: tuple[int, ...]
    home: P
    block: P
    target: int | None
    steps: tuple[tuple[str, str, int], ...]


def block_plan(shape: tuple[int, ...], home: P, target: int | None, mesh: Mesh,
               candidates: tuple[str, ...] = CANDIDATES) -> BlockPlan:
    """The plan for an array of ``shape`` laid out as ``home``: dimension ``target`` split over as many mesh axes as
    divide it (those already splitting it first, then ``candidates`` in order), every other dimension whole.
    ``target=None``: no dimension split (every device holds the whole array — the naive gather)."""
    home_t = tuple(home) + (None,) * (len(shape) - len(tuple(home)))
    where = {a: d for d, e in enumerate(home_t) for a in _axes(e)}
    steps, chosen = [], list(_axes(home_t[target])) if target is not None else []
    if target is not None:
        split = math.prod(mesh.shape[a] for a in chosen)
        for a in candidates:
            if a not in mesh.axis_names or mesh.shape[a] == 1 or a in chosen:
                continue
            if shape[target] % (split * mesh.shape[a]):
                continue
            chosen.append(a)
            split *= mesh.shape[a]
            steps.append(("a2a", a, where[a]) if a in where else ("slice", a, target))
    for a, d in where.items():
        if d != target and a not in chosen:
            steps.append(("gather", a, d))
    block = [None] * len(shape)
    if target is not None and chosen:
        block[target] = tuple(chosen)
    return BlockPlan(mesh, tuple(shape), P(*home_t), P(*block), target, tuple(steps))


def _slice(x: jax.Array, axis: str, dim: int) -> jax.Array:
    n = jax.lax.axis_size(axis)
    size = x.shape[dim] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, axis=dim)


def to_blocks(x: jax.Array, plan: BlockPlan) -> jax.Array:
    """``x`` (laid out as ``plan.home``) → the same values laid out as ``plan.block``."""
    def local(x):
        for kind, a, d in plan.steps:
            if kind == "a2a":
                x = jax.lax.all_to_all(x, a, plan.target, d, tiled=True)
            elif kind == "slice":
                x = _slice(x, a, plan.target)
            else:
                x = jax.lax.all_gather(x, a, axis=d, tiled=True)
        return x

    return jax.shard_map(local, mesh=plan.mesh, in_specs=plan.home, out_specs=plan.block, check_vma=False)(x)


def from_blocks(x: jax.Array, plan: BlockPlan) -> jax.Array:
    """The inverse of :func:`to_blocks`: ``plan.block`` → ``plan.home``."""
    def local(x):
        for kind, a, d in reversed(plan.steps):
            if kind == "a2a":
                x = jax.lax.all_to_all(x, a, d, plan.target, tiled=True)
            elif kind == "slice":
                x = jax.lax.all_gather(x, a, axis=plan.target, tiled=True)
            else:
                x = _slice(x, a, d)
        return x

    return jax.shard_map(local, mesh=plan.mesh, in_specs=plan.block, out_specs=plan.home, check_vma=False)(x)
