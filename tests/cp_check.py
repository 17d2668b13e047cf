"""Under 8 simulated CPU devices: context parallelism (k3jax.parallel.context) against one device; prints JSON.

Kernels on mesh context=4,data=2 (T = 100: 25 tokens per rank, not a multiple of the 32-token chunk; packed
documents that start on, just after and inside a rank's conv halo; an initial state) against the token-by-token
recurrence, the chunked kernel, the plain conv and plain MLA; the model (the 3-layer test preset) on
context=4,data=2 against one device, logits and gradients, and its 5-layer variant scanned there (layers 1–2
a lax.scan: small_models.scannable) against it unrolled on one device; the compiled KDA collectives at T = 4k and 32k;
Per-Head Muon on fsdp=4,tensor=2 in whole-block layouts against optax's Muon on one device."""

import functools
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from k3jax.ops.attention import mla_attention  # noqa: E402
from k3jax.ops.kda import causal_conv1d, kda_recurrent  # noqa: E402
from k3jax.ops.kda_chunked import kda_chunked  # noqa: E402
from k3jax.parallel.context import (ContextParallel, causal_conv1d_context_parallel,  # noqa: E402
                                    kda_context_parallel, mla_attention_context_parallel)
from k3jax.parallel.hlo import collective_bytes  # noqa: E402
from k3jax.parallel.mesh import make_mesh  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def maxdiff(a, b) -> jax.Array:
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))


def scale_of(a) -> jax.Array:
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(a)]))


def kernels(cp: ContextParallel) -> dict:
    """Every comparison in one jitted program (eager shard_maps and scans dispatch op by op: minutes on CPU)."""
    return jax.tree.map(float, jax.jit(_kernels, static_argnums=0)(cp))


