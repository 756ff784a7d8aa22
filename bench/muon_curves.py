"""The default job's validation curves under optimizer=muon and optimizer=adamw (docs/optimizers.md).

    # the two runs (the default job, validation every 20 steps instead of 100 for a curve):
    .venv/bin/python main.py optimizer=adamw trainer.eval_interval=20 hydra.run.dir=runs/adamw400
    .venv/bin/python main.py optimizer=muon trainer.eval_interval=20 hydra.run.dir=runs/muon400
    # keep their metrics (step, lr, loss, val_loss, step_time_s) under bench/results/, then plot:
    .venv/bin/python bench/muon_curves.py --adamw runs/adamw400 --muon runs/muon400
    # plot again from the kept metrics:
    .venv/bin/python bench/muon_curves.py

Writes docs/muon_vs_adamw.png (validation loss against step, training loss faint behind it) and
prints the validation losses as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os

KEEP = ("step", "lr", "loss", "val_loss", "step_time_s")
RUNS = ("adamw", "muon")


def kept_path(name: str) -> str:
    return f"bench/results/muon_vs_adamw_{name}.jsonl"


def keep(run_dir: str, name: str) -> None:
    """The run's metrics.jsonl, cut to KEEP, as bench/results/muon_vs_adamw_<name>.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f, open(kept_path(name), "w") as out:
        for line in f:
            row = json.loads(line)
            out.write(json.dumps({k: row[k] for k in KEEP if row.get(k) is not None}) + "\n")


def load(name: str) -> list:
    with open(kept_path(name)) as f:
        return [json.loads(line) for line in f]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adamw", help="run directory of the optimizer=adamw job (its metrics are kept first)")
    ap.add_argument("--muon", help="run directory of the optimizer=muon job (its metrics are kept first)")
    ap.add_argument("--png", default="docs/muon_vs_adamw.png")
    args = ap.parse_args()
    for name in RUNS:
        if getattr(args, name):
            keep(getattr(args, name), name)
    runs = {name: load(name) for name in RUNS}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (name, rows), color in zip(runs.items(), ("tab:blue", "tab:red")):
        ax.plot(
            [r["step"] for r in rows],
            [r["loss"] for r in rows],
            color=color,
            alpha=0.2,
            lw=0.8,
            label=f"{name} training",
        )
        val = [r for r in rows if "val_loss" in r]
        ax.plot(
            [r["step"] for r in val], [r["val_loss"] for r in val], "o-", color=color, ms=3, label=f"{name} validation"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("python main.py (model=small, data=stdlib, 2 ranks): optimizer=muon vs adamw", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")

    val = {name: {r["step"]: r["val_loss"] for r in rows if "val_loss" in r} for name, rows in runs.items()}
    print("| step | " + " | ".join(f"{n} val loss" for n in RUNS) + " |")
    print("|---|" + "---|" * len(RUNS))
    for step in sorted(set().union(*val.values())):
        print(f"| {step} | " + " | ".join(f"{val[n][step]:.3f}" if step in val[n] else "" for n in RUNS) + " |")


if __name__ == "__main__":
    main()
