#!/usr/bin/env python
"""What a verification forward costs as a function of rows and tokens per row, on a GPU (or here).

Builds a target of a named shape with random weights (no download: the cost of a forward does not depend on
the weights' values), holds B rows of a `--context`-token prompt in specdec's native cache, and times
`TargetModel.forward` of B rows x w tokens, rolling the cache back after each, exactly as the adaptive draft
budget's probe does (specdec/budget.py). Prints a Markdown table of median milliseconds and of the cost
relative to w = 1 at the same B: where the ratio stays near 1, verifying more draft tokens per row is nearly
free; where it grows with w, the budget should draft less.

    python scripts/gpu_forward_costs.py [--shape qwen3-8b|smollm2-135m] [--batches 1,4,16,32]
        [--widths 1,2,3,5,9,17] [--context 512] [--repeats 10] [--markdown table.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from specdec.target import TargetModel

SHAPES = {
    # Qwen3-8B's config.json (hidden 4096, 36 layers, 32 query / 8 key-value heads of 128, MLP 12288)
    "qwen3-8b": lambda: Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                                    num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                                    vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=False),
    # the embedded default target's shape
    "smollm2-135m": lambda: LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                        num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                                        max_position_embeddings=4096, tie_word_embeddings=True),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--widths", default="1,2,3,5,9,17")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(SHAPES[args.shape](), dtype=torch.bfloat16)
    target = TargetModel(model, cache="native")
    batches = [int(b) for b in args.batches.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    rows = []
    for batch in batches:
        target.reset()
        prompts = torch.randint(0, model.config.vocab_size, (batch, args.context), device=device)
        target.add_rows(list(prompts))
        lengths = target.cache_lengths
        feed = prompts[:, -1:]
        times = {}
        for width in widths:
            wide = feed.expand(-1, width).contiguous()
            for _ in range(2):  # warm-up: allocator, kernels' autotuning
                target.forward(wide)
                target.crop(lengths)
            samples = []
            for _ in range(args.repeats):
                sync(device)
                start = time.perf_counter()
                target.forward(wide)
                sync(device)
                samples.append(time.perf_counter() - start)
                target.crop(lengths)
            times[width] = statistics.median(samples) * 1e3
        rows.append((batch, times))
        print(f"  B={batch}: " + ", ".join(f"w={w} {t:.2f} ms" for w, t in times.items()), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    head = f"| B \\ w ({args.shape}, bf16, {name}, context {args.context}) | " + " | ".join(map(str, widths)) + " |"
    lines = [head, "|" + "---|" * (len(widths) + 1)]
    for batch, times in rows:
        cells = [f"{times[w]:.2f} ms ({times[w] / times[widths[0]]:.2f}x)" for w in widths]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
