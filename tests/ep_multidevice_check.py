"""Run under 8 simulated CPU devices (set by the caller): expert-parallel MoE == single-device dropless MoE.

Prints one JSON line: worst relative errors of outputs and gradients per (mesh, method, routing), and stats."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from k3jax.ops.grouped import moe_grouped  # noqa: E402
from k3jax.parallel.ep import moe_expert_parallel  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def act(g, u):
    return jax.nn.silu(g) * u


def routing(kind, N, E, K, R, rng):
    m = E // R
    logit = rng.normal(size=(N, E))
    if kind == "one_expert":
        logit[:, 0] += 100
    elif kind == "one_rank":
        logit[:, :m] += 100
    elif kind == "zipf":
        logit += np.log(1.0 / np.arange(1, E + 1) ** 1.5)[None, :] * 3
    elif kind == "balanced":
        return np.stack([(np.arange(K) + i * K) % E for i in range(N)])
    return np.argsort(-logit, 1)[:, :K]


def rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


def main():
    rng = np.random.default_rng(0)
    N, D, I, E, K = 256, 16, 8, 32, 4
    out = {"devices": jax.device_count(), "cases": []}
    z = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    w = jnp.asarray(rng.random((N, K)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in [(E, D, I), (E, D, I), (E, I, D)]]
    meshes = {"expert=8": jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,)),
              "data=2,expert=4": jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)}
    # The routing is an argument of every jitted function, not a constant folded into it: one compile per
    # (mesh, method) serves all five routings (as in training, where idx is computed at run time), instead of a
    # forward and a gradient compile per routing case (40 compiles → 8, most of this check's time on CPU).
    def ref_loss(z, w, w1, w3, w2, idx):
        return jnp.sum(jnp.sin(moe_grouped(z, idx, w, w1, w3, w2, act)))

    ref_fwd = jax.jit(lambda z, w, w1, w3, w2, idx: moe_grouped(z, idx, w, w1, w3, w2, act))
    ref_grad = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2, 3, 4)))
    eps = {}
    for mname, mesh in meshes.items():
        for method in ["moonep", "dropless"]:
            def ep(z, w, w1, w3, w2, idx, mesh=mesh, method=method):
                return moe_expert_parallel(z, idx, w, w1, w3, w2, act, mesh=mesh, method=method,
                                           with_stats=True)

            eps[mname, method] = (jax.jit(ep), jax.jit(jax.grad(lambda *a, ep=ep: jnp.sum(jnp.sin(ep(*a)[0])),
                                                               argnums=(0, 1, 2, 3, 4))))
    for kind in ["random", "one_expert", "one_rank", "zipf", "balanced"]:
        idx = jnp.asarray(routing(kind, N, E, K, 8, rng), jnp.int32)
        ref_y = ref_fwd(z, w, *ws, idx)
        ref_g = ref_grad(z, w, *ws, idx)
        for (mname, method), (fwd, grad) in eps.items():
            y, st = fwd(z, w, *ws, idx)
            g = grad(z, w, *ws, idx)
            out["cases"].append({"routing": kind, "mesh": mname, "method": method, "y_rel": rel(y, ref_y),
                                 "grad_rel": max(rel(a, b) for a, b in zip(g, ref_g)),
                                 "recv_rows": np.asarray(st["recv_rows"]).tolist(),
                                 "fetched": np.asarray(st["fetched_experts"]).tolist(),
                                 "fills": np.asarray(st["fills"]).tolist()})
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
