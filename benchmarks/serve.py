"""Serving: output tokens/s, TTFT and TPOT of the OpenAI-compatible server under concurrent streaming clients,
against the same requests run one at a time through the offline engine; cache bytes per slot vs ``inspect``.

    .venv/bin/python -m benchmarks.serve [--quick] [--concurrency 1 4 16 32] [--requests 32] [--plot out.png] [--json out.json]

One process, one run: the ``100m`` preset with random weights (``nnx.Rngs(0)``) is served in-process by
``k3jax.serve.build_server`` (``max_slots`` = the largest concurrency, paged MLA cache) on 127.0.0.1, and a fixed,
seeded mix of requests — token-id prompts of lengths drawn from ``--prompt-lengths``, ``max_tokens`` drawn from
``--output-lengths``, greedy, ``ignore_eos`` so that each generates exactly ``max_tokens`` — is sent with
``stream: true`` by ``httpx.AsyncClient`` at each concurrency level (at most ``c`` requests in flight, an
``asyncio.Semaphore``; the same mix at every level, in the same order). Per request, from the client's side: TTFT =
send → first content chunk; TPOT = (last − first content chunk) / (tokens − 1). Per level: output tokens/s = tokens
generated / wall time of the level; TTFT and TPOT p50 / p99 over the requests; preemptions, decode steps and slot /
page occupancy from ``/metrics`` before and after (slots and pages must all be free again afterwards).

Baseline: the same requests one at a time through ``k3jax.infer.Engine.generate`` (what ``k3jax.generate`` runs;
one engine, warmed up on every cache bucket of the mix first, so no compilation is timed), timed the same way
(``on_token`` timestamps): sequential output tokens/s = tokens / total wall time, and the engine's batch-1 TPOT.

Targets (the issue's): at concurrency 16, output tokens/s ≥ 6× the sequential figure, with TPOT p50 ≤ 2× the
single-stream TPOT — taken as the server's own TPOT p50 at concurrency 1 (the engine's batch-1 TPOT is recorded
next to it, with the ratio against it too).

Streamed text: prompts are token ids, but the server streams text. The benchmark's tokenizer (``IdTokenizer``) maps
each id to one character (U+4E00 + id), so every generated token is exactly one streamed character — the byte
tokenizer would drop ids ≥ 256 and hold back incomplete UTF-8, so chunks would not be tokens — and the client reads
back the token ids, which are compared with the engine's greedy tokens (``greedy_identical``).

Memory: the server's cache per slot at context T (``Scheduler.memory()``: KDA state + conv windows per slot, MLA
latent bytes per token × T) against ``k3jax inspect``'s ``decode_state_bytes_per_sequence``
(``costs.inspect_config``: bf16 activations by convention) at inspect's contexts, and against ``costs.decode_state``
at the model's own activation width (should match exactly).

``--quick``: 8 requests, concurrency 1 and 4, short prompts and outputs (a smoke run of a few minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FULL = {"requests": 32, "prompt_lengths": [16, 64, 128, 256], "output_lengths": [48, 64, 96],
        "concurrency": [1, 4, 16, 32], "max_model_len": 1024}
QUICK = {"requests": 8, "prompt_lengths": [16, 64, 128], "output_lengths": [8, 16], "concurrency": [1, 4],
         "max_model_len": 256}
TARGET_C, TARGET_SPEEDUP, TARGET_TPOT = 16, 6.0, 2.0
BASE = 0x4E00                                     # IdTokenizer: id i ↔ chr(BASE + i)


class IdTokenizer:
    """One character per token id (``chr(0x4E00 + id)``): every generated token is one streamed character, and
    the client reads the ids back. BOS/EOS/PAD as the preset's config."""

    name = "ids"

    def __init__(self, cfg):
        self.bos_id, self.eos_id, self.pad_id = cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id
        self.vocab_size = cfg.vocab_size

    def encode(self, text: str) -> list[int]:
        return [ord(c) - BASE for c in text]

    encode_ordinary = encode

    def special_id(self, name: str) -> None:
        return None

    def decode(self, ids) -> str:
        return "".join(chr(BASE + int(i)) for i in ids)


def machine() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version(),
            "jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(),
            "cpus": os.cpu_count()}


