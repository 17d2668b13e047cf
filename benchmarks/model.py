"""Whole-model tokens/s and MFU: a training step, a jitted forward (prefill without cache) and the engine's prefill.

    .venv/bin/python -m benchmarks.model [--presets tiny 100m] [--steps 5] [--modes train forward engine]
                                         [--batch B --seq T --chunk 256] [--json out.json]

Per preset (shapes ``train_throughput.SHAPES``: tiny B=8 T=128, 100m B=4 T=256, or ``--batch``/``--seq``):

* ``train``: one jitted step (forward + backward + Per-Head Muon/AdamW + Quantile Balancing) on packed byte-level
  batches, ``benchmarks.train_throughput.bench``; FLOPs/token = ``k3jax.costs.flops_per_token(...)["training"]``.
* ``forward``: ``jax.jit`` of the model's forward over ``[B, T]`` random token ids to logits (no cache) — a prefill
  that keeps nothing; FLOPs/token = ``flops_per_token(cfg, train_seq=T)["forward"]``.
* ``engine``: ``k3jax.infer.Engine.prefill`` of the same ``B`` prompts of ``T`` tokens (chunks of
  ``min(--chunk, T)``, filling the KDA state and MLA latent cache), same model FLOPs/token as ``forward``.

MFU = FLOPs/token × tokens/s / the fp32 GEMM FLOP/s of ``benchmarks.roofline`` (2048², measured in the same run).
Times: median of ``--steps`` runs after one warm-up (compile) run, which is reported separately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from benchmarks.roofline import machine
from benchmarks.train_throughput import SHAPES, bench as train_bench
from k3jax import K3Config, K3ForCausalLM
from k3jax.costs import flops_per_token

MODES = ("train", "forward", "engine")


def timed(run, steps: int) -> tuple[float, float]:
    """(first-call seconds, median of ``steps`` further calls); ``run`` blocks until its result is ready."""
    t = time.perf_counter()
    run()
    first = time.perf_counter() - t
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t)
    return first, statistics.median(ts)


def row(preset: str, mode: str, B: int, T: int, first: float, med: float, fpt: int, peak: float,
        params: int, **extra) -> dict:
    tps = B * T / med
    return {"preset": preset, "mode": mode, "params": int(params), "batch": B, "seq_len": T, "seconds_median": med,
            "first_call_seconds": first, "tokens_per_s": tps, "flops_per_token": int(fpt), "mfu": tps * fpt / peak,
            **extra}


def bench_preset(preset: str, modes: list[str], steps: int, peak: float, shape: tuple[int, int] | None,
                 chunk: int) -> list[dict]:
    B, T = shape or SHAPES.get(preset, (4, 256))
    cfg = K3Config.from_preset(preset)
    out = []
    if "train" in modes:
        r = train_bench(preset, steps, peak, (B, T))
        out.append(row(preset, "train", B, T, r["first_step_seconds"], r["step_seconds_median"],
                       r["train_flops_per_token"], peak, r["params"]))
    if not {"forward", "engine"} & set(modes):
        return out
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.split(model, nnx.Param, ...)[1]))
    fpt = flops_per_token(cfg, train_seq=T)["forward"]
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    if "forward" in modes:
        fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x).logits)
        x = jax.numpy.asarray(ids)
        first, med = timed(lambda: jax.block_until_ready(fwd(state, x)), steps)
        out.append(row(preset, "forward", B, T, first, med, fpt, peak, n_params))
    if "engine" in modes:
        from k3jax.infer import Engine

        C = min(chunk, T)
        eng = Engine(model, chunk=C, max_len=max(T, cfg.max_position_embeddings))
        prompts = [r.tolist() for r in ids]
        first, med = timed(lambda: jax.block_until_ready(eng.prefill(prompts, 0)[1]), steps)
        out.append(row(preset, "engine", B, T, first, med, fpt, peak, n_params, chunk=C,
                       compiles=dict(eng.traces)))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "100m"])
    ap.add_argument("--steps", type=int, default=5, help="timed runs per figure (median), after one warm-up")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--batch", type=int, default=None, help="override the preset's batch size")
    ap.add_argument("--seq", type=int, default=None, help="override the preset's sequence length")
    ap.add_argument("--chunk", type=int, default=256, help="engine prefill chunk (at most --seq)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps: at least 1 timed run")
    m = machine()
    peak = m["gemm_flops_fp32"]
    res = {"benchmark": "model", **m, "steps": a.steps, "rows": []}
    for p in a.presets:
        B, T = SHAPES.get(p, (4, 256))
        shape = (a.batch or B, a.seq or T)
        for r in bench_preset(p, a.modes, a.steps, peak, shape, a.chunk):
            res["rows"].append(r)
            print(f"{r['preset']:>5} {r['mode']:>7}: {r['params']:,} params, B={r['batch']} T={r['seq_len']}: "
                  f"{r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.2%} (GEMM {peak / 1e9:.0f} GFLOP/s), "
                  f"{r['seconds_median']:.3f} s/run (first {r['first_call_seconds']:.1f} s)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
