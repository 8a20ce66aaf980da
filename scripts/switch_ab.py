"""Batched decoding with a module switch at one value against another, in one process, interleaved.

    python scripts/switch_ab.py [--prompts 20] [--batch 4] [--rounds 2] [--tokens 256] [--dtype bfloat16]
        [--switch specdec.native.GROUPED_ATTENTION --values grouped,fused] [--proposers autoregressive,dflash]
        [--opt KEY=VALUE ...]

One embedded target (bf16 unless --dtype says otherwise, native forward), one decoder per runner: plain batched
decoding and `dflash` (the adaptive budget), each with the switch (a module's global) set to each value before its
passes: specdec.native.GROUPED_ATTENTION (grouped,fused: specdec's grouped attention against torch's fused kernel),
specdec.native.FOLDED_ATTENTION (folded,fused: query heads folded into queries or not),
specdec.budget.OBSERVED_COSTS (true,false: the steps' real forwards correct the budget's probed costs or not),
specdec_dflash.proposer.NODE_ORDER (lookup_first,draft_first: which nodes a cut tree keeps first),
specdec.budget.ONE_ROW (true,false: one row alone takes the budget or verifies its whole draft; with --batch 1),
specdec.budget._EXPLORATION (numbers: the budget's optimism margin in tokens after one step).
GSM8K first turns; a warm-up each (64 tokens a row: past the budget's warm-up steps, so its probe is not timed),
then rounds in a rotating order; prints each pass and the median tokens/s with mean acceptance (docs/benchmarks.md).
Before stop 27 this script was scripts/attention_ab.py, with GROUPED_ATTENTION only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import torch

from specdec import loading
from specdec.api import SpeculativeDecoder, build_proposer_config
from specdec.plugins import get_proposer_class
from specdec.target import TargetModel


def _parse(value: str) -> object:
    """A --values entry as the switch takes it: true/false, a number (specdec.budget._EXPLORATION), or text."""
    if value in ("true", "false"):
        return value == "true"
    try:
        return float(value)
    except ValueError:
        return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--data", default="../shared/datasets/gsm8k.jsonl")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"],
                        help="the target's dtype (auto: bfloat16 where the CPU has bf16 matrix units, else float32)")
    parser.add_argument("--switch", default="specdec.native.GROUPED_ATTENTION", help="module.NAME")
    parser.add_argument("--values", default="grouped,fused")
    parser.add_argument("--proposers", default="autoregressive,dflash")
    parser.add_argument("--opt", action="append", default=[], help="KEY=VALUE for every proposer but autoregressive")
    args = parser.parse_args()
    module_name, switch = args.switch.rsplit(".", 1)
    module = importlib.import_module(module_name)
    values = {value: _parse(value) for value in args.values.split(",")}
    with open(args.data) as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][: args.prompts]
    device = torch.device("cpu")
    model, tokenizer = loading.load_model(None, loading.resolve_dtype(args.dtype, device), device)
    target = TargetModel(model, tokenizer, cache="native")
    runners = {f"{proposer}-{attention}": (proposer, attention)
               for proposer in args.proposers.split(",") for attention in values}
    options = dict(option.split("=", 1) for option in args.opt)

    def build(proposer: str) -> SpeculativeDecoder:
        config = build_proposer_config(proposer, {} if proposer == "autoregressive" else options)
        return SpeculativeDecoder(target, get_proposer_class(proposer)(config, target))

    decoders = {name: build(proposer) for name, (proposer, _) in runners.items()}
    ids = [next(iter(decoders.values())).encode_prompt(p)[0] for p in prompts]

    def run(name: str, batch_ids: list[torch.Tensor], tokens: int) -> tuple[float, float]:
        setattr(module, switch, values[runners[name][1]])
        start = time.perf_counter()
        outs = decoders[name].generate_ids(batch_ids, max_new_tokens=tokens, batch_size=args.batch)
        seconds = time.perf_counter() - start
        total = sum(len(o.token_ids) for o in outs)
        return total / seconds, total / sum(len(o.stats.acceptance_lengths) for o in outs)

    for name in runners:
        run(name, ids[: args.batch], 64)
    passes: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    order = list(runners)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:
            passes[name].append(run(name, ids, args.tokens))
            print(f"round {r} {name}: {passes[name][-1][0]:.1f} tok/s, acceptance {passes[name][-1][1]:.2f}",
                  flush=True)
    print(f"| runner (batch {args.batch}) | tokens/s (median) | passes | mean acceptance |")
    print("| --- | ---: | --- | ---: |")
    for name, got in passes.items():
        print(f"| {name} | {statistics.median(p[0] for p in got):.1f} | {', '.join(f'{p[0]:.1f}' for p in got)} "
              f"| {statistics.median(p[1] for p in got):.2f} |")


if __name__ == "__main__":
    main()
