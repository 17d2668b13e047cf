"""Training at K3's depth: compile time vs depth, and what each remat policy keeps for the backward.

    .venv/bin/python -m benchmarks.depth [--depths 12 24 48] [--remat-depth 24] [--batch 1 --seq 256]
                                         [--json out.json] [--plot out.png]

The model is the ``test`` preset's widths (hidden 64, 2 KDA heads, 8 experts) with K3's layer pattern
(:func:`k3_pattern`): layer 0 KDA with a dense FFN, then units of (KDA, KDA, KDA, MLA) with MoE FFNs, AttnRes blocks
of 12 — so depth is the only thing that grows.

* **Compile time vs depth** — the jitted forward (logits) and its gradient (``jax.value_and_grad`` of the mean
  log-probability) at ``--depths`` layers, batch ``--batch`` × ``--compile-seq``: lowering + XLA compile, seconds.
  Unrolled, each layer is compiled on its own, so the time grows with depth; scanned (``scan_layers=True``,
  :mod:`k3jax.nn.scan`), the periodic run of layers is one ``lax.scan`` body compiled once. Scanned, also the
  whole training step (gradient + Per-Head Muon/AdamW update): the run's parameters and optimizer state are
  stored stacked, so the update's program does not grow with the run either.
* **Remat policies** (``k3jax.nn.remat``) at ``--remat-depth`` layers, batch ``--batch`` × ``--seq``: per policy,
  the bytes the backward keeps (``saved_residuals``: JAX's listing of the VJP's residuals, the parameters
  excluded), XLA's memory analysis of the compiled gradient (temporaries; host temporaries for ``offload``), the
  compile time and the median gradient step time; beside them the same model with plain residuals (no AttnRes,
  policy ``none``), and per layer (bytes / depth).
* **Pipeline stages** (``k3jax.nn.pipeline``, on 8 host CPU devices in a subprocess: ``benchmarks.pipeline``)
  at ``--pp-depth`` layers (AttnRes blocks of 6), per ``--pp-stages`` S × ``--pp-micro`` M on mesh
  ``stage=S,data=8/S``: the GPipe bubble, the bytes the compiled forward's collective-permutes move per
  micro-batch across each stage boundary ``s→t`` with incremental AttnRes sends (each stage sends its new blocks
  to the stages that read them) and with every block forwarded along the chain, and the gradient step's compile
  and wall time beside one device.

``--sections`` picks what to measure; ``--update JSON`` re-measures those sections of an earlier record and keeps
the rest. JSON out (``--json``), a three-panel chart (``--plot``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import write_result


def k3_pattern(depth: int, attn_res: bool = True, **overrides):
    """The ``test`` preset at ``depth`` layers in K3's pattern: layer i is MLA when i % 4 == 3, else KDA; layer 0's
    FFN is dense; AttnRes blocks of 12 (none with ``attn_res=False``)."""
    from k3jax import K3Config

    cfg = K3Config.from_preset("test")
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=[i + 1 for i in range(depth) if i % 4 != 3],
                              full_attn_layers=[i + 1 for i in range(depth) if i % 4 == 3])
    return cfg.replace(num_hidden_layers=depth, linear_attn_config=lac, first_k_dense_replace=1,
                       attn_res_block_size=12 if attn_res else None, **overrides)


def model_loss(cfg, batch: int, seq: int):
    """(params, loss(params, remat)) of a fresh model (pseudo-queries jittered so the AttnRes reads are not uniform)
    on a fixed batch of token ids."""
    from k3jax.nn.model import K3ForCausalLM

    m = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(m, nnx.Param, ...)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda p: jnp.asarray(np.asarray(p) + 0.02 * rng.standard_normal(p.shape), p.dtype), params)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)), jnp.int32)

    def loss(params, remat="none", scan=False):
        out = nnx.merge(graph, params, rest)(ids, remat=remat, scan_layers=scan)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0])

    def logits(params, scan=False):
        return nnx.merge(graph, params, rest)(ids, scan_layers=scan).logits

    return params, loss, logits


def compiled(fn, params) -> tuple[object, float]:
    t = time.perf_counter()
    c = jax.jit(fn).lower(params).compile()
    return c, time.perf_counter() - t


def compile_rows(depths, batch: int, seq: int) -> list[dict]:
    from k3jax.nn.scan import scan_plan

    rows = []
    for L in depths:
        cfg = k3_pattern(L)
        params, loss, logits = model_loss(cfg, batch, seq)
        plan = scan_plan(cfg)
        for layout, scan in (("unrolled", False), ("scanned", True)):
            _, fwd = compiled(lambda p: logits(p, scan), params)
            _, grad = compiled(jax.value_and_grad(lambda p: loss(p, "none", scan)), params)
            step = train_step_compile(params, loss) if scan else None
            compiled_layers = plan.compiled_layers(L) if scan and plan else L
            rows.append({"depth": L, "layout": layout, "compiled_layers": compiled_layers,
                         "scan_plan": list(plan) if scan and plan else None,
                         "forward_compile_s": fwd, "grad_compile_s": grad, "step_compile_s": step})
            print(f"depth {L:3d} {layout:>8} ({compiled_layers:3d} layers compiled) | forward {fwd:6.1f} s | "
                  f"gradient {grad:6.1f} s" + (f" | training step {step:6.1f} s" if step else ""),
                  file=sys.stderr, flush=True)
    return rows


def train_step_compile(params, loss) -> float:
    """Compile seconds of a whole scanned training step: the gradient and the Per-Head Muon + AdamW update applied
    (``k3jax.train.optim``, its defaults), on the parameters as the model stores them (the run stacked)."""
    import optax

    from k3jax.train.optim import OptimConfig, make_optimizer, muon_dims_tree

    opt = make_optimizer(muon_dims_tree(params), 100, OptimConfig())
    pure = nnx.to_pure_dict(params)

    def step(p, o):
        def f(p):
            st = jax.tree.map(lambda x: x, params)
            nnx.replace_by_pure_dict(st, p)
            return loss(st, "none", True)

        v, g = jax.value_and_grad(f)(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, v

    t = time.perf_counter()
    jax.jit(step).lower(pure, opt.init(pure)).compile()
    return time.perf_counter() - t


def median_time(c, params, reps: int) -> float:
    """Median wall time of ``reps`` calls of the compiled ``c(params)`` after one warm-up call."""
    jax.block_until_ready(c(params))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(c(params))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def policy_row(label: str, params, loss, policy: str, depth: int, reps: int, scan: bool = False) -> dict:
    from k3jax.nn.remat import saved_residuals

    kept = sum(n for _, n in saved_residuals(lambda p: loss(p, policy, scan), params))
    c, secs = compiled(jax.value_and_grad(lambda p: loss(p, policy, scan)), params)
    mem = c.memory_analysis()
    step_s = median_time(c, params, reps)
    row = {"model": label, "remat": policy, "scanned": scan, "residual_bytes": kept,
           "residual_bytes_per_layer": kept / depth,
           "temp_bytes": int(mem.temp_size_in_bytes), "host_temp_bytes": int(mem.host_temp_size_in_bytes),
           "compile_s": secs, "step_s": step_s}
    print(f"{label:>14} {policy:>8}{' scanned' if scan else ''} | kept {kept / 2**20:8.2f} MiB "
          f"({kept / depth / 2**10:8.1f} KiB/layer) | "
          f"XLA temp {row['temp_bytes'] / 2**20:8.2f} MiB (host {row['host_temp_bytes'] / 2**20:.2f}) | "
          f"compile {secs:5.1f} s | step {row['step_s'] * 1e3:7.1f} ms", file=sys.stderr, flush=True)
    return row


def remat_rows(depth: int, batch: int, seq: int, reps: int) -> list[dict]:
    from k3jax.nn.remat import REMAT_NAMES

    params, loss, _ = model_loss(k3_pattern(depth), batch, seq)
    rows = [policy_row("AttnRes", params, loss, name, depth, reps) for name in REMAT_NAMES]
    # scanned: the run's AttnRes block buffer is part of the scan's carry, kept once per iteration
    rows += [policy_row("AttnRes", params, loss, name, depth, reps, scan=True) for name in ("none", "attnres", "full")]
    params, loss, _ = model_loss(k3_pattern(depth, attn_res=False), batch, seq)
    rows.append(policy_row("plain residual", params, loss, "none", depth, reps))
    return rows


SECTIONS = ("remat", "compile", "pipeline")


def pipeline_rows(depth: int, stages: list[int], micros: list[int], reps: int) -> dict:
    """``benchmarks.pipeline``'s record at ``depth`` layers, run in a process of its own with 8 host devices (this
    process's timings stay on one device)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = (flags + " --xla_force_host_platform_device_count=8").strip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pipeline.json")
        cmd = [sys.executable, "-m", "benchmarks.pipeline", "--depth", str(depth), "--stages", *map(str, stages),
               "--micro", *map(str, micros), "--reps", str(reps), "--json", out]
        subprocess.run(cmd, check=True, env={**os.environ, "XLA_FLAGS": flags})
        with open(out) as f:
            rec = json.load(f)
    for r in rec["rows"]:
        if "boundary_bytes_new" in r:
            print(f"pipeline {r['mesh']:>15} M={r['micro_batches']} | bubble {r['bubble']:.2f} | AttnRes+x bytes "
                  f"new {r['permute_bytes_new']:,} vs all {r['permute_bytes_all']:,} "
                  f"({r['bytes_ratio_new_over_all']:.2f}) | grad compile {r['grad_compile_s']:.1f} s, "
                  f"step {r['grad_step_s']:.2f} s", file=sys.stderr, flush=True)
    return {"params": {k: v for k, v in rec["params"].items() if k != "json"}, "devices": rec["devices"],
            "rows": rec["rows"], "command": " ".join(["python"] + cmd[1:-2]),
            "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _plot_pipeline(ax, pp: dict) -> None:
    """Bytes per stage boundary, incremental vs every block forwarded, for the widest mesh's first micro-batch
    count."""
    rows = [r for r in pp["rows"] if "boundary_bytes_new" in r]
    if not rows:
        ax.set_visible(False)
        return
    r = max(rows, key=lambda r: (r["stages"], -r["micro_batches"]))
    links = sorted(set(r["boundary_bytes_new"]) | set(r["boundary_bytes_all"]))
    xs = range(len(links))
    ax.bar([x - 0.2 for x in xs], [r["boundary_bytes_new"].get(k, 0) / 2**10 for k in links], 0.4,
           label="new blocks to the stages that read them")
    ax.bar([x + 0.2 for x in xs], [r["boundary_bytes_all"].get(k, 0) / 2**10 for k in links], 0.4,
           label="every block forwarded")
    ax.set_xticks(list(xs), [f"stage {k}" for k in links], fontsize=8, rotation=45, ha="right")
    ax.set_ylabel("KiB per micro-batch tick (collective-permutes)")
    ax.set_title(f"pipeline {r['mesh']}, M={r['micro_batches']}: bubble {r['bubble']:.2f}, "
                 f"bytes {r['bytes_ratio_new_over_all']:.2f}×", fontsize=10)
    top = max(list(r["boundary_bytes_new"].values()) + list(r["boundary_bytes_all"].values())) / 2**10
    ax.set_ylim(0, 1.35 * top)
    ax.legend(fontsize=8, loc="upper center")


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 4.8))
    cr = res["compile"]
    for key, lab in (("forward_compile_s", "forward"), ("grad_compile_s", "gradient")):
        for layout, style in (("unrolled", "o-"), ("scanned", "s--")):
            rs = [r for r in cr if r["layout"] == layout]
            a.plot([r["depth"] for r in rs], [r[key] for r in rs], style, label=f"{lab}, {layout}")
    rs = [r for r in cr if r.get("step_compile_s")]
    if rs:
        a.plot([r["depth"] for r in rs], [r["step_compile_s"] for r in rs], "^:", label="training step, scanned")
    a.set_xlabel("layers")
    a.set_ylabel("compile time (s)")
    a.set_title("compile time vs depth (test widths, K3 pattern)")
    a.legend()
    rr = res["remat"]
    names = [(r["remat"] + (", scanned" if r.get("scanned") else "")) if r["model"] == "AttnRes"
             else "plain residual" for r in rr]
    b.bar(range(len(rr)), [r["residual_bytes_per_layer"] / 2**10 for r in rr],
          color=["C2" if r["model"] != "AttnRes" else "C1" if r.get("scanned") else "C0" for r in rr])
    b.set_xticks(range(len(rr)), names, fontsize=8, rotation=45, ha="right")
    b.set_ylabel("KiB kept for the backward per layer")
    b.set_title(f"remat policies ({res['params']['remat_depth']} layers, "
                f"{res['params']['batch']}×{res['params']['seq']} tokens)")
    if "pipeline" in res:
        _plot_pipeline(c, res["pipeline"])
    else:
        c.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[12, 24, 48])
    ap.add_argument("--compile-seq", type=int, default=64)
    ap.add_argument("--remat-depth", type=int, default=24)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pp-depth", type=int, default=25)
    ap.add_argument("--pp-stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--pp-micro", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="what to measure (default: all)")
    ap.add_argument("--update", default=None, metavar="JSON",
                    help="an earlier record: the measured sections replace its own, the others are kept")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    params = {"remat": {"remat_depth": args.remat_depth, "batch": args.batch, "seq": args.seq, "reps": args.reps},
              "compile": {"depths": args.depths, "compile_seq": args.compile_seq, "batch": args.batch}}
    res = {"benchmark": "depth", "params": {"widths": "test preset", "pattern": "K3 (k3_pattern)"}}
    if args.update:                          # the sections not measured now keep their figures and parameters
        with open(args.update) as f:
            res = json.load(f)
    res.update(backend=jax.default_backend(), jax=jax.__version__, python=platform.python_version())
    for sec in args.sections:
        res["params"].update(params.get(sec, {}))
    if "remat" in args.sections:
        res["remat"] = remat_rows(args.remat_depth, args.batch, args.seq, args.reps)
    if "compile" in args.sections:
        res["compile"] = compile_rows(args.depths, args.batch, args.compile_seq)
    if "pipeline" in args.sections:          # its parameters are in its own record
        res["pipeline"] = pipeline_rows(args.pp_depth, args.pp_stages, args.pp_micro, args.reps)
    if args.plot:
        res["plot"] = args.plot
        plot(res, args.plot)
    write_result(res, args.json)
    return res


if __name__ == "__main__":
    main()
