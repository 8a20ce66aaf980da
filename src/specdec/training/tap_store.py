"""The target's tapped hidden states of training sequences, kept on disk (`specdec train --tap-cache DIR`).

A draft trains for several epochs over the same sequences, and every step runs the frozen target up to its
deepest tapped layer to get the states the draft is conditioned on: on the CPU this project trains on, that
forward is about 40% of a one-layer DFlash step (py-spy, 2026-12-06). Its result depends only on the
sequence, so the store computes each sequence's taps once (in the batch it first appears in) and reads them
back in every later epoch, as offline hidden-state generation does in SpecForge and the EAGLE repository.

One safetensors file per sequence, named by a hash of its tokens, holds `layer.<i>` [T, H] for each tapped
layer. `meta.json` says whose taps they are: the target (its config without where it was loaded from, and a
checksum of a strided sample of every weight), its dtype and the tapped layers; a folder written for another
target or other layers is refused, since its states would train the draft on the wrong conditioning, and so
is a folder that holds files but no `meta.json`. The states read back are the ones the target
computed (bit for bit); a sequence computed inside another batch can round differently in its last bits
than it would in this one (the BLAS blocks by shape), as online training's batches already do.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..contracts import Target
from ..errors import SpecdecError
from ..files import atomic_save_file, atomic_write_json

#: values of each weight tensor the fingerprint reads (evenly strided over the whole tensor)
SAMPLED_VALUES = 4096


def target_fingerprint(target: Target) -> str:
    """A checksum of the target's config (without where it was loaded from, nor the transformers version that
    wrote it) and of a strided sample of every weight: the same target loaded from anywhere agrees; a
    fine-tuned one (any layer changed, embeddings frozen or not) almost surely does not."""
    digest = hashlib.sha256()
    config = getattr(target, "config", None)
    fields = config.to_dict() if hasattr(config, "to_dict") else {"config": repr(config)}
    fields = {k: v for k, v in fields.items()
              if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
    digest.update(json.dumps(fields, sort_keys=True, default=repr).encode())
    for name, weight in sorted(target.model.state_dict().items()):
        flat = weight.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLED_VALUES)][:SAMPLED_VALUES]
        digest.update(name.encode())
        digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:24]


def sequence_key(tokens: torch.Tensor) -> str:
    """The file name a sequence's taps are kept under: a hash of its token ids."""
    return hashlib.sha256(tokens.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:40]


class TapStore:
    """Taps of training sequences in `folder`, for one target and one set of tapped layers (`layer_ids`: every
    layer the objective reads, in any order)."""

    def __init__(self, folder: str | os.PathLike, target: Target, layer_ids: Sequence[int]) -> None:
        self.folder = Path(folder)
        self.layer_ids = sorted(int(i) for i in layer_ids)
        self.meta = {"target": target_fingerprint(target), "dtype": str(target.dtype).removeprefix("torch."),
                     "layer_ids": self.layer_ids, "hidden_size": int(target.hidden_size)}
        self.reads = self.writes = 0
        meta_file = self.folder / "meta.json"
        if meta_file.exists():
            try:
                held = json.loads(meta_file.read_text())
            except (OSError, json.JSONDecodeError):
                held = None
            if not isinstance(held, dict):
                raise SpecdecError(f"--tap-cache {self.folder}: meta.json cannot be read; give an empty folder "
                                   "(or delete this one).")
            if held != self.meta:
                differ = ", ".join(k for k in self.meta if held.get(k) != self.meta[k]) or "other fields"
                raise SpecdecError(f"--tap-cache {self.folder} holds taps of another target or layers ({differ} "
                                   f"differ); give a folder of its own to each target, dtype and set of layers.")
        elif self.folder.exists() and any(self.folder.iterdir()):
            raise SpecdecError(f"--tap-cache {self.folder} holds files but no meta.json saying whose taps they "
                               "are; give an empty or new folder.")
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_json(meta_file, self.meta)  # whole files only, also with several ranks writing

    def _file(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.safetensors"

    def tapped(self, target: Target, tokens: torch.Tensor, lengths: Sequence[int],
               layer_ids: Sequence[int]) -> torch.Tensor:
        """The taps at `layer_ids` (some of the store's, in this order) of a right-padded batch (row n real up
        to lengths[n]) concatenated on the feature axis, [N, L, len(layer_ids) * H] in the target's dtype (zeros
        past each row's length): read where kept, the rest computed in one target forward and kept."""
        wanted = [int(i) for i in layer_ids]
        if not set(wanted) <= set(self.layer_ids):
            raise ValueError(f"The tap store holds layers {self.layer_ids}, not all of {wanted}.")
        count, width = tokens.shape
        rows = [tokens[n, : int(lengths[n])] for n in range(count)]
        keys = [sequence_key(row) for row in rows]
        found: dict[int, torch.Tensor] = {}
        for n, key in enumerate(keys):
            path = self._file(key)
            if path.exists():
                try:
                    held = load_file(path)
                    found[n] = torch.cat([held[f"layer.{i}"] for i in wanted], dim=-1)
                except (SafetensorError, KeyError, OSError):
                    continue  # unreadable (a disk fault; writes are whole files): computed and written again
                self.reads += 1
        missing = [n for n in range(count) if n not in found]
        if missing:
            longest = max(int(lengths[n]) for n in missing)
            out = target.tap_hidden_states(tokens[missing, :longest])
            for j, n in enumerate(missing):
                length = int(lengths[n])
                taps = {f"layer.{i}": out.taps[i][j, :length].contiguous().cpu() for i in self.layer_ids}
                atomic_save_file(taps, self._file(keys[n]))
                found[n] = torch.cat([out.taps[i][j, :length] for i in wanted], dim=-1)  # on the target's device
                self.writes += 1
        feature = len(wanted) * int(target.hidden_size)
        result = torch.zeros(count, width, feature, dtype=target.dtype, device=tokens.device)
        for n, states in found.items():
            result[n, : states.shape[0]] = states.to(result.device)
        return result
