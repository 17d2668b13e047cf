"""Where a training step's time goes: the step of a preset timed whole and by component, from jitted sub-steps.

    .venv/bin/python -m benchmarks.step_profile [--preset 100m] [--batch 4 --seq 256] [--micro-batches 1] [--reps 5]
                                                [--grouped tiles|ragged] [--ns-dtype fp32|bf16]
                                                [--before JSON] [--json out.json] [--plot PNG]

The whole step is ``k3jax.train.loop.make_step`` (forward, backward, clip + Per-Head Muon / AdamW, Quantile
Balancing), median of ``--reps`` after a compile; with ``--micro-batches A`` the step takes A micro-batches of
``--batch`` rows (``TrainConfig.micro_batches``: A forward+backward passes, one optimizer update), so the
optimizer's fixed cost is spread over A·B·T tokens as in training with a larger global batch. Each component is then jitted on its own, on the step's shapes
and the model's own parameters, and timed forward and forward+backward (``jax.vjp`` with a random cotangent: the
gradients of its parameters and inputs); a component's time in the step is its count (× A for the model's components) × its fwd+bwd time:

* embedding lookup + final norm + LM head + cross entropy; the RMSNorms before attention and FFN;
* KDA, split into its chunked kernel (``kda_chunked`` on q, k, v, g, β of the step's shapes), its three short
  convs (``causal_conv1d`` + SiLU) and the rest of the layer (q/k/v/gate/β/output projections, L2 norms, gated
  output norm: the layer's time minus kernel and convs);
* MLA (the whole attention layer); the AttnRes reads (each with the number of blocks it reads at its depth);
* the MoE: router (logits, top-k, counts, scores), routed experts' dispatch + grouped matmul
  (``moe_grouped``), latent down/up projections + norm, shared experts; the dense MLP of the first layer;
* Quantile Balancing's update per MoE layer (forward only: it has no gradient);
* the optimizer update (one jitted ``optimizer.update``), split into Newton–Schulz (every Muon matrix through
  ``newton_schulz``, timed alone) and the rest (clipping, momentum, AdamW, schedules: the update minus NS).

``unattributed`` = step − Σ components (fusion across component boundaries and the step's own glue — parameter
add, grad norm — show here; it is negative where the sub-steps cost more alone than inside the step). MFU =
model FLOPs per token (``k3jax.costs``) × tokens/s over the GEMM peak measured in the same run; the Newton–Schulz
FLOPs are counted apart (they are not model FLOPs). JSON out, a bar chart with ``--plot``.

The stored chart's "before" is ``benchmarks/step_profile_before.json``, made by ``--grouped ragged --json …`` on the
same code (``jax.lax.ragged_dot`` for the routed experts, the grouped matmul the step used before the tiled one;
the other changes since are small beside it), and passed back with ``--before``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.costs import flops_per_token
from k3jax.ops.attnres import attnres_mix
from k3jax.ops.balance import quantile_balance_update
from k3jax.ops.grouped import moe_grouped
from k3jax.ops.kda import causal_conv1d
from k3jax.ops.kda_chunked import kda_chunked
from k3jax.ops.norm import rms_norm
from k3jax.ops.routing import expert_counts, router_topk
from k3jax.text.tokenizer import ByteTokenizer
from k3jax.train.data import Dataset, stdlib_corpus
from k3jax.train.loop import TrainConfig, cross_entropy, gemm_peak_flops, make_step, model_config
from k3jax.train.optim import NS_DTYPES, OptimConfig, make_optimizer, matrix_axes, muon_dims_tree, newton_schulz

SHAPES = {"tiny": (8, 128), "100m": (4, 256)}


def _median_time(fn, args, reps: int) -> tuple[float, float]:
    """(first call s, median of ``reps`` further calls s) of ``fn(*args)`` to a ready result."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return first, statistics.median(ts)


