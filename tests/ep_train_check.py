"""Under 8 simulated CPU devices: ``train`` on mesh context=2,data=2,expert=2 (sequences split along time, MoonEP,
data parallelism) vs one device; prints the losses. With a second argument also fsdp=2,expert=2,tensor=2 (weights
sharded by their metadata, Per-Head Muon in whole-block layouts).

The model is :data:`small_models.MODEL` (the test preset: 3 layers, every layer kind)."""

import json
import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
from small_models import MODEL  # noqa: E402  (beside this script: on sys.path)

from k3jax.train.loop import TrainConfig, train  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_log_compiles", True)
STEP_COMPILES = []


class _CountStepCompiles(logging.Handler):
    """Counts the compilations of the jitted training step (jax_log_compiles logs one record per compile)."""

    def emit(self, record: logging.LogRecord) -> None:
        if "Compiling jit(step)" in record.getMessage():
            STEP_COMPILES.append(record)


logging.getLogger("jax").addHandler(_CountStepCompiles())
logging.getLogger("jax").propagate = False     # the compile log goes to the counter, not to stderr


def losses(mesh: str, method: str, steps: int, stop: int | None = None) -> list[float]:
    from rich.console import Console

    out, times = [], [time.perf_counter()]
    STEP_COMPILES.clear()
    with tempfile.TemporaryDirectory() as d:
        c = TrainConfig.load(None, [f"out={d}", *MODEL, f"steps={steps}", "batch_size=8", "seq_len=32",
                                    "eval_every=1000", f"save_every={steps}", "resume=false", "progress=false",
                                    f"mesh={mesh}", f"ep_method={method}", "corpus_bytes=200000"])
        train(c, console=Console(file=open(os.devnull, "w")), stop_after=stop,
              on_step=lambda s, r: (out.append(r["loss"]), times.append(time.perf_counter())))
    COMPILES[mesh or "single"] = len(STEP_COMPILES)
    # seconds to the first step's end (model, compile, step 1), then of the other steps
    SECONDS[mesh or "single"] = [round(times[1] - times[0], 1), round(times[-1] - times[1], 1)]
    return out


COMPILES: dict[str, int] = {}
SECONDS: dict[str, list[float]] = {}


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    tight = 10    # the first 10 steps of the 20-step schedule (see test_ep for why no more are compared)
    # one device; sequences split along time (k3jax.parallel.context) with MoonEP and data parallelism at once
    res = {"single": losses("", "moonep", steps, stop=tight),
           "context": losses("context=2,data=2,expert=2", "moonep", steps, stop=tight)}
    if len(sys.argv) > 2:
        res["fsdp_tensor"] = losses("fsdp=2,expert=2,tensor=2", "moonep", steps, stop=6)  # same schedule, 6 steps
    res["step_compiles"] = COMPILES         # per mesh: how often the training step compiled in that run
    res["seconds"] = SECONDS
    print(json.dumps(res))
