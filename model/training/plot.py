"""Plot the training and validation loss curves of a run as a PNG.

Usage: python -m model.training.plot --run runs/base --out model/shipped/loss.png
       python -m model.training.plot --run runs/base --run runs/finish ...   # a run resumed from another's checkpoint

Each later run continues the one before it from a checkpoint: its curve replaces the earlier run's
records from its first step on, and a dashed line marks where it took over.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers or CI
import matplotlib.pyplot as plt


def read_log(run: Path) -> list[dict[str, float]]:
    with (run / "log.jsonl").open() as f:
        return [json.loads(line) for line in f if line.strip()]


def chain(logs: list[list[dict[str, float]]]) -> tuple[list[dict[str, float]], list[float]]:
    """One curve from runs that each resumed from a checkpoint of the one before; and the steps where
    each later run took over (records of the earlier run past that point were never shipped)."""
    records: list[dict[str, float]] = []
    takeovers: list[float] = []
    for log in logs:
        if records and log:
            first = log[0]["step"]
            records = [r for r in records if r["step"] < first]
            takeovers.append(records[-1]["step"] if records else first)
        records.extend(log)
    return records, takeovers


def plot(records: list[dict[str, float]], out: Path, takeovers: list[float] | None = None) -> None:
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    for step in takeovers or []:
        ax.axvline(step, color="grey", linestyle="--", linewidth=0.8)
    ax.plot(steps, [r["train_loss"] for r in records], label="train (label-smoothed)")
    ax.plot(steps, [r["valid_loss"] for r in records], label="validation (cross-entropy)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss per target token (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, action="append", help="a run directory; repeat for resumed runs, in order")
    p.add_argument("--out", type=Path, default=Path("model/shipped/loss.png"))
    args = p.parse_args()
    records, takeovers = chain([read_log(run) for run in args.run or [Path("runs/base")]])
    plot(records, args.out, takeovers)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
