"""Context parallelism and Per-Head Muon under FSDP/TP: what one device holds and what the collectives carry.

    .venv/bin/python -m benchmarks.context_parallel [--preset 100m] [--seq-lens 8192 32768 65536]
        [--contexts 1 2 4 8] [--rows T:C ...] [--run-up-to 8192] [--json out.json] [--plot PNG]

Runs on 8 simulated CPU devices (``--xla_force_host_platform_device_count=8`` is set here). Three parts:

* **training step** of ``--preset`` (batch 1) at each sequence length T and context-parallel size C (mesh
  ``context=C``; C = 1 is one device): the compiled step's memory per device from XLA's own analysis (arguments —
  parameters, optimizer state and batch — plus temporaries; what a device of that size would need), its compile
  time, and, for T ≤ ``--run-up-to``, the measured step time (median of ``--reps``). On one 2-core host the
  simulated devices share the same two cores and the same RAM, so step time here does not show CP's speed-up:
  the memory per device is the figure that carries over to real devices.
* **KDA collective bytes vs T**: the KDA context-parallel forward + backward at the preset's head sizes on
  ``context=4``, the collective operand bytes read from the compiled program at each T (expected: constant).
* **Muon**: the optimizer update of the preset's parameters on ``fsdp=4,tensor=2``, Newton–Schulz in whole-head /
  whole-expert layouts (k3jax.train.optim.muon_plans) vs every momentum gathered whole (``naive``): step time,
  temporary memory, all-gathers and their largest result.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {"argument_bytes": int(m.argument_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
           "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes)}
    # the arguments live through the step; temporaries on top; outputs not aliased to an argument are new buffers
    out["peak_bytes"] = out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"] - out["alias_bytes"]
    return out


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def train_step_row(preset: str, T: int, C: int, run: bool, reps: int, host_budget: float = 0.6) -> dict:
    from k3jax.train.loop import TrainConfig, build_training, model_config, place_batch

    with tempfile.TemporaryDirectory() as d:
        c = TrainConfig.load(None, [f"model={preset}", f"out={d}", f"seq_len={T}", "batch_size=1", "steps=100",
                                    f"mesh={'context=%d' % C if C > 1 else ''}", "progress=false"])
        c.validate()
        cfg = model_config(c)
        setup = build_training(c, cfg, jax.devices()[:C] if C > 1 else None)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, T + 1))
    batch = {"input_ids": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
             "segment_ids": np.zeros((1, T), np.int32), "loss_mask": np.ones((1, T), np.float32)}
    batch = place_batch(batch, setup.mesh)
    args = (setup.params, setup.rest, setup.opt_state, batch)
    t0 = time.perf_counter()
    compiled = setup.step_fn.lower(*args).compile()
    row = {"seq_len": T, "context": C, "compile_seconds": round(time.perf_counter() - t0, 1), **_memory(compiled)}
    # the simulated devices share this host's RAM: all C of them must fit
    row["fits_host"] = row["peak_bytes"] * C <= host_budget * host_memory_bytes()
    if run and not row["fits_host"]:
        row["not_run"] = f"{C} × {row['peak_bytes'] / 2**30:.1f} GiB exceeds {host_budget:.0%} of this host's RAM"
    elif run:
        times = []
        state = args[:3]
        for i in range(reps + 1):
            t0 = time.perf_counter()
            *state, m = compiled(*state, batch)
            jax.block_until_ready(m["loss"])
            if i:                                                 # the first call's allocations are not counted
                times.append(time.perf_counter() - t0)
        row.update({"step_seconds": statistics.median(times), "loss": float(m["loss"]),
                    "tokens_per_s": T / statistics.median(times)})
    return row


def kda_bytes(cfg, seq_lens: list[int], C: int = 4) -> list[dict]:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from k3jax.parallel.context import ContextParallel, kda_context_parallel
    from k3jax.parallel.hlo import collective_bytes
    from k3jax.parallel.mesh import make_mesh

    lac = cfg.linear_attn_config
    H, K = lac.num_heads, lac.head_dim
    cp = ContextParallel(make_mesh(f"context={C}", jax.devices()[:C]))
    sh = NamedSharding(cp.mesh, P(None, cp.axis))

    def f(q, k, v, g, b):
        o, S = kda_context_parallel(q, k, v, g, b, cp, output_final_state=True, safe_gate=True)
        return jnp.sum(o) + jnp.sum(S)

    rows = []
    for T in seq_lens:
        a = [jax.ShapeDtypeStruct((1, T, H, K), jnp.float32, sharding=sh)] * 4
        a.append(jax.ShapeDtypeStruct((1, T, H), jnp.float32, sharding=sh))
        txt = jax.jit(jax.value_and_grad(f, argnums=range(5)), out_shardings=(None, (sh,) * 5)).lower(*a) \
            .compile().as_text()
        rows.append({"seq_len": T, "context": C, "heads": H, "head_dim": K, "collective_bytes": collective_bytes(txt)})
    return rows


def muon(preset: str, mesh_spec: str, reps: int) -> dict:
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from k3jax.config import resolve_config
    from k3jax.nn.model import K3ForCausalLM
    from k3jax.parallel.hlo import collectives
    from k3jax.parallel.mesh import make_mesh
    from k3jax.parallel.rules import axes_tree, shard_pure
    from k3jax.train.optim import OptimConfig, make_blockwise_optimizer, muon_dims_tree, muon_plans

    cfg = resolve_config(preset)
    st = nnx.state(K3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(st)
    mesh = make_mesh(mesh_spec)
    dims = muon_dims_tree(st)
    sp = shard_pure(params, axes_tree(st), mesh)
    keys = iter(jax.random.split(jax.random.key(1), 100_000))
    g = shard_pure(jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype), params), axes_tree(st),
                   mesh)
    out = {"mesh": mesh_spec, "preset": preset, "params": int(sum(x.size for x in jax.tree.leaves(params)))}
    for name, naive in (("blocks", False), ("naive", True)):
        opt = make_blockwise_optimizer(dims, 100, OptimConfig(), muon_plans(st, mesh, naive=naive))
        state = jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding) and
                             x.sharding.mesh == mesh else jax.device_put(x, NamedSharding(mesh, P())), opt.init(sp))
        t0 = time.perf_counter()
        compiled = jax.jit(opt.update).lower(g, state, sp).compile()
        compile_s = time.perf_counter() - t0
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            u, state = compiled(g, state, sp)
            jax.block_until_ready(u)
            if i:
                times.append(time.perf_counter() - t0)
        gathers = [x for x in collectives(compiled.as_text()) if x["op"] == "all-gather" and x["group_size"] != 1]
        out[name] = {"step_seconds": statistics.median(times), "compile_seconds": round(compile_s, 1),
                     "all_gathers": len(gathers), "all_gather_bytes": sum(x["result_bytes"] for x in gathers),
                     "largest_all_gather_bytes": max([x["result_bytes"] for x in gathers] or [0]), **_memory(compiled)}
        del state, u
        print(f"muon {name}: {out[name]['step_seconds'] * 1e3:.0f} ms, temp {out[name]['temp_bytes'] / 2**20:.1f} MiB, "
              f"{len(gathers)} all-gathers", flush=True)
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for T in sorted({r["seq_len"] for r in res["train_step"]}):
        rows = sorted((r for r in res["train_step"] if r["seq_len"] == T), key=lambda r: r["context"])
        ax[0].plot([r["context"] for r in rows], [r["peak_bytes"] / 2**30 for r in rows], "o-", label=f"T={T:,}")
    ax[0].set(xscale="log", yscale="log", xlabel="context-parallel ranks", ylabel="GiB per device (XLA analysis)",
              title=f"{res['preset']} training step, batch 1")
    ax[0].set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax[0].legend()
    kb = res["kda_collective_bytes"]
    for kind in sorted({k for r in kb for k in r["collective_bytes"]}):
        ax[1].plot([r["seq_len"] for r in kb], [r["collective_bytes"].get(kind, 0) for r in kb], "o-", label=kind)
    ax[1].set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="operand bytes (compiled HLO)",
              title="KDA context-parallel fwd+bwd collectives, context=4")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 65536])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rows", nargs="+", default=None, metavar="T:C",
                    help="these (sequence length, context) pairs instead of the --seq-lens × --contexts grid")
    ap.add_argument("--run-up-to", type=int, default=8192, help="time steps only at T up to this (compile-only "
                    "memory analysis above it)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kda-seq-lens", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    ap.add_argument("--muon-mesh", default="fsdp=4,tensor=2")
    ap.add_argument("--muon-preset", default=None, help="the Muon comparison's model (default: --preset; the naive "
                    "plan holds every momentum whole on each of the 8 simulated devices, which share the host's RAM)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from rich.progress import Progress

    from k3jax.config import resolve_config

    cfg = resolve_config(a.preset)
    res: dict = {"benchmark": "context_parallel", "preset": a.preset, "devices": jax.device_count(),
                 "cpus": os.cpu_count(), "host_memory_bytes": host_memory_bytes(), "backend": jax.default_backend(), "jax": jax.__version__,
                 "train_step": []}
    grid = ([tuple(int(v) for v in r.split(":")) for r in a.rows] if a.rows else
            [(T, C) for T in a.seq_lens for C in a.contexts])
    with Progress() as bar:
        task = bar.add_task("train steps", total=len(grid))
        for T, C in grid:
            row = train_step_row(a.preset, T, C, T <= a.run_up_to, a.reps)
            res["train_step"].append(row)
            if a.json:                                    # kept if a later part fails
                Path(a.json).write_text(json.dumps(res, indent=2))
            bar.console.print(f"T={T:>6} context={C}: {row['peak_bytes'] / 2**30:6.2f} GiB/device "
                              f"(args {row['argument_bytes'] / 2**30:.2f}, temp {row['temp_bytes'] / 2**30:.2f})"
                              + (f", step {row['step_seconds']:.1f} s" if "step_seconds" in row else ""))
            bar.advance(task)
    res["kda_collective_bytes"] = kda_bytes(cfg, a.kda_seq_lens)
    res["muon"] = muon(a.muon_preset or a.preset, a.muon_mesh, a.reps)
    if a.plot:
        plot(res, a.plot)
        res["plot"] = a.plot
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
