"""MoonEP vs the dropless worst-case exchange vs a 1.25 capacity factor; planner speed; weight traffic.

    .venv/bin/python -m benchmarks.moonep [--S 256 --E 896 --K 16 --D 64 --I 32] [--json out.json]

Runs on R=8 simulated CPU devices (``--xla_force_host_platform_device_count=8`` is set here) with E=896 experts,
top-16, a reduced width (``--D`` latent, ``--I`` expert hidden), S tokens per rank. Per routing family (uniform,
Zipf 1.0 / 1.5 over experts, hot rank — a third of the mass on rank 0's experts): receive-buffer rows and bytes
per rank, MoE forward+backward step time (median of ``--reps`` after warm-up; tokens, routing and weights placed on
the mesh beforehand, as a training step holds them), drop rate, planner fills and
fetched redundant experts. Planner-only at R=64: jitted time per plan and the largest number of redundant experts
on one rank; fetches compared with a chain that always takes from the most overloaded donor (the reference's rule).
The exchange on CPU (see ``k3jax.parallel.ep``): row ``moonep`` uses the default ``one_hop`` exchange (one static
all_to_all of an [R, c] box, c the smallest of 1.25×, 1.5×, 2× S·K/R that holds the plan's largest
(source, destination) count, else the two-hop exchange; the redundant-weight fetch always two-hop);
``moonep_two_hop_exchange`` the previous default (two static all_to_all through an intermediate rank, ≈ 2·S·K rows
per rank); ``moonep_gather_exchange`` (one all_gather of the send rows and of every home's expert weights) and
``moonep_dense_exchange`` the box all_to_all — both receive R·S·K rows transiently. The MoonEP buffer reported is
what the plan and the grouped matmul use (= a ragged exchange's buffer on GPU/TPU). Every method of a routing is
compiled first, then timed in interleaved rounds (each median under the same load), each timed call right
after an untimed call of the same method (so no method is timed in the aftermath of another's buffers). ``chunk_rows``: the one-hop
chunk that ran (0: the two-hop fallback). ``ffn_layouts``: the grouped FFN's layouts the ranks ran over the home +
⌈m/8⌉ redundant slots (:func:`k3jax.ops.grouped.padded_layouts`: ``box C`` — C rows per slot; ``box C + n×t`` — the
rows past C in n tiles of t rows; ``tiles n×t``); ``box_rows``: rank 0's box rows (0: tiles only). ``fetch_slots`` / ``fetch_rows``: the redundant-expert slots per rank and the expert weight rows a rank
sent in the fetch that the step ran with (``k3jax.parallel.ep_fetch.fetch_layouts``: ⌈m/8⌉ slots in a one-hop
``[R, c]`` box in the common step; m slots along the two-hop route when some rank hosted more). ``moonep_over_capacity``: MoonEP's step over the
capacity-1.25 step; ``overflow`` (rows an exchange chunk could not carry) must be 0.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from k3jax.parallel.ep import moe_expert_parallel  # noqa: E402
from k3jax.parallel.moonep import plan, plan_numpy, slots_from_alloc  # noqa: E402


METHOD_ROWS = (("moonep", "moonep", "auto"), ("moonep_two_hop_exchange", "moonep", "two_hop"),
               ("moonep_gather_exchange", "moonep", "gather"), ("moonep_dense_exchange", "moonep", "dense"),
               ("dropless", "dropless", "auto"), ("capacity", "capacity", "auto"))


def act(g, u):
    return jax.nn.silu(g) * u


def routing(kind: str, N: int, E: int, K: int, R: int, rng) -> np.ndarray:
    m = E // R
    if kind == "uniform":
        w = np.ones(E)
    elif kind.startswith("zipf"):
        a = float(kind[4:])
        w = (1.0 / np.arange(1, E + 1) ** a)[rng.permutation(E)]
    else:                                                   # hot rank: 1/3 of the mass on rank 0's experts
        w = np.r_[np.full(m, (E - m) / (2 * m)), np.ones(E - m)]
    g = rng.gumbel(size=(N, E)) + np.log(w / w.sum())
    return np.argsort(-g, axis=-1)[:, :K].astype(np.int32)


def chain_plan_fetches(counts: np.ndarray) -> int:
    """Fetches of a chain that fills the most underloaded rank from the most overloaded one (reference rule)."""
    return int((np.asarray(slots_from_alloc(plan_numpy(counts, donor="most_overloaded").alloc)[2]) >= 0).sum())


def ffn_layouts(st: dict) -> list[str]:
    """The grouped FFN layouts the ranks ran (from the MoonEP stats), each once, as ``box C``, ``box C + n×t`` or
    ``tiles n×t``."""
    out = []
    for C, t, n in zip(*(np.asarray(st[k]).reshape(-1).tolist() for k in ("box_rows", "tile_rows", "tiles"))):
        name = f"box {C}" + (f" + {n}×{t}" if n else "") if C else f"tiles {n}×{t}"
        if name not in out:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", type=int, default=128)
    ap.add_argument("--E", type=int, default=896)
    ap.add_argument("--K", type=int, default=16)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--I", type=int, default=32)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--routings", nargs="+", default=["uniform", "zipf1.0", "zipf1.5", "hot_rank"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    R = jax.device_count()
    mesh = jax.make_mesh((R,), ("expert",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    N, E, K, D, I = a.S * R, a.E, a.K, a.D, a.I
    # tokens and expert weights placed on the mesh once, as a training step holds them: left on one device, every
    # call re-split them over the 8 devices (22 MB of weights), which added ~9 ms to every method's step
    on_mesh = NamedSharding(mesh, P("expert"))
    z = jax.device_put(jnp.asarray(rng.normal(size=(N, D)), jnp.float32), on_mesh)
    w = jax.device_put(jnp.asarray(rng.random((N, K)), jnp.float32), on_mesh)
    ws = [jax.device_put(jnp.asarray(rng.normal(size=s) / 8, jnp.float32), on_mesh)
          for s in [(E, D, I), (E, D, I), (E, I, D)]]
    res = {"benchmark": "moonep", "machine": platform.machine(), "jax": jax.__version__,
           "backend": jax.default_backend(), "devices": R, "setup": {"S": a.S, "E": E, "K": K, "D": D, "I": I,
                                                                    "dtype": "float32", "exchange": "one_hop (CPU default), two_hop, gather, dense"},
           "routings": []}
    for kind in a.routings:
        idx = jax.device_put(jnp.asarray(routing(kind, N, E, K, R, rng)), on_mesh)
        row = {"routing": kind, "methods": {}}
        steps, stats = {}, {}
        for label, method, exchange in METHOD_ROWS:
            def loss(z, w, w1, w3, w2, method=method, exchange=exchange):
                y, st = moe_expert_parallel(z, idx, w, w1, w3, w2, act, mesh=mesh, method=method, with_stats=True,
                                            exchange=exchange)
                return jnp.sum(y * y), st

            steps[label] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
            (_, stats[label]), g = steps[label](z, w, *ws)
            jax.block_until_ready(g)
        times = {label: [] for label in steps}
        for _ in range(a.reps):                  # interleaved rounds: every method's median under the same load
            for label, step in steps.items():
                # one untimed call of the same method first: timed right after the dropless step (16,384-row
                # buffers), capacity paid that step's aftermath — 37.0 ms against 30.3 ms settled (uniform,
                # 9 rounds), which made MoonEP / capacity read 1.38× instead of 1.71×
                jax.block_until_ready(step(z, w, *ws))
                t = time.perf_counter()
                jax.block_until_ready(step(z, w, *ws))
                times[label].append(time.perf_counter() - t)
        for label, st in stats.items():
            rows = int(np.asarray(st["recv_rows"])[0])
            row["methods"][label] = {"recv_rows_per_rank": rows, "recv_bytes_per_rank": rows * D * 4,
                                      "step_ms": 1e3 * statistics.median(times[label]),
                                      "drop_rate": float(np.asarray(st["dropped"]).sum()) / (N * K),
                                      "fills": int(np.asarray(st["fills"])[0]),
                                      "fetched_experts": int(np.asarray(st["fetched_experts"])[0]),
                                      "fetch_slots": int(np.asarray(st["fetch_slots"])[0]),
                                      "fetch_rows": int(np.asarray(st["fetch_rows"])[0]),
                                      "box_rows": int(np.asarray(st["box_rows"])[0]),
                                      "ffn_layouts": ffn_layouts(st),
                                      "chunk_rows": int(np.asarray(st["chunk_rows"])[0]),
                                      "overflow": int(np.asarray(st["overflow"]).sum())}
        mo, dl = row["methods"]["moonep"], row["methods"]["dropless"]
        row["buffer_ratio_dropless_over_moonep"] = dl["recv_rows_per_rank"] / mo["recv_rows_per_rank"]
        row["speedup_vs_dropless"] = dl["step_ms"] / mo["step_ms"]
        row["moonep_over_capacity"] = mo["step_ms"] / row["methods"]["capacity"]["step_ms"]
        for other in ("two_hop", "gather", "dense"):
            row[f"{other}_over_one_hop_exchange"] = row["methods"][f"moonep_{other}_exchange"]["step_ms"] / mo["step_ms"]
        if mo["overflow"]:
            raise RuntimeError(f"{kind}: MoonEP's exchange lost {mo['overflow']} rows (a chunk bound failed)")
        res["routings"].append(row)
        print(f"{kind:>9}: MoonEP {mo['step_ms']:.1f} ms ({mo['recv_rows_per_rank']} rows, {mo['fetched_experts']} "
              f"fetched), dropless {dl['step_ms']:.1f} ms ({dl['recv_rows_per_rank']} rows) → "
              f"{row['speedup_vs_dropless']:.2f}×; capacity 1.25 {row['methods']['capacity']['step_ms']:.1f} ms, "
              f"drops {row['methods']['capacity']['drop_rate']:.1%} (MoonEP/capacity {row['moonep_over_capacity']:.2f}×, "
              f"chunk {mo['chunk_rows']} rows, FFN {' / '.join(mo['ffn_layouts'])}; two-hop exchange "
              f"{row['methods']['moonep_two_hop_exchange']['step_ms']:.1f} ms, gather "
              f"{row['methods']['moonep_gather_exchange']['step_ms']:.1f} ms, dense "
              f"{row['methods']['moonep_dense_exchange']['step_ms']:.1f} ms)", flush=True)
    # planner only, R = 64
    plans = []
    f = jax.jit(plan)
    for kind in a.routings:
        prng = np.random.default_rng(1)
        Rp = 64
        ids = routing(kind, 64 * Rp, E, K, Rp, prng).reshape(Rp, 64, K)
        counts = np.stack([np.bincount(r.ravel(), minlength=E) for r in ids])
        counts = counts * (4096 // 64)                      # S = 4096 tokens per rank, same shape of loads
        jax.block_until_ready(f(jnp.asarray(counts)))
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            jax.block_until_ready(f(jnp.asarray(counts)))
            ts.append(time.perf_counter() - t)
        t = time.perf_counter()
        p = plan_numpy(counts)
        t_np = time.perf_counter() - t
        fetch = np.asarray(slots_from_alloc(p.alloc)[2])
        plans.append({"routing": kind, "R": Rp, "E": E, "S": 4096, "K": K,
                      "plan_ms_jit": 1e3 * statistics.median(ts), "plan_ms_numpy": 1e3 * t_np,
                      "fills": int(p.n_fills), "fetched_experts": int((fetch >= 0).sum()),
                      "max_redundant_per_rank": int((fetch >= 0).sum(1).max()), "E_over_R": E // Rp,
                      "chain_most_overloaded_fetches": chain_plan_fetches(counts),
                      "moved_fraction": float(np.abs(p.alloc.sum(1) - counts.sum(0).reshape(Rp, -1).sum(1)).sum()
                                              / 2 / counts.sum())})
        print(f"plan R=64 {kind:>9}: {plans[-1]['plan_ms_jit']:.3f} ms jitted ({plans[-1]['plan_ms_numpy']:.1f} ms "
              f"numpy); fills {p.n_fills}, fetched {plans[-1]['fetched_experts']} (chain rule "
              f"{plans[-1]['chain_most_overloaded_fetches']}), max redundant/rank "
              f"{plans[-1]['max_redundant_per_rank']} ≤ {E // Rp}; moved {plans[-1]['moved_fraction']:.2%}", flush=True)
    res["planner_R64"] = plans
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
