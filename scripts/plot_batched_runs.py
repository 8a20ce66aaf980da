"""Merge batch sizes from several `specdec bench --batch-size` runs into one pair of plots.

    python scripts/plot_batched_runs.py runs/gsm8k-b:1,4 runs/gsm8k-b2:16,32 --out docs/benchmarks/gsm8k40-batched

Each argument is a bench --out folder and the batch sizes to take from it. Writes OUT-speedup.png and
OUT-throughput.png (specdec.bench.plots.plot_batched on the merged results).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from specdec.bench.plots import plot_batched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="FOLDER:B,B")
    parser.add_argument("--out", required=True, help="prefix of the two PNG files")
    args = parser.parse_args()
    merged = {}
    for spec in args.runs:
        folder, _, sizes = spec.rpartition(":")
        batched = json.loads((Path(folder) / "results.json").read_text())["batched"]
        for size in sizes.split(","):
            merged[size] = batched[size]
    merged = dict(sorted(merged.items(), key=lambda item: int(item[0])))
    with tempfile.TemporaryDirectory() as staging:
        for path in plot_batched(merged, Path(staging)):
            kind = "speedup" if path.name.startswith("speedup") else "throughput"
            shutil.move(path, f"{args.out}-{kind}.png")


if __name__ == "__main__":
    main()
