"""Peak host RSS while loading a multi-shard release checkpoint, against the largest shard and the model's size.

    .venv/bin/python -m benchmarks.load_rss [--hidden 512] [--experts 64] [--shard-size 64MB] [--json out.json]

Writes a random MXFP4-expert K3-shaped checkpoint (every K3 feature on) with ``k3jax.save_pretrained``, then loads
it in a fresh process for each expert dtype and reports: baseline RSS after importing JAX, peak RSS during the load
(``VmHWM``), the bytes of the loaded model (which on a CPU backend live in host memory too), and the overhead
``peak − baseline − model bytes`` — what streaming must keep below the largest shard.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import jax, numpy as np
import k3jax
from flax import nnx
def status(field):  # VmRSS / VmHWM (the high-water mark of this process's own address space)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))
jax.numpy.zeros(1).block_until_ready()
base = status("VmRSS")
t0 = time.perf_counter()
m = k3jax.load_pretrained(sys.argv[1], expert_dtype=sys.argv[2], progress=False)
leaves = [v[...] for _, v in nnx.to_flat_state(nnx.split(m)[1])]
jax.block_until_ready(leaves)
dt = time.perf_counter() - t0
peak = status("VmHWM")
model = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)
print(json.dumps({"expert_dtype": sys.argv[2], "rss_baseline": base, "rss_peak": peak, "model_bytes": model,
                  "overhead_bytes": peak - base - model, "load_seconds": dt}))
"""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shard-size", default="64MB")
    ap.add_argument("--json", default=None, help="write the result here as JSON")
    a = ap.parse_args(argv)

    import jax
    from flax import nnx

    import k3jax
    from k3jax import K3Config

    base = K3Config.from_preset("tiny")
    lac = base.linear_attn_config
    cfg = base.replace(hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_experts=a.experts,
                       moe_intermediate_size=a.hidden, routed_expert_hidden_size=a.hidden, vocab_size=32768,
                       dtype="bfloat16", expert_dtype="mxfp4", num_hidden_layers=a.layers,
                       linear_attn_config=type(lac)(**{**lac.to_dict(), "kda_layers": [i for i in range(1, a.layers)
                                                                                      if i % 4], "full_attn_layers":
                                                       [i for i in range(1, a.layers) if i % 4 == 0] + [a.layers]}))
    with tempfile.TemporaryDirectory() as tmp:
        ck = Path(tmp) / "ckpt"
        model = k3jax.K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
        k3jax.save_pretrained(model, ck, shard_size=a.shard_size)
        del model
        shards = sorted(ck.glob("*.safetensors"))
        sizes = [p.stat().st_size for p in shards]
        runs = []
        for ed in ("mxfp4", "bfloat16"):
            out = subprocess.run([sys.executable, "-c", CHILD, str(ck), ed], capture_output=True, text=True,
                                 check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {
        "benchmark": "load_rss", "machine": platform.machine(), "python": platform.python_version(),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "checkpoint_bytes": sum(sizes), "shards": len(sizes), "largest_shard_bytes": max(sizes),
        "config": {"hidden_size": a.hidden, "num_experts": a.experts, "layers": a.layers},
        "runs": runs,
    }
    for r in runs:
        r["overhead_vs_largest_shard"] = r["overhead_bytes"] / max(sizes)
    print(json.dumps(result, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
