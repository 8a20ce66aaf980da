"""What a DFlash2 draft forward costs by depth and MLP width, with everything else held equal: random weights
shaped as the shipped SmolLM2 draft (bf16), a draft cache over 300 context positions, then steps of 3 new
context positions and a block of 8, as a chain drafting at batch 1 sees. Prints the median milliseconds per
forward (the target's LM head and the proposer's bookkeeping are the same for every shape and left out).

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


def step_ms(layers: int, units: int, context: int, steps: int, rounds: int) -> float:
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
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    step_ms(*shapes[0], args.context, 10, 1)  # warm-up
    for layers, units in shapes:
        ms = step_ms(layers, units, args.context, args.steps, args.rounds)
        print(f"{layers} layer(s) x {units} MLP units: {ms:.2f} ms per draft forward", flush=True)


if __name__ == "__main__":
    main()
