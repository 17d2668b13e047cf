"""``k3jax`` command line: ``demo``, ``train``, ``generate``, ``params``, ``inspect``, ``convert``, ``serve``, ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from k3jax.config import ConfigError, K3Config, preset_names, resolve_config
from k3jax.io.safetensors import CheckpointError

console = Console(width=None if sys.stdout.isatty() else 120)


def params_table(cfg: K3Config, title: str, counts=None) -> Table:
    from k3jax.params import ParamTable, parameter_table

    t = counts if counts is not None else parameter_table(cfg)
    if isinstance(t, dict):
        t = ParamTable(t["components"], t["total_params"], t["activated_params"], 0, t["routed_expert_params"], 0)
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("parameters", justify="right")
    table.add_column("billions", justify="right")
    for name, n in sorted(t.components.items(), key=lambda kv: -kv[1]):
        table.add_row(name, f"{n:,}", f"{n / 1e9:.3f}")
    table.add_section()
    table.add_row("[bold]total[/bold]", f"[bold]{t.total:,}[/bold]", f"{t.total / 1e9:.3f}")
    table.add_row("activated per token", f"{t.activated:,}", f"{t.activated / 1e9:.3f}")
    table.caption = ("activated = every weight a token touches (top-k routed experts, all others, lm_head), "
                     "input embedding excluded (the convention behind K3's published 104.2B)")
    return table


def cmd_params(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.model)
    console.print(params_table(cfg, f"parameters of {args.model} (counted with jax.eval_shape, nothing allocated)"))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from k3jax.costs import human_bytes, inspect_config

    cfg = resolve_config(args.model)
    rep = inspect_config(cfg, S=args.S, K=args.K, R=args.R, cp=args.cp, seq_len=args.seq_len)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    console.print(params_table(cfg, f"{args.model}: parameters (jax.eval_shape, nothing allocated)", rep))
    wb = Table(title="weight bytes", title_justify="left")
    wb.add_column("format")
    wb.add_column("bytes", justify="right")
    wb.add_column("", justify="right")
    for k, v in rep["weight_bytes"].items():
        label = {"bf16": "bf16 (fp32 where the release keeps fp32)", "mxfp4_experts": "routed experts in MXFP4, "
                 "rest bf16"}[k]
        wb.add_row(label, f"{v:,}", f"{v / 1e9:,.1f} GB")
    console.print(wb)
    ds = Table(title="decode state per sequence", title_justify="left")
    for c in ("context", "KDA state (fp32)", "conv state", "MLA latent cache", "total", "all-MLA model",
              "plain MHA cache"):
        ds.add_column(c, justify="right")
    for T, d in rep["decode_state_bytes_per_sequence"].items():
        ds.add_row(f"{int(T):,}", human_bytes(d["kda_recurrent_state"]), human_bytes(d["kda_conv_state"]),
                   human_bytes(d["mla_latent_cache"]), human_bytes(d["total"]), human_bytes(d["all_mla_model"]),
                   human_bytes(d["plain_mha_cache"]))
    console.print(ds)
    a = rep["all_to_all_receive_per_rank"]
    if a:
        at = Table(title=f"MoE all-to-all receive buffer per rank (S={a['S']} tokens/rank, K={a['K']}, "
                         f"R={a['R']} ranks, width {a['dispatch_width']})", title_justify="left")
        at.add_column("plan")
        at.add_column("tokens", justify="right")
        at.add_column("bytes (bf16)", justify="right")
        at.add_row("MoonEP: exactly S×K", f"{a['moonep_tokens']:,}", human_bytes(a["moonep_bytes"]))
        at.add_row("dropless ragged, worst case S×K×R", f"{a['dropless_worst_tokens']:,}",
                   human_bytes(a["dropless_worst_bytes"]))
        console.print(at)
    f = rep["flops_per_token"]
    ft = Table(title="FLOPs per token", title_justify="left")
    ft.add_column("")
    ft.add_column("FLOPs", justify="right")
    ft.add_row(f"training (fwd+bwd, sequence {f['training_seq']:,})", f"{f['training']:.4g}")
    for T, v in f["decode"].items():
        ft.add_row(f"decode at context {int(T):,}", f"{v:.4g}")
    console.print(ft)
    c = rep.get("context_parallel")
    if c:
        ct = Table(title=f"context parallelism: {c['ranks']} ranks, {c['seq_len']:,} tokens "
                         f"({c['tokens_per_rank']:,} per rank), per layer, fp32", title_justify="left")
        for col in ("layer", "collective", "sent per rank", "received per rank", "grows with T"):
            ct.add_column(col, justify="left" if col in ("layer", "collective") else "right")
        ct.add_row(f"KDA ×{c['kda_layers']}", "all-gather of (M, S̃)", human_bytes(c["kda_summary_send_per_layer"]),
                   human_bytes(c["kda_summary_recv_per_layer"]), "no")
        ct.add_row("", "conv halo (ppermute)", human_bytes(c["kda_conv_halo_per_layer"]),
                   human_bytes(c["kda_conv_halo_per_layer"]), "no")
        ct.add_row(f"MLA ×{c['mla_layers']}", "all-gather of the latent", human_bytes(c["mla_latent_send_per_layer"]),
                   human_bytes(c["mla_latent_recv_per_layer"]), "yes")
        console.print(ct)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from k3jax.io.export import save_pretrained
    from k3jax.io.hf import load_pretrained
    from k3jax.io.orbax import is_orbax_checkpoint, load_orbax, save_orbax

    src, dst = Path(args.src), Path(args.dst)
    t0 = time.perf_counter()
    if is_orbax_checkpoint(src):
        model = load_orbax(src)
    else:
        model = load_pretrained(src, expert_dtype=args.expert_dtype, progress=True)
    to = args.to or ("release" if is_orbax_checkpoint(src) else "orbax")
    if to == "orbax":
        save_orbax(model, dst)
    else:
        save_pretrained(model, dst, shard_size=args.shard_size, expert_format=args.expert_format)
    console.print(f"wrote {to} checkpoint {dst} from {src} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from k3jax.train.loop import TrainConfig, train
    from k3jax.train.metrics import MetricsLog, plot_run

    if args.plot:
        out = args.plot
        recs = MetricsLog(f"{out}/metrics.jsonl").read()
        if not recs:
            raise FileNotFoundError(f"{out}/metrics.jsonl: no metrics to plot")
        for p in plot_run(recs, out):
            console.print(f"wrote {p}")
        return 0
    if args.coordinator or args.num_processes:
        from k3jax.parallel.mesh import init_distributed

        init_distributed(args.coordinator, args.num_processes, args.process_id)
    sets = list(args.set or [])
    if args.preset:
        sets.append(f"model={args.preset}")
    if args.data:
        sets.append(f"data={args.data}")
    if args.out:
        sets.append(f"out={args.out}")
    if args.mesh:
        sets.append(f"mesh={args.mesh}")
    c = TrainConfig.load(args.config, sets)
    r = train(c, console=console)
    console.print(f"val loss {r.final_val_loss:.4f} nats/token after {r.steps} steps "
                  f"(train {r.final_train_loss:.4f}); unigram entropy {r.unigram_entropy:.4f} nats/token")
    console.print(f"checkpoints in {r.out / 'checkpoints'}; metrics {r.out / 'metrics.jsonl'}; plots "
                  + ", ".join(str(p) for p in r.plots))
    return 0


DEMO_OUT = "runs/demo"
DEMO_NO_REPEAT_NGRAM = 12   # bytes: longer than Python's usual repeats (indentation, `self.`), shorter than a loop


def cmd_demo(args: argparse.Namespace) -> int:
    import jax

    from k3jax.infer.sample_text import greedy_sample
    from k3jax.train.loop import TrainConfig, train

    # fp32 Newton–Schulz (optax's iteration; 50 against 29 ms for bf16 on the tiny preset, of a ~0.5 s step): with
    # the bf16 default this 180-step run ended at val 1.970 with a greedy sample of "the the the …", against 1.945
    # and Python
    c = TrainConfig.load(None, [f"out={args.out}", f"steps={args.steps}", f"batch_size={args.batch_size}", "seq_len=128",
                                "eval_every=30", "save_every=50", "eval_batches=16", "resume=false",
                                "optim.ns_dtype=fp32"])
    console.rule("[bold]k3jax demo: train the tiny K3 preset on Python's standard library")
    previous = Path(args.out) / "checkpoints"
    # the demo starts over in its own run directory; another --out with checkpoints is left to train()'s
    # resume=false check, which stops before touching it
    if args.out == DEMO_OUT and previous.is_dir() and (Path(args.out) / "train_config.json").is_file():
        import shutil

        shutil.rmtree(previous)
        console.print(f"removed the previous demo run's checkpoints in {previous}")
    console.print(f"JAX {jax.__version__} on {jax.devices()[0].platform}; every K3 feature on (KDA + gated MLA, "
                  f"Block AttnRes, Stable LatentMoE with SiTU, Quantile Balancing, Per-Head Muon)")
    r = train(c, console=console)
    console.rule("[bold]result")
    console.print(f"val loss {r.final_val_loss:.4f} nats/token (byte-level, validation split)")
    console.print(f"unigram entropy {r.unigram_entropy:.4f} nats/token (same unit, train split byte frequencies)")
    console.print(f"throughput {r.tokens_per_s:,.0f} tokens/s, MFU {r.mfu:.1%}; checkpoint in {r.out / 'checkpoints'}")
    console.print("plots: " + ", ".join(str(p) for p in r.plots))
    from k3jax.infer.engine import Engine

    prompt = "def "
    engine = Engine(r.model, chunk=64)             # one engine: the sampled run reuses the greedy run's compiles
    st: dict = {}
    n = args.no_repeat_ngram
    text = greedy_sample(r.model, r.dataset.tokenizer, prompt, new_tokens=args.sample_tokens, engine=engine,
                         no_repeat_ngram=n, stats=st)
    if n:
        console.rule(f"[bold]greedy sample[/bold] (repetition guard: no {n}-byte sequence twice; it changed "
                     f"{st.get('no_repeat_ngram_changed', 0)} of {st.get('generated_tokens', 0)} tokens; "
                     f"--no-repeat-ngram 0 shows plain greedy)")
    else:
        console.rule("[bold]greedy sample")
    console.print(text, markup=False, highlight=False)
    tok = r.dataset.tokenizer
    res = engine.generate([[tok.bos_id] + tok.encode(prompt)], args.sample_tokens, temperature=0.8, top_p=0.95,
                          seed=0, stop_tokens=[tok.eos_id])
    console.rule("[bold]sampled (temperature 0.8, top-p 0.95, seed 0)")
    console.print(prompt + tok.decode(res.tokens[0]), markup=False, highlight=False)
    console.print(f"generate: {res.stats['decode_steady_tokens_per_s']:.0f} tokens/s decode; try "
                  f"`k3jax generate --model {r.out} --prompt 'def '`")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from k3jax.cli_generate import cmd_generate as run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    import signal

    from k3jax.infer.config import EngineConfig, options_from_args
    from k3jax.serve.server import ServerOptions, build_server

    logging.getLogger("absl").setLevel(logging.ERROR)
    handler = logging.StreamHandler(sys.stderr)       # k3jax's own lines (one per request), whatever absl set up
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    k3log = logging.getLogger("k3jax")
    k3log.addHandler(handler)
    k3log.setLevel(logging.INFO)
    k3log.propagate = False
    engine = options_from_args(args, EngineConfig)          # a bad value fails here, before loading
    if args.speculative_no_fallback and engine.speculative is not None:
        engine = engine.replace(speculative=dataclasses.replace(engine.speculative, adaptive=False))
    options = options_from_args(args, ServerOptions)
    if options.host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning: binding to {options.host}: the server has no authentication")
    console.rule(f"[bold]k3jax serve {args.model}")
    srv = build_server(args.model, engine, options, say=lambda m: console.print(m, highlight=False, soft_wrap=True))
    # uvicorn drains on SIGTERM / Ctrl-C and then re-raises the signal: exit 0 after a clean drain instead
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        srv.run(on_ready=lambda: console.print(
            f"[bold green]ready[/bold green] on {srv.url} (model {srv.model_name!r}; started in {srv.startup_s:.1f} s)"
            f" — OpenAI API at {srv.url}/v1, metrics at {srv.url}/metrics", highlight=False, soft_wrap=True))
    except KeyboardInterrupt:
        pass
    console.print("k3jax serve: stopped", highlight=False)
    return 0


def source_checkout() -> Path | None:
    """The root of the source checkout this package runs from (``src/k3jax`` beside ``benchmarks/run.py`` and
    ``pyproject.toml``), or ``None`` for an installed package."""
    pkg = Path(__file__).resolve().parent
    root = pkg.parents[1]
    if pkg.parent.name == "src" and (root / "benchmarks" / "run.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    """``python -m benchmarks.run ARGS`` of the source checkout this package runs from (the benchmarks are not part
    of the installed package); the benchmarks package is imported from its file, ``sys.path`` is left alone."""
    import importlib
    import importlib.util

    root = source_checkout()
    if root is None:
        raise FileNotFoundError(
            f"k3jax bench needs a source checkout: it runs the benchmarks/ folder of a source checkout, which is not "
            f"installed with the package ({Path(__file__).resolve().parent}). Clone the k3jax repository and "
            f"`pip install -e .` from it, then run `k3jax bench …` (or `python -m benchmarks.run …` in its root)")
    pkg_dir = root / "benchmarks"
    loaded = sys.modules.get("benchmarks")
    if loaded is None:
        spec = importlib.util.spec_from_file_location("benchmarks", pkg_dir / "__init__.py",
                                                      submodule_search_locations=[str(pkg_dir)])
        loaded = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = loaded
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules["benchmarks"]
            raise
    elif Path(getattr(loaded, "__file__", "") or "").resolve().parent != pkg_dir.resolve():
        raise FileNotFoundError(f"k3jax bench: a different `benchmarks` module is already imported "
                                f"({getattr(loaded, '__file__', loaded)}), not {pkg_dir}")
    run = importlib.import_module("benchmarks.run")
    res = run.main(list(args.args))
    return 1 if res.get("failed") else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:   # everything after it belongs to benchmarks.run (its own --help, --list, …)
        try:
            return cmd_bench(argparse.Namespace(args=argv[1:]))
        except FileNotFoundError as e:
            console.print(f"[red]error:[/red] {e}")
            return 2
    p = argparse.ArgumentParser(prog="k3jax", description="The Kimi K3 architecture in JAX.")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train the tiny preset on the embedded corpus for a few minutes, then sample")
    d.add_argument("--steps", type=int, default=180)
    d.add_argument("--batch-size", type=int, default=16,
                   help="sequences of 128 bytes per step (16: ~4 minutes on 2 CPU cores, val loss ≈ 1.94 nats)")
    d.add_argument("--out", default=DEMO_OUT)
    d.add_argument("--sample-tokens", type=int, default=240)
    d.add_argument("--no-repeat-ngram", type=int, default=DEMO_NO_REPEAT_NGRAM, metavar="N",
                   help="the greedy sample never repeats an N-token sequence (a guard against a small model's "
                        "loops; 0 = plain greedy)")
    d.set_defaults(fn=cmd_demo)
    t = sub.add_parser("train", help="train a K3 model (config file + --set key=value overrides)")
    t.add_argument("--config", help="JSON or TOML training config (any subset of TrainConfig fields)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field: steps=500, optim.lr=0.01, model.hidden_size=256, balance=sign …")
    t.add_argument("--preset", help="model preset or config.json (same as --set model=…)")
    t.add_argument("--data", help=".txt / .jsonl / directory (default: the embedded standard-library corpus)")
    t.add_argument("--out", help="run directory (checkpoints, metrics.jsonl, plots)")
    t.add_argument("--mesh", help="device mesh, e.g. data=2,expert=4 (routed experts over the expert axis with "
                   "MoonEP; --set ep_method=dropless|capacity for the baselines) or context=4,data=2 (sequences "
                   "split along time: long seq_len)")
    t.add_argument("--coordinator", help="multi-process: HOST:PORT of process 0 (jax.distributed.initialize)")
    t.add_argument("--num-processes", type=int, default=None)
    t.add_argument("--process-id", type=int, default=None)
    t.add_argument("--plot", metavar="RUN_DIR", help="only (re)draw the plots of an existing run")
    t.set_defaults(fn=cmd_train)
    g = sub.add_parser("generate", help="generate text from a preset, a training run or a release checkpoint")
    g.add_argument("--model", required=True, help="preset name (random weights), k3jax train run directory, "
                   "Orbax export or release checkpoint directory")
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); default: empty after BOS")
    g.add_argument("--image", action="append", metavar="PATH",
                   help="an image for the prompt (repeat for several, in order): the prompt becomes one chat turn "
                        "with the images, through the checkpoint's vision tower")
    g.add_argument("--no-thinking", action="store_true", help="with --image: the response channel, no think channel")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                   help="never repeat an N-token sequence of the prompt and output (a guard against loops; 0 = off)")
    g.add_argument("--stop", action="append", help="extra stop token id (the config's eos_token_id always stops "
                   "unless --ignore-eos)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token")
    g.add_argument("--no-stream", action="store_true")
    g.add_argument("--chunk", type=int, default=None, help="largest prefill chunk (default: the engine's, 256)")
    g.add_argument("--max-len", type=int, default=None, help="longest prompt + generation (default "
                   "max_position_embeddings)")
    g.add_argument("--dtype", default=None, help="compute dtype override (float32, bfloat16)")
    g.add_argument("--json", default=None, help="also write tokens, text and stats here")
    g.add_argument("--speculative", default=None, metavar="SPEC", help="speculative decoding through the serving "
                   "scheduler: ngram:K (prompt lookup) or draft:PATH:K (a draft model with the same tokenizer)")
    g.set_defaults(fn=cmd_generate)
    q = sub.add_parser("params", help="parameter counts of a preset or a config.json / checkpoint directory")
    q.add_argument("model", help=f"a config.json or a directory holding one, or a preset "
                   f"({', '.join(preset_names())}); an existing path wins over a preset name")
    q.set_defaults(fn=cmd_params)
    i = sub.add_parser("inspect", help="parameters, weight bytes, decode state, all-to-all buffers, FLOPs per token")
    i.add_argument("model", help=f"a checkpoint directory / config.json, or a preset ({', '.join(preset_names())});"
                   f" an existing path wins over a preset name")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--S", type=int, default=4096, help="tokens per expert-parallel rank (default 4096)")
    i.add_argument("--K", type=int, default=None, help="experts per token (default: the config's top-k)")
    i.add_argument("--R", type=int, default=32, help="expert-parallel ranks (default 32)")
    i.add_argument("--cp", type=int, default=None, metavar="N",
                   help="context parallelism over N ranks: the KDA summary and MLA latent bytes per layer")
    i.add_argument("--seq-len", type=int, default=32768, help="sequence length for --cp (default 32768)")
    i.set_defaults(fn=cmd_inspect)
    c = sub.add_parser("convert", help="release safetensors <-> k3jax Orbax (training) checkpoint, or re-shard")
    c.add_argument("src", help="checkpoint directory (safetensors or k3jax Orbax)")
    c.add_argument("dst", help="output directory")
    c.add_argument("--to", choices=["release", "orbax"], default=None,
                   help="output format (default: the other one)")
    c.add_argument("--shard-size", default="5GB", help="release shards: bytes per file (default 5GB)")
    c.add_argument("--expert-format", choices=["mxfp4", "dense"], default=None,
                   help="release output: routed experts as MXFP4 or dense (default: as the source holds them)")
    c.add_argument("--expert-dtype", choices=["bfloat16", "float32", "mxfp4"], default=None,
                   help="how to hold routed experts while converting (default: as stored)")
    c.set_defaults(fn=cmd_convert)
    s = sub.add_parser("serve", help="OpenAI-compatible server: continuous batching over a static slot pool, paged "
                       "MLA cache")
    s.add_argument("--model", required=True, help="preset name (random weights), k3jax train run directory, Orbax "
                   "export or release checkpoint directory")
    from k3jax.infer.config import EngineConfig, add_options
    from k3jax.serve.server import ServerOptions

    add_options(s, ServerOptions)
    add_options(s, EngineConfig)
    s.add_argument("--speculative-no-fallback", action="store_true", help="speculate whenever there are drafts "
                   "(default: a request whose drafts keep failing decodes plainly for a while, and a step "
                   "speculates only when the measured step times say it pays)")
    s.set_defaults(fn=cmd_serve)

    sub.add_parser("bench", help="run the benchmarks of a source checkout: k3jax bench [names…] [--list] [--quick] "
                   "[--json OUT] [--save] (= python -m benchmarks.run …)")
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError, CheckpointError, ValueError, RuntimeError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
