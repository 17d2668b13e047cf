"""Training-step throughput and MFU of the ``tiny`` and ``100m`` presets on this machine.

    .venv/bin/python -m benchmarks.train_throughput [--presets tiny 100m] [--steps 5] [--json out.json]

One jitted step = forward + backward + Per-Head Muon/AdamW update + Quantile Balancing, on packed byte-level
batches of the embedded corpus. MFU = model FLOPs per token (``k3jax.costs.flops_per_token``, training) × tokens/s
/ the fp32 GEMM FLOP/s measured in the same run (``gemm_peak_flops``), for the bf16 mode too; ``mfu_own_precision``
against the GEMM of the mode's own products (bf16 mode: bf16 operands into fp32, ``gemm_peak_flops_bf16``, which an
AMX CPU runs ~5× faster than fp32) (``--modes``: fp32 =
``precision=fp32`` with the default ``optim.ns_dtype`` (bf16 Newton–Schulz, as training runs by default), and
bf16 = ``precision=bf16`` + ``optim.ns_dtype=bf16``). Median over ``--steps`` timed steps after one warm-up
(compile) step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.costs import flops_per_token
from k3jax.text.tokenizer import ByteTokenizer
from k3jax.train.data import Dataset, stdlib_corpus
from k3jax.train.loop import TrainConfig, gemm_peak_flops, make_step, model_config
from k3jax.train.optim import OptimConfig, make_optimizer, muon_dims_tree

SHAPES = {"tiny": (8, 128), "100m": (4, 256)}


MODES = {"fp32": ("fp32", OptimConfig.ns_dtype), "bf16": ("bf16", "bf16")}   # mode: (precision, optim.ns_dtype)


def bench(preset: str, steps: int, peak: float, shape: tuple[int, int] | None = None, mode: str = "fp32") -> dict:
    """One preset's training-step figures; ``shape`` = (batch, seq_len), default ``SHAPES[preset]``; ``mode``:
    ``fp32``, or ``bf16`` (``precision=bf16`` compute over fp32 master weights, Newton–Schulz in bf16)."""
    B, T = shape or SHAPES.get(preset, (4, 256))
    precision, ns_dtype = MODES[mode]
    c = TrainConfig(model=preset, batch_size=B, seq_len=T, steps=100, precision=precision,
                    optim=OptimConfig(ns_dtype=ns_dtype))
    cfg = model_config(c)
    docs, info = stdlib_corpus(400_000)
    data = Dataset(docs, info, ByteTokenizer(), T)
    from k3jax.nn.model import K3ForCausalLM

    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    g, p_st, r_st = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(p_st), nnx.to_pure_dict(r_st)
    opt = make_optimizer(muon_dims_tree(p_st), c.steps, c.optim)
    ost = opt.init(params)
    step, _ = make_step(g, p_st, r_st, opt, c, cfg)
    times = []
    t0 = time.perf_counter()
    for i in range(steps + 1):
        batch = {k: jnp.asarray(v) for k, v in data.train_batch(i, B).items()}
        t = time.perf_counter()
        params, rest, ost, m = step(params, rest, ost, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
    compile_s = times[0]
    med = statistics.median(times[1:])
    tps = B * T / med
    fpt = flops_per_token(cfg, train_seq=T)["training"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return {"preset": preset, "mode": mode, "params": n_params, "batch": B, "seq_len": T, "step_seconds_median": med,
            "first_step_seconds": compile_s, "tokens_per_s": tps, "train_flops_per_token": fpt,
            "mfu": tps * fpt / peak, "wall_seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "100m"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["fp32", "bf16"], choices=sorted(MODES),
                    help="fp32, and bf16 compute + bf16 Newton–Schulz (MFU against the same fp32 GEMM peak)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    peak, peak_bf16 = gemm_peak_flops(), gemm_peak_flops(dtype="bf16")
    res = {"benchmark": "train_throughput", "machine": platform.machine(), "cpus": __import__("os").cpu_count(),
           "jax": jax.__version__, "backend": jax.default_backend(), "gemm_peak_flops": peak,
           "gemm_peak_flops_bf16": peak_bf16,
           "runs": [bench(p, a.steps, peak, mode=m) for p in a.presets for m in a.modes]}
    for r in res["runs"]:
        own = peak_bf16 if r["mode"] == "bf16" else peak
        r["mfu_own_precision"] = r["mfu"] * peak / own
        print(f"{r['preset']:>5} {r['mode']}: {r['params']:,} params, B={r['batch']} T={r['seq_len']}: {r['tokens_per_s']:,.0f} "
              f"tokens/s, MFU {r['mfu']:.1%} (fp32 GEMM peak {peak / 1e9:.0f} GFLOP/s; {r['mfu_own_precision']:.1%} "
              f"of its own precision's {own / 1e9:,.0f}), step {r['step_seconds_median']:.2f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
