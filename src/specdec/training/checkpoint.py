"""A training run's folder on disk: checkpoints written whole and atomically, read back for a resume, and the
folder checked and repaired before a run opens it (the layout is described in specdec.training.trainer)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..errors import SpecdecError
from ..files import atomic_save_file, atomic_write_json, claim_output_dir
from .objective import TrainingObjective


def state_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    # master weights in their own dtype (float32, or float64 beside a float64 target): a resume is exact
    tensors = {f"param/{k}": v.detach().contiguous() for k, v in module.state_dict().items()}
    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors[f"optim/{names[id(p)]}/{key}"] = value.contiguous()
                elif isinstance(value, torch.Tensor):
                    tensors[f"optim/{names[id(p)]}/{key}"] = value.reshape(1).float()
    return tensors


def load_state_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        tensors: dict[str, torch.Tensor]) -> None:
    saved = {k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")}
    mine = module.state_dict()
    odd = sorted(set(saved) ^ set(mine)) or [k for k in saved if saved[k].shape != mine[k].shape]
    if odd:  # e.g. a resume given another --opt num_layers than the run was started with
        raise SpecdecError(f"The run's checkpoint holds a draft of another shape than these options build (tensor "
                           f"{odd[0]}); resume with the --opt values the run was started with.")
    module.load_state_dict(saved)
    params = dict(module.named_parameters())
    for key, value in tensors.items():
        if not key.startswith("optim/"):
            continue
        name, _, field = key[len("optim/"):].rpartition("/")
        p = params[name]
        state = optimizer.state.setdefault(p, {})
        state[field] = value.reshape(()) if field == "step" else value.to(p.device)


def _has_run(run: Path) -> bool:
    return (run / "trainer_state.json").is_file() or (run / "trainer_state.safetensors").is_file()


def _tidy_run_dir(run: Path) -> None:
    """Repair what a kill during `save_checkpoint` left: the draft swap half done, staging folders, temporaries."""
    final, old = run / "draft", run / ".draft-old"
    if old.is_dir():
        if final.is_dir():
            shutil.rmtree(old)
        else:  # killed between the two renames: the previous draft, which matches the trainer state, returns
            os.replace(old, final)
    for stale in run.glob(".draft-*"):
        if stale.is_dir():
            shutil.rmtree(stale)
    for stale in run.glob(".trainer_state.*.tmp"):
        stale.unlink(missing_ok=True)


def prepare_run_dir(run_dir: str | os.PathLike, resume: bool, overwrite: bool = False, writer: bool = True) -> Path:
    """Check the run folder before any work and claim it: `resume` needs a specdec run there; a fresh run needs
    a new or empty folder, or one holding other files with `overwrite` (a folder holding a run is refused
    either way: resume it or choose another --out). `writer` (rank 0) claims and repairs; other ranks check."""
    run = Path(run_dir)
    if run.exists() and not run.is_dir():
        raise SpecdecError(f"--out {run} is a file, not a folder; choose a folder path.")
    has_run = run.is_dir() and _has_run(run)
    if resume and not has_run:
        raise SpecdecError(f"Nothing to resume in {run} (no trainer_state.json); drop --resume to start afresh.")
    if not resume and has_run:
        raise SpecdecError(f"{run} already holds a training run; pass --resume to continue it or choose another "
                           "--out.")
    if writer:
        claim_output_dir(run, "train", overwrite=overwrite or has_run)  # a run from before the marker is ours
        _tidy_run_dir(run)
    return run


def save_checkpoint(run_dir: Path, objective: TrainingObjective, optimizer, state: dict,
                    generator: torch.Generator | None = None) -> None:
    """The draft, then the tensors with the state in their metadata (the checkpoint a resume reads), then the
    state as JSON; each atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=run_dir, prefix=".draft-"))
    objective.save_draft(staging)
    final = run_dir / "draft"
    if final.exists():
        old = run_dir / ".draft-old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    tensors = state_tensors(objective.module, optimizer)
    if generator is not None:
        tensors["rng/generator"] = generator.get_state()
    atomic_save_file(tensors, run_dir / "trainer_state.safetensors", metadata={"trainer_state": json.dumps(state)})
    atomic_write_json(run_dir / "trainer_state.json", state, indent=1)


def load_checkpoint(run: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(trainer state, tensors) of the run's last checkpoint, or a sentence if it cannot be read."""
    tensors_file = run / "trainer_state.safetensors"
    if not tensors_file.is_file():
        raise SpecdecError(f"{run} has no trainer_state.safetensors, so it cannot be resumed; start afresh in "
                           "another --out.")
    try:
        with safe_open(str(tensors_file), "pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(tensors_file)
        if "trainer_state" in metadata:
            saved = json.loads(metadata["trainer_state"])
        else:  # written before the state moved into the metadata
            saved = json.loads((run / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, SafetensorError, ValueError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise SpecdecError(f"The checkpoint in {run} cannot be read ({reason}); start afresh in another "
                           "--out.") from None
    return saved, tensors