def request_mix(n: int, prompts: list[int], outputs: list[int], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    pl, ol = rng.choice(prompts, n), rng.choice(outputs, n)
    return [{"prompt": rng.integers(0, 256, int(p)).tolist(), "max_tokens": int(o)} for p, o in zip(pl, ol)]


def pcts(xs) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"p50": None, "p99": None, "mean": None}
    p50, p99 = np.percentile(xs, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "mean": float(np.mean(xs))}


def per_request(t_send: float, times: list[float], n_want: int) -> dict:
    n = len(times)
    return {"ttft_s": times[0] - t_send if times else None,
            "tpot_s": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
            "tokens": n, "complete": n == n_want, "latency_s": (times[-1] - t_send) if times else None}


# ------------------------------------------------------------------------------------------------ baseline
def run_sequential(model, mix: list[dict], chunk: int) -> tuple[dict, list[list[int]]]:
    from k3jax.infer import Engine
    from k3jax.infer.engine import length_bucket

    engine = Engine(model, chunk=chunk)
    buckets = sorted({length_bucket(len(r["prompt"]) + r["max_tokens"], chunk) for r in mix})
    t = time.perf_counter()
    for b in buckets:                                  # compile every step shape for every cache bucket of the mix
        engine.scheduler(1, b).warmup()
    warm = time.perf_counter() - t
    print(f"sequential: engine warmed up on cache buckets {buckets} in {warm:.1f} s", flush=True)
    traces0 = dict(engine.traces)
    rows, tokens = [], []
    t0 = time.perf_counter()
    for r in mix:
        stamps: list[float] = []
        ts = time.perf_counter()
        res = engine.generate([r["prompt"]], r["max_tokens"], on_token=lambda b, tok, stamps=stamps:
                              stamps.append(time.perf_counter()))
        rows.append(per_request(ts, stamps, r["max_tokens"]))
        tokens.append(res.tokens[0])
    wall = time.perf_counter() - t0
    n = sum(x["tokens"] for x in rows)
    out = {"loadavg_after": list(os.getloadavg()), "wall_s": wall, "output_tokens": n, "tokens_per_s": n / wall, "warmup_s": warm, "cache_buckets": buckets,
           "ttft_s": pcts([x["ttft_s"] for x in rows]), "tpot_s": pcts([x["tpot_s"] for x in rows]),
           "recompiled": dict(engine.traces) != traces0, "compiles": dict(engine.traces)}
    print(f"sequential: {n} tokens in {wall:.1f} s = {out['tokens_per_s']:.2f} tokens/s; TTFT p50 "
          f"{1e3 * out['ttft_s']['p50']:.0f} ms, TPOT p50 {1e3 * out['tpot_s']['p50']:.1f} ms", flush=True)
    return out, tokens


