"""Serving while long prompts keep arriving: TPOT and output tokens/s of concurrent decode streams with mixed steps
(the decoding rows and the step's prefill chunk in one forward) against two forwards per step; and the steady
decode step's time with fresh host buffers against blocking host-to-device copies.

    .venv/bin/python -m benchmarks.serve_mixed [--quick] [--modes mixed separate] [--before old.json]
                                               [--json out.json] [--plot out.png]

(a) **Arrivals** (per mode, one server each, in-process on 127.0.0.1, the ``100m`` preset with random weights
    ``nnx.Rngs(0)``): ``clients`` streaming clients each send ``requests`` requests one after another (a
    ``prompt``-token id prompt, ``max_tokens`` greedy tokens, ``ignore_eos``), while one more client sends
    ``long``-token prompts (``long_tokens`` tokens each) back to back until the decode clients are done — so a
    prefill chunk is in nearly every step. From the client side: TPOT per decode request ((last − first token) /
    (tokens − 1)) p50 / p99, the gap between consecutive tokens p50 / p99 (what a reader sees stall), output
    tokens/s of the decode clients (their tokens / the wall time from the first send to the last token), the long
    prompts' TTFT, and the server's step counters. ``mixed``: ``EngineConfig(mixed_steps=True)`` (the default);
    ``separate``: two forwards, a prefill chunk's and the decode rows' (each reading every weight), as before
    mixed steps existed. Both modes run on one server (built with mixed steps; the runner's ``mixed`` switch is
    flipped between runs, on the scheduler thread), in ``rounds`` interleaved rounds, so that a slow spell of the
    machine falls on both; TPOTs and gaps are pooled over the rounds, tokens/s is the median round. Run from an
    older checkout (``PYTHONPATH=…/src``), ``separate`` drives that checkout's own server (its build API
    detected) — the "before" figure.
(b) **Step time**: one scheduler in-process, ``clients`` requests decoding (no prefill), the median wall time of
    ``steps`` steady steps per mode and round, interleaved: ``fresh`` (host inputs handed to the runner as fresh
    numpy arrays) against ``blocking`` (every host input first copied to the device and waited for, as the engine
    did before: the blocking ``_dev`` copy). From an older checkout: that checkout's own steps (``old``).

The greedy tokens of every decode request are checked against each other across modes (they must be equal).
``--before FILE``: the JSON of a run from an older checkout (``--modes separate --step-modes old``), stored in the
record beside this run's figures, with the ratios against it.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.serve import stream_tokens

FULL = {"clients": 16, "requests": 2, "prompt": 32, "max_tokens": 48, "long_tokens": 1024, "long_max_tokens": 4,
        "max_slots": 20, "max_model_len": 1152, "chunk": 256, "steps": 20, "rounds": 3}
QUICK = {"clients": 4, "requests": 1, "prompt": 16, "max_tokens": 12, "long_tokens": 192, "long_max_tokens": 2,
         "max_slots": 6, "max_model_len": 256, "chunk": 64, "steps": 6, "rounds": 1}


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
    return {"commit": commit, "dirty": dirty}


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
            t0, times, ids = await stream_tokens(client, url, prompts[i][r], p["max_tokens"])
            decode.append((i, r, t0, times, ids))

    async def arriving(client):
        k = 0
        while not done.is_set():
            t0, times, _ = await stream_tokens(client, url, longs[k % len(longs)], p["long_max_tokens"])
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
    return {"wall_s": wall, "output_tokens": n, "tokens_per_s": n / wall, "tpot": tpot, "gaps": gaps,
            "long_ttft": long_ttft, "all_complete": all(len(ids) == p["max_tokens"] for *_, ids in decode),
            "server": counters, "tokens": {f"{i}/{r}": ids for i, r, _, _, ids in decode}}


def pooled(runs: list[dict]) -> dict:
    """One mode's rounds: TPOTs, gaps and TTFTs pooled, tokens/s per round and its median."""
    tps = [r["tokens_per_s"] for r in runs]
    return {"rounds": len(runs), "tokens_per_s": float(np.median(tps)), "tokens_per_s_rounds": tps,
            "tpot_s": pcts([x for r in runs for x in r["tpot"]]), "token_gap_s": pcts([x for r in runs for x in r["gaps"]]),
            "long_prompts": sum(len(r["long_ttft"]) for r in runs),
            "long_ttft_s": pcts([x for r in runs for x in r["long_ttft"]]),
            "all_complete": all(r["all_complete"] for r in runs),
            "server": {k: sum(r["server"][k] for r in runs) for k in runs[0]["server"]}}


def set_mixed(srv, on: bool) -> bool:
    """Flip the runner's mixed-steps switch on the scheduler thread; False on a checkout without one."""
    sched = srv.scheduler
    if not hasattr(sched, "runner"):
        return False
    sched.call(lambda: setattr(sched.runner, "mixed", on))
    return True


def counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"k3jax_{name}_total ") or line.startswith(f"k3jax_{name} "):
            return float(line.split()[-1])
    return float("nan")


