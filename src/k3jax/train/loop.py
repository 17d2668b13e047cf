"""``k3jax train``: the training loop, readable top to bottom.

config → data → model → optimizer → (resume) → for each step: batch → jitted step (loss, grads, Muon/AdamW update,
load balancing for the next step) → progress bar / JSONL / periodic eval and checkpoint → plots at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import ConfigError, K3Config, resolve_config
from k3jax.nn.model import K3ForCausalLM
from k3jax.nn.remat import REMAT_NAMES
from k3jax.nn.scan import RunLayout, scan_plan, use_scan
from k3jax.ops.balance import max_violation
from k3jax.parallel.context import ContextParallel
from k3jax.parallel.ep import ExpertParallel
from k3jax.train.balance import METHODS as BALANCE_METHODS
from k3jax.train.balance import BalanceConfig, update_router_biases
from k3jax.train.checkpoint import Checkpointer
from k3jax.text.tokenizer import DataError, load_tokenizer
from k3jax.train.data import Dataset, stdlib_corpus, user_corpus
from k3jax.train.metrics import MetricsLog, plot_run
from k3jax.train.optim import OptimConfig, make_blockwise_optimizer, make_optimizer, muon_dims_tree, muon_plans


PRECISIONS = ("fp32", "bf16")


def compute_dtypes(cfg: K3Config, precision: str) -> dict | None:
    """The dtype each parameter is cast to for the forward and backward under ``precision`` (a pure dict like the
    parameters), or None for none.

    ``"bf16"``: every parameter the release holds in bf16 is cast to bf16 inside the step — the master weights,
    their gradients and the optimizer state stay fp32 (the cast's transpose brings the gradient back in fp32) —
    and the parameters the release keeps in fp32 whatever its dtype (KDA's ``A_log``, ``dt_bias``, short-conv
    kernels, output-norm gain; the router bias) stay fp32: it is the dtype tree of the same model built with
    ``dtype="bfloat16"``. Activations then run in bf16 with the fp32 islands the ops keep (KDA gate, cumsum,
    inverse and state; AttnRes scores; SiTU; softmax and loss accumulation; the router)."""
    if precision == "fp32":
        return None
    bcfg = cfg.replace(dtype="bfloat16")
    abstract = nnx.eval_shape(lambda: K3ForCausalLM(bcfg, rngs=nnx.Rngs(0)))
    return jax.tree.map(lambda v: jnp.dtype(v.dtype), nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message says what happened and what was kept."""


@dataclass
class TrainConfig:
    model: str = "tiny"                       # preset name or path to a config.json / checkpoint directory
    model_overrides: dict[str, Any] = field(default_factory=dict)   # K3Config fields (--set model.hidden_size=…)
    data: str | None = None                   # None: the embedded standard-library corpus
    corpus_bytes: int = 3_000_000
    text_field: str = "text"
    tokenizer: str = "bytes"                  # "bytes", a tokenizer.json, or a directory with tiktoken.model / tokenizer.json
    seq_len: int = 256
    batch_size: int = 16
    micro_batches: int = 1                    # the batch runs as this many forward+backward passes, one update
    steps: int = 300
    optim: OptimConfig = field(default_factory=OptimConfig)
    balance: str = "quantile"                 # "quantile" | "sign" | "none"
    balance_bins: int = 1000
    balance_passes: int = 3                   # QB fixed-point passes per step (1 = a single closed-form solve)
    sign_gamma: float = 1e-3
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 100
    keep: int = 3
    async_save: bool = True
    out: str = "runs/k3jax"
    seed: int = 0
    resume: bool = True
    progress: bool | None = None              # None: on a terminal
    mesh: str = ""                            # e.g. "data=2,expert=4" (empty: one device)
    ep_method: str = "moonep"                 # routed experts over the expert axis: moonep | dropless | capacity
    precision: str = "fp32"                   # "fp32" | "bf16": bf16 compute over fp32 master weights (see compute_dtypes)
    remat: str = "none"                       # what a layer keeps for the backward (k3jax.nn.remat.REMAT_NAMES)
    scan_layers: bool | None = None           # the periodic run of layers as one lax.scan body (k3jax.nn.scan);
                                              # None: where it pays (k3jax.nn.scan.scan_pays: K3 yes, small presets no)
    pipeline_micro_batches: int = 4           # with a mesh stage axis: the GPipe schedule's micro-batches (the
                                              # bubble is (stages − 1) / (micro-batches + stages − 1))

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "TrainConfig":
        """A JSON or TOML file (any subset of fields), then ``key=value`` overrides (dotted keys for nesting)."""
        raw: dict[str, Any] = {}
        if path:
            p = Path(path)
            if not p.exists():
                raise ConfigError(f"{p}: training config not found")
            text = p.read_text()
            try:
                raw = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
            except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
                raise ConfigError(f"{p}: cannot parse ({e})") from None
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"--set {item!r}: expected key=value")
            key, val = item.split("=", 1)
            try:
                val = json.loads(val)
            except json.JSONDecodeError:
                pass
            parts = key.split(".")
            if parts[0] == "model" and len(parts) == 2:
                parts = ["model_overrides", parts[1]]
            node = raw
            for p_ in parts[:-1]:
                node = node.setdefault(p_, {})
            node[parts[-1]] = val
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(raw) - names)
        if bad:
            raise ConfigError(f"training config: unknown field(s) {bad}; known: {sorted(names)}")
        raw = dict(raw)
        if "optim" in raw:
            onames = {f.name for f in dataclasses.fields(OptimConfig)}
            obad = sorted(set(raw["optim"]) - onames)
            if obad:
                raise ConfigError(f"training config: unknown optim field(s) {obad}; known: {sorted(onames)}")
            raw["optim"] = OptimConfig(**raw["optim"])
        c = cls(**raw)
        c.validate()
        return c

    def validate(self) -> None:
        for name in ("seq_len", "batch_size", "micro_batches", "steps", "eval_every", "save_every", "keep",
                     "eval_batches", "balance_bins", "balance_passes", "pipeline_micro_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"training config: {name}: expected a positive integer, got {v!r}")
        if self.ep_method not in ("moonep", "dropless", "capacity"):
            raise ConfigError(f"training config: ep_method: expected 'moonep', 'dropless' or 'capacity', got "
                              f"{self.ep_method!r}")
        if self.scan_layers is not None and not isinstance(self.scan_layers, bool):
            raise ConfigError(f"training config: scan_layers: expected true, false or null, got {self.scan_layers!r}")
        if self.remat not in REMAT_NAMES:
            raise ConfigError(f"training config: remat: expected one of {', '.join(REMAT_NAMES)}, got {self.remat!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"training config: precision: expected one of {', '.join(PRECISIONS)}, got "
                              f"{self.precision!r}")
        from k3jax.train.optim import NS_DTYPES

        if self.optim.ns_dtype not in NS_DTYPES:
            raise ConfigError(f"training config: optim.ns_dtype: expected one of {', '.join(NS_DTYPES)}, got "
                              f"{self.optim.ns_dtype!r}")
        if self.balance not in BALANCE_METHODS:
            raise ConfigError(f"training config: balance: expected one of {', '.join(BALANCE_METHODS)}, got "
                              f"{self.balance!r}")
        if self.mesh:
            from k3jax.parallel.mesh import MeshError, parse_mesh

            try:
                sizes = parse_mesh(self.mesh)
            except MeshError as e:
                raise ConfigError(f"training config: {e}") from None
            if self.seq_len % sizes["context"]:
                raise ConfigError(f"training config: seq_len={self.seq_len} does not split over context="
                                  f"{sizes['context']} (mesh {self.mesh})")
            if sizes["stage"] > 1 and self.micro_batches > 1:
                raise ConfigError(f"training config: micro_batches={self.micro_batches}: with pipeline stages (mesh "
                                  f"{self.mesh}) the batch is split by pipeline_micro_batches instead")
            if sizes["stage"] > 1 and self.batch_size % (sizes["data"] * sizes["fsdp"] * self.pipeline_micro_batches):
                raise ConfigError(f"training config: batch_size={self.batch_size} does not split over data×fsdp="
                                  f"{sizes['data'] * sizes['fsdp']} × pipeline_micro_batches="
                                  f"{self.pipeline_micro_batches} (mesh {self.mesh})")
            if self.batch_size % (sizes["data"] * sizes["fsdp"] * self.micro_batches):
                micro = f" × micro_batches={self.micro_batches}" if self.micro_batches > 1 else ""
                raise ConfigError(f"training config: batch_size={self.batch_size} does not split over data×fsdp="
                                  f"{sizes['data'] * sizes['fsdp']}{micro} (mesh {self.mesh})")
        elif self.batch_size % self.micro_batches:
            raise ConfigError(f"training config: batch_size={self.batch_size} does not split into "
                              f"micro_batches={self.micro_batches} equal micro-batches")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_config(c: TrainConfig) -> K3Config:
    """The model config: ``c.model`` through :func:`k3jax.config.resolve_config` (an existing path wins over a
    preset name), then ``c.model_overrides``."""
    cfg = resolve_config(c.model)
    return cfg.replace(**c.model_overrides) if c.model_overrides else cfg


def load_data(c: TrainConfig, tokenizer) -> Dataset:
    docs, info = stdlib_corpus(c.corpus_bytes) if c.data is None else user_corpus(c.data, c.text_field)
    return Dataset(docs, info, tokenizer, c.seq_len, seed=c.seed)


def gemm_peak_flops(n: int = 1024, reps: int = 5, dtype: str = "fp32") -> float:
    """FLOP/s of a jitted ``n×n @ n×n`` on this backend (the MFU denominator, measured in the same run): fp32, or
    (``dtype="bf16"``) bf16 operands into an fp32 result — the products bf16 training runs (on an AMX CPU ~5× the
    fp32 rate)."""
    a = jnp.ones((n, n), jnp.bfloat16 if dtype == "bf16" else jnp.float32)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


# ------------------------------------------------------------------------------------------------- the step
def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_step(graphdef, params_template, rest_template, optimizer, c: TrainConfig, cfg: K3Config,
              state_shardings: tuple | None = None, ep: ExpertParallel | None = None,
              cp: ContextParallel | None = None, pp=None):
    """The jitted training step over (params, rest, opt_state, batch) as pure pytrees.

    One step: forward (routed experts over ``ep``'s mesh when given, sequences split along time over ``cp``'s
    context axis when given) → loss → gradients → Muon/AdamW update →
    the router biases for the next step from this step's routing (:mod:`k3jax.train.balance`; this step routed
    with the old ones). With ``c.micro_batches`` > 1 the forward and backward run once per micro-batch and the
    gradients are summed before the one update (see ``accumulated``). ``state_shardings`` (on a mesh): the
    shardings of (params, rest, opt_state); the step
    returns its new state with exactly these, so that step 2 sees the arguments step 1 saw and reuses its
    executable (an argument whose sharding changes between steps, e.g. an optimizer counter left on one device,
    makes the second step compile the whole step again).
    """
    balance = BalanceConfig(c.balance, c.balance_bins, c.balance_passes, c.sign_gamma)
    compute = compute_dtypes(cfg, c.precision)
    scan = use_scan(cfg, c.scan_layers)

    def to_state(template, pure):
        st = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(st, pure)
        return st

    def merged(params, rest):
        return nnx.merge(graphdef, to_state(params_template, params), to_state(rest_template, rest))

    def loss_fn(params, rest, batch, router_scores: bool):
        if compute is not None:                   # fp32 master weights → the compute dtype (gradients come back fp32)
            params = jax.tree.map(lambda p, d: p.astype(d), params, compute)
        out = merged(params, rest)(batch["input_ids"], segment_ids=batch["segment_ids"], ep=ep, cp=cp,
                                   router_scores=router_scores, remat=c.remat, scan_layers=scan,
                                   **({} if pp is None else {"pipeline": pp}))
        return cross_entropy(out.logits, batch["targets"], batch["loss_mask"]), out

    def accumulated(params, rest, batch):
        """Loss, gradients and routing statistics of the whole batch from ``c.micro_batches`` forward+backward
        passes in a scan: micro-batch ``a`` takes rows ``a, a+A, a+2A, …`` (on a mesh each device keeps its own
        rows), each pass differentiates its masked NLL sum, and the sums are divided by the batch's mask count —
        the gradient of the whole batch's mean loss. Expert counts are summed and router scores concatenated, so
        the router biases are solved from the same tokens as in one pass."""
        A = c.micro_batches
        micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // A, A, *x.shape[1:]), 0, 1), batch)
        n = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

        def nll_sum(params, mb):
            loss, out = loss_fn(params, rest, mb, balance.needs_scores)
            return loss * jnp.maximum(jnp.sum(mb["loss_mask"].astype(jnp.float32)), 1.0), out

        def body(acc, mb):
            (s, out), g = jax.value_and_grad(nll_sum, has_aux=True)(params, mb)
            acc = jax.tree.map(jnp.add, acc, (s, g))
            return acc, (out.expert_counts, out.router_scores)

        zero = (jnp.zeros([], jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (total, grads), (counts, scores) = jax.lax.scan(body, zero, micro)
        grads = jax.tree.map(lambda g: g / n, grads)
        if scores is not None:
            scores = tuple(s.reshape(-1, s.shape[-1]) for s in scores)
        stats = types.SimpleNamespace(expert_counts=jnp.sum(counts, axis=0), router_scores=scores)
        return total / n, stats, grads

    def step(params, rest, opt_state, batch):
        if c.micro_batches == 1:
            (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch,
                                                                           balance.needs_scores)
        else:
            loss, out, grads = accumulated(params, rest, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = merged(params, rest)                      # router biases as the step saw them
        update_router_biases(model, out, balance)
        rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
        params = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates)
        gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        return params, rest, opt_state, {"loss": loss, "grad_norm": gnorm, "counts": out.expert_counts}

    step = jax.jit(step) if state_shardings is None else jax.jit(step, out_shardings=(*state_shardings, None))

    @jax.jit
    def eval_step(params, rest, batch):
        loss, _ = loss_fn(params, rest, batch, False)
        return loss

    return step, eval_step


@dataclass
class TrainSetup:
    """What :func:`build_training` makes: the model split into its graph and (pure-dict) state, the optimizer
    state, the jitted steps and the mesh (None on one device)."""
    graphdef: Any
    params_st: Any
    rest_st: Any
    params: dict
    rest: dict
    opt_state: Any
    step_fn: Any
    eval_fn: Any
    mesh: Any
    pipeline: Any = None          # the PipelineConfig on a mesh with a stage axis


def pipeline_line(pp, cfg: K3Config) -> str:
    """The pipeline's layout for the run's log (:func:`k3jax.nn.pipeline.describe`)."""
    from k3jax.nn.pipeline import describe, split_run

    plan = scan_plan(cfg)
    return describe(plan, split_run(plan.repeats, pp.mesh.shape[pp.axis]), pp.micro_batches,
                    cfg.attn_res_block_size if cfg.attn_res else None, cfg.num_hidden_layers)


def pipeline_for(c: TrainConfig, model: K3ForCausalLM, mesh):
    """The pipeline of a mesh with a ``stage`` axis (:mod:`k3jax.nn.pipeline`): the model's periodic run split
    over the stages, ``c.pipeline_micro_batches`` micro-batches; a clear error where the model has no such run."""
    from k3jax.nn.pipeline import PipelineConfig, PipelineError, split_run

    plan, S = model.model.scan_plan, mesh.shape["stage"]
    if plan is None:
        raise ConfigError(f"training config: mesh {c.mesh}: pipeline stages split the model's periodic run of "
                          f"layers (k3jax.nn.scan.scan_plan), and {c.model} has none")
    try:
        split_run(plan.repeats, S)
    except PipelineError as e:
        raise ConfigError(f"training config: mesh {c.mesh}: {e}") from None
    return PipelineConfig(mesh, c.pipeline_micro_batches)


def build_training(c: TrainConfig, cfg: K3Config, devices: list | None = None) -> TrainSetup:
    """The model's initial state and the jitted steps for ``c``. On a mesh (``c.mesh``) the state is laid out by its logical axes, routed experts run over MoonEP,
    sequences split along time over the ``context`` axis, and Muon's Newton–Schulz runs in whole-head/whole-expert
    layouts (:func:`~k3jax.train.optim.muon_plans`: no momentum is gathered whole). ``devices``: the mesh's devices
    (default: all of them)."""
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(c.seed))
    graphdef, params_st, rest_st = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params_st), nnx.to_pure_dict(rest_st)
    dims = muon_dims_tree(params_st)
    mesh = ep = cp = pp = None
    if c.mesh:
        from k3jax.parallel.mesh import make_mesh
        from k3jax.parallel.rules import axes_tree, shard_pure

        mesh = make_mesh(c.mesh, devices)               # the sizes were checked against the batch in validate()
        params, rest = shard_pure(params, axes_tree(params_st), mesh), shard_pure(rest, axes_tree(rest_st), mesh)
        ep = ExpertParallel(mesh, c.ep_method)
        cp = ContextParallel(mesh) if mesh.shape["context"] > 1 else None
        if mesh.shape["stage"] > 1:
            pp = pipeline_for(c, model, mesh)
        optimizer = make_blockwise_optimizer(dims, c.steps, c.optim, muon_plans(params_st, mesh))
    else:
        optimizer = make_optimizer(dims, c.steps, c.optim)
    opt_state = optimizer.init(params)
    shardings = None
    if mesh is None:
        # One device: the state committed to the device it is on, as a restored one is (Orbax places it), so that
        # a fresh and a resumed run lower the same step (uncommitted arguments lower to another HLO: a resumed run
        # compiled the whole step again)
        params, rest, opt_state = jax.device_put((params, rest, opt_state), jax.tree.leaves(params)[0].sharding)
    else:
        from k3jax.parallel.rules import replicate_unplaced

        opt_state = replicate_unplaced(opt_state, mesh)       # optax's step counters are created off the mesh
        shardings = jax.tree.map(lambda x: x.sharding, (params, rest, opt_state))
    step_fn, eval_fn = make_step(graphdef, params_st, rest_st, optimizer, c, cfg, shardings, ep, cp, pp)
    return TrainSetup(graphdef, params_st, rest_st, params, rest, opt_state, step_fn, eval_fn, mesh, pp)


# ------------------------------------------------------------------------------------------------- the loop
@dataclass
class TrainResult:
    out: Path
    steps: int
    final_train_loss: float
    final_val_loss: float | None
    unigram_entropy: float
    model: K3ForCausalLM
    dataset: Dataset
    plots: list[Path]
    tokens_per_s: float
    mfu: float


def train(c: TrainConfig, *, console=None, stop_after: int | None = None, on_step=None) -> TrainResult:
    """Run (or resume) training as configured; ``stop_after`` ends early at that step; ``on_step(step, record)``
    is called after every step (after its checkpoint was handed to Orbax)."""
    from rich.console import Console

    console = console or Console()
    out = Path(c.out)
    old = sorted(int(p.name) for p in (out / "checkpoints").glob("*") if p.name.isdigit())
    if old and not c.resume:      # before anything in the run directory is written over
        raise TrainingError(f"{out / 'checkpoints'} holds checkpoints (latest step {old[-1]}) and resume=false: "
                            f"pass resume=true to continue that run, or a new out= directory to start another")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(c.tokenizer)
    cfg = model_config(c)
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model vocab_size={cfg.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer.vocab_size}, {tokenizer.name}); set model.vocab_size")
    data = load_data(c, tokenizer)
    primary = jax.process_index() == 0                 # multi-process: one writer of files and console output
    if not primary:
        console = Console(file=open(os.devnull, "w"))
    write = (lambda path, text: path.write_text(text)) if primary else (lambda path, text: None)
    write(out / "train_config.json", json.dumps(c.to_dict(), indent=2, default=str))
    write(out / "config.json", json.dumps(cfg.to_release_dict(), indent=2))
    write(out / "data.json", json.dumps({**data.info, "unigram_entropy_nats": data.unigram_entropy,
                                   "train_rows": data.train.rows, "val_rows": data.val.rows}, indent=2))

    setup = build_training(c, cfg)
    params, rest, opt_state, step_fn, eval_fn, mesh = (setup.params, setup.rest, setup.opt_state, setup.step_fn,
                                                       setup.eval_fn, setup.mesh)

    ckpt = Checkpointer(out / "checkpoints", keep=c.keep, save_every=c.save_every, async_save=c.async_save)
    log = MetricsLog(out / ("metrics.jsonl" if primary else f"metrics.process{jax.process_index()}.jsonl"))
    start = 0
    if c.resume and ckpt.latest_step() is not None:
        start = ckpt.latest_step()
        (params, rest, opt_state), meta = ckpt.restore(start, (params, rest, opt_state), RunLayout(scan_plan(cfg)))
        log.truncate_after(start)
        console.print(f"resumed from {ckpt.dir / str(start)} (step {start}, data position {meta['data_step']})")
    else:                                              # a new run (or resume=true with nothing to resume)
        log.path.unlink(missing_ok=True)

    from k3jax.costs import flops_per_token

    peak = gemm_peak_flops()
    flops_tok = flops_per_token(cfg, train_seq=c.seq_len)["training"]
    tokens_per_step = c.batch_size * c.seq_len
    console.print(f"[bold]k3jax train[/bold] {c.model}: {sum(x.size for x in jax.tree.leaves(params)):,} "
                  f"parameters; data {data.info['source']} ({data.info['files']} files, {data.info['bytes']:,} bytes, "
                  f"sha256 {data.info['sha256'][:12]}…); {data.train.rows} train / {data.val.rows} val rows of "
                  f"{c.seq_len}; balance={c.balance}; GEMM peak {peak / 1e9:.1f} GFLOP/s")
    if setup.pipeline is not None:
        console.print(pipeline_line(setup.pipeline, cfg))

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    show = (os.isatty(1) if c.progress is None else c.progress)
    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn(), console=console, disable=not show)
    task = bar.add_task("train", total=c.steps, completed=start, info="")
    loss_f = float("nan")
    val_loss = None
    tps = mfu = 0.0
    last_t = time.perf_counter()
    end = c.steps if stop_after is None else min(c.steps, stop_after)
    with bar:
        for step in range(start, end):
            batch = place_batch(data.train_batch(step, c.batch_size), mesh)
            params, rest, opt_state, m = step_fn(params, rest, opt_state, batch)
            loss_f = float(m["loss"])
            now = time.perf_counter()
            dt, last_t = now - last_t, now
            if not math.isfinite(loss_f):
                ckpt.wait()
                kept = ckpt.latest_step()
                raise TrainingError(f"non-finite loss ({loss_f}) at step {step + 1}; stopped. Last good checkpoint: "
                                    f"{ckpt.dir / str(kept) if kept is not None else 'none (no save yet)'}")
            counts = np.asarray(m["counts"])
            vio = np.asarray(max_violation(counts)) if counts.size else np.zeros(0)
            if step > start:                      # the first step of a process includes compilation
                tps = tokens_per_step / dt
                mfu = tps * flops_tok / peak
            rec = {"kind": "train", "step": step + 1, "loss": loss_f, "grad_norm": float(m["grad_norm"]),
                   "tokens_per_s": tps, "mfu": mfu, "maxvio": float(vio.max()) if vio.size else 0.0,
                   "maxvio_per_layer": vio.tolist(), "expert_load": counts.tolist()}
            log.write(rec)
            bar.update(task, advance=1, info=f"loss {loss_f:.3f}  {tps:,.0f} tok/s  MFU {mfu:.1%}  "
                                             f"maxvio {rec['maxvio']:.2f}")
            if (step + 1) % c.eval_every == 0 or step + 1 == c.steps:
                val_loss = evaluate(eval_fn, params, rest, data, c, mesh)
                log.write({"kind": "val", "step": step + 1, "val_loss": val_loss})
                bar.console.print(f"step {step + 1}: train loss {loss_f:.4f}, val loss {val_loss:.4f} nats/token")
            ckpt.save(step + 1, (params, rest, opt_state), {"step": step + 1, "data_step": step + 1,
                                                              "loss": loss_f}, force=step + 1 == c.steps)
            if on_step is not None:
                on_step(step + 1, rec)
    ckpt.close()
    params_st2 = jax.tree.map(lambda x: x, setup.params_st)
    nnx.replace_by_pure_dict(params_st2, params)
    rest_st2 = jax.tree.map(lambda x: x, setup.rest_st)
    nnx.replace_by_pure_dict(rest_st2, rest)
    trained = nnx.merge(setup.graphdef, params_st2, rest_st2)
    plots = plot_run(log.read(), out, data.unigram_entropy) if primary else []
    return TrainResult(out, end, loss_f, val_loss, data.unigram_entropy, trained, data, plots, tps, mfu)


def place_batch(batch: dict, mesh) -> dict:
    """Host batch → device arrays; on a mesh the batch axis is split over ``data``."""
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    from k3jax.parallel.rules import batch_sharding

    return {k: jax.device_put(v, batch_sharding(mesh, v.shape[0])) for k, v in batch.items()}


def evaluate(eval_fn, params, rest, data: Dataset, c: TrainConfig, mesh=None) -> float:
    losses = [float(eval_fn(params, rest, place_batch(b, mesh)))
              for b in data.val_batches(c.batch_size, c.eval_batches)]
    return float(np.mean(losses))


__all__ = ["TrainConfig", "TrainResult", "TrainSetup", "TrainingError", "build_training", "train", "DataError"]
