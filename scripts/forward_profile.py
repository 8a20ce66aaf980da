"""Where one batched target forward spends its time, by operator (torch profiler).

    python scripts/forward_profile.py [--rows 4] [--width 16] [--context 300] [--dtype bfloat16]

The embedded target through specdec's native forward: `--rows` rows of `--context` random tokens prefilled,
then a forward of `--width` tokens per row, rolled back after each; prints the median of 10 timed forwards
and the profiler's table over 5 more (operators by self CPU time; the profiler's own cost inflates the
small operators). docs/benchmarks.md, stop 28, has the figures at 4 x 1 and 4 x 16 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specdec import SpeculativeDecoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    target = SpeculativeDecoder.from_pretrained(None, proposer="autoregressive", dtype=args.dtype).target
    generator = torch.Generator().manual_seed(0)
    target.reset()
    target.add_rows(list(torch.randint(100, 40000, (args.rows, args.context), generator=generator)))
    lengths = list(target.cache_lengths)
    ids = torch.randint(100, 40000, (args.rows, args.width), generator=generator)

    def forward() -> None:
        target.forward(ids)
        target.crop(lengths)

    for _ in range(5):
        forward()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        forward()
        times.append(time.perf_counter() - start)
    print(f"{args.rows} rows x {args.width} tokens: median {statistics.median(times) * 1e3:.1f} ms a forward")
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(5):
            forward()
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