def _kernels(cp: ContextParallel) -> dict:
    B, T, H, K, V = 2, 100, 2, 16, 8
    ks = jax.random.split(jax.random.key(0), 10)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = unit(jax.random.normal(ks[0], (B, T, H, K))), unit(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -5 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    S0 = 0.3 * jax.random.normal(ks[5], (B, H, K, V))
    # row 0: documents from 25 (a rank boundary), 30 and 77; row 1: from 49, 50 (the last two tokens of rank 1
    # are its own documents: rank 2's conv halo holds a document start) and 74 (inside rank 2, one before rank 3)
    reset = jnp.zeros((B, T), bool).at[0, 25].set(True).at[0, 30].set(True).at[0, 77].set(True)
    reset = reset.at[1, 49].set(True).at[1, 50].set(True).at[1, 74].set(True)
    w = jax.random.normal(ks[6], (V + 4, 4)) * 0.5
    ct = jnp.cos(jnp.arange(V) * 0.7)

    def loss(o, S):
        return jnp.sum(o * ct) + 0.3 * jnp.sum(S * jnp.sin(jnp.arange(V)))

    def cp_kda(q, k, v, g, beta, S0):
        return loss(*kda_context_parallel(q, k, v, g, beta, cp, initial_state=S0, output_final_state=True,
                                          reset=reset, safe_gate=True))

    def rec_kda(q, k, v, g, beta, S0):
        return loss(*kda_recurrent(q, k, v, g, beta, initial_state=S0, output_final_state=True, reset=reset))

    def chunk_kda(q, k, v, g, beta, S0):
        return loss(*kda_chunked(q, k, v, g, beta, initial_state=S0, output_final_state=True, reset=reset,
                                 safe_gate=True))

    args = (q, k, v, g, beta, S0)
    out = {}
    got = kda_context_parallel(q, k, v, g, beta, cp, initial_state=S0, output_final_state=True, reset=reset,
                               safe_gate=True)
    ref = kda_recurrent(q, k, v, g, beta, initial_state=S0, output_final_state=True, reset=reset)
    chk = kda_chunked(q, k, v, g, beta, initial_state=S0, output_final_state=True, reset=reset, safe_gate=True)
    gcp = jax.grad(cp_kda, argnums=range(6))(*args)
    grec = jax.grad(rec_kda, argnums=range(6))(*args)
    gch = jax.grad(chunk_kda, argnums=range(6))(*args)
    out["kda"] = {"out_vs_recurrent": maxdiff(got[0], ref[0]), "state_vs_recurrent": maxdiff(got[1], ref[1]),
                  "out_vs_chunked": maxdiff(got[0], chk[0]), "state_vs_chunked": maxdiff(got[1], chk[1]),
                  "grads_vs_recurrent": [maxdiff(a, b) for a, b in zip(gcp, grec)],
                  "grads_vs_chunked": [maxdiff(a, b) for a, b in zip(gcp, gch)],
                  "grad_scale": [scale_of(a) for a in grec], "out_scale": scale_of(ref[0])}
    # no initial state, no documents, the unbounded (softplus-style) gate path
    g2 = -jnp.abs(jax.random.normal(ks[7], (B, T, H, K))) * 3
    got = kda_context_parallel(q, k, v, g2, beta, cp, output_final_state=True)
    ref = kda_recurrent(q, k, v, g2, beta, output_final_state=True)
    out["kda_plain"] = {"out": maxdiff(got[0], ref[0]), "state": maxdiff(got[1], ref[1])}

    x = jax.random.normal(ks[8], (B, T, V + 4))
    conv_cp = lambda x, w: causal_conv1d_context_parallel(x, w, cp, reset)  # noqa: E731
    conv_ref = lambda x, w: causal_conv1d(x, w, reset=reset)[0]  # noqa: E731
    gc = jax.grad(lambda x, w: jnp.sum(jnp.sin(conv_cp(x, w))), argnums=(0, 1))(x, w)
    gr = jax.grad(lambda x, w: jnp.sum(jnp.sin(conv_ref(x, w))), argnums=(0, 1))(x, w)
    out["conv"] = {"out": maxdiff(conv_cp(x, w), conv_ref(x, w)), "grads": [maxdiff(a, b) for a, b in zip(gc, gr)],
                   "out_no_reset": maxdiff(causal_conv1d_context_parallel(x, w, cp), causal_conv1d(x, w)[0])}

    N, Dn, Dr, Dv, R = 2, 8, 4, 8, 12
    qn, qr = jax.random.normal(ks[9], (B, T, N, Dn)), jax.random.normal(ks[0], (B, T, N, Dr))
    ckv, kr = jax.random.normal(ks[1], (B, T, R)), jax.random.normal(ks[2], (B, T, Dr))
    wkv = jax.random.normal(ks[3], (R, N, Dn + Dv)) * 0.3
    seg = jnp.cumsum(reset.astype(jnp.int32), axis=1)

    def expand(w, c):
        kv = jnp.einsum("btr,rnd->btnd", c, w)
        return kv[..., :Dn], kv[..., Dn:]

    def mla_cp(qn, qr, ckv, kr, wkv):
        return mla_attention_context_parallel(qn, qr, ckv, kr, expand, wkv, 0.3, cp, seg)

    def mla_ref(qn, qr, ckv, kr, wkv):
        k_n, vv = expand(wkv, ckv)
        return mla_attention(qn, qr, k_n, kr, vv, 0.3, seg)

    margs = (qn, qr, ckv, kr, wkv)
    gm = jax.grad(lambda *a: jnp.sum(jnp.sin(mla_cp(*a))), argnums=range(5))(*margs)
    gmr = jax.grad(lambda *a: jnp.sum(jnp.sin(mla_ref(*a))), argnums=range(5))(*margs)
    out["mla"] = {"out": maxdiff(mla_cp(*margs), mla_ref(*margs)), "grads": [maxdiff(a, b) for a, b in zip(gm, gmr)],
                  "out_no_segments": maxdiff(mla_attention_context_parallel(qn, qr, ckv, kr, expand, wkv, 0.3, cp),
                                             mla_attention(qn, qr, *expand(wkv, ckv)[:1], kr,
                                                           expand(wkv, ckv)[1], 0.3))}
    return out


def model_check(cp: ContextParallel, scanned: bool = False) -> dict:
    """``scanned``: the test preset's 5-layer variant (small_models.scannable: layers 1–2 a scan, k3jax.nn.scan)
    scanned on the mesh against unrolled on one device; else the 3-layer test preset on both."""
    from flax import nnx
    from small_models import scannable

    from k3jax import K3Config

    cfg = scannable() if scanned else K3Config.from_preset("test")
    from k3jax.nn.model import K3ForCausalLM

    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    gd, params, rest = nnx.split(model, nnx.Param, ...)
    B, T = 2, 48
    ids = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    seg = jnp.zeros((B, T), jnp.int32).at[0, 12:].set(1).at[1, 30:].set(1).at[1, 40:].set(2)

    from k3jax.parallel.ep import ExpertParallel

    ep = ExpertParallel(cp.mesh)            # no expert axis: each device runs the routed experts on its own tokens

    def loss(p, cp=None):
        out = nnx.merge(gd, p, rest)(ids, segment_ids=seg, cp=cp, ep=None if cp is None else ep,
                                     scan_layers=scanned and cp is not None)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., :7]), out.logits

    (l1, lg1), g1 = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    (l2, lg2), g2 = jax.jit(jax.value_and_grad(lambda p: loss(p, cp), has_aux=True))(params)
    return jax.tree.map(float, {"logits": maxdiff(lg1, lg2), "logit_scale": scale_of(lg1), "grads": maxdiff(g1, g2),
                                "grad_scale": scale_of(g1), "loss": [l1, l2]})


