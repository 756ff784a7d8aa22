"""`loss.png`: train and validation loss against step (bottom axis) and tokens (top axis), for the
people who would rather look than read metrics.jsonl. Rank 0 writes it at each checkpoint and at
the end; the file is replaced atomically."""

from __future__ import annotations

import os
from typing import Dict, List

from framework.fileio import create_temporary


def write_loss_plot(records: List[Dict[str, object]], tokens_per_step: int, path: str) -> bool:
    """Plot `records` (metrics records: step, loss, val_loss) to `path`; False when there is
    nothing to plot yet."""
    train = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    valid = [(r["step"], r["val_loss"]) for r in records if isinstance(r.get("val_loss"), (int, float))]
    if not train and not valid:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5), dpi=100)
    ax = figure.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    per = max(1, tokens_per_step)
    top = ax.secondary_xaxis("top", functions=(lambda s: s * per, lambda t: t / per))
    top.set_xlabel("tokens")
    figure.tight_layout()
    tmp = f"{path}.tmp"
    with create_temporary(tmp, "wb") as handle:  # never through a planted link
        figure.savefig(handle, format="png")
    os.replace(tmp, path)
    return True
