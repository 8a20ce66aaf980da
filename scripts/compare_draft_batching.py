"""The draft-model proposer drafting a batch's rows together (one ragged draft cache) against the proposer before
that change (row by row, a draft cache per row), on one target in one process, interleaved rounds after a
warm-up, medians; GSM8K prompts, 128 new tokens, bf16, greedy, the draft budget pinned.

There is no smaller model with SmolLM2's tokenizer on this machine, so the draft is the embedded target cut to
its first DRAFT_LAYERS decoder layers (its own final norm and LM head): a layer-skip draft, weak but honest
for timing what drafting costs.

    mkdir -p /tmp/draft-old && git show a248590:src/specdec/proposers/draft_model.py \
        | sed 's/from \\.\\. import/from specdec import/; s/^from \\.\\./from specdec./' \\
        > /tmp/draft-old/old_draft_model.py
    python scripts/compare_draft_batching.py N_PROMPTS ROUNDS BATCHES BUDGET DRAFT_LAYERS   # e.g. 8 3 1,4 4 6
"""
import sys
import tempfile

import torch

sys.path.insert(0, "/tmp/draft-old")
from interleaved_rounds import compare  # noqa: E402
from old_draft_model import DraftModelProposer as OldDraft  # noqa: E402

from specdec import SpeculativeDecoder, loading  # noqa: E402
from specdec.bench.batched import prompt_ids  # noqa: E402
from specdec.bench.datasets import load_dataset  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
BATCHES = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "1,4").split(",")]
BUDGET = int(sys.argv[4]) if len(sys.argv) > 4 else 4
LAYERS = int(sys.argv[5]) if len(sys.argv) > 5 else 6
torch.manual_seed(0)
folder = tempfile.mkdtemp(prefix="layer-skip-draft-")
model, tokenizer = loading.load_model(None, torch.bfloat16, torch.device("cpu"))
model.model.layers = model.model.layers[:LAYERS]
model.config.num_hidden_layers = LAYERS
if getattr(model.config, "layer_types", None):
    model.config.layer_types = model.config.layer_types[:LAYERS]
model.save_pretrained(folder)
tokenizer.save_pretrained(folder)
new = SpeculativeDecoder.from_pretrained(proposer="draft", draft=folder, dtype="bfloat16")
old = SpeculativeDecoder(new.target, OldDraft(new.proposer.config, new.target))
_, prompts = load_dataset("gsm8k", "/work/shared/datasets", limit=N)
ids = prompt_ids(prompts, new.target.tokenizer)
for batch in BATCHES:
    compare(new, old, ids, batch, ROUNDS, BUDGET)
