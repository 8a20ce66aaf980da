"""EAGLE-3 checkpoints in SpecForge's layout (what vLLM and SGLang serve): config.json + safetensors.

Never pickle, never remote code. The embeddings are the target's; a checkpoint that carries a copy
(SpecForge's does) has it ignored.
"""

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

from .model import Eagle3Config, Eagle3DraftModel

#: how messages name the checkpoint
KIND = "EAGLE-3 draft"

#: tensors some checkpoints carry but an EAGLE-3 draft takes from the target instead
TARGET_OWNED = ("embed_tokens.weight", "model.embed_tokens.weight")


#: What an EAGLE-3 config.json may hold besides Eagle3Config's own fields and specdec.hidden_state.INERT_FIELDS:
#: the layout's own keys, read by Eagle3Config.from_checkpoint_json or checked in read_config
#: (`num_hidden_layers`, `target_hidden_size`, the window fields); `tie_word_embeddings` (inert: the draft's head
#: is read from its own lm_head weights, whatever the flag says, and its embeddings are the target's).
LAYOUT_FIELDS = frozenset({"num_hidden_layers", "eagle_config", "eagle_aux_hidden_state_layer_ids",
                           "target_hidden_size", "tie_word_embeddings", "sliding_window", "use_sliding_window",
                           "max_window_layers"})

#: `eagle_config` keys that specdec reads
EAGLE_CONFIG_FIELDS = frozenset({"eagle_aux_hidden_state_layer_ids"})

#: settings of EAGLE-3 checkpoints that change the numbers, of which specdec implements one value each
SETTINGS = {
    # vLLM's option of norming the fused feature before the residual; EAGLE-3's reference keeps it un-normed
    "norm_before_residual": Setting(lambda v: v is False, "norm_before_residual false (the residual is the "
                                    "un-normed feature, as in EAGLE-3's reference)"),
    # false would make the draft read only the target's last hidden state (EAGLE-1 style)
    "use_aux_hidden_state": Setting(lambda v: v is True, "use_aux_hidden_state true (three target layers fused)"),
}


def read_config(path: str | os.PathLike) -> Eagle3Config:
    """The draft's config; a field it does not honour is refused, before any weights load."""
    folder = Path(path)
    raw = read_config_json(folder, KIND)
    config_file = folder / "config.json"
    if "dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or []):
        raise SpecdecError(f"{folder} holds a DFlash draft, not an EAGLE-3 one; use --proposer dflash.")
    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise SpecdecError(f"{config_file} describes {layers} draft layers; an EAGLE-3 draft has exactly "
                           "one (is this a DFlash draft? use --proposer dflash).")
    check_config_fields(config_file, KIND, raw, set(Eagle3Config.model_fields) | LAYOUT_FIELDS, SETTINGS,
                        nested={"eagle_config": (EAGLE_CONFIG_FIELDS, {})})
    if sliding_window_of(raw) is not None:
        raise SpecdecError(f"{config_file} sets sliding_window to {raw['sliding_window']}, but specdec's EAGLE-3 "
                           "draft attends over the whole context; use a draft without a sliding window.")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != raw.get("hidden_size"):
        raise SpecdecError(f"{config_file} sets target_hidden_size to {target_hidden} but hidden_size to "
                           f"{raw.get('hidden_size')}; specdec's EAGLE-3 draft reads target states as wide as its own, "
                           "so use a draft whose two sizes agree.")
    return parse_config(config_file, raw, Eagle3Config.from_checkpoint_json)


def check_against_target(config: Eagle3Config, target_hidden: int, target_layers: int, vocab_size: int,
                         where: str) -> None:
    """Every way a draft can fail to fit its target, each as one sentence, before any work starts."""
    check_taps_fit(KIND, config, target_hidden, target_layers, where)
    check_vocabulary_fits(KIND, config.vocab_size, vocab_size, where)


def load_weights(model: Eagle3DraftModel, folder: Path) -> None:
    tensors = read_safetensors(folder, KIND)
    tensors = {k.removeprefix("model."): v for k, v in tensors.items() if k not in TARGET_OWNED}
    config = model.config
    if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)  # the identity map
    tensors.pop("t2d", None)  # derived from d2t below (vLLM does not read it either)
    expected = {k: v for k, v in model.state_dict().items() if k != "t2d"}
    check_tensors(expected, tensors, folder, KIND)
    target_ids = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
    if target_ids.min() < 0 or target_ids.max() >= config.vocab_size or target_ids.unique().numel() != len(target_ids):
        raise SpecdecError(f"The d2t table in {folder} maps draft tokens to ids that are repeated or outside the "
                           f"target's vocabulary of {config.vocab_size}; the checkpoint is corrupt.")
    tensors["d2t"] = tensors["d2t"].long()
    tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
    tensors["t2d"][target_ids] = True
    model.load_state_dict(tensors, strict=True)


def read_config_for(path: str | os.PathLike, num_target_layers: int | None) -> Eagle3Config:
    """`read_config`, with what the checkpoint leaves to the target (its depth, the default taps) filled in."""
    config = read_config(path)
    if num_target_layers is not None:
        config = config.for_target(num_target_layers)
    if config.target_layer_ids is None:
        raise SpecdecError(f"{Path(path) / 'config.json'} names neither its target layers "
                           "(eagle_config.eagle_aux_hidden_state_layer_ids) nor num_target_layers; add one.")
    return config


def load_draft(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               num_target_layers: int | None = None) -> Eagle3DraftModel:
    """The draft in `path`; `num_target_layers` fills in a config that leaves the taps to the target."""
    folder = Path(path)
    model = Eagle3DraftModel(read_config_for(folder, num_target_layers))
    load_weights(model, folder)
    return model.to(device=device, dtype=dtype).eval()


def save_draft(model: Eagle3DraftModel, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors (float weights in `dtype`; d2t int64, t2d bool)."""
    config = model.config.to_checkpoint_json() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in model.state_dict().items()}
    return write_checkpoint(Path(path), config, tensors)
