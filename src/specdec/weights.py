"""Reading a draft's weights: safetensors only (never pickle), checked against the model they fill."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import SpecdecError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def read_safetensors(folder: Path, kind: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's .safetensors files. `kind` names the checkpoint in messages
    ("DFlash draft"). Pickle files are refused, never opened: unpickling can run code."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise SpecdecError(f"{folder} holds only pickle weights ({', '.join(pickles)}), which specdec never "
                               "loads because unpickling can run code; convert them to safetensors.")
        raise SpecdecError(f"{folder} has no .safetensors weights; a {kind} folder holds config.json and "
                           "model.safetensors.")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def check_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], folder: Path,
                  kind: str) -> None:
    """The names and shapes a model's state dict expects, against a checkpoint's: one sentence per problem."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise SpecdecError(f"The {kind} in {folder} lacks the tensor {missing[0]!r}{more}; the checkpoint is "
                           "incomplete or was made for another architecture.")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise SpecdecError(f"The {kind} in {folder} has a tensor {unexpected[0]!r} that its config.json does not "
                           "describe (e.g. more layers than it names); fix the config or the weights.")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise SpecdecError(f"Tensor {name!r} in {folder} has shape {tuple(tensor.shape)} but config.json implies "
                               f"{tuple(expected[name].shape)}; the weights and the config do not match.")
