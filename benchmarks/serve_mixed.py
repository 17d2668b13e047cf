"""Serving while long prompts keep arriving: TPOT and output tokens/s of concurrent decode streams with mixed steps
(the decoding rows and the step's prefill chunk in one forward) against two forwards per step; and the steady
decode step's time with fresh host buffers against blocking host-to-device copies.

    .venv/bin/python -m benchmarks.serve_mixed [--quick] [--modes mixed separate] [--json out.json] [--plot out.png]

(a) **Arrivals** (per mode, one server each, in-process on 127.0.0.1, the ``100m`` preset with random weights
    ``nnx.Rngs(0)``): ``clients`` streaming clients each send ``requests`` requests one after another (a
    ``prompt``-token id prompt, ``max_tokens`` greedy tokens, ``ignore_eos``), while one more client sends
    ``long``-token prompts (``long_tokens`` tokens each) back to back until the decode clients are done — so a
    prefill chunk is in nearly every step. From the client side: TPOT per decode request ((last − first token) /
    (tokens − 1)) p50 / p99, the gap between consecutive tokens p50 / p99 (what a reader sees stall), output
    tokens/s of the decode clients (their tokens / the wall time from the first send to the last token), the long
    prompts' TTFT, and the server's step counters. ``mixed``: ``EngineConfig(mixed_steps=True)`` (the default);
    ``separate``: two forwards, a prefill chunk's and the decode rows' (each reading every weight), as before
    mixed steps existed. Run from an older checkout (``PYTHONPATH=…/src``), ``separate`` drives that checkout's
    own server (its build API detected) — the "before" figure.
(b) **Step time**: one scheduler in-process, ``clients`` requests decoding (no prefill), the median wall time of
    ``steps`` steady steps: ``fresh`` (host inputs handed to the runner as fresh numpy arrays) against
    ``blocking`` (every host input first copied to the device and waited for, as the engine did before: the
    blocking ``_dev`` copy). From an older checkout: that checkout's own steps (``old``).

The greedy tokens of every decode request are checked against each other across modes (they must be equal).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FULL = {"clients": 16, "requests": 3, "prompt": 32, "max_tokens": 48, "long_tokens": 1024, "long_max_tokens": 4,
        "max_slots": 20, "max_model_len": 1152, "chunk": 256, "steps": 30}
QUICK = {"clients": 4, "requests": 1, "prompt": 16, "max_tokens": 12, "long_tokens": 192, "long_max_tokens": 2,
         "max_slots": 6, "max_model_len": 256, "chunk": 64, "steps": 8}


def checkout() -> dict:
    """Which k3jax this process imported (the before / after of a comparison)."""
    import k3jax

    src = Path(k3jax.__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(src), "status", "--porcelain", "src"], capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"path": str(src), "commit": commit, "dirty": dirty}


def pcts(xs) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"p50": None, "p99": None, "mean": None, "n": 0}
    p50, p99 = np.percentile(xs, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "mean": float(np.mean(xs)), "n": len(xs)}


# ------------------------------------------------------------------------------------------- the servers
def start_server(model, tokenizer, p: dict, mixed: bool):
    """A background server on this checkout's build API (the current one, or the one before EngineConfig)."""
    from k3jax.serve import build_server

    say = lambda s: print(f"server: {s}", file=sys.stderr, flush=True)  # noqa: E731
    if "engine" in inspect.signature(build_server).parameters:
        from k3jax.infer import EngineConfig
        from k3jax.serve import ServerOptions

        engine = EngineConfig(max_slots=p["max_slots"], max_model_len=p["max_model_len"], chunk=p["chunk"],
                              mixed_steps=mixed, prefix_cache=False)
        srv = build_server(model, engine, ServerOptions(port=0), tokenizer=tokenizer, say=say)
    else:
        if mixed:
            raise SystemExit("this checkout has no mixed steps: run --modes separate")
        srv = build_server(model, tokenizer=tokenizer, port=0, max_slots=p["max_slots"],
                           max_model_len=p["max_model_len"], chunk=p["chunk"], prefix_cache=False, say=say)
    return srv.start_background()


