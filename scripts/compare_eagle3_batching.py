"""eagle3 drafting a batch's rows together against the proposer before that change (c29f914: row by row, its own
chain and tree code), on one target in one process, interleaved rounds after a warm-up, medians; GSM8K prompts,
128 new tokens, bf16, greedy.

    git show c29f914:src/specdec_eagle/proposer.py | sed 's/^from \\.checkpoint/from specdec_eagle.checkpoint/; \
        s/^from \\.model/from specdec_eagle.model/' > /tmp/eagle-old/old_proposer.py
    python scripts/compare_eagle3_batching.py N_PROMPTS ROUNDS BATCHES [PINNED_BUDGET]   # e.g. 8 3 1,4 16

PINNED_BUDGET pins the draft tokens per row at batch > 1 (otherwise the adaptive budget decides, from timings).
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, "/tmp/eagle-old")
from old_proposer import Eagle3Proposer as OldEagle3  # noqa: E402

from specdec import SpeculativeDecoder  # noqa: E402
from specdec_eagle.proposer import Eagle3Proposer  # noqa: E402

OldEagle3.shipped_draft = Eagle3Proposer.shipped_draft
from specdec.bench.batched import prompt_ids  # noqa: E402
from specdec.bench.datasets import load_dataset  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
BUDGET = int(sys.argv[4]) if len(sys.argv) > 4 else None  # pinned draft tokens per row at batch > 1
torch.manual_seed(0)
new = SpeculativeDecoder.from_pretrained(proposer="eagle3", dtype="bfloat16")
old = SpeculativeDecoder(new.target, OldEagle3(new.proposer.config, new.target))
_, prompts = load_dataset("gsm8k", "/work/shared/datasets", limit=N)
ids = prompt_ids(prompts, new.target.tokenizer)
results = {}
for batch in [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else '1,4').split(',')]:
    times = {"new": [], "old": []}
    outs = {}
    for r in range(ROUNDS + 1):  # round 0 warms up
        order = [("new", new), ("old", old)] if r % 2 == 0 else [("old", old), ("new", new)]
        for name, decoder in order:
            start = time.perf_counter()
            if batch == 1:
                res = [decoder.generate_ids(p, max_new_tokens=128) for p in ids]
            else:
                res = decoder.generate_ids(ids, max_new_tokens=128, batch_size=batch, draft_budget=BUDGET)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in res)
            taus = [a for o in res for a in o.stats.acceptance_lengths]
            outs[name] = [o.token_ids for o in res]
            if r:
                times[name].append(tokens / elapsed)
            tau = sum(taus) / max(len(taus), 1)
            print(f"batch {batch} round {r} {name}: {tokens / elapsed:.1f} tok/s, tau {tau:.2f}", flush=True)
    same = sum(a == b for a, b in zip(outs["new"], outs["old"], strict=True))
    print(f"batch {batch}: {same}/{len(ids)} outputs identical (bf16: batched shapes round differently)")
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["new"] / med["old"]
    print(f"batch {batch}: new {med['new']:.1f} tok/s, old {med['old']:.1f} tok/s, new/old {ratio:.3f}")
