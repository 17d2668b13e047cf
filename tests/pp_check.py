"""Under 8 simulated CPU devices: the model's periodic run pipelined over the ``stage`` axis
(k3jax.nn.pipeline) against the unpipelined model, in float64; prints JSON.

The model: the test preset's widths at 13 layers, layer 0 KDA with a dense FFN, then six (KDA, MLA) periods with
MoE FFNs, AttnRes blocks of 3 — a period does not line up with the blocks, 6 periods over 4 stages is an uneven
split (2, 2, 1, 1), over 2 stages an even one (3, 3); two packed documents per row. The parameters are placed by
the sharding rules, as training places them: the run's stacks ``[6, …]`` on the stage axis where the split is even
(each stage holds its 3 periods), whole on every device where it is not. Loss, logits, expert counts, router
scores and gradients on ``stage=4,data=2`` and on ``stage=2,context=2,data=2`` (each stage's layers split along
time over the context axis, documents crossing the ranks) with 2 micro-batches (MoonEP inside the stages:
pp_train_check's stage=2,expert=2,data=2 run), and how many of the run's rows each device holds of the parameters
and of their gradients; the bytes the compiled forward's collective-permutes move across each stage boundary with
incremental AttnRes sends and with every block forwarded along the chain."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.nn.model import K3ForCausalLM  # noqa: E402
from k3jax.parallel.context import ContextParallel  # noqa: E402
from k3jax.parallel.ep import ExpertParallel  # noqa: E402
from k3jax.parallel.mesh import make_mesh  # noqa: E402
from k3jax.nn.pipeline import PipelineConfig, stage_links  # noqa: E402
from k3jax.parallel.rules import axes_tree, shard_pure  # noqa: E402
from test_scan import k3_pattern  # noqa: E402  (beside this script: on sys.path)

jax.config.update("jax_enable_x64", True)


def main():
    cfg = k3_pattern(13, 3, mla=[2, 4, 6, 8, 10, 12]).replace(dtype="float64")
    graph, state, rest = nnx.split(K3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = nnx.to_pure_dict(state)
    run_key = ("model", "run", 0, "self_attn", "q_proj", "kernel")        # one of the run's stacks [6, …]
    ids = jax.random.randint(jax.random.key(2), (4, 16), 0, cfg.vocab_size)
    seg = jnp.where(jnp.arange(16) < 6, 1, 2)[None].repeat(4, 0)        # documents of 6 and 10 tokens

    def loss(p, pp=None, ep=None, cp=None):
        st = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(st, p)
        out = nnx.merge(graph, st, rest)(ids, segment_ids=seg, pipeline=pp, ep=ep, cp=cp, router_scores=True)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0]), (out.logits, out.expert_counts, out.router_scores)

    def rows(tree) -> int:
        """How many of the stack's rows one device holds."""
        for k in run_key:
            tree = tree[k]
        return tree.addressable_shards[0].data.shape[0]

    def diff(a, b):
        return max((float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))),
                   default=0.0)

    (v0, aux0), g0 = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    out = {"plan": list(K3ForCausalLM(cfg, rngs=nnx.Rngs(0)).model.scan_plan), "grad_scale": diff(g0, jax.tree.map(
        jnp.zeros_like, g0))}
    for name, mesh_spec in (("stage4", "stage=4,data=2"), ("stage2_context2", "stage=2,context=2,data=2")):
        mesh = make_mesh(mesh_spec)
        pp = PipelineConfig(mesh, 2)
        ep = ExpertParallel(mesh) if mesh.shape["expert"] > 1 else None
        cp = ContextParallel(mesh) if mesh.shape["context"] > 1 else None
        placed = shard_pure(params, axes_tree(state), mesh)                # as training places them
        (v, aux), g = jax.jit(jax.value_and_grad(lambda p: loss(p, pp, ep, cp), has_aux=True))(placed)
        out[name] = {"loss": abs(float(v - v0)), "logits": diff(aux[0], aux0[0]),
                     "counts_equal": bool(jnp.all(aux[1] == aux0[1])), "scores": diff(aux[2], aux0[2]),
                     "grads": diff(g, g0), "run_rows_per_device": rows(placed), "grad_rows_per_device": rows(g)}
    mesh = make_mesh("stage=4,data=2")
    for sends in ("new", "all"):
        fwd = jax.jit(lambda p, s=sends: loss(p, PipelineConfig(mesh, 2, sends=s))[0])
        out[f"boundary_bytes_{sends}"] = stage_links(fwd.lower(params).compile().as_text(), mesh)
        out[f"permute_bytes_{sends}"] = sum(out[f"boundary_bytes_{sends}"].values())
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
