"""Compare `specdec bench` runs of two installs side by side (e.g. before and after a refactor).

    python scripts/compare_bench.py --a OLD1 OLD2 --b NEW1 NEW2

Each argument is a bench --out folder (results.json). Prints, per runner, whether every prompt's acceptance
length, output length and match class are the same in every A and B run, and the median tokens/s of each run
with the ratio of B's median to A's. Alternate the runs (A, B, A, B) so drift falls on both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def per_prompt(results: dict, runner: str, key: str) -> list:
    return [p["runs"][runner][key] for p in results["per_prompt"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", nargs="+", required=True, help="bench folders of install A")
    parser.add_argument("--b", nargs="+", required=True, help="bench folders of install B")
    args = parser.parse_args()
    a_runs = [json.loads((Path(f) / "results.json").read_text()) for f in args.a]
    b_runs = [json.loads((Path(f) / "results.json").read_text()) for f in args.b]
    print("| runner | A mean acceptance | B mean acceptance | every prompt the same (acceptance, length, match) "
          "| A median tok/s per run | B median tok/s per run | B/A |")
    print("|---|---|---|---|---|---|---|")
    for runner in a_runs[0]["proposers"]:
        same = all(per_prompt(a, runner, key) == per_prompt(b, runner, key)
                   for a in a_runs for b in b_runs for key in ("mean_acceptance_length", "tokens", "match"))
        tps_a = [r["proposers"][runner]["tokens_per_second"]["median"] for r in a_runs]
        tps_b = [r["proposers"][runner]["tokens_per_second"]["median"] for r in b_runs]
        tau_a = a_runs[0]["proposers"][runner]["mean_acceptance_length"]
        tau_b = b_runs[0]["proposers"][runner]["mean_acceptance_length"]
        print(f"| {runner} | {tau_a:.3f} | {tau_b:.3f} | {'yes' if same else 'NO'} | "
              f"{', '.join(f'{x:.1f}' for x in tps_a)} | {', '.join(f'{x:.1f}' for x in tps_b)} | "
              f"{statistics.median(tps_b) / statistics.median(tps_a):.3f} |")


if __name__ == "__main__":
    main()
