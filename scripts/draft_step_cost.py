"""What a DFlash2 draft forward costs by depth and MLP width, with everything else held equal: random weights
shaped as the shipped SmolLM2 draft (bf16), a draft cache over 300 context positions, then steps of 3 new
context positions and a block of 8, as a chain drafting at batch 1 sees. Prints the median milliseconds per
forward (the target's LM head and the proposer's bookkeeping are the same for every shape and left out).

Between two draft forwards the target's verification forward reads some hundreds of MB of weights, so in
decoding the draft's weights come from memory, not from cache; `--evict-mb` (default 512) reads that much
between forwards to do the same. With `--evict-mb 0` the weights stay cached and the figures are what
operation overhead alone costs: a widened MLP then looks nearly free, which it is not in decoding.

    python scripts/draft_step_cost.py --shapes 1x1536,1x3072,1x6144,2x1536

Run it with nothing else on the machine; it decides whether capacity is cheaper across (`widen`) or down
(`deepen`), see specdec_dflash.grow."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdec_dflash.checkpoint import read_config
from specdec_dflash.dflash2_model import DFlash2DraftModel
from specdec_dflash.model import DraftCache

SHIPPED = Path(__file__).resolve().parent.parent / "src/specdec_dflash/drafts/smollm2-135m-instruct-dflash2"


def step_ms(layers: int, units: int, context: int, steps: int, rounds: int, evict: torch.Tensor | None) -> float:
    base = read_config(SHIPPED)
    config = type(base)(**(base.model_dump() | {"num_hidden_layers": layers, "intermediate_size": units,
                                                 "layer_types": ["full_attention"] * layers}))
    torch.manual_seed(0)
    draft = DFlash2DraftModel(config).to(torch.bfloat16).eval()
    hidden, taps = config.hidden_size, len(config.target_layer_ids) * config.hidden_size
    times = []
    with torch.inference_mode():
        for _ in range(rounds):
            cache = DraftCache(layers)
            draft(torch.randn(1, 8, hidden, dtype=torch.bfloat16), torch.randn(1, context, taps, dtype=torch.bfloat16),
                  torch.arange(context)[None], torch.arange(context, context + 8)[None], cache)
            position = context
            for _ in range(steps):
                block = torch.randn(1, 8, hidden, dtype=torch.bfloat16)  # [1, n, H]
                new = torch.randn(1, 3, taps, dtype=torch.bfloat16)  # [1, 3 accepted, taps x H]
                if evict is not None:
                    evict.sum()  # stands in for the verification forward's weight reads
                start = time.perf_counter()
                draft(block, new, torch.arange(position, position + 3)[None],
                      torch.arange(position + 3, position + 11)[None], cache)
                times.append(time.perf_counter() - start)
                position += 3
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x1536,1x3072,1x6144,2x1536",
                        help="comma-separated LAYERSxUNITS (decoder layers x MLP units)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--evict-mb", type=int, default=512, help="MB read between draft forwards (0: none)")
    args = parser.parse_args()
    evict = torch.ones(args.evict_mb * 2**20 // 4) if args.evict_mb else None
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    step_ms(*shapes[0], args.context, 10, 1, evict)  # warm-up
    for layers, units in shapes:
        ms = step_ms(layers, units, args.context, args.steps, args.rounds, evict)
        print(f"{layers} layer(s) x {units} MLP units: {ms:.2f} ms per draft forward", flush=True)


if __name__ == "__main__":
    main()
