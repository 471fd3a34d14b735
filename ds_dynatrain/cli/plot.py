"""Loss-against-step plot of a metrics file, resizes marked (matplotlib, the ``examples`` extra)."""

from __future__ import annotations

import json
from typing import List, Optional


def read_metrics(path: str) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(
    metrics_path: str,
    out_path: str,
    static_path: Optional[str] = None,
    title: str = "Loss of an elastic DeepSpeed ZeRO job",
) -> None:
    """Write a PNG: loss per step of the elastic run (and of the static run, if given), with a
    vertical line and a label ``old → new`` at every resize.

    Raises:
        ImportError: matplotlib is not installed (``pip install ds_dynatrain[examples]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    steps = [r for r in recs if r["event"] == "step"]
    fig, ax = plt.subplots(figsize=(9, 5))
    if static_path:
        st = [r for r in read_metrics(static_path) if r["event"] == "step"]
        ax.plot(
            [r["step"] for r in st],
            [r["loss"] for r in st],
            color="0.6",
            lw=2.5,
            label=f"static run (world size {st[0]['world_size'] if st else '?'})",
        )
    ax.plot(
        [r["step"] for r in steps],
        [r["loss"] for r in steps],
        color="C0",
        lw=1.2,
        marker=".",
        ms=3,
        label="elastic run",
    )
    ymax = max((r["loss"] for r in steps), default=1.0)
    for r in recs:
        if r["event"] == "resize":
            x = r["step"] + 0.5
            ax.axvline(x, color="C3", ls="--", lw=1)
            ax.text(x, ymax, f" {r['from']}\u2192{r['to']}\n {r['seconds']:.1f} s", color="C3", va="top", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
