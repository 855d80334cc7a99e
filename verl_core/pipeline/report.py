"""The evaluation report's files: a CSV of the table and one PNG (accuracy per policy, loss curves)."""

from __future__ import annotations

import csv
from pathlib import Path


def write_csv(path: Path, table: list[dict]) -> None:
    keys = list(dict.fromkeys(k for row in table for k in row))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, keys)
        writer.writeheader()
        writer.writerows(table)


def plot_report(table: list[dict], curves: dict[str, dict[str, list]], path: Path) -> Path:
    """Accuracy per policy (bars) and each training stage's loss curve, as one PNG (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    score = "accuracy" if all("accuracy" in r for r in table) else "reward_score"
    axes[0].bar([r["policy"] for r in table], [r.get(score, 0.0) for r in table], color="tab:blue")
    axes[0].set(title=f"held-out {score}", ylabel=score, **({"ylim": (0, 1)} if score == "accuracy" else {}))
    for stage, hist in curves.items():
        if hist.get("loss"):
            steps, values = zip(*hist["loss"])
            axes[1].plot(steps, values, label=stage)
    axes[1].set(title="training loss", xlabel="step")
    if curves:
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
