"""Two decoders of one target timed side by side, for the scripts/compare_*_batching.py scripts: rounds
interleaved (the first runner alternates), round 0 a warm-up, medians of tokens/s, outputs compared."""

from __future__ import annotations

import statistics
import time


def compare(new, old, ids: list[list[int]], batch: int, rounds: int, budget: int | None,
            max_new_tokens: int = 128) -> float:
    """Prints each round and the verdict; returns new/old, the ratio of the median tokens/s. Batch 1 decodes
    the prompts one at a time; a larger batch decodes them all at that batch size. `budget` pins the draft
    tokens per row (None: the adaptive budget)."""
    times: dict[str, list[float]] = {"new": [], "old": []}
    outs = {}
    for r in range(rounds + 1):  # round 0 warms up
        order = [("new", new), ("old", old)] if r % 2 == 0 else [("old", old), ("new", new)]
        for name, decoder in order:
            start = time.perf_counter()
            if batch == 1:
                res = [decoder.generate_ids(p, max_new_tokens=max_new_tokens, draft_budget=budget) for p in ids]
            else:
                res = decoder.generate_ids(ids, max_new_tokens=max_new_tokens, batch_size=batch, draft_budget=budget)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in res)
            taus = [a for o in res for a in o.stats.acceptance_lengths]
            outs[name] = [o.token_ids for o in res]
            if r:
                times[name].append(tokens / elapsed)
            print(f"batch {batch} round {r} {name}: {tokens / elapsed:.1f} tok/s, tau "
                  f"{sum(taus) / max(len(taus), 1):.2f}", flush=True)
    same = sum(a == b for a, b in zip(outs["new"], outs["old"], strict=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["new"] / med["old"]
    print(f"batch {batch}: {same}/{len(ids)} outputs identical (bf16: batched shapes round differently); new "
          f"{med['new']:.1f} tok/s, old {med['old']:.1f} tok/s, new/old {ratio:.3f}", flush=True)
    return ratio