# ------------------------------------------------------------------------------------------------- server
def parse_metrics(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(k3jax_(?:slots_in_use|max_slots|free_pages|num_pages|queue_length|preemptions_total|"
                     r"steps_total|decode_steps_total|prefill_chunks_total))\s+(\S+)$", line)
        if m:
            out[m.group(1).removeprefix("k3jax_").removesuffix("_total")] = float(m.group(2))
    return out


async def stream_tokens(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float], list[int]]:
    """One greedy streamed completion: ``(send time, arrival time of each token, token ids)`` (one character per
    token: :class:`IdTokenizer`)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    times, ids = [], []
    t_send = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"server error: {obj['error']}")
            text = obj["choices"][0]["text"] if obj.get("choices") else ""
            if text:
                now = time.perf_counter()
                for c in text:
                    times.append(now)
                    ids.append(ord(c) - BASE)
    return t_send, times, ids


async def one(client, url: str, r: dict, sem: asyncio.Semaphore) -> tuple[dict, list[int]]:
    async with sem:
        t_send, times, ids = await stream_tokens(client, url, r["prompt"], r["max_tokens"])
        return per_request(t_send, times, r["max_tokens"]), ids


async def run_level(url: str, mix: list[dict], c: int) -> tuple[dict, list[list[int]]]:
    import httpx

    sem = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        before = parse_metrics((await client.get(f"{url}/metrics")).text)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(client, url, r, sem) for r in mix))
        wall = time.perf_counter() - t0
        after = {}
        for _ in range(200):                           # slots and pages are freed as each request finishes
            after = parse_metrics((await client.get(f"{url}/metrics")).text)
            if after.get("slots_in_use") == 0 and after.get("queue_length") == 0:
                break
            await asyncio.sleep(0.05)
    rows = [d[0] for d in done]
    n = sum(x["tokens"] for x in rows)
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    res = {"concurrency": c, "loadavg_after": list(os.getloadavg()), "wall_s": wall, "output_tokens": n, "tokens_per_s": n / wall,
           "ttft_s": pcts([x["ttft_s"] for x in rows]), "tpot_s": pcts([x["tpot_s"] for x in rows]),
           "all_complete": all(x["complete"] for x in rows),
           "preemptions": after.get("preemptions", 0) - before.get("preemptions", 0),
           "decode_steps": steps, "prefill_chunks": after.get("prefill_chunks", 0) - before.get("prefill_chunks", 0),
           "scheduler_steps": after.get("steps", 0) - before.get("steps", 0),
           # the first token of each request comes from its last prefill chunk, the rest from decode steps
           "mean_decode_batch": (n - len(rows)) / steps if steps else None,
           "slots_in_use_after": after.get("slots_in_use"), "queue_length_after": after.get("queue_length"),
           "free_pages_after": after.get("free_pages"), "num_pages": after.get("num_pages"),
           "all_free_after": after.get("slots_in_use") == 0 and after.get("free_pages") == after.get("num_pages")}
    return res, [d[1] for d in done]


def cache_memory(sched, cfg, contexts: list[int]) -> dict:
    from k3jax.costs import decode_state, inspect_config

    mem = sched.memory()
    per_slot = lambda T: mem["kda_state_bytes_per_slot"] + mem["mla_bytes_per_token"] * T
    inspect = inspect_config(cfg)["decode_state_bytes_per_sequence"]
    act = jnp.dtype(cfg.dtype).itemsize
    rows = []
    for T in sorted({*map(int, inspect), *contexts}):
        own = decode_state(cfg, [T], act_bytes=act)[str(T)]["total"]
        ins = (inspect.get(str(T)) or decode_state(cfg, [T])[str(T)])["total"]   # inspect's convention elsewhere
        rows.append({"context": T, "server_bytes_per_slot": per_slot(T), "inspect_prediction_bytes": ins,
                     "inspect_is_reported_context": str(T) in inspect,
                     "ratio_vs_inspect": per_slot(T) / ins, "prediction_at_model_dtype_bytes": own,
                     "ratio_vs_model_dtype_prediction": per_slot(T) / own})
    sz = sched.sizes
    return {**mem, "max_slots": sz.max_slots, "max_model_len": sz.max_model_len, "page_size": sz.page_size,
            "num_pages": sz.num_pages, "allocated_bytes_per_slot": mem["total_bytes"] / sz.max_slots,
            "model_dtype": str(cfg.dtype), "inspect_convention": "bf16 activations (conv windows, MLA latent); "
            "KDA state fp32", "rows": rows}


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lv = res["levels"]
    cs = [x["concurrency"] for x in lv]
    seq = res["sequential"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(cs, [x["tokens_per_s"] for x in lv], "o-", label="server")
    a1.axhline(seq["tokens_per_s"], color="gray", ls="--", label="sequential (Engine.generate)")
    a1.axhline(TARGET_SPEEDUP * seq["tokens_per_s"], color="tab:red", ls=":", label=f"target {TARGET_SPEEDUP:g}× sequential")
    a1.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    a2.plot(cs, [1e3 * x["tpot_s"]["p50"] for x in lv], "o-", label="server TPOT p50")
    a2.plot(cs, [1e3 * x["tpot_s"]["p99"] for x in lv], "x--", color="tab:blue", alpha=0.5, label="server TPOT p99")
    a2.axhline(1e3 * seq["tpot_s"]["p50"], color="gray", ls="--", label="engine batch-1 TPOT p50")
    a2.axhline(TARGET_TPOT * 1e3 * lv[0]["tpot_s"]["p50"], color="tab:red", ls=":",
               label=f"target {TARGET_TPOT:g}× c={cs[0]}")
    a2.set(xscale="log", xlabel="concurrency", ylabel="ms / output token", title="TPOT")
    for a in (a1, a2):
        a.minorticks_off()
        a.set_xticks(cs, [str(c) for c in cs])
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    s = res["setup"]
    fig.suptitle(f"k3jax serve, {s['preset']} (random weights), {s['requests']} requests, "
                 f"{s['max_slots']} slots, {res.get('backend', '')}", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------- main
def mismatches(model, mix, got, want) -> list[dict]:
    """Where a server answer differs from the engine's: the request, the first differing position, the two tokens
    and the margin between the best two logits there (full forward over the prompt + the engine's tokens before it):
    a margin near the float32 noise of a different batch composition (~1e-6) means a near-tie, not a fault."""
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        k = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        seq = list(mix[i]["prompt"]) + list(w[:k])
        logits = np.asarray(model(jnp.asarray([seq], jnp.int32)).logits[0, -1], np.float64)
        top = np.sort(logits)[-2:]
        out.append({"request": i, "prompt_tokens": len(mix[i]["prompt"]), "position": k,
                    "server_token": g[k] if k < len(g) else None, "engine_token": w[k] if k < len(w) else None,
                    "top2_logit_margin": float(top[1] - top[0])})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke-run sizes: " + json.dumps(QUICK))
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--requests", type=int, default=None, help=f"requests in the mix (default {FULL['requests']})")
    ap.add_argument("--prompt-lengths", type=int, nargs="+", default=None)
    ap.add_argument("--output-lengths", type=int, nargs="+", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--max-slots", type=int, default=None, help="server slots (default: the largest concurrency)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-step-tokens", type=int, default=None,
                    help="the server's per-step token budget (decode tokens + one prefill chunk; default its chunk)")
    ap.add_argument("--no-mixed-steps", action="store_true", help="the server runs decode rows and a prefill chunk "
                    "as two forwards (EngineConfig.mixed_steps off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="write a PNG of tokens/s and TPOT vs concurrency here")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    d = QUICK if a.quick else FULL
    n_req = a.requests or d["requests"]
    prompts, outputs = a.prompt_lengths or d["prompt_lengths"], a.output_lengths or d["output_lengths"]
    levels = sorted(a.concurrency or d["concurrency"])
    max_slots = a.max_slots or max(levels)
    max_len = a.max_model_len or d["max_model_len"]
    if max(prompts) + max(outputs) > max_len:
        ap.error(f"--max-model-len {max_len} < longest prompt + output ({max(prompts) + max(outputs)})")

    from k3jax import K3ForCausalLM
    from k3jax.config import resolve_config
    from k3jax.infer import EngineConfig
    from k3jax.serve import ServerOptions, build_server

    load0 = os.getloadavg()
    cfg = resolve_config(a.preset)
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.split(model, nnx.Param, ...)[1]))
    mix = request_mix(n_req, prompts, outputs, a.seed)
    setup = {"preset": a.preset, "params": int(n_params), "weights": "random (nnx.Rngs(0))", "dtype": str(cfg.dtype),
             "requests": n_req, "prompt_lengths": prompts, "output_lengths": outputs, "seed": a.seed,
             "concurrency": levels, "max_slots": max_slots, "max_model_len": max_len, "chunk": a.chunk,
             "max_step_tokens": a.max_step_tokens or a.chunk, "page_size": a.page_size,
             "mixed_steps": not a.no_mixed_steps, "prompt_tokens": sum(len(r["prompt"]) for r in mix),
             "output_tokens": sum(r["max_tokens"] for r in mix), "sampling": "greedy, ignore_eos, stream",
             "tokenizer": "IdTokenizer (one character per id)", "client": "httpx.AsyncClient over 127.0.0.1"}
    print(f"serve: {a.preset} ({n_params / 1e6:.0f}M params), {n_req} requests (prompts {prompts}, outputs "
          f"{outputs}: {setup['prompt_tokens']} prompt + {setup['output_tokens']} output tokens), concurrency "
          f"{levels}, {max_slots} slots, max_model_len {max_len}", flush=True)

    seq, seq_tokens = run_sequential(model, mix, a.chunk)

    t = time.perf_counter()
    engine = EngineConfig(max_slots=max_slots, max_model_len=max_len, chunk=a.chunk, page_size=a.page_size,
                          max_step_tokens=a.max_step_tokens, mixed_steps=not a.no_mixed_steps)
    srv = build_server(model, engine, ServerOptions(port=0), tokenizer=IdTokenizer(cfg),
                       say=lambda s: print(f"server: {s}", flush=True))
    srv.start_background()
    startup = time.perf_counter() - t
    compiles0 = dict(srv.scheduler.snapshot()["compiles"])
    try:
        asyncio.run(run_level(srv.url, [{"prompt": [1, 2, 3, 4], "max_tokens": 2}], 1))   # first HTTP request
        rows = []
        for c in levels:
            r, toks = asyncio.run(run_level(srv.url, mix, c))
            r["greedy_identical"] = sum(x == y for x, y in zip(toks, seq_tokens))
            r["greedy_mismatches"] = mismatches(model, mix, toks, seq_tokens)
            r["speedup_vs_sequential"] = r["tokens_per_s"] / seq["tokens_per_s"]
            rows.append(r)
            print(f"c={c:>3}: {r['output_tokens']} tokens in {r['wall_s']:.1f} s = {r['tokens_per_s']:.2f} tokens/s "
                  f"({r['speedup_vs_sequential']:.2f}× sequential); TTFT p50/p99 {1e3 * r['ttft_s']['p50']:.0f}/"
                  f"{1e3 * r['ttft_s']['p99']:.0f} ms, TPOT p50/p99 {1e3 * r['tpot_s']['p50']:.1f}/"
                  f"{1e3 * r['tpot_s']['p99']:.1f} ms; mean decode batch {r['mean_decode_batch'] or 0:.1f}; "
                  f"preemptions {r['preemptions']:.0f}; greedy = engine {r['greedy_identical']}/{n_req}; "
                  f"all free after: {r['all_free_after']}", flush=True)
        snap = srv.scheduler.snapshot()
        memory = cache_memory(srv.scheduler, cfg, [max_len])
    finally:
        srv.stop()
    c1 = rows[0]
    tc = TARGET_C if TARGET_C in levels else levels[-1]
    rt = next(r for r in rows if r["concurrency"] == tc)
    speedup = rt["tokens_per_s"] / seq["tokens_per_s"]
    ratio = rt["tpot_s"]["p50"] / c1["tpot_s"]["p50"]
    targets = {"concurrency": tc, "is_issue_level": tc == TARGET_C, "single_stream": f"server TPOT p50 at c={c1['concurrency']}",
               "speedup": speedup, "speedup_target": TARGET_SPEEDUP, "target_speedup_met": speedup >= TARGET_SPEEDUP,
               "tpot_ratio": ratio, "tpot_ratio_target": TARGET_TPOT, "target_tpot_met": ratio <= TARGET_TPOT,
               "tpot_ratio_vs_engine_batch1": rt["tpot_s"]["p50"] / seq["tpot_s"]["p50"],
               "c1_tpot_vs_engine_batch1": c1["tpot_s"]["p50"] / seq["tpot_s"]["p50"]}
    res = {"benchmark": "serve", **machine(), "command": " ".join(sys.argv), "setup": setup,
           "startup": {"build_and_start_s": startup, "server_startup_s": srv.startup_s, "compiled": srv.compiled,
                       "compiles_after_warmup": compiles0, "compiles_at_end": snap["compiles"],
                       "recompiled_while_serving": snap["compiles"] != compiles0},
           "sequential": seq, "levels": rows, "targets": targets, "memory": memory,
           "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg())}
    if tc == TARGET_C:
        res.update(speedup_c16=speedup, tpot_ratio_c16=ratio, target_speedup_met=speedup >= TARGET_SPEEDUP,
                   target_tpot_met=ratio <= TARGET_TPOT)
    m0 = next(x for x in memory["rows"] if x["context"] == 4096)
    print(f"targets at c={tc}: {speedup:.2f}× sequential tokens/s (target ≥ {TARGET_SPEEDUP:g}: "
          f"{'met' if speedup >= TARGET_SPEEDUP else 'NOT met'}); TPOT p50 {ratio:.2f}× c=1 (target ≤ "
          f"{TARGET_TPOT:g}: {'met' if ratio <= TARGET_TPOT else 'NOT met'}); {targets['tpot_ratio_vs_engine_batch1']:.2f}× "
          f"the engine's batch-1 TPOT", flush=True)
    print(f"cache per slot at 4096 tokens: {m0['server_bytes_per_slot']:,} bytes; inspect predicts "
          f"{m0['inspect_prediction_bytes']:,} (bf16; ratio {m0['ratio_vs_inspect']:.3f}), at {cfg.dtype} "
          f"{m0['prediction_at_model_dtype_bytes']:,} (ratio {m0['ratio_vs_model_dtype_prediction']:.3f})", flush=True)
    if a.plot:
        plot(res, a.plot)
        res["plot"] = a.plot
        print(f"wrote {a.plot}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
