"""KDA with its heads spread over devices: every head's recurrence is independent, so each device runs
:func:`~k3jax.ops.kda_chunked.kda_chunked` on its own heads and nothing crosses between them.

On a many-core CPU this is how the chunked kernel uses the cores: XLA:CPU runs a batched matmul on one core and
independent ops one after another, so a single CPU device leaves the kernel's small per-chunk matmuls on one core
while a large GEMM uses all of them. Split the host into devices *before JAX starts*
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``, see :func:`host_device_flag`) and each device — one core's
worth of work — runs its share of the heads (measured in ``benchmarks/kda.py``, rows ``heads over N host devices``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k3jax.parallel.mesh import inner_mesh
from k3jax.ops.kda_chunked import kda_chunked
from k3jax.parallel.host import host_cores, host_device_flag  # noqa: F401  (re-exported: split the host)


def head_mesh(num_heads: int, devices=None, axis: str = "heads") -> Mesh:
    """A one-axis mesh over the most devices (of ``devices``, default all) whose count divides ``num_heads``."""
    devices = list(jax.devices() if devices is None else devices)
    d = max(c for c in range(1, len(devices) + 1) if num_heads % c == 0)
    return Mesh(np.array(devices[:d]), (axis,))


def kda_chunked_over_heads(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                           mesh: Mesh | None = None, axis: str = "heads", *, initial_state: jax.Array | None = None,
                           output_final_state: bool = False, reset: jax.Array | None = None,
                           **kwargs) -> tuple[jax.Array, jax.Array | None]:
    """:func:`kda_chunked` with the head axis split over ``mesh``'s ``axis`` (default :func:`head_mesh` of H).

    q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, initial_state ``[B, H, K, V]``, reset
    ``[B, T]`` (every device gets all of it); returns ``(o [B, T, H, V], S [B, H, K, V] or None)`` with H split the
    same way. ``kwargs`` go to :func:`kda_chunked` (``scale`` defaults to K^-1/2 as there, so the split does not
    change it). Outputs and gradients equal the single-device kernel's: each head is computed by the same code on
    its own device. Differentiable (the kernel's recomputing VJP runs per device)."""
    if mesh is None:
        mesh = head_mesh(q.shape[2])
    if axis not in mesh.axis_names:
        raise ValueError(f"kda_chunked_over_heads: mesh has axes {mesh.axis_names}, no {axis!r}")
    H, d = q.shape[2], mesh.shape[axis]
    if H % d:
        raise ValueError(f"kda_chunked_over_heads: {H} heads do not split over {d} devices of mesh axis {axis!r}")
    h4, h3, rep = P(None, None, axis, None), P(None, None, axis), P()
    sh = P(None, axis, None, None)

    def local(q, k, v, g, beta, s0, r):
        o, s = kda_chunked(q, k, v, g, beta, initial_state=s0, output_final_state=output_final_state, reset=r,
                           **kwargs)
        return o, s

    in_specs = (h4, h4, h4, h4, h3, None if initial_state is None else sh, None if reset is None else rep)
    # check_vma=False: the kernel's custom VJP and scans carry no varying-axis annotations, and nothing inside
    # communicates, so there is nothing for the check to find.
    f = jax.shard_map(local, mesh=inner_mesh(mesh), in_specs=in_specs, out_specs=(h4, sh if output_final_state else None),
                      check_vma=False)
    return f(q, k, v, g, beta, initial_state, reset)
