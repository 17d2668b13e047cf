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
    elif kind == "hot7":           # seven hot experts: on data=2,expert=4 one rank's slots need the FFN's tiles
        logit[:, :7] += 2.0
    elif kind == "balanced":
        return np.stack([(np.arange(K) + i * K) % E for i in range(N)])
    elif kind == "one_fill":       # balanced, then 8 pairs of the last rank's experts moved to expert 0 (rank 0):
        idx = np.stack([(np.arange(K) + i * K) % E for i in range(N)])   # one redundant expert, one row sent
        hit = np.argwhere(idx == E - 1)[:8]
        idx[hit[:, 0], hit[:, 1]] = 0
        return idx
    return np.argsort(-logit, 1)[:, :K]


def _plan(idx, R, E):
    """The numpy plan of the routing ``idx [N, K]`` over R expert ranks (the token split is by rank, in order)."""
    from k3jax.parallel.moonep import plan_numpy
    per = idx.reshape(R, -1)          # on data=2,expert=4 each expert group plans half the tokens: R ranks of it
    counts = np.stack([np.bincount(r, minlength=E) for r in per])
    return counts, plan_numpy(counts)


def max_pair_rows(idx, R, E):
    """Per device: the most pairs one source of its expert group sends one destination under the plan (numpy)."""
    from k3jax.parallel.moonep import pair_counts
    out = []
    for g in idx.reshape(8 // R, -1, idx.shape[1]):
        counts, p = _plan(g, R, E)
        out += [int(np.asarray(pair_counts(counts, p.alloc)).max())] * R
    return out


def slot_sizes(idx, R, E):
    """Per expert group, per rank: the rows of its home and first ⌈m/8⌉ redundant slots (numpy plan)."""
    from k3jax.parallel.moonep import slots_from_alloc
    m = E // R
    F0 = max(1, -(-m // 8))
    out = []
    for g in idx.reshape(8 // R, -1, idx.shape[1]):
        _, sizes, _ = slots_from_alloc(_plan(g, R, E)[1].alloc)
        out += np.asarray(sizes)[:, :m + F0].tolist()
    return out


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
    # (mesh, method) serves all seven routings (as in training, where idx is computed at run time), instead of a
    # forward and a gradient compile per routing case (40 compiles → 8, most of this check's time on CPU).
    def ref_loss(z, w, w1, w3, w2, idx):
        return jnp.sum(jnp.sin(moe_grouped(z, idx, w, w1, w3, w2, act)))

    ref_fwd = jax.jit(lambda z, w, w1, w3, w2, idx: moe_grouped(z, idx, w, w1, w3, w2, act))
    ref_grad = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2, 3, 4)))
    eps = {}
    # "moonep/gather": MoonEP over the gather exchange, whose redundant-weight fetch is the all_gather one (the
    # default exchanges fetch by two hops); on one mesh, to keep the compiles few
    for mname, method in [(mname, method) for mname in meshes for method in ["moonep", "dropless"]] + [
            ("expert=8", "moonep/gather")]:
        mesh = meshes[mname]

        def ep(z, w, w1, w3, w2, idx, mesh=mesh, method=method):
            name, _, exchange = method.partition("/")
            return moe_expert_parallel(z, idx, w, w1, w3, w2, act, mesh=mesh, method=name,
                                       exchange=exchange or "auto", with_stats=True)

        eps[mname, method] = (jax.jit(ep), jax.jit(jax.grad(lambda *a, ep=ep: jnp.sum(jnp.sin(ep(*a)[0])),
                                                           argnums=(0, 1, 2, 3, 4))))
    for kind in ["random", "one_expert", "one_rank", "zipf", "balanced", "one_fill", "hot7"]:
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
                                 "fills": np.asarray(st["fills"]).tolist(),
                                 "fetch_slots": np.asarray(st["fetch_slots"]).tolist(),
                                 "fetch_rows": np.asarray(st["fetch_rows"]).tolist(),
                                 "box_rows": np.asarray(st["box_rows"]).tolist(),
                                 "tile_rows": np.asarray(st["tile_rows"]).tolist(),
                                 "tiles": np.asarray(st["tiles"]).tolist(),
                                 "chunk_rows": np.asarray(st["chunk_rows"]).tolist(),
                                 "max_pair_rows": max_pair_rows(np.asarray(idx), 8 if mname == "expert=8" else 4, E),
                                 "slot_sizes": slot_sizes(np.asarray(idx), 8 if mname == "expert=8" else 4, E),
                                 "overflow": np.asarray(st["overflow"]).tolist()})
    out["two_hop"] = two_hop_cases(rng)
    print(json.dumps(out))


