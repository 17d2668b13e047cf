"""Training at K3's depth: compile time vs depth, and what each remat policy keeps for the backward.

    .venv/bin/python -m benchmarks.depth [--depths 12 24 48] [--remat-depth 24] [--batch 1 --seq 256]
                                         [--json out.json] [--plot out.png]

The model is the ``test`` preset's widths (hidden 64, 2 KDA heads, 8 experts) with K3's layer pattern
(:func:`k3_pattern`): layer 0 KDA with a dense FFN, then units of (KDA, KDA, KDA, MLA) with MoE FFNs, AttnRes blocks
of 12 — so depth is the only thing that grows.

* **Compile time vs depth** — the jitted forward (logits) and its gradient (``jax.value_and_grad`` of the mean
  log-probability) at ``--depths`` layers, batch ``--batch`` × ``--compile-seq``: lowering + XLA compile, seconds.
  Unrolled, each layer is compiled on its own, so the time grows with depth; scanned (``scan_layers=True``,
  :mod:`k3jax.nn.scan`), the periodic run of layers is one ``lax.scan`` body compiled once.
* **Remat policies** (``k3jax.nn.remat``) at ``--remat-depth`` layers, batch ``--batch`` × ``--seq``: per policy,
  the bytes the backward keeps (``saved_residuals``: JAX's listing of the VJP's residuals, the parameters
  excluded), XLA's memory analysis of the compiled gradient (temporaries; host temporaries for ``offload``), the
  compile time and the median gradient step time; beside them the same model with plain residuals (no AttnRes,
  policy ``none``), and per layer (bytes / depth).

JSON out (``--json``), a two-panel chart (``--plot``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


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
            compiled_layers = plan.compiled_layers(L) if scan and plan else L
            rows.append({"depth": L, "layout": layout, "compiled_layers": compiled_layers,
                         "scan_plan": list(plan) if scan and plan else None,
                         "forward_compile_s": fwd, "grad_compile_s": grad})
            print(f"depth {L:3d} {layout:>8} ({compiled_layers:3d} layers compiled) | forward {fwd:6.1f} s | "
                  f"gradient {grad:6.1f} s", file=sys.stderr, flush=True)
    return rows


def policy_row(label: str, params, loss, policy: str, depth: int, reps: int, scan: bool = False) -> dict:
    from k3jax.nn.remat import saved_residuals

    kept = sum(n for _, n in saved_residuals(lambda p: loss(p, policy, scan), params))
    c, secs = compiled(jax.value_and_grad(lambda p: loss(p, policy, scan)), params)
    mem = c.memory_analysis()
    jax.block_until_ready(c(params))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(c(params))
        times.append(time.perf_counter() - t)
    row = {"model": label, "remat": policy, "scanned": scan, "residual_bytes": kept,
           "residual_bytes_per_layer": kept / depth,
           "temp_bytes": int(mem.temp_size_in_bytes), "host_temp_bytes": int(mem.host_temp_size_in_bytes),
           "compile_s": secs, "step_s": statistics.median(times)}
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


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    cr = res["compile"]
    for key, lab in (("forward_compile_s", "forward"), ("grad_compile_s", "gradient")):
        for layout, style in (("unrolled", "o-"), ("scanned", "s--")):
            rs = [r for r in cr if r["layout"] == layout]
            a.plot([r["depth"] for r in rs], [r[key] for r in rs], style, label=f"{lab}, {layout}")
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
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    res = {"benchmark": "depth", "params": {"depths": args.depths, "compile_seq": args.compile_seq,
                                            "remat_depth": args.remat_depth, "batch": args.batch, "seq": args.seq,
                                            "reps": args.reps, "widths": "test preset", "pattern": "K3 (k3_pattern)"},
           "backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version()}
    res["remat"] = remat_rows(args.remat_depth, args.batch, args.seq, args.reps)
    res["compile"] = compile_rows(args.depths, args.batch, args.compile_seq)
    if args.plot:
        res["plot"] = args.plot
        plot(res, args.plot)
    text = json.dumps(res, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return res


if __name__ == "__main__":
    main()