# ------------------------------------------------------------------------------------------- step time
def step_time(model, p: dict, modes: list[str]) -> list[dict]:
    """Median wall time of steady decode steps with ``clients`` requests decoding (the scheduler driven in-process),
    per mode, the modes interleaved over ``rounds`` rounds of ``steps`` steps."""
    from k3jax.infer.scheduler import SamplingParams, Scheduler

    big = dict(max_slots=p["clients"], max_model_len=p["max_model_len"], chunk=p["chunk"], prefix_cache=False)
    new = "config" in inspect.signature(Scheduler).parameters
    if new:
        from k3jax.infer import EngineConfig

        sched = Scheduler(model, EngineConfig(**big))
    else:
        if modes != ["old"]:
            raise SystemExit("this checkout's scheduler is the old one: run --step-modes old")
        sched = Scheduler(model, **big)
    sched.warmup()
    rng = np.random.default_rng(0)
    total = p["rounds"] * len(modes) * p["steps"]
    params = SamplingParams(max_tokens=total + 8, ignore_eos=True)
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
    times: dict[str, list[float]] = {m: [] for m in modes}
    plain = sched.runner._step if new else None
    for _ in range(p["rounds"]):
        for mode in modes:
            if new:
                sched.runner._step = blocking(plain) if mode == "blocking" else plain
            for _ in range(p["steps"]):
                t = time.perf_counter()
                one_step()
                times[mode].append(time.perf_counter() - t)
    return [{"mode": m, "decoding": p["clients"], "steps": len(times[m]), "step_s": pcts(times[m])} for m in modes]


def blocking(inner):
    """``inner`` (the runner's jitted step) with every numpy input first copied to the device and waited for (what
    the engine's ``_dev`` did)."""
    def dev(x):
        return jax.block_until_ready(jnp.array(x, copy=True)) if isinstance(x, np.ndarray) else x

    def run(*args):
        return inner(*[jax.tree.map(dev, a) if a is not None else None for a in args])

    return run


# ------------------------------------------------------------------------------------------------- main
def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(res["arrivals"])
    old = next((r for r in (res.get("before") or {}).get("arrivals", []) if r["mode"] == "separate"), None)
    if old is not None:
        rows.append({**old, "mode": f"before ({(res['before'].get('checkout') or {}).get('commit')})"})
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
    ap.add_argument("--before", default=None, help="JSON of a run from an older checkout, kept beside this one")
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
    tokens, runs = {}, {m: [] for m in a.modes}
    if a.modes:
        srv = start_server(model, IdTokenizer(cfg), p, "mixed" in a.modes)
        try:
            asyncio.run(stream_once(srv.url))
            for rnd in range(p["rounds"]):
                for mode in a.modes:
                    if not set_mixed(srv, mode == "mixed") and len(a.modes) > 1:
                        raise SystemExit("this checkout cannot switch modes: run one mode")
                    r = asyncio.run(arrivals(srv.url, p, a.seed + rnd))
                    tokens.setdefault(mode, []).append(r.pop("tokens"))
                    runs[mode].append(r)
                    print(f"round {rnd} {mode:>9}: TPOT p50 {1e3 * np.median(r['tpot']):.1f} ms, "
                          f"{r['tokens_per_s']:.2f} tokens/s", flush=True)
        finally:
            srv.stop()
    for mode in a.modes:
        r = pooled(runs[mode])
        res["arrivals"].append({"mode": mode, **r})
        print(f"{mode:>9}: TPOT p50/p99 {1e3 * r['tpot_s']['p50']:.1f}/{1e3 * r['tpot_s']['p99']:.1f} ms, token gap "
              f"p50/p99 {1e3 * r['token_gap_s']['p50']:.1f}/{1e3 * r['token_gap_s']['p99']:.1f} ms, "
              f"{r['tokens_per_s']:.2f} tokens/s (median of {r['rounds']} rounds); {r['long_prompts']} long prompts "
              f"(TTFT p50 {r['long_ttft_s']['p50'] or 0:.2f} s); steps {r['server']}", flush=True)
    if len(tokens) > 1:
        first = next(iter(tokens.values()))
        res["greedy_identical_across_modes"] = all(t == first for t in tokens.values())
    if "mixed" in a.modes and "separate" in a.modes:
        m, s_ = (next(r for r in res["arrivals"] if r["mode"] == k) for k in ("mixed", "separate"))
        res["mixed_vs_separate"] = {"tpot_p50": m["tpot_s"]["p50"] / s_["tpot_s"]["p50"],
                                    "tpot_p99": m["tpot_s"]["p99"] / s_["tpot_s"]["p99"],
                                    "tokens_per_s": m["tokens_per_s"] / s_["tokens_per_s"]}
    if a.step_modes:
        for r in step_time(model, p, a.step_modes):
            res["step_time"].append(r)
            print(f"step time {r['mode']:>9}: p50 {1e3 * r['step_s']['p50']:.1f} ms (p99 "
                  f"{1e3 * r['step_s']['p99']:.1f}) with {r['decoding']} rows decoding", flush=True)
    if a.before:
        res["before"] = before = json.loads(Path(a.before).read_text())
        res["vs_before"] = vs_before(res, before)
    if a.plot and res["arrivals"]:
        plot(res, a.plot)
        res["plot"] = a.plot
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


def vs_before(res: dict, before: dict) -> dict:
    """This run's figures over the older checkout's (ratios < 1: lower now)."""
    out = {}
    old = next((r for r in before.get("arrivals", []) if r["mode"] == "separate"), None)
    for r in res["arrivals"]:
        if old is not None:
            out[f"{r['mode']}_tpot_p50"] = r["tpot_s"]["p50"] / old["tpot_s"]["p50"]
            out[f"{r['mode']}_tpot_p99"] = r["tpot_s"]["p99"] / old["tpot_s"]["p99"]
            out[f"{r['mode']}_tokens_per_s"] = r["tokens_per_s"] / old["tokens_per_s"]
    old_step = next((r for r in before.get("step_time", []) if r["mode"] == "old"), None)
    for r in res["step_time"]:
        if old_step is not None:
            out[f"step_{r['mode']}_p50"] = r["step_s"]["p50"] / old_step["step_s"]["p50"]
    return out


async def stream_once(url: str) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:                    # the first HTTP request, untimed
        await stream_tokens(client, url, [1, 2, 3, 4], 2)


if __name__ == "__main__":
    main()