def _randn(key: int, shape, scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def time_component(f, args: tuple, reps: int, backward: bool = True) -> dict:
    """Forward and forward+backward seconds of ``f(*args)`` (every array argument differentiated, floats only)."""
    fwd = jax.jit(f)
    _, t_f = _median_time(fwd, args, reps)
    out = {"forward_s": t_f}
    if backward:
        diff = [i for i, a in enumerate(args)
                if all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(a))]

        def fb(a, ct):
            def g(*d):
                full = list(a)
                for i, x in zip(diff, d):
                    full[i] = x
                return f(*full)
            _, pull = jax.vjp(g, *[a[i] for i in diff])
            return pull(ct)

        # the cotangent is made outside the timed program (a fixed, non-constant pattern per output)
        shapes = jax.eval_shape(f, *args)
        ct = jax.tree.map(lambda v: jnp.asarray(np.cos(np.arange(math.prod(v.shape))).reshape(v.shape), v.dtype)
                          if jnp.issubdtype(v.dtype, jnp.floating) else np.zeros(v.shape, jax.dtypes.float0),
                          shapes)
        _, t_fb = _median_time(jax.jit(fb), (args, ct), reps)
        out["forward_backward_s"] = t_fb
    else:
        out["forward_backward_s"] = t_f
    return out


def _module_fn(module):
    """``(params, f)``: a module's nnx.Param state and ``f(params, *inputs) = module(*inputs)``."""
    g, p, r = nnx.split(module, nnx.Param, ...)
    return p, lambda params, *xs: nnx.merge(g, params, r)(*xs)


def attnres_reads(n_layers: int, block_size: int) -> dict[int, int]:
    """How many AttnRes reads see n blocks (spec §6 schedule): ``{n_blocks: reads}`` over the layers' two reads
    and the output read (layer 0's first read sees no block and is the identity)."""
    counts: dict[int, int] = {}
    n = 0
    for idx in range(n_layers):
        if n:
            counts[n] = counts.get(n, 0) + 1
        if idx % block_size == 0:
            n += 1
        counts[n] = counts.get(n, 0) + 1
    counts[n] = counts.get(n, 0) + 1
    return counts


def muon_leaves(params: dict, dims: dict) -> list[tuple[jax.Array, object]]:
    return [(p, d) for p, d in zip(jax.tree.leaves(params), jax.tree.leaves(dims, is_leaf=lambda x: x is None or
                                                                             hasattr(x, "reduction_axis")))
            if d is not None]


def ns_flops(shape: tuple[int, ...], dims, steps: int = 5) -> int:
    """FLOPs of Newton–Schulz on one parameter: per matrix (m ≤ n) and iteration ``4·m²·n + 2·m³``."""
    red, out = matrix_axes(dims, len(shape))
    a, b = math.prod(shape[i] for i in red), math.prod(shape[i] for i in out)
    batch = math.prod(shape) // (a * b)
    m, n = min(a, b), max(a, b)
    return batch * steps * (4 * m * m * n + 2 * m ** 3)


