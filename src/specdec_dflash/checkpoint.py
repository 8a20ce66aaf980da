"""DFlash checkpoints in z-lab's layout: `config.json` + safetensors. Never pickle, never remote code."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from specdec.errors import SpecdecError
from specdec.weights import check_tensors, read_safetensors

from .model import DFlashConfig, DFlashDraftModel

#: tensors some checkpoints carry but a DFlash draft takes from the target instead
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")


def read_config(path: str | os.PathLike) -> DFlashConfig:
    folder = Path(path)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise SpecdecError(f"DFlash draft folder {folder} does not exist; pass --draft PATH to a checkpoint folder.")
    if not config_file.is_file():
        raise SpecdecError(f"{folder} has no config.json; a DFlash draft folder holds config.json and safetensors.")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise SpecdecError(f"{config_file} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    if "eagle_config" in raw or any("Eagle" in str(a) for a in raw.get("architectures") or []):
        raise SpecdecError(f"{folder} holds an EAGLE draft, not a DFlash one; use --proposer eagle3.")
    try:
        return DFlashConfig.from_checkpoint_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "config"
        raise SpecdecError(f"{config_file}: {key}: {err['msg']}; fix the draft's config.json.") from None


def check_against_target(config: DFlashConfig, target_hidden: int, target_layers: int, vocab_size: int,
                         where: str) -> None:
    """Every way a draft can fail to fit its target, each as one sentence, before any work starts."""
    if config.hidden_size != target_hidden:
        raise SpecdecError(f"The DFlash draft {where} has hidden size {config.hidden_size} but the target has "
                           f"{target_hidden}; use a draft trained for this target.")
    bad = [i for i in config.target_layer_ids if not 0 <= i < target_layers]
    if bad:
        raise SpecdecError(f"The DFlash draft {where} taps target layers {bad} but the target has only "
                           f"{target_layers} layers (ids 0..{target_layers - 1}); use a draft trained for this target.")
    if config.num_target_layers != target_layers:
        raise SpecdecError(f"The DFlash draft {where} was trained for a target with {config.num_target_layers} "
                           f"layers but this target has {target_layers}; use a draft trained for this target.")
    if not 0 <= config.mask_token_id < vocab_size:
        raise SpecdecError(f"The DFlash draft {where} uses mask token {config.mask_token_id}, outside the target's "
                           f"vocabulary of {vocab_size}; use a draft trained for this target.")
    if config.vocab_size is not None and config.vocab_size != vocab_size:
        raise SpecdecError(f"The DFlash draft {where} was trained for a vocabulary of {config.vocab_size} tokens but "
                           f"the target has {vocab_size}; use a draft trained for this target.")


def load_weights(model: DFlashDraftModel, folder: Path) -> None:
    tensors = read_safetensors(folder, "DFlash draft")
    tensors = {k.removeprefix("model."): v for k, v in tensors.items() if k not in TARGET_OWNED}
    check_tensors(model.state_dict(), tensors, folder, "DFlash draft")
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
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_checkpoint_json()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.update(extra_config or {})
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
