"""Training checkpoints with Orbax: model variables, optimizer state, data position, step.

``CKPT_DIR/<step>/`` holds ``state`` (an Orbax PyTree ``(params, rest, opt_state)``: the ``nnx.Param`` variables,
the other model variables — router biases — and the optimizer state) and ``meta`` (JSON written by the training
loop: ``step``, ``data_step`` — the data iterator's position — and that step's ``loss``). The run's model config is
not in the checkpoint but beside it, in ``RUN/config.json``. Saves are asynchronous and atomic (Orbax writes to a
temporary directory and renames on commit); the last ``keep`` are kept.

Restoring goes through :func:`k3jax.io.orbax.restore_tree`, the reader that model loading uses too: the saved tree
must match the target variable for variable and shape for shape (else ``CheckpointError`` naming the variable),
except saved :data:`~k3jax.io.orbax.LEGACY_KEYS` the target lacks (e.g. the ``qb_bounds`` that older runs kept in
``rest``), which are skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from k3jax.io.orbax import restore_tree


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

    def restore(self, step: int, target: Any, layout=None) -> tuple[Any, dict]:
        """``(state, meta)`` of ``step``; ``state`` has ``target``'s structure, shardings and dtypes. ``layout``
        (the model's :class:`~k3jax.nn.scan.RunLayout`): a checkpoint saved with the run of layers per layer is
        stacked as it is read (:func:`~k3jax.io.orbax.restore_tree`)."""
        state = restore_tree(self.dir / str(step) / "state", target, against="this run's training state",
                             layout=layout)
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        return state, meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