def profile(preset: str, B: int, T: int, reps: int, grouped: str | None = None, ns_dtype: str = OptimConfig.ns_dtype,
            micro: int = 1) -> dict:
    c = TrainConfig(model=preset, batch_size=B * micro, micro_batches=micro, seq_len=T, steps=100,
                    optim=OptimConfig(ns_dtype=ns_dtype))
    cfg = model_config(c)
    docs, info = stdlib_corpus(400_000)
    data = Dataset(docs, info, ByteTokenizer(), T)
    from k3jax.nn.model import K3ForCausalLM
    import k3jax.ops.grouped as grouped_mod

    prev = grouped_mod.DEFAULT_STRATEGY
    if grouped:
        grouped_mod.DEFAULT_STRATEGY = grouped
    try:
        model = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
        g, p_st, r_st = nnx.split(model, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(p_st), nnx.to_pure_dict(r_st)
        dims = muon_dims_tree(p_st)
        opt = make_optimizer(dims, c.steps, c.optim)
        ost = opt.init(params)
        step, _ = make_step(g, p_st, r_st, opt, c, cfg)
        batch = {k: jnp.asarray(v) for k, v in data.train_batch(0, B).items()}      # one micro-batch's rows
        step_batch = {k: jnp.asarray(v) for k, v in data.train_batch(0, B * micro).items()}
        state = [params, rest, ost]

        def run_step(b):
            out = step(*state, b)
            state[:3] = out[:3]
            return out[3]["loss"]

        print(f"{preset}: compiling and timing the whole step ({micro} × B={B}, T={T}) …", flush=True)
        t_compile, t_step = _median_time(run_step, (step_batch,), reps)
        comps: list[dict] = []

        def add(name: str, group: str, count: int, f, args, backward: bool = True, **extra):
            r = time_component(f, args, reps, backward)
            r.update(name=name, group=group, count=count * micro, **extra)
            r["step_s"] = count * micro * r["forward_backward_s"]
            comps.append(r)
            print(f"  {name:<48} ×{count:<3} fwd {r['forward_s'] * 1e3:8.2f} ms  fwd+bwd "
                  f"{r['forward_backward_s'] * 1e3:8.2f} ms", flush=True)
            return r

        H = cfg.hidden_size
        x = _randn(1, (B, T, H))
        layers = model.model.layer_views()          # the stacked run's layers as per-layer modules
        kinds = cfg.layer_types
        # embedding + head + loss
        head_p, f_head = _module_fn(model.lm_head)
        emb = model.model.embed_tokens[...]
        w_norm = model.model.norm.weight[...]

        def head_loss(emb, w_norm, head_p, h):   # the embedding's output gets a cotangent: its scatter-add runs
            e = jnp.take(emb, batch["input_ids"], axis=0)
            logits = f_head(head_p, rms_norm(h, w_norm, cfg.rms_norm_eps))
            return cross_entropy(logits, batch["targets"], batch["loss_mask"]), e

        add("embedding + final norm + LM head + loss", "embedding/head/loss", 1, head_loss, (emb, w_norm, head_p, x))
        # norms
        n0 = layers[0].input_layernorm
        add("RMSNorm (before attention / FFN)", "norms", 2 * len(layers),
            lambda w, h: rms_norm(h, w, cfg.rms_norm_eps), (n0.weight[...], x))
        # KDA
        i_kda = kinds.index("kda") if "kda" in kinds else None
        if i_kda is not None:
            attn = layers[i_kda].self_attn
            n_kda = kinds.count("kda")
            p_att, f_att = _module_fn(attn)
            whole = add("KDA layer (whole)", "KDA", 0, lambda p, h: f_att(p, h)[0], (p_att, x))
            nh, hd = attn.num_heads, attn.head_dim
            q = _randn(2, (B, T, nh, hd))
            q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
            k = _randn(3, (B, T, nh, hd))
            k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
            v = _randn(4, (B, T, nh, hd))
            gg = -5.0 * jax.nn.sigmoid(_randn(5, (B, T, nh, hd)))
            beta = jax.nn.sigmoid(_randn(6, (B, T, nh)))
            safe = attn.gate_kind == "lower_bound"
            kern = add("KDA chunked kernel", "KDA", n_kda,
                       lambda q, k, v, g, b: kda_chunked(q, k, v, g, b, safe_gate=safe)[0], (q, k, v, gg, beta))
            u = _randn(7, (B, T, nh * hd))
            wc = attn.q_conv1d[...]
            conv = add("KDA short convs (3 × conv1d + SiLU)", "KDA", n_kda,
                       lambda w, u: sum(causal_conv1d(u * (j + 1), w)[0] for j in range(3)), (wc, u))
            restr = {key: whole[key] - kern[key] - conv[key] for key in ("forward_s", "forward_backward_s")}
            comps.append({**restr, "name": "KDA projections, gates, norms (layer − kernel − convs)", "group": "KDA",
                          "count": n_kda * micro, "step_s": n_kda * micro * restr["forward_backward_s"],
                          "derived": True})
        if "mla" in kinds:
            attn = layers[kinds.index("mla")].self_attn
            p_att, f_att = _module_fn(attn)
            add("MLA layer (whole)", "MLA", kinds.count("mla"), lambda p, h: f_att(p, h)[0], (p_att, x))
        # AttnRes
        if cfg.attn_res:
            site = layers[1].self_attention_res
            for n, cnt in sorted(attnres_reads(len(layers), cfg.attn_res_block_size).items()):
                blocks = [_randn(10 + j, (B, T, H)) for j in range(n)]
                add(f"AttnRes read over {n} block(s)", "AttnRes", cnt,
                    lambda w, q_, bl, p: attnres_mix(bl, p, w, q_, cfg.rms_norm_eps),
                    (site.norm[...], site.proj[...] + 0.01, blocks, x))
        # MoE / MLP
        moe_idx = [i for i, layer in enumerate(layers) if layer.is_moe]
        if moe_idx:
            moe = layers[moe_idx[0]].block_sparse_moe
            nm = len(moe_idx)
            xf = x.reshape(B * T, H)
            gate_k = moe.gate.kernel[...]
            bias = moe.e_score_correction_bias[...]

            def router(wg, h):
                logits = jnp.einsum("nd,de->ne", h, wg, precision=jax.lax.Precision.HIGHEST)
                w, idx = router_topk(logits, bias, **moe.cfg_route)
                return w, expert_counts(idx, moe.num_experts), jax.nn.sigmoid(jax.lax.stop_gradient(logits))

            add("MoE router (logits, top-k, counts, scores)", "router + balancing", nm, router, (gate_k, xf))
            logits = xf @ gate_k
            w_r, idx = router_topk(logits, bias, **moe.cfg_route)
            L = cfg.routed_expert_hidden_size if moe.latent else H
            z = _randn(8, (B * T, L))
            w1, w3, w2 = moe.experts.weights(jnp.float32)
            add("routed experts: dispatch + grouped matmul", "routed experts", nm,
                lambda z, w, a, b_, c_: moe_grouped(z, idx, w, a, b_, c_, moe.act), (z, w_r, w1, w3, w2),
                strategy=grouped_mod.DEFAULT_STRATEGY)
            if moe.latent:
                dn, up = moe.routed_expert_down_proj.kernel[...], moe.routed_expert_up_proj.kernel[...]
                nw = moe.routed_expert_norm.weight[...] if moe.routed_expert_norm is not None else None

                def latent(dn, up, h, y):
                    zz = h @ dn
                    yy = rms_norm(y, nw, cfg.rms_norm_eps) if nw is not None else y
                    return zz, yy @ up

                add("routed experts: latent down/up projections + norm", "routed experts", nm, latent,
                    (dn, up, xf, z))
            if moe.shared_experts is not None:
                p_sh, f_sh = _module_fn(moe.shared_experts)
                add("shared experts", "shared experts / dense MLP", nm, f_sh, (p_sh, xf))
            scores = jax.nn.sigmoid(logits)
            add("Quantile Balancing update", "router + balancing", nm,
                lambda s, b_: quantile_balance_update(s, b_, moe.top_k, c.balance_bins, c.balance_passes),
                (scores, bias), backward=False)
        dense_idx = [i for i, layer in enumerate(layers) if not layer.is_moe]
        if dense_idx:
            p_mlp, f_mlp = _module_fn(layers[dense_idx[0]].mlp)
            add("dense MLP", "shared experts / dense MLP", len(dense_idx), f_mlp, (p_mlp, x))
        # optimizer
        grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
        upd = jax.jit(lambda gr, s, p: opt.update(gr, s, p))
        _, t_upd = _median_time(upd, (grads, ost, params), reps)
        ml = muon_leaves(params, dims)
        mats = [p for p, _ in ml]
        ns_fn = jax.jit(lambda ms: [newton_schulz(m, d, dtype=NS_DTYPES[ns_dtype]) for m, (_, d) in zip(ms, ml)])
        _, t_ns = _median_time(ns_fn, (mats,), reps)
        nsf = sum(ns_flops(p.shape, d) for p, d in ml)
        comps.append({"name": "optimizer: Newton–Schulz (Muon)", "group": "optimizer", "count": 1, "forward_s": t_ns,
                      "forward_backward_s": t_ns, "step_s": t_ns, "flops": nsf})
        comps.append({"name": "optimizer: clip, momentum, AdamW, schedules (update − NS)", "group": "optimizer",
                      "count": 1, "forward_s": t_upd - t_ns, "forward_backward_s": t_upd - t_ns,
                      "step_s": t_upd - t_ns, "derived": True})
        print(f"  optimizer update {t_upd * 1e3:.1f} ms (Newton–Schulz {t_ns * 1e3:.1f} ms, "
              f"{nsf / 1e9:.1f} GFLOP)", flush=True)
    finally:
        grouped_mod.DEFAULT_STRATEGY = prev
    attributed = sum(r["step_s"] for r in comps)
    fpt = flops_per_token(cfg, train_seq=T)["training"]
    n_params = sum(v.size for v in jax.tree.leaves(params))
    groups: dict[str, float] = {}
    for r in comps:
        groups[r["group"]] = groups.get(r["group"], 0.0) + r["step_s"]
    return {"preset": preset, "params": int(n_params), "batch": B, "micro_batches": micro, "seq_len": T,
            "grouped_strategy": grouped or prev, "step_seconds": t_step, "first_step_seconds": t_compile,
            "tokens_per_s": micro * B * T / t_step, "train_flops_per_token": int(fpt), "optimizer_update_seconds": t_upd,
            "newton_schulz_flops": int(nsf), "components": comps, "groups": groups,
            "attributed_seconds": attributed, "unattributed_seconds": t_step - attributed}


def plot(res: dict, path: str, before: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("before", before), ("after", res)] if before else [("", res)]
    tokens = [r.get("micro_batches", 1) * r["batch"] * r["seq_len"] for _, r in runs]
    per_k = len(set(tokens)) > 1          # runs of different step sizes: compare seconds per 1,000 tokens
    names = list(dict.fromkeys([*(before or {}).get("groups", {}), *res["groups"], "unattributed"]))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.6))
    y = np.arange(len(names))
    hgt = 0.8 / len(runs)
    for j, ((label, r), n_tok) in enumerate(zip(runs, tokens)):
        scale = 1000 / n_tok if per_k else 1.0
        vals = [scale * (r["groups"].get(n, 0.0) if n != "unattributed" else r["unattributed_seconds"]) for n in names]
        what = f"{scale * r['step_seconds']:.2f} s / 1k tokens ({n_tok:,} a step)" if per_k else \
            f"step {r['step_seconds']:.2f} s"
        ax.barh(y + j * hgt, vals, hgt, label=f"{label} {what}".strip())
    ax.set_yticks(y + hgt * (len(runs) - 1) / 2, names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per 1,000 training tokens" if per_k else "seconds per training step")
    micro = res.get("micro_batches", 1)
    rows = f"{micro} × B={res['batch']}" if micro > 1 else f"B={res['batch']}"
    ax.set_title(f"{res['preset']} training step by component ({rows}, T={res['seq_len']})")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="micro-batches of --batch rows per step (gradient accumulation, one optimizer update)")
    ap.add_argument("--grouped", default=None, help="grouped-matmul strategy of the routed experts (tiles | ragged)")
    ap.add_argument("--ns-dtype", default=OptimConfig.ns_dtype, choices=sorted(NS_DTYPES),
                    help="Muon's Newton–Schulz operands (optim.ns_dtype)")
    ap.add_argument("--before", default=None, help="a step_profile JSON to chart beside this run (before/after)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    B, T = SHAPES.get(a.preset, (4, 256))
    B, T = a.batch or B, a.seq or T
    peak = gemm_peak_flops(2048)
    res = {"benchmark": "step_profile", "backend": jax.default_backend(), "jax": jax.__version__,
           "gemm_peak_flops": peak, "ns_dtype": a.ns_dtype,
           **profile(a.preset, B, T, a.reps, a.grouped, a.ns_dtype, a.micro_batches)}
    res["mfu"] = res["tokens_per_s"] * res["train_flops_per_token"] / peak
    print(f"step {res['step_seconds']:.3f} s, {res['tokens_per_s']:,.0f} tokens/s, MFU {res['mfu']:.1%} "
          f"(GEMM peak {peak / 1e9:.0f} GFLOP/s); attributed {res['attributed_seconds']:.3f} s, unattributed "
          f"{res['unattributed_seconds']:+.3f} s")
    for name, s in sorted(res["groups"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:<28} {s:8.3f} s  {s / res['step_seconds']:6.1%}")
    before = json.loads(Path(a.before).read_text()) if a.before else None
    if before:
        res["before"] = {k: before[k] for k in ("step_seconds", "groups", "unattributed_seconds", "mfu", "batch",
                                                "seq_len", "micro_batches", "tokens_per_s", "grouped_strategy",
                                                "gemm_peak_flops") if k in before}
    if a.plot:
        plot(res, a.plot, before)
        res["plot"] = a.plot
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2, default=float))
    return res


if __name__ == "__main__":
    main()
