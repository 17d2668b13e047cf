"""Training checkpoints with Orbax: model variables, optimizer state, QB state, data position, step.

``CKPT_DIR/<step>/`` holds ``state`` (an Orbax PyTree: params, non-trainable model state — router biases and QB
bounds — and the optimizer state) and ``meta`` (JSON: step, data position, config, metrics so far). Saves are
asynchronous and atomic (Orbax writes to a temporary directory and renames on commit); the last ``keep`` are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3, save_every: int = 100, async_save: bool = True):
        self.dir = Path(directory).absolute()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every,
                                            enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.dir, options=opts, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, force: bool = False) -> bool:
        return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                               meta=ocp.args.JsonSave(meta)), force=force)

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