async def stream(client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float], list[int]]:
    from benchmarks.serve import BASE

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    times, ids = [], []
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"server error: {obj['error']}")
            text = obj["choices"][0]["text"] if obj.get("choices") else ""
            now = time.perf_counter()
            for c in text:                              # one character per token (IdTokenizer)
                times.append(now)
                ids.append(ord(c) - BASE)
    return t0, times, ids


async def arrivals(url: str, p: dict, seed: int) -> dict:
    import httpx

    rng = np.random.default_rng(seed)
    prompts = [[rng.integers(0, 256, p["prompt"]).tolist() for _ in range(p["requests"])]
               for _ in range(p["clients"])]
    longs = [rng.integers(0, 256, p["long_tokens"]).tolist() for _ in range(64)]
    done = asyncio.Event()
    decode, long_ttft = [], []

    async def decoder(client, i):
        for r in range(p["requests"]):
            t0, times, ids = await stream(client, url, prompts[i][r], p["max_tokens"])
            decode.append((i, r, t0, times, ids))

    async def arriving(client):
        k = 0
        while not done.is_set():
            t0, times, _ = await stream(client, url, longs[k % len(longs)], p["long_max_tokens"])
            long_ttft.append(times[0] - t0 if times else None)
            k += 1

    limits = httpx.Limits(max_connections=p["clients"] + 8, max_keepalive_connections=p["clients"] + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        before = (await client.get(f"{url}/metrics")).text
        t0 = time.perf_counter()
        longer = asyncio.create_task(arriving(client))
        await asyncio.gather(*(decoder(client, i) for i in range(p["clients"])))
        wall = max(t[-1] for *_, t, _ in decode if t) - t0
        done.set()
        await longer
        after = (await client.get(f"{url}/metrics")).text
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for *_, t, _ in decode if len(t) > 1]
    gaps = [b - a for *_, t, _ in decode for a, b in zip(t, t[1:])]
    n = sum(len(t) for *_, t, _ in decode)
    counters = {k: counter(after, k) - counter(before, k) for k in ("steps", "decode_steps", "prefill_chunks",
                                                                     "mixed_steps", "decode_rows")}
    return {"wall_s": wall, "output_tokens": n, "tokens_per_s": n / wall, "tpot_s": pcts(tpot),
            "token_gap_s": pcts(gaps), "long_prompts": len(long_ttft), "long_ttft_s": pcts(long_ttft),
            "all_complete": all(len(ids) == p["max_tokens"] for *_, ids in decode), "server": counters,
            "tokens": {f"{i}/{r}": ids for i, r, _, _, ids in decode}}


def counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"k3jax_{name}_total ") or line.startswith(f"k3jax_{name} "):
            return float(line.split()[-1])
    return float("nan")


# ------------------------------------------------------------------------------------------- step time
def step_time(model, p: dict, mode: str) -> dict:
    """Median wall time of steady decode steps with ``clients`` requests decoding (scheduler driven in-process)."""
    from k3jax.infer.scheduler import SamplingParams, Scheduler

    big = dict(max_slots=p["clients"], max_model_len=p["max_model_len"], chunk=p["chunk"], prefix_cache=False)
    new = "config" in inspect.signature(Scheduler).parameters
    if new:
        from k3jax.infer import EngineConfig

        sched = Scheduler(model, EngineConfig(**big))
    else:
        if mode != "old":
            raise SystemExit("this checkout's scheduler is the old one: run --step-modes old")
        sched = Scheduler(model, **big)
    sched.warmup()
    if mode == "blocking":
        block_inputs(sched.runner)
    rng = np.random.default_rng(0)
    n_steps = p["steps"]
    params = SamplingParams(max_tokens=n_steps + 8, ignore_eos=True)
    reqs = [sched.submit(rng.integers(0, 256, p["prompt"]).tolist(), params) for _ in range(p["clients"])]

    def one_step():
        if new:
            sched.step()
        else:
            box = list(sched._inbox)
            sched._inbox.clear()
            sched.step(box)

    while any(len(r.tokens) == 0 for r in reqs):         # every prompt prefilled: steady decode from here
        one_step()
    times = []
    for _ in range(n_steps):
        t = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t)
    return {"mode": mode, "decoding": p["clients"], "steps": n_steps, "step_s": pcts(times)}


