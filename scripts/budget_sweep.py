"""The adaptive draft budget against pinned draft lengths, side by side on one loaded model.

    python scripts/budget_sweep.py [--batch-size 4] [--budgets 4] [--limit 40] [--rounds 2]
        [--data-dir ../shared/datasets]

GSM8K's first `--limit` first turns, bfloat16, 256 new tokens, the shipped DFlash draft. Runners: plain decoding
(autoregressive), dflash with the adaptive budget (`auto`), and dflash pinned to each of `--budgets` draft tokens
per row (`m4` ...). After a warm-up each, every round runs them all, the order reversed every other round; the
engine's budget state carries over from call to call, as it does in a server. Prints each pass and the median
tokens/s with its ratio to plain decoding and the mean acceptance length.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specdec import SpeculativeDecoder
from specdec.check import read_prompts_jsonl
from specdec.plugins import get_proposer_class

DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--budgets", default="4", help="comma-separated pinned draft lengths")
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data-dir", default=str(DATASETS))
    args = parser.parse_args()
    prompts = [p.turns[0] for p in read_prompts_jsonl(Path(args.data_dir) / "gsm8k.jsonl")[: args.limit]]
    dflash = SpeculativeDecoder.from_pretrained(proposer="dflash", dtype="bfloat16")
    plain_class = get_proposer_class("autoregressive")
    plain = SpeculativeDecoder(dflash.target, plain_class(plain_class.Config(), dflash.target))
    runs = [("plain", plain, None), ("auto", dflash, None)]
    runs += [(f"m{m}", dflash, int(m)) for m in args.budgets.split(",") if m]
    for _, decoder, budget in runs:
        decoder.generate(prompts[: args.batch_size], max_new_tokens=16, batch_size=args.batch_size,
                         draft_budget=budget)
    passes: dict[str, list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for name, decoder, budget in runs if r % 2 == 0 else runs[::-1]:
            start = time.perf_counter()
            outs = decoder.generate(prompts, max_new_tokens=256, batch_size=args.batch_size, draft_budget=budget)
            seconds = time.perf_counter() - start
            tokens = sum(o.stats.num_generated_tokens for o in outs)
            steps = [n for o in outs for n in o.stats.acceptance_lengths]
            passes.setdefault(name, []).append((tokens / seconds, sum(steps) / len(steps)))
            print(f"{name} round {r}: {tokens / seconds:.1f} tok/s, mean acceptance {sum(steps) / len(steps):.2f}",
                  flush=True)
    base = statistics.median(t for t, _ in passes["plain"])
    for name, rows in passes.items():
        rate = statistics.median(t for t, _ in rows)
        taus = ", ".join(f"{tau:.2f}" for _, tau in rows)
        print(f"{name}: {rate:.1f} tok/s ({rate / base:.2f}x plain), mean acceptance {taus}")


if __name__ == "__main__":
    main()
