"""Plot the training and validation loss curves of a run as a PNG.

Usage: python -m model.plot --run runs/base --out model/shipped/loss.png
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


def plot(records: list[dict[str, float]], out: Path) -> None:
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
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
    p.add_argument("--run", type=Path, default=Path("runs/base"))
    p.add_argument("--out", type=Path, default=Path("model/shipped/loss.png"))
    args = p.parse_args()
    plot(read_log(args.run), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
