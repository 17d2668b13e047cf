"""The device mesh: named axes (stage, data, context, fsdp, expert, tensor), built from ``"data=2,expert=4"``, and
``jax.distributed`` start-up. (The expert-parallel setting is an explicit argument: :class:`k3jax.parallel.ep.ExpertParallel`.)"""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, Mesh

AXES = ("stage", "data", "context", "fsdp", "expert", "tensor")    # stage: pipeline stages (k3jax.nn.pipeline)


class MeshError(ValueError):
    """A mesh specification that cannot be built; the message names the axis."""


def parse_mesh(spec: str | dict | None) -> dict[str, int]:
    """``"data=2,expert=4"`` → ``{"stage": 1, "data": 2, "context": 1, "fsdp": 1, "expert": 4, "tensor": 1}``."""
    sizes = dict.fromkeys(AXES, 1)
    if not spec:
        return sizes
    items = spec.items() if isinstance(spec, dict) else (p.split("=", 1) for p in str(spec).split(",") if p.strip())
    for item in items:
        if len(item) != 2:
            raise MeshError(f"mesh: expected 'axis=size' pairs like 'data=2,expert=4', got {spec!r}")
        name, val = item[0].strip(), str(item[1]).strip()
        if name not in AXES:
            raise MeshError(f"mesh: unknown axis {name!r}; axes are {', '.join(AXES)}")
        if not val.isdigit() or int(val) < 1:
            raise MeshError(f"mesh: axis {name}: expected a positive integer size, got {val!r}")
        sizes[name] = int(val)
    return sizes


def make_mesh(spec: str | dict | None, devices=None) -> Mesh:
    """A mesh over all (or the given) devices with the six named axes (``context`` splits sequences along time:
    :mod:`k3jax.parallel.context`); their product must equal the device count."""
    sizes = parse_mesh(spec)
    devices = list(devices if devices is not None else jax.devices())
    n = math.prod(sizes.values())
    if n != len(devices):
        raise MeshError(f"mesh {spec!r}: {n} devices requested ({'×'.join(str(sizes[a]) for a in AXES)} for "
                        f"{', '.join(AXES)}), {len(devices)} available")
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices)


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """Join a multi-process run through ``jax.distributed.initialize`` (no launcher of our own). On CPU the
    cross-process collectives use gloo. With no arguments JAX reads the cluster environment (SLURM, TPU pods …)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU devices only; GPUs/TPUs use their own
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def inner_mesh(mesh: Mesh):
    """The mesh a ``shard_map`` over ``mesh`` must name where it is traced: inside another ``shard_map`` over some
    of the same axes (a pipeline stage, :mod:`k3jax.nn.pipeline`, is manual over ``stage``), JAX's context
    mesh — the same axes with those manual — else ``mesh``."""
    am = jax.sharding.get_abstract_mesh()
    if not am.empty and am.axis_names == mesh.axis_names and am.axis_sizes == mesh.axis_sizes:
        return am
    return mesh
