"""DFlash checkpoints in z-lab's layout: `config.json` + safetensors. Never pickle, never remote code."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.hidden_state import (
    check_taps_fit,
    check_vocabulary_fits,
    parse_config,
    read_config_json,
    write_checkpoint,
)
from specdec.weights import check_tensors, read_safetensors

from .model import DFlashConfig, DFlashDraftModel

#: how messages name the checkpoint
KIND = "DFlash draft"

#: tensors some checkpoints carry but a DFlash draft takes from the target instead
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")


def read_config(path: str | os.PathLike) -> DFlashConfig:
    folder = Path(path)
    raw = read_config_json(folder, KIND)
    if "eagle_config" in raw or any("Eagle" in str(a) for a in raw.get("architectures") or []):
        raise SpecdecError(f"{folder} holds an EAGLE draft, not a DFlash one; use --proposer eagle3.")
    return parse_config(folder / "config.json", raw, DFlashConfig.from_checkpoint_json)


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


def save_draft(model: DFlashDraftModel, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
               extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors in z-lab's layout (loadable by z-lab's code, vLLM and SGLang)."""
    config = model.config.to_checkpoint_json() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    config.update(extra_config or {})
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    return write_checkpoint(Path(path), config, tensors)
