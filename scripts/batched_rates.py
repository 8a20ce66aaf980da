"""Plain batched decoding against a proposer, step by step: tokens per second of the engine's steps by batch
bucket (rows in the batch at that step), beside each whole call's time, tokens and admissions (prefills).

    python scripts/batched_rates.py [--prompts 32] [--batch 16] [--tokens 256] [--proposer dflash]
        [--data ../shared/datasets/mt_bench.jsonl]

The embedded target in bf16, one decoder per runner; each runner warms up on a call at the full batch and one
with the batch draining (so every batch bucket's forward costs are probed before the timed call), then one
timed call each. A whole call's tokens/s also counts prefills and the rows' different output lengths (bf16
greedy outputs part ways between runners); the steps' rates by bucket compare the decoding itself
(docs/benchmarks.md, stop 27).
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import specdec.engine as engine
from specdec.api import SpeculativeDecoder
from specdec.budget import bucket


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--proposer", default="dflash")
    parser.add_argument("--data", default="../shared/datasets/mt_bench.jsonl")
    args = parser.parse_args()
    steps: dict[tuple[str, int], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    running = {"name": ""}
    step = engine.Engine.step

    def timed_step(self, rows):
        start = time.perf_counter()
        committed = step(self, rows)
        seen = steps[(running["name"], bucket(len(rows)))]
        seen[0] += 1
        seen[1] += time.perf_counter() - start
        seen[2] += sum(map(len, committed))
        return committed

    admits: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    admit = engine.Engine.admit

    def timed_admit(self, *a, **k):
        start = time.perf_counter()
        out = admit(self, *a, **k)
        admits[running["name"]][0] += 1
        admits[running["name"]][1] += time.perf_counter() - start
        return out

    engine.Engine.step, engine.Engine.admit = timed_step, timed_admit
    with open(args.data) as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][: args.prompts]
    decoders = {name: SpeculativeDecoder.from_pretrained(proposer=name, dtype="bfloat16")
                for name in ("autoregressive", args.proposer)}
    for name, decoder in decoders.items():
        running["name"] = name
        decoder.generate(prompts[: args.batch], max_new_tokens=32, batch_size=args.batch)
        decoder.generate(prompts[: args.batch], max_new_tokens=64, batch_size=args.batch)  # rows end apart
    steps.clear()
    admits.clear()
    print("| runner | call seconds | tokens | tokens/s | admissions (prefills of joining rows) | their seconds |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, decoder in decoders.items():
        running["name"] = name
        start = time.perf_counter()
        outputs = decoder.generate(prompts, max_new_tokens=args.tokens, batch_size=args.batch)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outputs)
        print(f"| {name} | {seconds:.2f} | {tokens} | {tokens / seconds:.1f} | {admits[name][0]} "
              f"| {admits[name][1]:.2f} |")
    print("\n| runner | rows (bucket) | steps | step seconds | tokens | tokens/s in steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for (name, rows), (count, seconds, tokens) in sorted(steps.items()):
        print(f"| {name} | {rows} | {count} | {seconds:.2f} | {tokens} | {tokens / seconds:.1f} |")


if __name__ == "__main__":
    main()
