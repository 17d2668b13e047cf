"""Under 8 simulated CPU devices: ``train`` on mesh stage=4,data=2 (the periodic run pipelined, 4 micro-batches)
and on stage=2,expert=2,data=2 against data=8; prints the losses. The model: the test preset's widths at 11 layers
(layer 0 KDA + dense FFN, five (KDA, MLA) periods with MoE, AttnRes blocks of 3), Quantile Balancing and Per-Head
Muon on (fp32 Newton–Schulz)."""

import json
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402

from k3jax.train.loop import TrainConfig, train  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
LAC = {"kda_layers": [1, 2, 4, 6, 8, 10], "full_attn_layers": [3, 5, 7, 9, 11], "num_heads": 2, "head_dim": 32,
       "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True}
MODEL = ["model=test", "model.num_hidden_layers=11", f"model.linear_attn_config={json.dumps(LAC)}",
         "model.attn_res_block_size=3", "optim.ns_dtype=fp32"]


def losses(mesh: str, steps: int) -> list[float]:
    from rich.console import Console

    out = []
    with tempfile.TemporaryDirectory() as d:
        c = TrainConfig.load(None, [f"out={d}", *MODEL, f"steps={steps}", "batch_size=8", "seq_len=32",
                                    "eval_every=1000", f"save_every={steps}", "resume=false", "progress=false",
                                    f"mesh={mesh}", "corpus_bytes=200000"])
        train(c, console=Console(file=open(os.devnull, "w")), on_step=lambda s, r: out.append(r["loss"]))
    return out


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    meshes = sys.argv[2:] or ["data=8", "stage=4,data=2", "stage=2,expert=2,data=2"]
    print(json.dumps({m: losses(m, steps) for m in meshes}))
