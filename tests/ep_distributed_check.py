"""One of two processes × 4 CPU devices (jax.distributed on localhost): the first ``stop`` steps of the 20-step
``ep_train_check`` run (its model, :data:`small_models.MODEL`) on mesh context=2,data=2,expert=2; process 0 prints the
losses."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
pid, port, stop, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
steps = 20
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
from k3jax.parallel.mesh import init_distributed  # noqa: E402

init_distributed(f"127.0.0.1:{port}", 2, pid)
jax.config.update("jax_default_matmul_precision", "highest")
from small_models import MODEL  # noqa: E402  (beside this script: on sys.path)
from rich.console import Console  # noqa: E402

from k3jax.train.loop import TrainConfig, train  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4
losses = []
c = TrainConfig.load(None, [f"out={out}", *MODEL, f"steps={steps}", "batch_size=8", "seq_len=32",
                            "eval_every=1000", f"save_every={steps}", "resume=false", "progress=false",
                            "mesh=context=2,data=2,expert=2", "ep_method=moonep", "corpus_bytes=200000"])
train(c, console=Console(file=open(os.devnull, "w")), stop_after=stop, on_step=lambda s, r: losses.append(r["loss"]))
if pid == 0:
    print(json.dumps({"losses": losses}))
