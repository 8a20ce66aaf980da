"""Where a batched `dflash` step's time goes: wall time inside the engine's and the proposer's parts, per step.

    python scripts/batched_step_split.py [--prompts 20] [--batch 4] [--tokens 256] [--proposer dflash2]

The embedded target in bf16 with the proposer's shipped draft and the adaptive budget, GSM8K first turns, one warm-up
call; each part is timed by wrapping it (perf_counter around the call), so nested parts are inside their
callers (draft.forward_rows inside propose) and `step` holds all but admit (the prefill of joining rows).
Then the adaptive budget's state: the draft tokens per row it chose at this batch size, with how many steps
each, and the forward costs it probed per batch-size bucket.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time

import specdec.budget as budget
import specdec.engine as engine
import specdec.target as target
import specdec_dflash.dflash2_proposer as dflash2
import specdec_dflash.model as draft_model
import specdec_dflash.proposer as dflash
from specdec.api import SpeculativeDecoder

seconds: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()
choices: collections.Counter = collections.Counter()  # (rows, draft tokens per row) -> steps


def counted_choose(choose):
    @functools.wraps(choose)
    def wrapper(self, rows, most):
        chosen = choose(self, rows, most)
        choices[(rows, chosen[0])] += 1
        return chosen

    return wrapper


def timed(owner: object, attribute: str, label: str) -> None:
    inner = getattr(owner, attribute)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, attribute, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--data", default="../shared/datasets/gsm8k.jsonl")
    parser.add_argument("--proposer", choices=("dflash", "dflash2", "autoregressive"), default="dflash")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    for owner, attribute, label in (
            (engine.Engine, "step", "step"), (engine.Engine, "admit", "admit (prefill)"),
            (engine.Engine, "_propose", "propose"), (engine, "verify_groups", "verify"),
            (target.TargetModel, "forward", "target forward"), (target.TargetModel, "retain", "cache retain"),
            (draft_model.DFlashDraftModel, "forward_rows", "draft forward"), (dflash.DFlashProposer, "_tree", "trees"),
            (dflash.DFlashProposer, "_head_logits", "draft head"), (engine, "row_output", "row outputs"),
            (dflash.DFlashProposer, "_finish", "finish (logits to a row's draft)"),
            (dflash2.DFlash2Proposer, "_finish", "finish (logits to a row's draft)"),
            (budget.DraftBudget, "probe", "budget probe"), (budget.DraftBudget, "choose", "budget choose")):
        timed(owner, attribute, label)
    budget.DraftBudget.choose = counted_choose(budget.DraftBudget.choose)
    with open(args.data) as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][: args.prompts]
    decoder = SpeculativeDecoder.from_pretrained(proposer=args.proposer, dtype=args.dtype)
    decoder.generate(prompts[: args.batch], max_new_tokens=32, batch_size=args.batch)
    seconds.clear()
    calls.clear()
    choices.clear()
    start = time.perf_counter()
    outs = decoder.generate(prompts, max_new_tokens=args.tokens, batch_size=args.batch)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    steps = calls["step"]
    print(f"batch {args.batch}: {tokens / wall:.1f} tok/s, {steps} steps, {wall:.1f} s, mean acceptance "
          f"{tokens / sum(len(o.stats.acceptance_lengths) for o in outs):.2f}")
    print("| part | seconds | ms per step | calls |\n| --- | ---: | ---: | ---: |")
    for label, total in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"| {label} | {total:.2f} | {total / steps * 1e3:.2f} | {calls[label]} |")
    chosen = sorted(((m, n) for (rows, m), n in choices.items() if rows == args.batch), key=lambda c: -c[1])
    print(f"draft tokens per row chosen at {args.batch} rows (tokens: steps):",
          ", ".join(f"{'all' if m is None else m}: {n}" for m, n in chosen))
    for rows, table in sorted(decoder.engine.budget.costs.items()):
        print(f"probed forward costs, bucket {rows}:", ", ".join(f"{w}: {t * 1e3:.1f} ms" for w, t in table))


if __name__ == "__main__":
    main()