def hlo_bytes(cp: ContextParallel) -> dict:
    """Operand bytes of the collectives of KDA CP forward + backward (B=1, H=2, K=V=16), inputs laid out over the
    context axis as they are in the model."""
    sh = NamedSharding(cp.mesh, P(None, cp.axis))          # batch 1: the data axis holds copies

    def f(q, k, v, g, b):
        o, S = kda_context_parallel(q, k, v, g, b, cp, output_final_state=True, safe_gate=True)
        return jnp.sum(o) + jnp.sum(S)

    out = {}
    for T in (4096, 32768):
        a = [jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32, sharding=sh)] * 4
        a.append(jax.ShapeDtypeStruct((1, T, 2), jnp.float32, sharding=sh))
        txt = jax.jit(jax.value_and_grad(f, argnums=range(5)), out_shardings=(None, (sh,) * 5)).lower(*a) \
            .compile().as_text()
        out[str(T)] = collective_bytes(txt)
    return out


def muon_check(mesh) -> dict:
    """Per-Head Muon on ``mesh`` (fsdp=4,tensor=2) with Newton–Schulz in whole-head/whole-expert layouts
    (``make_blockwise_optimizer`` + ``muon_plans``) and with every momentum gathered whole (the naive plan), three
    updates of the 3-layer model's parameters against optax's Muon on one device; the compiled updates'
    all-gathers (by result size) and memory analysis."""
    from flax import nnx
    from small_models import MODEL

    from k3jax.nn.model import K3ForCausalLM
    from k3jax.parallel.hlo import collectives
    from k3jax.parallel.rules import axes_tree, shard_pure
    from k3jax.train.loop import TrainConfig, model_config
    from k3jax.train.optim import (OptimConfig, make_blockwise_optimizer, make_reference_optimizer, muon_dims_tree,
                                   muon_plans)

    st = nnx.state(K3ForCausalLM(model_config(TrainConfig.load(None, list(MODEL))), rngs=nnx.Rngs(0)), nnx.Param)
    params, axes, dims = nnx.to_pure_dict(st), axes_tree(st), muon_dims_tree(st)
    keys = iter(jax.random.split(jax.random.key(1), 10_000))
    grads = [jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype), params) for _ in range(3)]
    fp32 = OptimConfig(ns_dtype="fp32")          # against optax's iteration, which runs in the parameters' dtype
    ref = make_reference_optimizer(dims, 100, fp32)
    r_state, ref_updates = ref.init(params), []
    for g in grads:
        u, r_state = jax.jit(ref.update)(g, r_state, params)
        ref_updates.append(u)
    leaves = jax.tree.leaves(params)
    muon_sizes = sorted({x.size for x, d in zip(leaves, jax.tree.leaves(dims, is_leaf=lambda d: d is None or
                                                                        not isinstance(d, dict))) if d is not None})
    sp = shard_pure(params, axes, mesh)
    out = {"muon_params": sum(d is not None for d in jax.tree.leaves(dims, is_leaf=lambda d: d is None or
                                                                    not isinstance(d, dict))),
           "smallest_muon_param_elements": muon_sizes[0], "update_scale": float(scale_of(ref_updates[-1]))}
    for name, naive in (("blocks", False), ("naive", True)):
        opt = make_blockwise_optimizer(dims, 100, fp32, muon_plans(st, mesh, naive=naive))
        state = jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding) and
                             x.sharding.mesh == mesh else jax.device_put(x, NamedSharding(mesh, P())), opt.init(sp))
        compiled = jax.jit(opt.update).lower(shard_pure(grads[0], axes, mesh), state, sp).compile()
        diffs = []
        for g, ru in zip(grads, ref_updates):
            u, state = compiled(shard_pure(g, axes, mesh), state, sp)
            diffs.append(float(maxdiff(u, ru)))
        gathers = [c for c in collectives(compiled.as_text()) if c["op"] == "all-gather" and c["group_size"] != 1]
        mem = compiled.memory_analysis()
        out[name] = {"max_update_diff": max(diffs), "all_gathers": len(gathers),
                     "largest_all_gather_elements": max([c["result_bytes"] // 4 for c in gathers] or [0]),
                     "temp_bytes": int(mem.temp_size_in_bytes)}
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    import time

    res, seconds = {}, {}
    for name, fn, mesh in (("kernels", kernels, "context=4,data=2"), ("hlo", hlo_bytes, "context=4"),
                           ("model", model_check, "context=4,data=2"),
                           ("scanned", functools.partial(model_check, scanned=True), "context=4,data=2")):
        t0 = time.perf_counter()
        devices = jax.devices()[:4] if mesh == "context=4" else None
        res[name] = fn(ContextParallel(make_mesh(mesh, devices)))
        seconds[name] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    res["muon"] = muon_check(make_mesh("fsdp=4,tensor=2"))
    seconds["muon"] = round(time.perf_counter() - t0, 1)
    res["seconds"] = seconds
    print(json.dumps(res))
