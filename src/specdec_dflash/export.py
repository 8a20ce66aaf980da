"""Export a DFlash draft for serving engines.

- ``zlab``: z-lab's own layout (config.json with ``dflash_config`` + model.safetensors), which z-lab's code,
  vLLM and SGLang load with ``method: dflash``.
- ``speculators``: the vLLM ``speculators`` layout (``speculators_model_type: dflash``, a Qwen3
  ``transformer_layer_config`` and a ``speculators_config`` naming the verifier). The field names follow
  the public ``DFlashSpeculatorConfig`` schema; the tensor names are z-lab's. No vocabulary mapping: the
  draft predicts over the target's whole vocabulary.

A reduced draft vocabulary (``draft_vocab.json``) travels with ``zlab`` (engines that ignore the file draft
over the whole vocabulary: as lossless, a little slower) and is left out of ``speculators``.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.errors import SpecdecError

from .checkpoint import load_draft, save_draft
from .vocab import load_vocab, save_vocab

FORMATS = ("zlab", "speculators")


def export_draft(draft: str | Path, out: str | Path, fmt: str, verifier: str | None = None) -> Path:
    if fmt not in FORMATS:
        raise SpecdecError(f"Unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}.")
    model = load_draft(draft)
    folder = save_draft(model, out)
    if fmt == "zlab":
        vocab_ids = load_vocab(draft, model.config.vocab_size or 2**31 - 1)
        if vocab_ids is not None:
            save_vocab(vocab_ids, folder, source=f"exported from {draft}")
        return folder
    c = model.config
    layer_config = {
        "model_type": "qwen3", "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    }
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.3.0",
        "torch_dtype": "bfloat16",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": c.vocab_size,
        "target_hidden_size": c.hidden_size,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "aux_hidden_state_layer_ids": list(c.target_layer_ids),
        "fusion_type": "linear",
        "draft_sliding_window": c.sliding_window,
        "draft_block_causal": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
