"""Chunked KDA forward and forward+backward against the recurrent scan and fla's naive chunk, and its variants.

    .venv/bin/python -m benchmarks.kda [--T 1024 4096 16384] [--explore-T 4096] [--reps 5] [--settle 0.5] [--no-fla] [--json out.json]

Shapes B=1, H=4, K=V=128, lower-bound gate (K3), fp32 (plus one bf16-input row). FLOPs are counted once, from the
chunked algorithm at the reference chunk n=64 (fla's, and k3jax's on accelerators; per chunk and head: decayed K·Kᵀ
2n²K, unit-triangular solve on [V | K̃] n²(V+K), in-chunk Q·Kᵀ 2n²K and P·U 2n²V, the state terms K̃S₀, QS₀ and the
state update 6nKV); forward+backward = 3× forward. Every variant is measured against that same count, so a
variant that does more work is not rewarded (one that does less, like a smaller chunk, is). The default chunk on
CPU is 32, which does 0.8× the reference work per token; ``own_flops_*`` ratios count its own FLOPs instead.
Reported: median of ``--reps`` interleaved rounds after a warm-up (every contender of a table runs once per
round, the roofline's GEMM among them, so a slow spell on a shared machine hits them alike), ratio to the
FLOP-roofline time (FLOPs / the best fp32 GEMM FLOP/s seen in the run: its best interleaved round or the
runner's best-of-5 roofline, ``gemm_flops_peak``; the GEMM's median in the rounds is ``gemm_flops_interleaved``),
and XLA's compiled temporary memory of the backward with
the recomputing custom VJP vs ``jax.grad`` of the same forward storing its intermediates (``recompute=False``).
``--explore-T`` times each variant at one length: the registered implementations (fused vs separate passes) and
their block size, chunk size, sub-tile size, and the stage swaps of ``benchmarks/kda_variants.py`` (solve,
cumsum, cross-chunk scan, recompute, the hand-written intra-chunk VJP vs autodiff). Also recorded: the GEMM rate at
the kernel's own matmul shapes (``kernel_gemm_flops``).

With several host devices (``benchmarks.run`` splits the CPU into one per core; run directly, this module does
the same) the default kernel also runs with its heads split over them (``k3jax.parallel.heads``; XLA:CPU runs
each batched matmul on one core, so one device leaves the kernel's per-chunk matmuls on one core while the
roofline GEMM uses all): rows ``chunked_heads_*``, ratios against the same FLOP count and the same peak GEMM
(which then includes the GEMM split over the devices too), and its largest difference from the one-device output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kda_variants import KEYS as VARIANT_KEYS
from benchmarks.kda_variants import kda_variant
from benchmarks.roofline import gemm_runs, machine
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.ops.kda import kda_recurrent
from k3jax.ops.kda_chunked import kda_chunked
from k3jax.parallel.heads import head_mesh, kda_chunked_over_heads

B, H, K, V, N = 1, 4, 128, 128, 64


def default_chunk() -> int:
    """The chunk ``kda_chunked`` runs by default on this backend (32 on CPU, 64 elsewhere)."""
    return 32 if jax.default_backend() == "cpu" else 64


VARIANTS: dict[str, dict] = {
    "default (fused scan over blocks of 16 (chunk, head) pairs, chunk 32 on CPU / 64 elsewhere, sub 16, blocked "
    "inverse, tiled cumsum, hand-written intra VJP, recompute)": {},
    "chunk 16": {"chunk_size": 16},
    "chunk 32": {"chunk_size": 32},
    "chunk 64": {"chunk_size": 64},
    "chunk 128": {"chunk_size": 128},
    "sub-tile 8": {"sub_chunk": 8},
    "sub-tile 32 (one tile per chunk; the −5 bound cannot factor its exponentials, so diagonal tiles pairwise)":
        {"sub_chunk": 32, "safe_gate": False},
    "fused, blocks of 8 pairs": {"impl": "fused", "block": 8},
    "fused, blocks of 64 pairs": {"impl": "fused", "block": 64},
    "separate passes (intra for all chunks, then a state scan, then outputs; blocks of 64 pairs)":
        {"impl": "scan", "block": 64},
    "intra-chunk VJP by jax.vjp (autodiff) instead of the hand-written one": {"intra_vjp": "autodiff"},
    "inverse: Neumann doubling": {"solve": "neumann"},
    "inverse: row-by-row scan": {"solve": "rowscan"},
    "cumsum: jnp.cumsum": {"cumsum": "native"},
    "separate passes, state scan: associative_scan": {"scan": "associative", "block": 64},
    "no recompute (jax.grad stores intermediates)": {"recompute": False},
    "diagonal tiles pairwise (unbounded-gate path)": {"safe_gate": False},
}
"""The ``--explore-T`` table: ``kda_chunked`` keywords, and those of ``benchmarks.kda_variants.kda_variant``."""


def kernel_gemms(n: int) -> dict[str, tuple[str, tuple, tuple]]:
    """The matmuls the default kernel is made of at B·H = 4, K = V = 128, chunk n, as ``(einsum, lhs, rhs)``:
    the state terms inside the sequential loop (batched over the 4 heads; K̃ᵀ·U contracts over the n rows of a
    chunk) and the intra-chunk products (batched over a block of 16 (chunk, head) pairs). Their measured rate is
    the ceiling for this kernel on this backend."""
    t, P = 16, 16
    return {f"[4×{n}×128]·[4×128×128] (W·S, Q·S)": ("gnk,gkv->gnv", (4, n, K), (4, K, V)),
            f"[4×{n}×128]ᵀ·[4×{n}×128] (K̃ᵀ·U)": ("gnk,gnv->gkv", (4, n, K), (4, n, V)),
            f"[4×{n}×{n}]·[4×{n}×128] (A·U)": ("gns,gsv->gnv", (4, n, n), (4, n, V)),
            f"[16×32×128]·[16×{n}×128]ᵀ (Gram tile row, last)": ("prk,psk->prs", (P, 2 * t, K), (P, n, K)),
            f"[16×16×{n}]·[16×{n}×256] (T·[V | K̃], last row block)": ("prs,psm->prm", (P, t, n), (P, n, V + K))}


def kernel_gemm_rates(n: int, reps: int = 5, steps: int = 64) -> dict[str, float]:
    """FLOP/s of each ``kernel_gemms(n)`` batched matmul, fp32 at ``Precision.HIGHEST``, run ``steps`` times in
    sequence inside one jitted loop and summed (as the kernel runs them: one dispatch, no sequence-sized output);
    median of ``reps``."""
    out = {}
    r = np.random.default_rng(0)
    for name, (spec, ls, rs) in kernel_gemms(n).items():
        x = jnp.asarray(r.normal(size=(steps, *ls)), jnp.float32)
        y = jnp.asarray(r.normal(size=rs), jnp.float32)
        shape = jax.eval_shape(lambda a, b, s=spec: jnp.einsum(s, a, b), x[0], y).shape
        f = jax.jit(lambda x, y, s=spec, sh=shape: jax.lax.fori_loop(0, steps, lambda i, acc: acc + jnp.einsum(
            s, x[i], y, precision=jax.lax.Precision.HIGHEST), jnp.zeros(sh, jnp.float32)))
        out[name] = float(2 * steps * np.prod(shape) * _contracted(spec, ls) / timed(f, x, y, reps=reps))
    return out


def _contracted(spec: str, lhs_shape: tuple) -> int:
    """Size of the contracted index of a two-operand einsum."""
    ins, out = spec.split("->")
    a, b = ins.split(",")
    return int(np.prod([lhs_shape[a.index(c)] for c in a if c in b and c not in out]))


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


def interleaved(runs: dict[str, Callable[[], object]], reps: int, settle: float = 0.0) -> dict[str, list[float]]:
    """Seconds of each ``runs`` callable (each blocks until its result is ready) in every round: one warm-up call
    each, then ``reps`` rounds that call every one once in turn, so that a slow spell of a shared machine falls on
    all contenders of a round alike instead of on whichever happened to run then. With ``settle > 0`` each timed
    call is preceded by ``settle`` seconds of sleep and one untimed call of the same contender: right after a
    contender that touched a lot of memory (the recurrent backward stores 1 GiB of states at T=4096) the next one
    ran up to 2× slower for a few hundred ms on a 2-core machine, whichever it was, and the first call after a
    pause runs ~15% slower than the next (both measured), so without this one contender is charged for its
    neighbour."""
    for f in runs.values():
        f()
    ts: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for k, f in runs.items():
            if settle > 0:
                time.sleep(settle)
                f()
            t = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t)
    return ts


def medians_and_peak(ts: dict[str, list[float]], gemms: dict[str, float], roofline: float) -> tuple[dict, float, float]:
    """``(median seconds per contender, the one-device GEMM's median FLOP/s in these rounds, the peak)``: the peak
    the ratios use is the best GEMM rate seen in the run (the best round of any of the ``gemms`` contenders —
    ``{name: FLOPs}``, the one-device GEMM and the one split over the host devices — or the runner's best-of-5
    roofline if higher): the machine's capability, not its rate in a slow spell."""
    g = {name: ts.pop(name) for name in gemms}
    peak = max([roofline] + [fl / min(g[name]) for name, fl in gemms.items()])
    return {k: statistics.median(v) for k, v in ts.items()}, gemms["gemm"] / statistics.median(g["gemm"]), peak


def call(f, *x) -> Callable[[], object]:
    return lambda: jax.block_until_ready(f(*x))


def kernels(**kw):
    """``(forward, forward+backward)`` jitted for one variant (the production ``kda_chunked`` unless a keyword of
    ``kda_variant`` is given); the loss is ``Σ o²``."""
    kw = dict(kw)
    fn = kda_variant if kw.keys() & set(VARIANT_KEYS) else kda_chunked
    kw.setdefault("safe_gate", True)
    fwd = lambda *x: fn(*x, **kw)[0]  # noqa: E731
    loss = lambda *x: jnp.sum(fwd(*x).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def heads_kernels(mesh: Mesh):
    """``(forward, forward+backward)`` of the default kernel with the heads split over ``mesh``
    (:func:`k3jax.parallel.heads.kda_chunked_over_heads`), jitted; the loss is ``Σ o²``."""
    fwd = lambda *x: kda_chunked_over_heads(*x, mesh=mesh, safe_gate=True)[0]  # noqa: E731
    loss = lambda *x: jnp.sum(fwd(*x) ** 2)  # noqa: E731
    return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def on_heads(mesh: Mesh, x: list) -> list:
    """The inputs placed as the head-split kernel takes them (H over the mesh), so no transfer is timed."""
    return [jax.device_put(v, NamedSharding(mesh, P(None, None, "heads", *([None] * (v.ndim - 3))))) for v in x]


def temp_bytes(f, *x) -> int:
    return int(getattr(f.lower(*x).compile().memory_analysis(), "temp_size_in_bytes", 0))


def fla_chunk_run(args) -> tuple[Callable[[], object] | None, str]:
    """fla 0.6.0's ``naive_chunk_kda`` (pure torch) as a contender, on the GPU when JAX runs on one, else on the
    CPU; ``(None, why)`` without fla."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        return None, "fla not installed"
    import torch

    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    ms = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(ms)
    ms.loader.exec_module(mod)
    dev = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    t = [torch.from_numpy(np.array(a)).to(dev) for a in args]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def run():
        with torch.no_grad():
            mod.naive_chunk_kda(*t)
        sync()

    return run, f"torch {torch.__version__} {dev}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--explore-T", type=int, default=4096, help="length for the variant table (0: skip it)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds (median of each contender)")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="before every timed call: this many seconds of sleep, then one untimed call of the same "
                         "contender, so one contender's aftermath does not land on the next (0: neither; "
                         "default %(default)s)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    m = machine()
    n_run = default_chunk()
    res = {"benchmark": "kda", **m, "shape": {"B": B, "H": H, "K": K, "V": V, "chunk": n_run, "flops_chunk": N},
           "dtype": "float32",
           "flops_note": f"FLOPs of the chunked algorithm at n={N} for every row (own_flops_*: at the default "
                         f"chunk n={n_run}); fwd+bwd = 3x forward",
           "rows": [], "variants": []}
    res["kernel_gemm_flops"] = kernel_gemm_rates(n_run)
    print("GEMM rate at the kernel's shapes: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s"
                                                          for k, v in res["kernel_gemm_flops"].items()), flush=True)
    fwd, grad = kernels()
    _, grad_stored = kernels(recompute=False)
    recurrent = jax.jit(lambda *x: kda_recurrent(*x)[0])
    grad_recurrent = jax.jit(jax.grad(lambda *x: jnp.sum(kda_recurrent(*x)[0] ** 2), argnums=(0, 1, 2, 3, 4)))
    gemms, fl_gemm = gemm_runs()       # timed in every round, so the ratios use the machine's rate then
    gemm_fl = dict.fromkeys(gemms, fl_gemm)
    mesh = head_mesh(H)
    hd = mesh.shape["heads"]
    res["host_devices"], res["heads_devices"] = jax.device_count(), hd
    if hd > 1:
        hfwd, hgrad = heads_kernels(mesh)
    for T in a.T:
        x = [jnp.asarray(v) for v in inputs(T)]
        runs = {**gemms, "chunked_forward_s": call(fwd, *x), "chunked_fwd_bwd_s": call(grad, *x),
                "chunked_bf16_forward_s": call(fwd, *[v.astype(jnp.bfloat16) for v in x]),
                "recurrent_forward_s": call(recurrent, *x)}
        if T <= 4096:  # the token scan's backward stores T states: 16k would need 4 GiB
            runs["recurrent_fwd_bwd_s"] = call(grad_recurrent, *x)
        if hd > 1:
            xh = on_heads(mesh, x)
            runs["chunked_heads_forward_s"], runs["chunked_heads_fwd_bwd_s"] = call(hfwd, *xh), call(hgrad, *xh)
        fla, how = (None, "skipped (--no-fla)") if a.no_fla else fla_chunk_run([np.asarray(v) for v in x])
        if fla is not None:
            runs["fla_naive_chunk_forward_s"] = fla
        med, g_med, peak = medians_and_peak(interleaved(runs, a.reps, a.settle), gemm_fl, m["gemm_flops_fp32"])
        row = {"T": T, **med, "fla_how": how}
        fl, own = flops_forward(T), flops_forward(T, n_run)
        row.update(gemm_flops_interleaved=g_med, gemm_flops_peak=peak, flops_forward=fl, own_flops_forward=own,
                   roofline_forward_s=fl / peak, roofline_fwd_bwd_s=3 * fl / peak)
        row["forward_vs_roofline"] = row["chunked_forward_s"] / row["roofline_forward_s"]
        row["fwd_bwd_vs_roofline"] = row["chunked_fwd_bwd_s"] / row["roofline_fwd_bwd_s"]
        row["own_flops_forward_vs_roofline"] = row["chunked_forward_s"] / (own / peak)
        row["own_flops_fwd_bwd_vs_roofline"] = row["chunked_fwd_bwd_s"] / (3 * own / peak)
        if hd > 1:
            row["heads_forward_vs_roofline"] = row["chunked_heads_forward_s"] / row["roofline_forward_s"]
            row["heads_fwd_bwd_vs_roofline"] = row["chunked_heads_fwd_bwd_s"] / row["roofline_fwd_bwd_s"]
            row["heads_speedup_forward"] = row["chunked_forward_s"] / row["chunked_heads_forward_s"]
            row["heads_speedup_fwd_bwd"] = row["chunked_fwd_bwd_s"] / row["chunked_heads_fwd_bwd_s"]
            row["heads_max_abs_diff"] = float(jnp.max(jnp.abs(hfwd(*xh) - fwd(*x))))
            row["temp_bytes_grad_heads_per_device"] = temp_bytes(hgrad, *xh)
        row["chunked_speedup_vs_recurrent_forward"] = row["recurrent_forward_s"] / row["chunked_forward_s"]
        if "fla_naive_chunk_forward_s" in row:
            row["chunked_speedup_vs_fla_naive"] = row["fla_naive_chunk_forward_s"] / row["chunked_forward_s"]
        row["temp_bytes_forward"] = temp_bytes(fwd, *x)
        row["temp_bytes_grad_recompute"] = temp_bytes(grad, *x)
        row["temp_bytes_grad_stored"] = temp_bytes(grad_stored, *x)
        row["input_bytes"] = int(sum(v.nbytes for v in x))
        res["rows"].append(row)
        if hd > 1:
            print(f"T={T:>6}: heads over {hd} host devices: fwd {row['chunked_heads_forward_s'] * 1e3:8.2f} ms "
                  f"({row['heads_forward_vs_roofline']:.2f}× roofline), fwd+bwd "
                  f"{row['chunked_heads_fwd_bwd_s'] * 1e3:8.2f} ms ({row['heads_fwd_bwd_vs_roofline']:.2f}×); "
                  f"max |Δo| vs one device {row['heads_max_abs_diff']:.1e}", flush=True)
        print(f"T={T:>6}: chunked fwd {row['chunked_forward_s'] * 1e3:8.2f} ms ({row['forward_vs_roofline']:.1f}× "
              f"roofline), fwd+bwd {row['chunked_fwd_bwd_s'] * 1e3:8.2f} ms ({row['fwd_bwd_vs_roofline']:.1f}×); "
              f"GEMM {g_med / 1e9:.0f} (best {peak / 1e9:.0f}) GFLOP/s; bf16 fwd {row['chunked_bf16_forward_s'] * 1e3:.2f} ms; recurrent fwd "
              f"{row['recurrent_forward_s'] * 1e3:8.2f} ms; fla naive chunk "
              f"{(row.get('fla_naive_chunk_forward_s') or 0) * 1e3:8.2f} ms; backward temp "
              f"{row['temp_bytes_grad_recompute'] / 2**20:.0f} MiB (recompute) vs "
              f"{row['temp_bytes_grad_stored'] / 2**20:.0f} MiB (jax.grad), forward {row['temp_bytes_forward'] / 2**20:.0f}"
              f" MiB", flush=True)
    if a.explore_T:
        T = a.explore_T
        x = [jnp.asarray(v) for v in inputs(T)]
        fl = flops_forward(T)
        res["explore_T"] = T
        compiled = {name: kernels(**kw) for name, kw in VARIANTS.items()}
        placed = dict.fromkeys(compiled, x)
        if hd > 1:
            name = f"default, heads over {hd} host devices (k3jax.parallel.heads)"
            compiled[name], placed[name] = (hfwd, hgrad), on_heads(mesh, x)
        runs = dict(gemms)
        for name, (f, gf) in compiled.items():
            runs[(name, "forward_s")], runs[(name, "fwd_bwd_s")] = call(f, *placed[name]), call(gf, *placed[name])
        t, g_med, peak = medians_and_peak(interleaved(runs, a.reps, a.settle), gemm_fl, m["gemm_flops_fp32"])
        res["explore_gemm_flops_interleaved"], res["explore_gemm_flops_peak"] = g_med, peak
        for name in compiled:
            kw = VARIANTS.get(name, {"heads_devices": hd})
            v = {"variant": name, "kwargs": kw, "forward_s": t[(name, "forward_s")], "fwd_bwd_s": t[(name, "fwd_bwd_s")]}
            v["forward_vs_roofline"] = v["forward_s"] / (fl / peak)
            v["fwd_bwd_vs_roofline"] = v["fwd_bwd_s"] / (3 * fl / peak)
            v["temp_bytes_grad"] = temp_bytes(compiled[name][1], *placed[name])
            res["variants"].append(v)
            print(f"  T={T} {name:<70} fwd {v['forward_s'] * 1e3:8.2f} ms ({v['forward_vs_roofline']:5.1f}×)  "
                  f"fwd+bwd {v['fwd_bwd_s'] * 1e3:8.2f} ms ({v['fwd_bwd_vs_roofline']:5.1f}×)  "
                  f"grad temp {v['temp_bytes_grad'] / 2**20:.0f} MiB", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    from k3jax.parallel.heads import host_device_flag

    host_device_flag()      # before JAX starts its backends: one CPU device per core
    main()