def block_inputs(runner) -> None:
    """Every numpy input of a step copied to the device and waited for first (what the engine's ``_dev`` did)."""
    inner = runner._step

    def dev(x):
        return jax.block_until_ready(jnp.array(x, copy=True)) if isinstance(x, np.ndarray) else x

    def run(*args):
        return inner(*[jax.tree.map(dev, a) if a is not None else None for a in args])

    runner._step = run


# ------------------------------------------------------------------------------------------------- main
def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["arrivals"]
    names = [r["mode"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    x = np.arange(len(rows))
    a1.bar(x - 0.2, [1e3 * r["tpot_s"]["p50"] for r in rows], 0.4, label="TPOT p50")
    a1.bar(x + 0.2, [1e3 * r["tpot_s"]["p99"] for r in rows], 0.4, label="TPOT p99")
    a1.set(xticks=x, xticklabels=names, ylabel="ms / output token", title="decode streams, long prompts arriving")
    a1.legend(fontsize=8)
    a2.bar(x, [r["tokens_per_s"] for r in rows], 0.5, color="tab:green")
    a2.set(xticks=x, xticklabels=names, ylabel="output tokens/s", title=f"{res['params']['clients']} streams")
    fig.suptitle(f"k3jax serve, {res['preset']} (random weights), {res['backend']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke-run sizes: " + json.dumps(QUICK))
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--modes", nargs="*", default=["mixed", "separate"], choices=["mixed", "separate"])
    ap.add_argument("--step-modes", nargs="*", default=["fresh", "blocking"], choices=["fresh", "blocking", "old"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    p = dict(QUICK if a.quick else FULL)
    from benchmarks.serve import IdTokenizer
    from k3jax.config import resolve_config
    from k3jax.nn.model import K3ForCausalLM

    cfg = resolve_config(a.preset)
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    res = {"benchmark": "serve_mixed", "preset": a.preset, "params": p, "checkout": checkout(),
           "backend": jax.default_backend(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "jax": jax.__version__, "arrivals": [], "step_time": []}
    tokens = {}
    for mode in a.modes:
        srv = start_server(model, IdTokenizer(cfg), p, mode == "mixed")
        try:
            asyncio.run(stream_once(srv.url))
            r = asyncio.run(arrivals(srv.url, p, a.seed))
        finally:
            srv.stop()
        tokens[mode] = r.pop("tokens")
        res["arrivals"].append({"mode": mode, **r})
        print(f"{mode:>9}: TPOT p50/p99 {1e3 * r['tpot_s']['p50']:.1f}/{1e3 * r['tpot_s']['p99']:.1f} ms, token gap "
              f"p50/p99 {1e3 * r['token_gap_s']['p50']:.1f}/{1e3 * r['token_gap_s']['p99']:.1f} ms, "
              f"{r['tokens_per_s']:.2f} tokens/s; {r['long_prompts']} long prompts (TTFT p50 "
              f"{r['long_ttft_s']['p50'] or 0:.2f} s); steps {r['server']}", flush=True)
    if len(tokens) > 1:
        first = next(iter(tokens.values()))
        res["greedy_identical_across_modes"] = all(t == first for t in tokens.values())
    for mode in a.step_modes:
        r = step_time(model, p, mode)
        res["step_time"].append(r)
        print(f"step time {mode:>9}: p50 {1e3 * r['step_s']['p50']:.1f} ms (p99 {1e3 * r['step_s']['p99']:.1f}) with "
              f"{r['decoding']} rows decoding", flush=True)
    if a.plot and res["arrivals"]:
        plot(res, a.plot)
        res["plot"] = a.plot
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


async def stream_once(url: str) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:                    # the first HTTP request, untimed
        await stream(client, url, [1, 2, 3, 4], 2)


if __name__ == "__main__":
    main()
