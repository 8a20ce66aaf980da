"""Time the target's forward by the number of tokens it verifies at once, on the embedded target (or --model).

    python scripts/verify_cost.py [--widths 1,8,16,24,32,40,48,64] [--rows 1] [--context 300] [--repeats 5]
        [--dtype bfloat16] [--folded auto|folded|fused]

After a prefill of `--context` random tokens, each width's forward runs on top of that context and is rolled
back (crop), widths interleaved in every round, two warm-up rounds; prints the median milliseconds per width and
whether the native forward's prepacked weights are in use. On a CPU whose bf16 products are bound by reading
the weights (AMX) the cost stays flat far into the tens of tokens; where they are bound by arithmetic it grows
with the width, and the tree a proposer verifies should shrink with it (docs/benchmarks.md). `--rows B` times B
rows of `--context` tokens each (a batch), every row verifying `width` tokens: a forward of B x width tokens.
`--folded` pins `specdec.native.FOLDED_ATTENTION` (query heads folded into queries for rows of 2 or more tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import SpeculativeDecoder, native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,8,16,24,32,40,48,64")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=None)
    parser.add_argument("--folded", default="auto", choices=["auto", "folded", "fused"])
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    native.FOLDED_ATTENTION = args.folded
    decoder = SpeculativeDecoder.from_pretrained(args.model, proposer="autoregressive", dtype=args.dtype)
    target = decoder.target
    packs = getattr(getattr(target.backend, "forward_pass", None), "prepacked", None)
    print("prepacked weights:", "n/a (not the native forward)" if packs is None
          else "on" if packs.enabled else f"off ({packs.reason})")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (args.rows, args.context), generator=generator)
    if args.rows == 1:
        target.prefill(prompts)
    else:
        target.reset()
        target.add_rows(list(prompts))
    lengths = list(target.cache_lengths)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for round_ in range(args.repeats + 2):
        for width in widths:
            ids = torch.randint(100, 40000, (args.rows, width), generator=generator)
            start = time.perf_counter()
            target.forward(ids)
            elapsed = time.perf_counter() - start
            target.crop(lengths)
            if round_ >= 2:  # warm-up
                times[width].append(elapsed)
    for width in widths:
        print(f"| {args.rows} x {width} | {statistics.median(times[width]) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
