"""Learning curves of `specdec train` runs side by side: held-out chain acceptance against training minutes,
and the training loss against steps, one line per run folder.

    python scripts/plot_learning_curves.py --run dflash=RUN_A --run dflash2=RUN_B --out curves.png

Reads each run's trainer_state.json (its history: one record per checkpoint, `acceptance` where an evaluation
ran); prints the points the plot shows and a markdown table of each run's end. `--right accuracy` draws the
slot-1 accuracy on training blocks (comparable between hard-label and distillation runs, whose losses are
not) instead of the loss.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: Path) -> list[dict]:
    return json.loads((run / "trainer_state.json").read_text())["history"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="LABEL=RUN_FOLDER, repeatable")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--title", default="")
    parser.add_argument("--right", choices=("loss", "accuracy"), default="loss",
                        help="what the right panel draws against steps")
    parser.add_argument("--steps-panel", action="store_true", help="add held-out acceptance against steps")
    parser.add_argument("--minutes-label", default="training minutes (this 2-core CPU)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.steps_panel:
        fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.2))
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        middle = None
    rows: list[str] = []
    for spec in args.run:
        label, _, folder = spec.partition("=")
        history = load(Path(folder))
        evals = [h for h in history if "acceptance" in h]
        minutes = [h["elapsed_seconds"] / 60 for h in evals]
        left.plot(minutes, [h["acceptance"] for h in evals], marker="o", label=label)
        if middle is not None:
            middle.plot([h["step"] for h in evals], [h["acceptance"] for h in evals], marker="o", label=label)
        if args.right == "accuracy":
            key = "accuracy"
            right.plot([h["step"] for h in history], [h["accuracy"] for h in history], label=label)
        else:
            key = "draft_loss" if any("draft_loss" in h for h in history) else "loss"
            right.plot([h["step"] for h in history], [h.get(key, h["loss"]) for h in history],
                       label=f"{label} ({key})")
        points = zip(minutes, evals, strict=True)
        print(f"{label}: " + ", ".join(f"{m:.1f} min tau {h['acceptance']:.3f}" for m, h in points))
        last = history[-1]
        rows.append(f"| {label} | {last['step']} | {last['elapsed_seconds'] / 60:.1f} | "
                    f"{last['elapsed_seconds'] / last['step']:.2f} | {evals[-1]['acceptance']:.3f} | "
                    f"{max(h['acceptance'] for h in evals):.3f} | {last['accuracy']:.3f} |")
    print("\n| run | steps | training minutes | s/step | held-out acceptance (end) | best | slot-1 accuracy "
          "(last 20 steps) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    left.set(xlabel=args.minutes_label, ylabel="held-out chain acceptance (tokens/step)")
    if middle is not None:
        middle.set(xlabel="step", ylabel="held-out chain acceptance (tokens/step)")
    right.set(xlabel="step", ylabel="slot-1 accuracy on training blocks" if args.right == "accuracy"
              else "training loss (DFlash's part)")
    for axis in [a for a in (left, middle, right) if a is not None]:
        axis.grid(alpha=0.3)
        axis.legend()
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
