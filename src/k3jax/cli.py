"""``k3jax`` command line: ``demo`` and ``params`` (more subcommands arrive with training and inference)."""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.table import Table

from k3jax.config import ConfigError, K3Config, preset_names

console = Console()

DEMO_SENTENCE = "Kimi Delta Attention keeps a fixed-size state, so the cache does not grow with the context."


def _load_config(name_or_path: str) -> K3Config:
    if name_or_path in preset_names():
        return K3Config.from_preset(name_or_path)
    return K3Config.from_json(name_or_path)


def params_table(cfg: K3Config, title: str) -> Table:
    from k3jax.params import parameter_table

    t = parameter_table(cfg)
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
                     "input embedding excluded — the convention of the published 104.2B")
    return table


def cmd_params(args: argparse.Namespace) -> int:
    cfg = _load_config(args.model)
    console.print(params_table(cfg, f"parameters of {args.model} (counted with jax.eval_shape, nothing allocated)"))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from k3jax.nn.model import K3ForCausalLM

    cfg = K3Config.from_preset("tiny")
    console.rule("[bold]k3jax demo: the tiny K3 preset (every K3 feature on)")
    console.print(f"JAX {jax.__version__} on {jax.devices()[0].platform}; layers: "
                  + " ".join("K" if t == "kda" else "M" for t in cfg.layer_types)
                  + f" (K = KDA, M = gated MLA); AttnRes block {cfg.attn_res_block_size}; "
                    f"{cfg.num_experts} latent experts top-{cfg.num_experts_per_token}, SiTU")
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(args.seed))
    text = args.text
    data = list(text.encode("utf-8"))
    ids = jnp.asarray([[cfg.bos_token_id] + data], jnp.int32)
    console.print(f"input: {text!r} → {ids.shape[1]} byte-level tokens (BOS + UTF-8 bytes)")

    fwd = jax.jit(lambda i: model.forward(i))
    t0 = time.perf_counter()
    out = fwd(ids)
    out.logits.block_until_ready()
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = fwd(ids)
    out.logits.block_until_ready()
    t_run = time.perf_counter() - t0
    logits = np.asarray(out.logits, np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    nll = -np.mean(logp[0, np.arange(len(data)), np.asarray(data)])
    console.print(f"forward: logits {tuple(out.logits.shape)} in {t_run * 1e3:.1f} ms "
                  f"(first call incl. compile {t_compile:.1f} s)")
    console.print(f"untrained next-byte loss {nll:.3f} nats (uniform over the vocabulary: {np.log(cfg.vocab_size):.3f})")

    ref = np.asarray(model(ids, kda_kernel="recurrent", moe_grouped=False))
    console.print(f"self-check: chunked KDA + grouped MoE vs recurrent KDA + per-token MoE: "
                  f"max |Δlogit| = {np.max(np.abs(ref - logits)):.2e}")
    counts = Table(title="tokens routed to each expert (per MoE layer)", title_justify="left")
    counts.add_column("layer")
    counts.add_column("counts per expert")
    for layer, c in zip(cfg.moe_layers, np.asarray(out.expert_counts)):
        counts.add_row(str(layer), " ".join(f"{int(x):2d}" for x in c))
    console.print(counts)
    console.print(params_table(K3Config.from_preset("k3"),
                               "parameters of the released K3 config (jax.eval_shape, nothing allocated)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3jax", description="The Kimi K3 architecture in JAX.")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="build the tiny preset, run a forward on a sentence, print K3's parameter table")
    d.add_argument("--text", default=DEMO_SENTENCE)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=cmd_demo)
    q = sub.add_parser("params", help="parameter counts of a preset or a config.json / checkpoint directory")
    q.add_argument("model", help=f"preset ({', '.join(preset_names())}) or path")
    q.set_defaults(fn=cmd_params)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
