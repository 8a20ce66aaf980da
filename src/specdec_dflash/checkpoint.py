"""DFlash checkpoints in z-lab's layout: `config.json` + safetensors. Never pickle, never remote code."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.hidden_state import (
    Setting,
    check_config_fields,
    check_taps_fit,
    check_vocabulary_fits,
    parse_config,
    read_config_json,
    sliding_window_of,
    write_checkpoint,
)
from specdec.weights import check_tensors, read_safetensors

from .model import DFlashConfig, DFlashDraftModel

#: how messages name the checkpoint
KIND = "DFlash draft"

#: tensors some checkpoints carry but a DFlash draft takes from the target instead
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")


#: What a DFlash config.json may hold besides DFlashConfig's own fields and specdec.hidden_state.INERT_FIELDS:
#: the layout's own keys (read by DFlashConfig.from_checkpoint_json); `tie_word_embeddings` (inert: the draft has
#: no embeddings or head of its own, it uses the target's); `use_sliding_window` (read: false means no window, as
#: in transformers' Qwen configs); `max_window_layers` (checked in read_config).
LAYOUT_FIELDS = frozenset({"dflash_config", "tie_word_embeddings", "use_sliding_window", "max_window_layers"})

#: z-lab's `dflash_config` keys that specdec reads
DFLASH_CONFIG_FIELDS = frozenset({"mask_token_id", "target_layer_ids", "block_size"})

#: Fields of newer DFlash drafts (z-lab's current code; DFlash2 is issue 26) that change the numbers and that this
#: specdec does not implement: refused by name unless they ask for what it computes anyway. They may stand at the
#: top level or in `dflash_config`.
NEWER_SETTINGS = {
    "output_multiplier": Setting(lambda v: v == 1, "output_multiplier 1", newer=True),
    "input_embedding_scale": Setting(lambda v: v == 1, "input_embedding_scale 1", newer=True),
    "final_logit_softcapping": Setting(lambda v: False, "no final_logit_softcapping", newer=True),
    # z-lab's attention is bidirectional within the block unless is_causal says otherwise (or, when it is
    # absent, a layer is a sliding_attention one); specdec implements only bidirectional full-attention layers
    "is_causal": Setting(lambda v: v is False, "is_causal false", newer=True),
    "layer_types": Setting(lambda v: isinstance(v, list) and all(t == "full_attention" for t in v),
                           "full_attention layers", newer=True),
}

#: architectures this specdec does not implement, though their configs look like DFlash's
NEWER_ARCHITECTURES = ("DFlash2DraftModel",)


def read_config(path: str | os.PathLike) -> DFlashConfig:
    """The draft's config; a field it does not honour is refused, before any weights load."""
    folder = Path(path)
    raw = read_config_json(folder, KIND)
    architectures = [str(a) for a in raw.get("architectures") or []]
    if "eagle_config" in raw or any("Eagle" in a for a in architectures):
        raise SpecdecError(f"{folder} holds an EAGLE draft, not a DFlash one; use --proposer eagle3.")
    newer = sorted(set(architectures) & set(NEWER_ARCHITECTURES))
    if newer:
        raise SpecdecError(f"{folder} holds a {newer[0]}, a newer kind of DFlash draft that this specdec does not "
                           "implement yet; use a DFlash (DFlashDraftModel) draft.")
    config_file = folder / "config.json"
    read = set(DFlashConfig.model_fields) | LAYOUT_FIELDS
    check_config_fields(config_file, KIND, raw, read, NEWER_SETTINGS,
                        nested={"dflash_config": (DFLASH_CONFIG_FIELDS, {})})
    window = sliding_window_of(raw)
    if window is not None and raw.get("layer_types") is None and raw.get("max_window_layers"):
        raise SpecdecError(f"{config_file} sets max_window_layers to {raw['max_window_layers']} with a sliding window, "
                           "but specdec's DFlash draft applies the window to every layer when layer_types is absent; "
                           "use a draft without max_window_layers.")
    if window is None:
        raw = {**raw, "sliding_window": None}
    return parse_config(config_file, raw, DFlashConfig.from_checkpoint_json)


def check_against_target(config: DFlashConfig, target_hidden: int, target_layers: int, vocab_size: int,
                         where: str) -> None:
    """Every way a draft can fail to fit its target, each as one sentence, before any work starts."""
    check_taps_fit(KIND, config, target_hidden, target_layers, where)
    if not 0 <= config.mask_token_id < vocab_size:
        raise SpecdecError(f"The DFlash draft {where} uses mask token {config.mask_token_id}, outside the target's "
                           f"vocabulary of {vocab_size}; use a draft trained for this target.")
    check_vocabulary_fits(KIND, config.vocab_size, vocab_size, where)


def load_weights(model: DFlashDraftModel, folder: Path) -> None:
    tensors = read_safetensors(folder, KIND)
    tensors = {k.removeprefix("model."): v for k, v in tensors.items() if k not in TARGET_OWNED}
    check_tensors(model.state_dict(), tensors, folder, KIND)
    model.load_state_dict(tensors, strict=True)


def load_draft(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> DFlashDraftModel:
    folder = Path(path)
    config = read_config(folder)
    model = DFlashDraftModel(config)
    load_weights(model, folder)
    return model.to(device=device, dtype=dtype).eval()


def checkpoint_contents(model: DFlashDraftModel, dtype: torch.dtype = torch.bfloat16,
                        extra_config: dict | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config.json (z-lab's layout) and the tensors of `model`'s checkpoint, weights in `dtype`."""
    config = model.config.to_checkpoint_json() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    config.update(extra_config or {})
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    return config, tensors


def save_draft(model: DFlashDraftModel, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
               extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors in z-lab's layout (loadable by z-lab's code, vLLM and SGLang)."""
    config, tensors = checkpoint_contents(model, dtype, extra_config)
    return write_checkpoint(Path(path), config, tensors)
