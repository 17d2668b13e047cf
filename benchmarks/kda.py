"""Chunked KDA forward and forward+backward against the recurrent scan and fla's naive chunked KDA (torch CPU).

    .venv/bin/python -m benchmarks.kda [--T 1024 4096 16384] [--json out.json]

Shapes B=1, H=4, K=V=128, fp32, lower-bound gate (K3). FLOPs are counted from the chunked algorithm (chunk n=64,
per chunk and head: decayed K·Kᵀ 2n²K, unit-triangular solve on [V | K̃] n²(V+K), in-chunk Q·Kᵀ 2n²K and
P·U 2n²V, the state terms K̃S₀, QS₀ and the state update 6nKV); forward+backward = 3× forward. Reported: median
time of ``--reps`` runs after warm-up, ratio to the FLOP-roofline time (FLOPs / GEMM FLOP/s measured in this run),
and the compiled temporary memory of ``jax.grad`` vs the forward (XLA's memory analysis).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.roofline import machine
from k3jax.ops.kda import kda_chunked, kda_recurrent

B, H, K, V, N = 1, 4, 128, 128, 64


def flops_forward(T: int, n: int = N) -> float:
    C = -(-T // n)
    per_chunk = 2 * n * n * K + n * n * (V + K) + 2 * n * n * K + 2 * n * n * V + 6 * n * K * V
    return float(B * H * C * per_chunk)


def inputs(T: int, seed: int = 0):
    r = np.random.default_rng(seed)
    nrm = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True))  # noqa: E731
    q = nrm(r.normal(size=(B, T, H, K))).astype(np.float32)
    k = nrm(r.normal(size=(B, T, H, K))).astype(np.float32)
    v = r.normal(size=(B, T, H, V)).astype(np.float32)
    g = (-5.0 / (1 + np.exp(-2 * r.normal(size=(B, T, H, K))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-r.normal(size=(B, T, H))))).astype(np.float32)
    return q, k, v, g, beta


def timed(f, *args, reps: int) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def fla_chunk_seconds(args, reps: int) -> float | None:
    spec = importlib.util.find_spec("fla")
    if spec is None:
        return None
    import torch

    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    ms = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(ms)
    ms.loader.exec_module(mod)
    t = [torch.from_numpy(a) for a in args]
    with torch.no_grad():
        mod.naive_chunk_kda(*t)
        ts = []
        for _ in range(reps):
            s = time.perf_counter()
            mod.naive_chunk_kda(*t)
            ts.append(time.perf_counter() - s)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    m = machine()
    peak = m["gemm_flops_fp32"]
    res = {"benchmark": "kda", **m, "shape": {"B": B, "H": H, "K": K, "V": V, "chunk": N}, "dtype": "float32",
           "rows": []}
    chunked = jax.jit(lambda *x: kda_chunked(*x, safe_gate=True)[0])
    recurrent = jax.jit(lambda *x: kda_recurrent(*x)[0])
    loss = lambda f: (lambda *x: jnp.sum(f(*x) ** 2))  # noqa: E731
    grad_chunked = jax.jit(jax.grad(loss(lambda *x: kda_chunked(*x, safe_gate=True)[0]), argnums=(0, 1, 2, 3, 4)))
    grad_recurrent = jax.jit(jax.grad(loss(lambda *x: kda_recurrent(*x)[0]), argnums=(0, 1, 2, 3, 4)))
    for T in a.T:
        x = [jnp.asarray(v) for v in inputs(T)]
        fl = flops_forward(T)
        row = {"T": T, "flops_forward": fl, "roofline_forward_s": fl / peak, "roofline_fwd_bwd_s": 3 * fl / peak}
        row["chunked_forward_s"] = timed(chunked, *x, reps=a.reps)
        row["chunked_fwd_bwd_s"] = timed(grad_chunked, *x, reps=a.reps)
        row["recurrent_forward_s"] = timed(recurrent, *x, reps=a.reps)
        row["recurrent_fwd_bwd_s"] = timed(grad_recurrent, *x, reps=a.reps)
        row["forward_vs_roofline"] = row["chunked_forward_s"] / row["roofline_forward_s"]
        row["fwd_bwd_vs_roofline"] = row["chunked_fwd_bwd_s"] / row["roofline_fwd_bwd_s"]
        row["chunked_speedup_vs_recurrent_forward"] = row["recurrent_forward_s"] / row["chunked_forward_s"]
        fwd_mem = chunked.lower(*x).compile().memory_analysis()
        bwd_mem = grad_chunked.lower(*x).compile().memory_analysis()
        row["temp_bytes_forward"] = int(getattr(fwd_mem, "temp_size_in_bytes", 0))
        row["temp_bytes_grad"] = int(getattr(bwd_mem, "temp_size_in_bytes", 0))
        if not a.no_fla:
            s = fla_chunk_seconds([np.asarray(v) for v in x], a.reps)
            row["fla_naive_chunk_forward_s"] = s
            if s:
                row["chunked_speedup_vs_fla_naive"] = s / row["chunked_forward_s"]
        res["rows"].append(row)
        print(f"T={T:>6}: chunked fwd {row['chunked_forward_s'] * 1e3:8.1f} ms ({row['forward_vs_roofline']:.1f}× "
              f"roofline), fwd+bwd {row['chunked_fwd_bwd_s'] * 1e3:8.1f} ms ({row['fwd_bwd_vs_roofline']:.1f}×); "
              f"recurrent fwd {row['recurrent_forward_s'] * 1e3:8.1f} ms; fla naive chunk "
              f"{(row.get('fla_naive_chunk_forward_s') or 0) * 1e3:8.1f} ms; grad temp "
              f"{row['temp_bytes_grad'] / 2**20:.0f} MiB vs fwd {row['temp_bytes_forward'] / 2**20:.0f} MiB",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
