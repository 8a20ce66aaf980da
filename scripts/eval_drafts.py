"""Chain acceptance of several drafts on the same unseen training-distribution prompts: a bigger and fixed
held-out set than the trainer's (which holds out 1% of a data folder: 8 prompts of a small one).

    python scripts/eval_drafts.py --prompts ../shared/train_prompts --exclude DATA --n 48 --tokens 64 \
        --draft base=RUN_A/draft --draft depth1=RUN_B/draft --draft eagle=eagle3:RUN_C/draft

Prompts: every prompt of the --prompts files in a seeded shuffle, skipping those a data folder (--exclude)
already answered, the first --n that fit in 384 tokens. Each draft runs its own argmax chain, greedy, on the
embedded target: a DFlash draft (the default, or `dflash:` / `dflash2:` before the folder) with tree_size=0,
lookup=0; an EAGLE-3 draft (`eagle3:`) with tree_size=0 and --eagle3-tokens drafts per step (7 by default,
the length of a block-8 DFlash chain). Prints one markdown row per draft: mean acceptance length over all
steps, and its standard error over prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path


def unseen_prompts(folders: list[str], exclude: str | None, n: int, tokenizer, seed: int) -> list[list[int]]:
    from specdec.training.data import encode_user_prompt, prompt_key, read_prompts

    seen: set[str] = set()
    if exclude:
        index = json.loads((Path(exclude) / "index.json").read_text())
        seen = {i for shard in index["shards"] for i in shard["ids"]}
    records = []
    for folder in folders:
        path = Path(folder)
        for file in sorted(path.glob("*.jsonl")) if path.is_dir() else [path]:
            records.extend(read_prompts(file))
    random.Random(seed).shuffle(records)
    chosen = []
    for record in records:
        if prompt_key(record.text) in seen:
            continue
        ids = encode_user_prompt(tokenizer, record.text)
        if len(ids) <= 384:
            chosen.append(ids)
        if len(chosen) == n:
            break
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", action="append", required=True, help="JSONL file or folder, repeatable")
    parser.add_argument("--exclude", help="a data folder whose prompts to skip")
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft", action="append", required=True,
                        help="LABEL=[PROPOSER:]DRAFT_FOLDER, repeatable (PROPOSER: dflash, dflash2 or eagle3)")
    parser.add_argument("--eagle3-tokens", type=int, default=7, help="an EAGLE-3 chain's drafts per step")
    args = parser.parse_args()
    import torch

    from specdec import SpeculativeDecoder
    from specdec.api import build_proposer_config
    from specdec.budget import UNCUT
    from specdec.plugins import get_proposer_class

    base = SpeculativeDecoder.from_pretrained(proposer="autoregressive", dtype=args.dtype)
    target = base.target
    prompts = unseen_prompts(args.prompts, args.exclude, args.n, target.tokenizer, args.seed)
    print(f"{len(prompts)} prompts, {args.tokens} new tokens, {args.dtype}")
    print("| draft | mean acceptance length | standard error (over prompts) |\n| --- | ---: | ---: |")
    for spec in args.draft:
        label, _, folder = spec.partition("=")
        proposer, _, path = folder.partition(":")
        if not path:  # no proposer named: a DFlash draft
            proposer, path = "dflash", folder
        options = {"draft": path, "tree_size": 0}
        options.update({"num_tokens": args.eagle3_tokens} if proposer == "eagle3" else {"lookup": 0})
        config = build_proposer_config(proposer, options)
        decoder = SpeculativeDecoder(target, get_proposer_class(proposer)(config, target))
        accepted, steps, per_prompt = 0, 0, []
        for ids in prompts:
            # every draft verified whole: the draft's acceptance, not what the adaptive budget makes of it here
            out = decoder.generate_ids(torch.tensor([ids]), max_new_tokens=args.tokens,
                                       draft_budget=UNCUT)
            lengths = out.stats.acceptance_lengths
            accepted, steps = accepted + sum(lengths), steps + len(lengths)
            per_prompt.append(sum(lengths) / len(lengths))
        error = statistics.stdev(per_prompt) / math.sqrt(len(per_prompt)) if len(per_prompt) > 1 else float("nan")
        print(f"| {label} | {accepted / steps:.3f} | {error:.3f} |", flush=True)


if __name__ == "__main__":
    main()