def two_hop_cases(rng):
    """The two-hop exchange (values, its transpose, gradients) against a numpy ragged exchange built from T alone,
    for count matrices that stress its chunk bounds; and the overflow count when a bound is violated on purpose."""
    from functools import partial

    from jax.sharding import PartitionSpec as P

    from k3jax.parallel.exchange import two_hop_exchange, two_hop_return, two_hop_route

    R, M_in, M_out = 8, 37, 41
    mesh = jax.make_mesh((R,), ("x",), axis_types=(AxisType.Auto,))
    Ts = {"random": None, "all_to_one": np.zeros((R, R), int), "one_to_all": np.zeros((R, R), int),
          "single_source": np.zeros((R, R), int), "empty": np.zeros((R, R), int)}
    Ts["all_to_one"][:, 3] = 5                                  # 40 rows into one rank
    Ts["one_to_all"][2, :] = [5, 4, 4, 4, 5, 5, 5, 5]           # one source fills 37 rows
    Ts["single_source"][np.arange(R), (np.arange(R) + 3) % R] = M_in    # each destination filled by one source
    while Ts["random"] is None or (Ts["random"].sum(1) > M_in).any() or (Ts["random"].sum(0) > M_out).any():
        Ts["random"] = rng.integers(0, 12, size=(R, R))
    cases = {}
    fns = {}

    def run(T, c2):
        if c2 not in fns:                       # T is an argument: one compile per chunk size serves every case
            def body(T, x, c):
                rt = two_hop_route(T, jax.lax.axis_index("x"), M_in, M_out, c2)
                y, vjp = jax.vjp(lambda x: two_hop_exchange(x, rt, "x", R), x[0])
                back = two_hop_return(c[0], rt, "x", R, M_in)
                return y[None], vjp(c[0])[0][None], back[None], rt.overflow[None]

            fns[c2] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x"), P("x")),
                                            out_specs=(P("x"),) * 4, check_vma=False))
        f = partial(fns[c2], jnp.asarray(T, jnp.int32))
        x = rng.normal(size=(R, M_in, 2)).astype(np.float32)
        c = rng.normal(size=(R, M_out, 2)).astype(np.float32)
        y, g, back, ov = (np.asarray(a) for a in f(jnp.asarray(x), jnp.asarray(c)))
        exp_y, exp_g = np.zeros_like(c), np.zeros_like(x)
        in_off = np.cumsum(T, 1) - T
        for d in range(R):                                       # destination d: rows by source, in source order
            o = 0
            for s in range(R):
                rows = slice(in_off[s, d], in_off[s, d] + T[s, d])
                exp_y[d, o:o + T[s, d]] = x[s, rows]
                exp_g[s, rows] = c[d, o:o + T[s, d]]
                o += T[s, d]
        return {"y_err": float(np.abs(y - exp_y).max()), "grad_err": float(np.abs(g - exp_g).max()),
                "return_err": float(np.abs(back - exp_g).max()), "overflow": int(ov.sum())}

    for name, T in Ts.items():
        cases[name] = run(T, None)
    cases["single_source_tight_c2"] = run(Ts["single_source"], -(-M_out // R))   # the bound MoonEP's fetch uses
    # violated on purpose: all_to_one with the single-source chunk leaves rows behind, and says how many
    cases["all_to_one_tight_c2"] = run(Ts["all_to_one"], -(-M_out // R))
    return cases


if __name__ == "__main__":
    sys.exit(main())
