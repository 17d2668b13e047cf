"""Run under 2 simulated CPU devices (set here unless the caller set a count): KDA with its heads split over the
devices (``k3jax.parallel.heads``) against the one-device kernel, the float64 NumPy recurrence of
``reference_k3_numpy`` and ``kda_recurrent``'s gradients.

Prints one JSON line of worst differences and the errors raised for bad meshes."""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
sys.path.insert(0, str(Path(__file__).parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from k3jax.ops.kda import kda_gate_lower_bound, kda_recurrent  # noqa: E402
from k3jax.ops.kda_chunked import kda_chunked  # noqa: E402
from k3jax.ops.norm import l2_norm  # noqa: E402
from k3jax.parallel.heads import head_mesh, kda_chunked_over_heads  # noqa: E402
from reference_k3_numpy import _kda_recurrence  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def inputs(rng, B, T, H, K, V):
    q = l2_norm(jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32))
    k = l2_norm(jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
    f = jnp.asarray(rng.normal(size=(B, T, H, K)) * 2, jnp.float32)
    g = kda_gate_lower_bound(f, jnp.asarray(rng.normal(size=(H, K)), jnp.float32),
                             jnp.asarray(rng.uniform(-1, 1, size=(H,)), jnp.float32), -5.0)
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32))
    return q, k, v, g, beta


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def main():
    rng = np.random.default_rng(0)
    B, T, H, K, V = 2, 100, 4, 32, 16
    q, k, v, g, beta = inputs(rng, B, T, H, K, V)
    s0 = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
    reset = jnp.asarray(rng.random((B, T)) < 0.05)
    mesh = head_mesh(H)
    out = {"devices": jax.device_count(), "mesh": dict(mesh.shape)}

    split = jax.jit(lambda q, k, v, g, beta, s0, r: kda_chunked_over_heads(
        q, k, v, g, beta, mesh, initial_state=s0, output_final_state=True, reset=r, safe_gate=True))
    o2, S2 = split(q, k, v, g, beta, s0, reset)
    # the one-device side (and every call below) jitted too: one compile each instead of op by op
    one = jax.jit(lambda q, k, v, g, beta, s0, r: kda_chunked(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, reset=r, safe_gate=True))
    o1, S1 = one(q, k, v, g, beta, s0, reset)
    out["output_split_over"] = [str(o2.sharding.spec), str(S2.sharding.spec)]
    out["vs_one_device"] = {"o": float(jnp.max(jnp.abs(o2 - o1))), "S": float(jnp.max(jnp.abs(S2 - S1)))}

    # float64 NumPy recurrence (no initial state, no resets): scale K^-1/2 on q, decay e^g
    o, _ = jax.jit(lambda q, k, v, g, beta: kda_chunked_over_heads(q, k, v, g, beta, safe_gate=True))(q, k, v, g, beta)
    ref = np.stack([_kda_recurrence(np.asarray(q[b], np.float64) * K ** -0.5, np.asarray(k[b], np.float64),
                                    np.asarray(v[b], np.float64), np.exp(np.asarray(g[b], np.float64)),
                                    np.asarray(beta[b], np.float64)) for b in range(B)])
    out["vs_numpy_float64"] = rel(o, ref)

    def loss(fn):
        return lambda q, k, v, g, beta, s0: jnp.sum(jnp.sin(fn(q, k, v, g, beta, s0)[0]))

    args = (q, k, v, g, beta, s0)
    d_split = jax.jit(jax.grad(loss(lambda *a: kda_chunked_over_heads(*a[:5], mesh, initial_state=a[5],
                                                                      safe_gate=True)), argnums=range(6)))(*args)
    d_one = jax.jit(jax.grad(loss(lambda *a: kda_chunked(*a[:5], initial_state=a[5], safe_gate=True)),
                             argnums=range(6)))(*args)
    d_rec = jax.jit(jax.grad(loss(lambda *a: kda_recurrent(*a[:5], initial_state=a[5])), argnums=range(6)))(*args)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    out["grad_vs_one_device"] = {n: float(jnp.max(jnp.abs(a - b))) for n, a, b in zip(names, d_split, d_one)}
    out["grad_vs_recurrent"] = {n: rel(a, b) for n, a, b in zip(names, d_split, d_rec)}

    errors = {}
    for name, call in {
        "heads_not_divisible": lambda: kda_chunked_over_heads(*inputs(rng, 1, 8, 3, 8, 8), Mesh(np.array(jax.devices()[:2]), ("heads",))),
        "no_such_axis": lambda: kda_chunked_over_heads(q, k, v, g, beta, mesh, axis="tensor"),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    out["head_mesh_of_3_heads"] = dict(head_mesh(3).shape)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
