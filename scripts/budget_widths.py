"""What each forward width yields in a batched `dflash` call: the adaptive budget's cost model against the real
verification forwards, and committed tokens per row per second by width.

    python scripts/budget_widths.py [--prompts 20] [--batch 4] [--tokens 256]

The embedded target in bf16 with the shipped draft and the adaptive budget, GSM8K first turns, after a warm-up
call of 32 tokens. For every step of a full batch, the width of its verification forward (1 + the longest draft
of the step), the forward's real time, the budget's modeled time for that width before the step, the whole
step's time and the tokens committed per row. Widths seen on fewer than 3 steps are left out. Where the rate
(committed per row / step time) is flat across the widths chosen, no choice of draft length can do much better
with this draft (docs/benchmarks.md, stop 27).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import time

import specdec.engine as engine
import specdec.target as target
from specdec.api import SpeculativeDecoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--data", default="../shared/datasets/gsm8k.jsonl")
    args = parser.parse_args()
    steps: dict[int, list[tuple[float, float, float, float]]] = collections.defaultdict(list)
    last: dict[str, float] = {}
    forward, step = target.TargetModel.forward, engine.Engine.step

    def timed_forward(self, feed, *a, **k):
        start = time.perf_counter()
        out = forward(self, feed, *a, **k)
        last["seconds"], last["width"] = time.perf_counter() - start, feed.shape[1]
        return out

    def timed_step(self, rows):
        before = copy.deepcopy((self.budget.observed, self.budget.observed_ratio, self.budget.forwards))  # chosen by
        start = time.perf_counter()
        committed = step(self, rows)
        seconds = time.perf_counter() - start
        if len(rows) == args.batch:
            width = int(last["width"])
            after = self.budget.observed, self.budget.observed_ratio, self.budget.forwards
            self.budget.observed, self.budget.observed_ratio, self.budget.forwards = before
            modeled = self.budget.forward_seconds(len(rows), width) if self.budget.costs else float("nan")
            self.budget.observed, self.budget.observed_ratio, self.budget.forwards = after
            steps[width].append((last["seconds"], modeled, seconds, sum(map(len, committed)) / len(rows)))
        return committed

    target.TargetModel.forward, engine.Engine.step = timed_forward, timed_step
    with open(args.data) as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][: args.prompts]
    decoder = SpeculativeDecoder.from_pretrained(proposer="dflash", dtype="bfloat16")
    decoder.generate(prompts[: args.batch], max_new_tokens=32, batch_size=args.batch)
    steps.clear()
    start = time.perf_counter()
    outputs = decoder.generate(prompts, max_new_tokens=args.tokens, batch_size=args.batch)
    print(f"batch {args.batch}: {sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start):.1f} tok/s")
    print("| width | steps | forward ms (median) | modeled ms (median) | step ms (median) | committed per row "
          "| tokens per row per second |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for width in sorted(steps):
        seen = steps[width]
        if len(seen) < 3:
            continue
        real, modeled, whole = (statistics.median(s[i] for s in seen) * 1e3 for i in range(3))
        committed = statistics.mean(s[3] for s in seen)
        print(f"| {width} | {len(seen)} | {real:.1f} | {modeled:.1f} | {whole:.1f} | {committed:.2f} "
              f"| {committed / whole * 1e3:.1f} |")


if __name__ == "__main__":
    main()
