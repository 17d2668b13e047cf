"""Inference: decode latency vs context, cache bytes vs ``inspect``'s prediction, decode speed vs transformers,
and a long chunked prefill's peak memory.

    .venv/bin/python -m benchmarks.inference decode  [--contexts 1024 4096 16384 32768] [--json out.json]
    .venv/bin/python -m benchmarks.inference cache   [--json out.json]
    .venv/bin/python -m benchmarks.inference vs-transformers [--tokens 64] [--json out.json]
    .venv/bin/python -m benchmarks.inference prefill [--tokens 131072] [--json out.json]   (one process per run)

``decode``: per-token latency of the model's jitted decode step (one token over a contiguous cache, greedy) of the
``100m`` preset (9 KDA + 3 MLA layers) with a filled cache of ``context`` tokens — the cache is filled with random latents, not by a prefill, since the step's
work does not depend on the values — median of ``--steps`` steps after warm-up; also the same-size KDA-only and
MLA-only variants, which separate the flat KDA part from the MLA part that grows with the context.
``cache``: per-sequence bytes of the engine's cache arrays at each context, next to ``k3jax inspect``'s
prediction (``costs.decode_state``) at the model's activation width.
``vs-transformers``: greedy decode tokens/s of k3jax's engine vs ``KimiLinearForCausalLM.generate`` on the same
random Kimi-Linear-shaped tiny model (the oracle fixture's), same process, same CPU threads.
``prefill``: chunked prefill of ``--tokens`` random tokens into the ``100m`` preset; peak RSS of the process
(``ru_maxrss``) and the cache's share of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import K3Config, K3ForCausalLM
from k3jax.costs import decode_state
from k3jax.infer import Engine
from k3jax.infer.engine import length_bucket
from k3jax.nn.cache import cache_bytes, init_cache


def machine() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version(),
            "jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count()}


def variant(kind: str, max_len: int) -> K3Config:
    cfg = K3Config.from_preset("100m").replace(max_position_embeddings=max_len)
    lac, n = cfg.linear_attn_config, cfg.num_hidden_layers
    if kind == "kda_only":
        lac = dataclasses.replace(lac, kda_layers=list(range(1, n + 1)), full_attn_layers=[])
    elif kind == "mla_only":
        lac = dataclasses.replace(lac, kda_layers=[], full_attn_layers=list(range(1, n + 1)))
    return cfg.replace(linear_attn_config=lac)


def filled_cache(cfg: K3Config, context: int, extra: int, chunk: int, seed: int = 0):
    """A batch-1 cache holding ``context`` tokens of random latents and random (bounded) KDA state."""
    cache = init_cache(cfg, 1, length_bucket(context + extra, chunk))
    key = jax.random.key(seed)
    layers = []
    for i, c in enumerate(cache.layers):
        k = jax.random.fold_in(key, i)
        leaves, tree = jax.tree.flatten(c)
        layers.append(jax.tree.unflatten(tree, [(0.1 * jax.random.normal(jax.random.fold_in(k, j), x.shape))
                                                .astype(x.dtype) for j, x in enumerate(leaves)]))
    return dataclasses.replace(cache, layers=tuple(layers), lengths=jnp.full((1,), context, jnp.int32))


def decode_step(model):
    """The model's one-token decode step over a contiguous cache (greedy), jitted; ``.compiles`` counts traces."""
    graphdef, state = nnx.split(model)

    def step(state, cache, tok):
        run.compiles += 1
        out = nnx.merge(graphdef, state)(tok[:, None], cache=cache)
        return jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32), out.cache

    fn = jax.jit(step, donate_argnums=(1,))

    def run(cache, tok):
        return fn(state, cache, tok)

    run.compiles = 0
    return run


def bench_decode(contexts: list[int], steps: int, kinds: list[str]) -> list[dict]:
    rows = []
    for kind in kinds:
        cfg = variant(kind, max(contexts) + 1024)
        model = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
        step = decode_step(model)
        for ctx in contexts:
            cache = filled_cache(cfg, ctx, steps + 8, 256)
            tok = jnp.zeros((1,), jnp.int32)
            times = []
            for i in range(steps + 3):
                t = time.perf_counter()
                tok, cache = step(cache, tok)
                tok.block_until_ready()
                if i >= 3:
                    times.append(time.perf_counter() - t)
            lat = statistics.median(times)
            rows.append({"model": kind, "context": ctx, "bucket": cache.capacity or None, "latency_ms": 1e3 * lat, "tokens_per_s": 1 / lat,
                         "compiles": {"decode": step.compiles}})
            print(f"decode {kind:>9} context {ctx:>6}: {1e3 * lat:7.2f} ms/token ({1 / lat:6.1f} tokens/s)",
                  flush=True)
    for kind in kinds:
        mine = [r for r in rows if r["model"] == kind]
        base = mine[0]["latency_ms"]
        for r in mine:
            r["latency_vs_first_context"] = r["latency_ms"] / base
    return rows


