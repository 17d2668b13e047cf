"""Metrics to JSONL, and the plots people look at: loss curves and expert load over steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class MetricsLog:
    """Appends one JSON object per line; reading back gives the run's history (resumes append)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run rewrites them)."""
        keep = [r for r in self.read() if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def plot_run(records: list[dict], out_dir: str | Path, unigram: float | None = None) -> list[Path]:
    """``loss.png`` (train and val loss vs step) and ``expert_load.png`` (per-layer max-violation and the last MoE
    layer's per-expert load share over steps, as heatmaps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    if unigram is not None:
        ax.axhline(unigram, color="gray", ls="--", label=f"unigram entropy {unigram:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    paths.append(out / "loss.png")
    loads = [r for r in records if r.get("kind") == "train" and "expert_load" in r]
    if loads:
        steps = [r["step"] for r in loads]
        vio = np.array([r["maxvio_per_layer"] for r in loads]).T              # [layers, steps]
        last = np.array([r["expert_load"][-1] for r in loads], np.float64).T  # [experts, steps]
        last = last / np.maximum(last.sum(0, keepdims=True), 1)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        im = axes[0].imshow(vio, aspect="auto", cmap="magma", origin="lower", interpolation="nearest",
                            extent=[steps[0], steps[-1], -0.5, vio.shape[0] - 0.5])
        axes[0].set(xlabel="step", ylabel="MoE layer", title="max load / mean − 1 per layer")
        fig.colorbar(im, ax=axes[0])
        im = axes[1].imshow(last, aspect="auto", cmap="viridis", origin="lower", interpolation="nearest",
                            extent=[steps[0], steps[-1], -0.5, last.shape[0] - 0.5])
        axes[1].set(xlabel="step", ylabel="expert", title="last MoE layer: share of routed tokens")
        fig.colorbar(im, ax=axes[1])
        fig.tight_layout()
        fig.savefig(out / "expert_load.png", dpi=110)
        plt.close(fig)
        paths.append(out / "expert_load.png")
    return paths
