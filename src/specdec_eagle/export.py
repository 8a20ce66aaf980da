"""EAGLE-3 drafts for `specdec export` (the dflash plugin's command), registered with `register_exporters`.

- ``vllm``: the fields and tensors vLLM 0.32's ``Eagle3LlamaForCausalLM`` (model_executor/models/llama_eagle3.py)
  reads, which specdec's loader reads back to the same draft. It is SpecForge's layout with two changes: the taps
  stand at the top level as ``eagle_aux_hidden_state_layer_ids`` too (vLLM 0.32 takes the taps from there, from
  ``eagle_config`` it only counts them: a draft trained on other layers than vLLM's default (2, L/2, L-3) would
  otherwise read the wrong ones), and only the tensors vLLM loads (no ``t2d``, which it skips; ``d2t`` only with a
  reduced draft vocabulary, without which vLLM has no table to load it into).
- ``specforge``: SpecForge's layout as specdec trains it (what vLLM and SGLang serve with ``method: eagle3``).

tests/test_export_vllm.py holds the lists taken from vLLM's source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specdec.contracts import DraftExporter, ExportedDraft

from .checkpoint import load_draft, read_config_for

FORMATS = ("vllm", "specforge")


class Eagle3Exporter(DraftExporter):
    """EAGLE-3 drafts in vLLM's and SpecForge's layouts."""

    name = "eagle3"
    architectures = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
    formats = FORMATS
    description = "EAGLE-3 drafts: vllm (vLLM 0.32's Eagle3LlamaForCausalLM), specforge"

    def contents(self, draft: Path, fmt: str, verifier: str | None = None) -> ExportedDraft:
        read_config_for(draft, None)  # a config that cannot be read is refused before any weights load
        model = load_draft(draft)
        config = model.config.to_checkpoint_json() | {"torch_dtype": "bfloat16"}
        tensors = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous().cpu()
                   for k, v in model.state_dict().items()}
        if fmt == "vllm":
            config = vllm_config(config)
            tensors.pop("t2d")
            if model.config.draft_vocab_size == model.config.vocab_size:
                tensors.pop("d2t")
        return ExportedDraft(config=config, tensors=tensors)


def vllm_config(specforge: dict[str, Any]) -> dict[str, Any]:
    """SpecForge's config.json as vLLM 0.32 reads it: the taps at the top level too, RoPE as rope_parameters,
    nothing vLLM does not read but `num_target_layers` (specdec's loader reads it; vLLM leaves it alone)."""
    config = {k: v for k, v in specforge.items() if k not in ("rope_theta", "tie_word_embeddings")}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": specforge["rope_theta"]}
    config["eagle_aux_hidden_state_layer_ids"] = list(specforge["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return config