def bench_cache(contexts: list[int]) -> list[dict]:
    cfg = variant("mixed", max(contexts) + 1024)
    act = jnp.dtype(cfg.dtype).itemsize
    pred = decode_state(cfg, contexts, act_bytes=act)
    rows = []
    for ctx in contexts:
        measured = cache_bytes(init_cache(cfg, 1, length_bucket(ctx, 256)), context=ctx)
        alloc = cache_bytes(init_cache(cfg, 1, length_bucket(ctx, 256)))
        p = pred[str(ctx)]
        rows.append({"context": ctx, "measured_bytes": measured, "allocated_bucket_bytes": alloc["total"],
                     "bucket": length_bucket(ctx, 256),
                     "inspect_prediction": {k: p[k] for k in ("kda_recurrent_state", "kda_conv_state",
                                                              "mla_latent_cache", "total")},
                     "match": all(measured[k] == p[k] for k in ("kda_recurrent_state", "kda_conv_state",
                                                                "mla_latent_cache", "total")),
                     "all_mla_model_bytes": p["all_mla_model"], "plain_mha_bytes": p["plain_mha_cache"]})
        print(f"cache context {ctx:>7}: {measured['total']:>12,} bytes measured, {p['total']:>12,} predicted "
              f"(all-MLA {p['all_mla_model']:,}, plain MHA {p['plain_mha_cache']:,})", flush=True)
    return rows


def bench_vs_transformers(tokens: int, prompt: int, reps: int) -> dict:
    import tempfile

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "oracles"))
    from hf_kimi_linear_fixture import build

    torch.manual_seed(0)
    hf = build(None, 1)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        import k3jax

        ours = k3jax.load_pretrained(d)
    ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(1))
    engine = Engine(ours, chunk=64)
    engine.generate([ids[0].tolist()], tokens)                      # compile
    t_ours, t_hf = [], []
    for _ in range(reps):
        r = engine.generate([ids[0].tolist()], tokens)
        t_ours.append(r.stats["decode_s"] / max(r.stats["decode_steps"], 1))
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
            t = time.perf_counter()
            g1 = hf.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            t1 = time.perf_counter() - t
            t = time.perf_counter()
            g = hf.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
            tn = time.perf_counter() - t
        t_hf.append((tn - t1) / (tokens - 1))                      # decode steps only: minus prefill + 1 token
    same = g[0, prompt:].tolist() == r.tokens[0]
    res = {"tokens": tokens, "prompt": prompt, "torch_threads": torch.get_num_threads(),
           "k3jax_ms_per_token": 1e3 * statistics.median(t_ours), "transformers_ms_per_token":
           1e3 * statistics.median(t_hf), "same_greedy_tokens": same, "config": "oracle fixture "
           "(tests/oracles/hf_kimi_linear_fixture.py): 3 KDA + 1 MLA, hidden 64, 8 experts top-2, fp32"}
    res["speedup"] = res["transformers_ms_per_token"] / res["k3jax_ms_per_token"]
    print(f"vs transformers: k3jax {res['k3jax_ms_per_token']:.2f} ms/token, transformers "
          f"{res['transformers_ms_per_token']:.2f} ms/token → {res['speedup']:.1f}×; same tokens {same}", flush=True)
    del g1
    return res


def bench_prefill(tokens: int, chunk: int) -> dict:
    cfg = variant("mixed", tokens + 16)
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model, chunk=chunk)
    ids = np.random.default_rng(0).integers(0, 256, tokens).tolist()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = time.perf_counter()
    done = [0]

    def progress(n: int, total: int) -> None:
        if n - done[0] >= max(total // 16, chunk) or n == total:
            done[0] = n
            el = time.perf_counter() - t
            print(f"  prefill {n:>7}/{total} tokens, {el:7.1f} s, peak RSS "
                  f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB", flush=True)

    cache, last, lengths = engine.prefill([ids], 1, progress=progress)
    last.block_until_ready()
    secs = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cb = cache_bytes(cache)
    res = {"tokens": tokens, "chunk": chunk, "seconds": secs, "tokens_per_s": tokens / secs,
           "peak_rss_bytes": rss, "rss_before_prefill_bytes": rss0, "cache_bytes": cb,
           "finite_logits": bool(np.isfinite(np.asarray(last)).all()), "compiles": dict(engine.traces)}
    print(f"prefill {tokens} tokens in {secs:.0f} s ({tokens / secs:.0f} tokens/s); peak RSS {rss / 2**30:.2f} GiB "
          f"(before prefill {rss0 / 2**30:.2f} GiB; cache {cb['total'] / 2**20:.1f} MiB)", flush=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["decode", "cache", "vs-transformers", "prefill"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kinds", nargs="+", default=["mixed", "kda_only", "mla_only"])
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res: dict = {"benchmark": f"inference.{a.what}", **machine(), "command": " ".join(sys.argv)}
    if a.what == "decode":
        res["rows"] = bench_decode(a.contexts, a.steps, a.kinds)
        m = [r for r in res["rows"] if r["model"] == "mixed"]
        res["target_latency_ratio_last_vs_first"] = {"measured": m[-1]["latency_ms"] / m[0]["latency_ms"],
                                                     "target": 1.3, "contexts": [m[0]["context"], m[-1]["context"]]}
    elif a.what == "cache":
        res["rows"] = bench_cache(a.contexts + [131072])
    elif a.what == "vs-transformers":
        res["result"] = bench_vs_transformers(a.tokens or 64, 32, a.reps)
    else:
        res["result"] = bench_prefill(a.tokens or 131072, a.chunk)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
