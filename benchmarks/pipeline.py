"""Pipeline parallelism (k3jax.nn.pipeline) on 8 simulated CPU devices: GPipe bubble, AttnRes bytes sent
between stages (incremental vs every block forwarded), step time.

    .venv/bin/python -m benchmarks.pipeline [--depth 25] [--stages 2 4] [--micro 1 2 4 8] [--json out.json]

The model is the ``test`` preset's widths with K3's layer pattern (``benchmarks.depth.k3_pattern``: layer 0 KDA with
a dense FFN, (KDA, KDA, KDA, MLA) units with MoE FFNs, the last layer MLA, AttnRes blocks of ``--block``), batch
``--batch`` × ``--seq``. Per (stages S, micro-batches M) on mesh ``stage=S,data=8/S``:

* the GPipe bubble ``(S − 1) / (M + S − 1)`` (the fraction of stage-ticks without work);
* the bytes the compiled forward's collective-permutes move per micro-batch (one schedule tick), in all and per
  pair of stages ``"s→t"`` (:func:`~k3jax.nn.pipeline.stage_links`), with each stage sending its new blocks to the
  stages that read them (``new``) and with every block forwarded along the chain (``all``), and their ratio;
* the gradient step's compile time and median wall time, beside the same model on one device (no pipeline). On
  simulated CPU devices the stages share the host's cores, so the times show the schedule's overhead, not a
  speed-up.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import write_result  # noqa: E402


def _timed(fn, params, reps: int) -> tuple[float, float]:
    from benchmarks.depth import compiled, median_time

    c, compile_s = compiled(fn, params)
    return compile_s, median_time(c, params, reps)


def rows(depth: int, block: int, batch: int, seq: int, stages: list[int], micros: list[int], reps: int) -> list[dict]:
    from benchmarks.depth import k3_pattern
    from k3jax.nn.model import K3ForCausalLM
    from k3jax.parallel.mesh import make_mesh
    from k3jax.nn.pipeline import PipelineConfig, bubble_fraction, split_run, stage_links, stage_seals

    cfg = k3_pattern(depth).replace(attn_res_block_size=block)
    graph, params, rest = nnx.split(K3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size)
    plan = K3ForCausalLM(cfg, rngs=nnx.Rngs(0)).model.scan_plan

    def loss(p, pp=None):
        return jnp.mean(jax.nn.log_softmax(nnx.merge(graph, p, rest)(ids, pipeline=pp).logits)[..., 0])

    out = []
    c_s, t_s = _timed(jax.value_and_grad(loss), params, reps)
    out.append({"mesh": "one device", "stages": 1, "micro_batches": 1, "bubble": 0.0, "grad_compile_s": round(c_s, 2),
                "grad_step_s": round(t_s, 4)})
    for S in stages:
        mesh = make_mesh(f"stage={S},data={8 // S}")
        split = split_run(plan.repeats, S)
        for M in micros:
            if batch % M:
                continue
            row = {"mesh": f"stage={S},data={8 // S}", "stages": S, "micro_batches": M, "periods": list(split.periods),
                   "blocks_sealed": list(stage_seals(plan, split, block)),
                   "bubble": round(bubble_fraction(S, M), 4)}
            for sends in ("new", "all"):
                pp = PipelineConfig(mesh, M, sends=sends)
                hlo = jax.jit(lambda p, pp=pp: loss(p, pp)).lower(params).compile().as_text()
                links = stage_links(hlo, mesh)
                row[f"permute_bytes_{sends}"] = sum(links.values())
                row[f"boundary_bytes_{sends}"] = links
            row["bytes_ratio_new_over_all"] = round(row["permute_bytes_new"] / row["permute_bytes_all"], 3)
            c_s, t_s = _timed(jax.value_and_grad(lambda p, pp=PipelineConfig(mesh, M): loss(p, pp)), params, reps)
            row.update(grad_compile_s=round(c_s, 2), grad_step_s=round(t_s, 4))
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=25)
    ap.add_argument("--block", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    params = {k: v for k, v in vars(args).items() if k != "json"}
    res = {"benchmark": "pipeline", "params": params | {"widths": "test preset", "pattern": "K3 (k3_pattern)"},
           "backend": jax.default_backend(), "devices": jax.device_count(), "jax": jax.__version__,
           "python": platform.python_version()}
    res["rows"] = rows(args.depth, args.block, args.batch, args.seq, args.stages, args.micro, args.reps)
    write_result(res, args.json)
    return res


if __name__ == "__main__":
    main()
