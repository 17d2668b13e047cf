"""One runner for the benchmarks: one roofline per run, one combined JSON, optionally each record stored.

    .venv/bin/python -m benchmarks.run [NAME ...] [--quick] [--json out.json] [--save] [--list]

Names (``--list`` shows them): by default the main suite (roofline, kda, model); the slower ones run when named
(``inference`` names all four inference benchmarks). The roofline (``benchmarks.roofline.machine()``: fp32 GEMM
FLOP/s at full fp32 precision, 2048² on CPU and 8192² on an accelerator, and the bandwidth of a 256 MiB add) is measured once at the start and shared by every benchmark
run in this process. On CPU the runner first splits the host into one XLA device per core (``--host-devices``;
arrays stay on the first device unless a benchmark spreads them, as kda's head-parallel rows do). Each benchmark is its module's ``main(argv)``; ``moonep`` (8 simulated devices),
``inference_prefill`` (peak RSS) and the one-device model benchmarks ``model``, ``train``, ``step_profile`` run in a
process of their own, with the environment as the runner found it, each measuring its own roofline (one XLA:CPU
device over the host, as a user's program runs: in the split host with its larger thread pool the 100m forward
took 0.73 s against 0.55 s alone, and the one-device GEMM 316 against 362 GFLOP/s). ``--quick`` passes small sizes (a smoke run of a
few minutes; ``--save`` then needs ``--save-dir`` elsewhere, so that stored figures are never replaced by smoke
ones); ``--args NAME='…'`` replaces a benchmark's arguments. Every record gets ``command`` (this command),
``module_command`` (the equivalent ``python -m benchmarks.<module>`` call), ``wall_seconds``, ``recorded`` and the
run's ``roofline``. ``--save`` writes each record to ``<save-dir>/results_<stem>.json``
(``results_<stem>_<backend>.json`` off CPU); ``python -m benchmarks.report`` turns the stored records into
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Bench:
    module: str                       # benchmarks.<module>.main(argv)
    about: str
    stem: str                         # results_<stem>.json
    args: tuple[str, ...] = ()        # argv of a full run
    quick: tuple[str, ...] = ()       # argv of a --quick run
    isolated: bool = False            # in a process of its own
    default: bool = False             # part of the default suite


BENCHMARKS: dict[str, Bench] = {
    "roofline": Bench("roofline", "fp32 GEMM FLOP/s (2048²) and memory bandwidth (256 MiB add)", "roofline",
                      default=True),
    "kda": Bench("kda", "chunked KDA forward / forward+backward vs the recurrent scan and fla's naive chunk",
                 "kda", quick=("--T", "1024", "--explore-T", "1024", "--reps", "1", "--settle", "0.1", "--no-fla"), default=True),
    "model": Bench("model", "tokens/s and MFU of a training step, a jitted forward and the engine's prefill",
                   "model", quick=("--presets", "tiny", "--steps", "2"), default=True, isolated=True),
    "train": Bench("train_throughput", "training-step tokens/s and MFU (MFU against a 1024² GEMM)",
                   "train_throughput", quick=("--presets", "tiny", "--steps", "2"), isolated=True),
    "inference_decode": Bench("inference", "decode latency vs context (100m: mixed, KDA-only, MLA-only)",
                              "inference_decode", ("decode",),
                              ("decode", "--contexts", "1024", "2048", "--steps", "2", "--kinds", "mixed")),
    "inference_cache": Bench("inference", "cache bytes vs `k3jax inspect`'s prediction", "inference_cache",
                             ("cache",), ("cache", "--contexts", "1024")),
    "inference_vs_transformers": Bench("inference", "greedy decode ms/token vs transformers' generate",
                                       "inference_vs_transformers", ("vs-transformers",),
                                       ("vs-transformers", "--tokens", "8", "--reps", "1")),
    "inference_prefill": Bench("inference", "chunked prefill of 128k tokens (100m): peak RSS (about an hour on "
                               "2 CPU cores)", "inference_prefill_128k", ("prefill", "--tokens", "131072"),
                               ("prefill", "--tokens", "2048"), isolated=True),
    "moonep": Bench("moonep", "MoonEP vs dropless vs capacity 1.25 on 8 simulated devices; planner at R=64",
                    "moonep", quick=("--S", "16", "--reps", "1", "--routings", "uniform"), isolated=True),
    "balance": Bench("balance", "Quantile Balancing vs the sign update on a drifting router", "balance",
                     quick=("--experts", "64", "--k", "4", "--tokens", "1024", "--steps", "10", "--exact-steps",
                            "3")),
    "serve": Bench("serve", "HTTP server (100m): tokens/s, TTFT, TPOT at concurrency 1-32 vs sequential "
                   "Engine.generate; cache per slot vs `inspect`", "serve", ("--plot", "benchmarks/serve.png"),
                   ("--quick",)),
    "serve_mixed": Bench("serve_mixed", "HTTP server (100m): TPOT p50/p99 and tokens/s of 16 decode streams while "
                         "1024-token prompts keep arriving, mixed steps vs two forwards per step; steady decode step "
                         "time with fresh host buffers vs blocking copies; beside the stored run of the checkout "
                         "before mixed steps", "serve_mixed",
                         ("--plot", "benchmarks/serve_mixed.png", "--before", "benchmarks/serve_mixed_before.json"),
                         ("--quick",)),
    "prefix_cache": Bench("prefix_cache", "KDA-aware prefix cache (100m): multi-turn chat hit rate and prefill time, "
                          "TTFT of an 8k shared prefix hit vs miss, checkpoint bytes vs `inspect`", "prefix_cache",
                          ("--plot", "benchmarks/prefix_cache.png"), ("--quick",)),
    "speculative": Bench("speculative", "speculative decoding (100m): decode tokens/s plain vs prompt lookup k=2/4/8 "
                         "and a draft model, copy-heavy and free generation, batch 1 and 8 slots; replay cost",
                         "speculative", ("--plot", "benchmarks/speculative.png"), ("--quick",)),
    "context_parallel": Bench("context_parallel", "context parallelism (100m, 8 simulated devices): memory per device "
                              "of a training step at T=8k/32k/64k × context 1/2/4/8, KDA CP collective bytes vs T, "
                              "Per-Head Muon in whole blocks vs gathered whole", "context_parallel",
                              ("--plot", "benchmarks/context_parallel.png"),
                              ("--preset", "tiny", "--seq-lens", "1024", "--contexts", "1", "2", "--run-up-to", "1024",
                               "--reps", "1", "--kda-seq-lens", "1024", "4096"), isolated=True),
    "step_profile": Bench("step_profile", "a training step (100m, 8 micro-batches of 4×256) by component: "
                          "embedding/head, KDA (kernel, convs, projections), MLA, AttnRes, router + balancing, "
                          "routed/shared experts, optimizer (NS, AdamW); bar chart beside the stored before",
                          "step_profile", ("--micro-batches", "8", "--reps", "3", "--before",
                                           "benchmarks/step_profile_before.json", "--plot",
                                           "benchmarks/step_profile.png"),
                          ("--preset", "tiny", "--reps", "1"), isolated=True),
    "vision": Bench("vision", "vision tower + projector (release size): ms/image at 448²/896²/1792² vs the FLOP "
                    "roofline; patch-bucket compiles and padding waste on a size mix; TTFT image+text vs text",
                    "vision", ("--reps", "1"), ("--sizes", "224", "--layers", "2", "--reps", "1", "--text-preset",
                                                "tiny", "--ttft-image", "224")),
    "depth": Bench("depth", "training at K3's depth (test widths, K3 layer pattern): compile time vs depth; bytes kept "
                   "for the backward, XLA temporaries and step time per remat policy vs a plain-residual model; "
                   "pipeline bubble and AttnRes bytes per stage boundary on 8 host devices",
                   "depth", ("--plot", "benchmarks/depth.png"),
                   ("--depths", "4", "8", "--remat-depth", "8", "--seq", "64", "--reps", "1", "--pp-depth", "13",
                    "--pp-stages", "2", "--pp-micro", "2"), isolated=True),
    "pipeline": Bench("pipeline", "pipeline stages (test widths, K3 layer pattern, 8 simulated devices): GPipe bubble, "
                      "AttnRes bytes between stages (incremental vs every block forwarded), step time", "pipeline",
                      (), ("--depth", "13", "--stages", "2", "--micro", "2", "--reps", "1"), isolated=True),
    "load_rss": Bench("load_rss", "peak host RSS while loading a multi-shard MXFP4 checkpoint", "load_rss",
                      quick=("--hidden", "128", "--experts", "8", "--layers", "4", "--shard-size", "2MB")),
}
GROUPS = {"inference": [n for n in BENCHMARKS if n.startswith("inference_")]}
DEFAULT = [n for n, b in BENCHMARKS.items() if b.default]


def results_path(directory: Path, stem: str, backend: str) -> Path:
    return Path(directory) / (f"results_{stem}.json" if backend in ("cpu", "", None) else
                              f"results_{stem}_{backend}.json")


def this_command(argv: list[str] | None = None) -> str:
    """This run as a shell command (``argv`` as given to :func:`main`, else the process's own)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return "python -m benchmarks.run" + (" " + shlex.join(args) if args else "")


def resolve(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names or DEFAULT:
        for m in GROUPS.get(n, [n]):
            if m not in BENCHMARKS:
                raise SystemExit(f"benchmarks.run: unknown benchmark {n!r}; known: "
                                 f"{', '.join([*BENCHMARKS, *GROUPS])} (see --list)")
            if m not in out:
                out.append(m)
    return out


_CHILD_ENV: list[dict[str, str | None]] = []   # XLA_FLAGS and NPROC as this process found them, for the children


def host_devices(count: int) -> None:
    """Split the host into ``count`` CPU devices (0: one per core) before JAX starts its backends here; the
    isolated children get the environment as it was (they set their own device counts)."""
    from k3jax.parallel.heads import host_device_flag

    _CHILD_ENV.append({k: os.environ.get(k) for k in ("XLA_FLAGS", "NPROC")})
    host_device_flag(count or None)


def call(b: Bench, argv: list[str]) -> dict:
    """The benchmark's record: its ``main(argv)`` here, or in a child process (``--json`` to a temporary file)."""
    if not b.isolated:
        return importlib.import_module(f"benchmarks.{b.module}").main(list(argv))
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        for k, v in (_CHILD_ENV[0].items() if _CHILD_ENV else ()):
            env.pop(k, None)          # the split host's device count and its larger thread pool stay here
            if v is not None:
                env[k] = v
        subprocess.run([sys.executable, "-m", f"benchmarks.{b.module}", *argv, "--json", str(out)], cwd=ROOT,
                       env=env, check=True)
        return json.loads(out.read_text())


def list_text() -> str:
    w = max(map(len, BENCHMARKS))
    lines = [f"{n:<{w}}  {'*' if b.default else ' '} {b.about}" for n, b in BENCHMARKS.items()]
    lines += [f"{g:<{w}}    = {' '.join(ms)}" for g, ms in GROUPS.items()]
    return "\n".join(lines + ["(* = run when no names are given)"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="benchmarks to run (default: %(default)s)", default=DEFAULT)
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of the suite")
    ap.add_argument("--json", default=None, help="write the combined record here")
    ap.add_argument("--save", action="store_true", help="write each record to <save-dir>/results_<stem>.json")
    ap.add_argument("--save-dir", default=None, help="where --save writes (default: benchmarks/)")
    ap.add_argument("--host-devices", type=int, default=0, metavar="N",
                    help="split the CPU into N XLA devices (default 0: one per core this process may use; 1: one "
                         "device). Arrays stay on the first one unless a benchmark spreads them (the kda rows "
                         "'heads over N host devices'). Ignored if XLA_FLAGS already sets a count")
    ap.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                    help="replace a benchmark's arguments, e.g. --args 'model=--presets tiny --steps 3'")
    a = ap.parse_args(argv)
    if a.list:
        print(list_text())
        return {"benchmarks": list(BENCHMARKS), "groups": GROUPS, "default": DEFAULT}
    names = resolve(a.names)
    save_dir = Path(a.save_dir) if a.save_dir else HERE
    if a.save and a.quick and save_dir.resolve() == HERE:
        ap.error("--quick --save would replace the stored results with smoke-run figures; "
                 "pass --save-dir DIR (or drop --quick)")
    override = {}
    for s in a.args:
        n, sep, rest = s.partition("=")
        if not sep or n not in BENCHMARKS:
            ap.error(f"--args {s!r}: expected NAME=ARGS with NAME one of {', '.join(BENCHMARKS)}")
        override[n] = shlex.split(rest)

    host_devices(a.host_devices)
    from benchmarks.roofline import machine

    m = machine()
    print(f"roofline: {m['device']} ({m['backend']}, {m['devices']} device(s)), fp32 GEMM "
          f"{m['gemm_flops_fp32'] / 1e9:,.1f} GFLOP/s, memory {m['memory_bytes_per_s'] / 1e9:,.1f} GB/s", flush=True)
    cmd = this_command(argv)
    combined = {"machine": m, "command": cmd, "quick": a.quick, "results": {}}
    failed = []
    for n in names:
        b = BENCHMARKS[n]
        argv_n = override.get(n, list(b.quick if a.quick else b.args))
        print(f"== {n}: python -m benchmarks.{b.module} {shlex.join(argv_n)}".rstrip(), flush=True)
        t = time.perf_counter()
        try:
            rec = dict(call(b, argv_n))
        except (Exception, SystemExit) as e:                 # record and go on with the others
            traceback.print_exc()
            failed.append(n)
            rec = {"benchmark": n, "error": f"{type(e).__name__}: {e}"}
        module_cmd = f"python -m benchmarks.{b.module} {shlex.join(argv_n)}".rstrip()
        rec.update({"command": cmd, "module_command": module_cmd,
                    "wall_seconds": time.perf_counter() - t, "quick": a.quick,
                    "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "roofline": m})
        rec.setdefault("backend", m["backend"])
        combined["results"][n] = rec
        print(f"== {n}: {rec['wall_seconds']:.1f} s{' (FAILED)' if n in failed else ''}", flush=True)
        if a.save and n not in failed:
            p = results_path(save_dir, b.stem, rec["backend"])
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(rec, indent=2))
            print(f"   saved {p}", flush=True)
        if a.json:                                          # after each benchmark: a crash keeps what was done
            Path(a.json).write_text(json.dumps(combined, indent=2))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    combined["failed"] = failed
    if a.json:
        Path(a.json).write_text(json.dumps(combined, indent=2))
    return combined


if __name__ == "__main__":
    sys.exit(1 if main().get("failed") else 0)
