"""Reading weights: safetensors only (never pickle), each file's header checked before any tensor is read, and
a draft's tensors checked against the model they fill."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .errors import SpecdecError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
#: bytes per element of the safetensors dtypes (a dtype not listed here is left to safetensors to judge)
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: safetensors itself refuses headers above 100 MB
MAX_HEADER = 100_000_000


def pickle_files(folder: Path) -> list[str]:
    """The names of the pickle weight files in `folder` (never opened)."""
    return sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())


def refuse_pickles(folder: Path, kind: str) -> None:
    """A folder whose weights are pickle files only: one sentence; unpickling can run code, so they stay shut."""
    pickles = pickle_files(folder)
    if pickles:
        raise SpecdecError(f"{folder} holds only pickle weights ({', '.join(pickles)}), which specdec never loads "
                           "because unpickling can run code; convert them to safetensors.")


def check_safetensors_file(path: Path, kind: str, fix: str = "replace it with an intact copy") -> None:
    """The file's header parses and its tensors exactly fill the file (what safetensors checks on load), so a
    truncated or corrupt file is one sentence naming it instead of an error deep inside a load."""

    def corrupt(problem: str) -> SpecdecError:
        return SpecdecError(f"The {kind} weights file {path} is truncated or corrupt ({problem}); {fix}.")

    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise corrupt(f"{size} bytes, shorter than the 8-byte header length")
            length = int.from_bytes(head, "little")
            if length > min(size - 8, MAX_HEADER):
                raise corrupt(f"the header claims {length} bytes but the file has {size - 8} after the length")
            raw = handle.read(length)
    except OSError as exc:
        raise SpecdecError(f"The {kind} weights file {path} cannot be read ({exc.strerror or exc}); check the "
                           "file and its permissions.") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise corrupt("its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    data_size = size - 8 - length
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not 0 <= offsets[0] <= offsets[1]):
            raise corrupt(f"the header entry of tensor {name!r} is malformed")
        if offsets[1] > data_size:
            raise corrupt(f"tensor {name!r} ends at byte {offsets[1]} of the data but the data has {data_size}")
        element = DTYPE_SIZES.get(info.get("dtype"))
        if element is not None and math.prod(shape) * element != offsets[1] - offsets[0]:
            raise corrupt(f"tensor {name!r} has {offsets[1] - offsets[0]} bytes but its shape {tuple(shape)} needs "
                          f"{math.prod(shape) * element}")
        spans.append((offsets[0], offsets[1]))
    end = 0
    for start, stop in sorted(spans):
        if start != end:
            raise corrupt(f"its tensors leave a gap or overlap at byte {start} of the data")
        end = stop
    if end != data_size:
        raise corrupt(f"its tensors cover {end} of its {data_size} data bytes")


def read_safetensors(folder: Path, kind: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's .safetensors files. `kind` names the checkpoint in messages
    ("DFlash draft"). Pickle files are refused, never opened: unpickling can run code."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        refuse_pickles(folder, kind)
        raise SpecdecError(f"{folder} has no .safetensors weights; a {kind} folder holds config.json and "
                           "model.safetensors.")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        check_safetensors_file(file, kind)
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise SpecdecError(f"The {kind} weights file {file} could not be read ({str(exc).splitlines()[0]}); "
                               "replace it with an intact copy.") from None
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
