"""eagle3 drafting a batch's rows together against the proposer before that change (c29f914: row by row, its own
chain and tree code), on one target in one process, interleaved rounds after a warm-up, medians; GSM8K prompts,
128 new tokens, bf16, greedy.

    git show c29f914:src/specdec_eagle/proposer.py | sed 's/^from \\.checkpoint/from specdec_eagle.checkpoint/; \
        s/^from \\.model/from specdec_eagle.model/' > /tmp/eagle-old/old_proposer.py
    python scripts/compare_eagle3_batching.py N_PROMPTS ROUNDS BATCHES [PINNED_BUDGET]   # e.g. 8 3 1,4 16

PINNED_BUDGET pins the draft tokens per row at batch > 1 (otherwise the adaptive budget decides, from timings).
"""
import sys

import torch

sys.path.insert(0, "/tmp/eagle-old")
from old_proposer import Eagle3Proposer as OldEagle3  # noqa: E402

from specdec import SpeculativeDecoder  # noqa: E402
from specdec_eagle.proposer import Eagle3Proposer  # noqa: E402

OldEagle3.shipped_draft = Eagle3Proposer.shipped_draft
from interleaved_rounds import compare  # noqa: E402

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
for batch in [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else '1,4').split(',')]:
    compare(new, old, ids, batch, ROUNDS, None if batch == 1 else BUDGET)
