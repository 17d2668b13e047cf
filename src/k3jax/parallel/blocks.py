"""Explicit reshards between a parameter's layout and a *whole-block* layout (Per-Head Muon under FSDP/TP).

Newton–Schulz needs whole matrices, or at least whole Gram matrices. With Per-Head Muon the unit is one head's (or
one expert's) block, so instead of gathering a parameter on every device, its heads/experts axis (the *block* axis)
is split over the devices; a mesh axis that cannot split the block axis any further splits one dimension of the
matrix's larger side (the *column* axis) instead: Newton–Schulz's Gram matrix ``X Xᵀ`` (over the smaller side) is
then a sum of per-device partial products, one ``psum`` of a small matrix per iteration, and every other product
is local. A single matrix (no block axis) is split along its columns alone.

XLA's partitioner does not always find that reshard by itself (it falls back to gathering the whole array and
slicing), so :func:`to_blocks_local` / :func:`from_blocks_local` spell it out, one collective per mesh axis that moves:

* an axis that splits another dimension in the parameter's layout → one ``all_to_all`` moving the split to the
  block (or column) axis: each device sends away what it will not own and receives the rest of what it will;
* an axis that splits a dimension but divides neither the block nor the column axis → an ``all_gather`` of that
  dimension over that axis only (never the whole parameter).

An axis the parameter is replicated over moves nothing: its devices compute the same blocks, as data-parallel
replicas compute the same update.

``from_blocks_local`` runs the inverse steps in reverse order.
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
    """How one array moves between ``home`` (its layout) and ``block`` (``target`` — the block axis — and ``cols``
    split over the mesh, every other dimension whole). ``steps``: ``(kind, mesh axis, from dim, to dim)`` with kind
    ``"a2a"`` or ``"gather"`` (to None). ``gram_axes``: the mesh axes splitting ``cols``
    (a Gram matrix over the other side is a ``psum`` over them). Hashable: it is static under jit."""
    mesh: Mesh
    shape: tuple[int, ...]
    home: P
    block: P
    target: int | None
    cols: int | None
    steps: tuple[tuple[str, str, int | None, int | None], ...]

    @property
    def gram_axes(self) -> tuple[str, ...]:
        return _axes(tuple(self.block)[self.cols]) if self.cols is not None else ()


def block_plan(shape: tuple[int, ...], home: P, target: int | None, mesh: Mesh, cols: int | None = None,
               candidates: tuple[str, ...] = CANDIDATES) -> BlockPlan:
    """The plan for an array of ``shape`` laid out as ``home``: the mesh axes that split it move to dimension
    ``target`` (those already splitting it first, then ``candidates`` in order) as long as they divide it, the rest
    to dimension ``cols``; every other dimension whole. ``target=cols=None``: nothing split (every device holds the
    whole array — the naive gather)."""
    home_t = tuple(home) + (None,) * (len(shape) - len(tuple(home)))
    where = {a: d for d, e in enumerate(home_t) for a in _axes(e)}
    dests = [t for t in (target, cols) if t is not None]
    placed = {t: list(_axes(home_t[t])) for t in dests}
    steps = []
    for a in candidates:
        # an axis the array is replicated over stays so: its devices orthogonalise the same blocks, as data-parallel
        # replicas compute the same update (splitting the work would need an all-gather of the result after it)
        if a not in where or where[a] in dests:
            continue
        n = mesh.shape[a]
        for t in dests:
            if shape[t] % (math.prod(mesh.shape[b] for b in placed[t]) * n) == 0:
                placed[t].append(a)
                steps.append(("a2a", a, where[a], t))
                break
        else:
            steps.append(("gather", a, where[a], None))
    block = [None] * len(shape)
    for t in dests:
        if placed[t]:
            block[t] = tuple(placed[t]) if len(placed[t]) > 1 else placed[t][0]
    return BlockPlan(mesh, tuple(shape), P(*home_t), P(*block), target, cols, tuple(steps))


def _slice(x: jax.Array, axis: str, dim: int) -> jax.Array:
    n = jax.lax.axis_size(axis)
    size = x.shape[dim] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, axis=dim)


def to_blocks_local(x: jax.Array, plan: BlockPlan) -> jax.Array:
    """Inside ``shard_map``: this device's ``plan.home`` shard → its ``plan.block`` shard."""
    for kind, a, src, dst in plan.steps:
        if kind == "a2a":
            x = jax.lax.all_to_all(x, a, dst, src, tiled=True)
        else:
            x = jax.lax.all_gather(x, a, axis=src, tiled=True)
    return x


def from_blocks_local(x: jax.Array, plan: BlockPlan) -> jax.Array:
    """Inside ``shard_map``: the inverse of :func:`to_blocks_local`."""
    for kind, a, src, dst in reversed(plan.steps):
        if kind == "a2a":
            x = jax.lax.all_to_all(x, a, src, dst, tiled=True)
        else:
            x = _slice(x, a, src)
    return x


def apply_in_blocks(fn, x: jax.Array, plan: BlockPlan) -> jax.Array:
    """``fn`` applied to ``x`` in its block layout, in one ``shard_map`` from ``plan.home`` to ``plan.home``:
    ``fn(local block shard)`` runs per device and may ``psum`` over ``plan.gram_axes``."""
    def local(x):
        return from_blocks_local(fn(to_blocks_local(x, plan)), plan)

    return jax.shard_map(local, mesh=plan.mesh, in_specs=plan.home, out_specs=plan.home, check_vma=False)(x)
