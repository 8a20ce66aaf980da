"""The shared training loop: AdamW, cosine schedule with warmup, clipping, checkpoints, resume, evaluation, DDP.

A run directory holds:
- ``draft/``: the latest draft in its proposer's checkpoint format (loadable with ``--draft``);
- ``trainer_state.safetensors``: float32 master weights, AdamW moments and the anchor sampler's random state
  (no pickle anywhere), with the trainer state below in its metadata (``trainer_state``), so one file holds
  a whole, consistent checkpoint;
- ``trainer_state.json``: step, epoch, position in the epoch, settings, the metrics history and the last
  steps' metrics (the progress average), for people and tools; a resume reads the copy in the safetensors;
- ``.specdec-owner`` and ``.specdec-lock`` (specdec.files; the lock keeps a second run out of the folder).
Every file is written atomically (the draft into a staging folder renamed into place; a kill between the
two renames is repaired when the run is next opened), so a run killed at any moment resumes from its last
checkpoint, and a resumed run ends with the same weights and history as one never stopped. SIGINT or
SIGTERM ends the current step, saves a checkpoint (without a history record) and raises `Interrupted`.
A run folder that holds files specdec did not write is refused unless `overwrite`.
Under ``torchrun`` every rank trains on its own slice of each epoch, gradients are all-reduced, and rank 0
writes the checkpoints (signals are then left to torchrun).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..budget import UNCUT
from ..errors import SpecdecError
from .checkpoint import load_checkpoint, load_state_tensors, prepare_run_dir, save_checkpoint
from .data import DataDir
from .interrupts import Interrupted, InterruptGuard, folder_lock
from .objective import TrainingObjective


@dataclass
class TrainSettings:
    steps: int = 1000
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    sequences_per_step: int = 2
    sequences_per_forward: int = 1  # >1 packs a step's sequences into batched forwards (GPUs)
    max_sequence_length: int = 1024
    save_every: int = 100
    eval_every: int = 0  # 0 = only at the end
    eval_prompts: int = 8
    eval_max_new_tokens: int = 64
    eval_fraction: float = 0.01  # share of sequences held out (by id hash) for evaluation
    seed: int = 0
    max_minutes: float | None = None
    # end this invocation (checkpoint and evaluation) once the run has trained this many minutes in all,
    # resumes included; the schedule still runs over max_minutes / steps: one long run in pieces
    pause_at_minutes: float | None = None


def lr_at(step: int, settings: TrainSettings, elapsed_seconds: float = 0.0) -> float:
    """Linear warmup then cosine decay. With a time budget (`max_minutes`) the schedule runs over whichever
    ends first, the steps or the time, so a run cut short by its budget still ends at the low learning rate.

    Never above `settings.lr`: a run shorter than one warm-up step (steps < 1 / warmup_ratio) used to start
    at 1 / (steps * warmup_ratio) times the peak; the warm-up fraction is now capped at 1."""
    progress = step / settings.steps
    if settings.max_minutes:
        progress = max(progress, elapsed_seconds / (60 * settings.max_minutes))
    if progress < settings.warmup_ratio:
        return settings.lr * min(1.0, max(progress, 1 / settings.steps) / settings.warmup_ratio)
    decay = min(1.0, (progress - settings.warmup_ratio) / max(1e-9, 1 - settings.warmup_ratio))
    floor = settings.min_lr_ratio
    return min(settings.lr, settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * decay))))


#: settings that shape the learning itself: a resume that changes one is told so (the new value is used)
SCHEDULE_SETTINGS = ("steps", "lr", "warmup_ratio", "min_lr_ratio", "weight_decay", "sequences_per_step",
                     "max_sequence_length", "seed", "max_minutes")


def schedule_changes(saved: dict[str, Any], settings: TrainSettings) -> list[str]:
    """One sentence per learning setting a resume changes against the run's last piece."""
    now = asdict(settings)
    return [f"{key} is {now[key]} now against {saved[key]} before; the run follows {now[key]} from here."
            for key in SCHEDULE_SETTINGS if key in saved and saved[key] != now[key]]


def _held_out(sequence_id: str, fraction: float) -> bool:
    digest = int(hashlib.sha1(sequence_id.encode()).hexdigest()[:8], 16)
    return digest % 10_000 < fraction * 10_000


def split_sequences(data: DataDir, fraction: float, max_length: int):
    """(train, held-out, held-out ids): lists of (tokens, loss_mask), and the held-out sequences' ids in data order.

    Held-out is chosen by id hash, and data only grows by appended shards, so a grown data set keeps the
    held-out sequences it had, in front: runs on it evaluate the same first prompts (``eval_ids`` records them)."""
    index = data.read_index()
    train, held, train_ids, held_ids = [], [], [], []
    ids = [i for shard in index["shards"] for i in shard["ids"]]
    for sequence_id, (tokens, mask) in zip(ids, data.sequences(), strict=True):
        tokens, mask = tokens[:max_length], mask[:max_length]
        is_held = _held_out(sequence_id, fraction)
        (held if is_held else train).append((tokens, mask))
        (held_ids if is_held else train_ids).append(sequence_id)
    if not held and fraction > 0 and len(train) > 1:
        held.append(train.pop())  # tiny data sets: still evaluate on one unseen sequence
        held_ids.append(train_ids.pop())
    return train, held, held_ids


def evaluate_acceptance(objective: TrainingObjective, proposer_name: str, prompts: list[torch.Tensor],
                        max_new_tokens: int) -> float:
    """Mean acceptance length of the real proposer, greedy, on held-out prompts (saves a temporary draft)."""
    from ..api import SpeculativeDecoder, build_proposer_config
    from ..plugins import get_proposer_class

    if not prompts:
        return float("nan")
    target = objective.target
    module = objective.module
    was_training = module.training
    module.eval()
    try:
        with tempfile.TemporaryDirectory() as folder:
            objective.save_draft(folder)
            config = build_proposer_config(proposer_name, objective.proposer_options(folder))
            decoder = SpeculativeDecoder(target, get_proposer_class(proposer_name)(config, target))
            accepted, steps = 0, 0
            for prompt in prompts:
                # the draft's whole chain each step: its acceptance, not the adaptive budget's cut of it
                out = decoder.generate_ids(prompt.unsqueeze(0), max_new_tokens=max_new_tokens,
                                           draft_budget=UNCUT)
                accepted += sum(out.stats.acceptance_lengths)
                steps += len(out.stats.acceptance_lengths)
    finally:
        module.train(was_training)
    return accepted / steps if steps else float("nan")


def train(objective: TrainingObjective, proposer_name: str, data_dir: str | os.PathLike, run_dir: str | os.PathLike,
          settings: TrainSettings, resume: bool = False, progress: bool = True,
          extra_state: dict[str, Any] | None = None, overwrite: bool = False) -> dict:
    """Train `objective.module` on the sequences of `data_dir`; returns the final trainer state.

    SIGINT or SIGTERM (outside torchrun) finishes the current step, saves it and raises `Interrupted`."""
    run = Path(run_dir)
    data = DataDir(data_dir)
    if objective.target.tokenizer is not None:
        data.check_target(objective.target.tokenizer)
    else:
        data.read_index()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank, world = 0, 1
    owns_group = False
    if distributed:  # gradients are averaged by hand after each step: the loss is not a module's forward
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            owns_group = True
        rank, world = dist.get_rank(), dist.get_world_size()
    prepare_run_dir(run, resume, overwrite, writer=rank == 0)
    with folder_lock(run, "train") if rank == 0 else _no_lock():
        return _train(objective, proposer_name, data, data_dir, run, settings, resume, progress, extra_state,
                      distributed, rank, world, owns_group)


@contextlib.contextmanager
def _no_lock():
    yield


def _train(objective: TrainingObjective, proposer_name: str, data: DataDir, data_dir: str | os.PathLike, run: Path,
           settings: TrainSettings, resume: bool, progress: bool, extra_state: dict[str, Any] | None,
           distributed: bool, rank: int, world: int, owns_group: bool) -> dict:
    objective.use_data(data)
    params = [p for p in objective.module.parameters() if p.requires_grad]
    if distributed:  # every rank starts from rank 0's weights
        for p in params:
            torch.distributed.broadcast(p.data, src=0)
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    state: dict[str, Any] = {"step": 0, "epoch": 0, "position": 0, "elapsed": 0.0, "history": [],
                             "settings": asdict(settings),
                             "proposer": proposer_name, "data_dir": str(data_dir), **(extra_state or {})}
    tensors: dict[str, torch.Tensor] = {}
    if resume:
        saved, tensors = load_checkpoint(run)
        load_state_tensors(objective.module, optimizer, tensors)
        state.update({k: saved[k] for k in ("step", "epoch", "position", "elapsed", "history", "window", "eval_ids")
                      if k in saved})
        for change in schedule_changes(saved.get("settings", {}), settings) if rank == 0 else []:
            print(f"note: {change}", file=sys.stderr, flush=True)

    if settings.pause_at_minutes is not None and state["elapsed"] >= 60 * settings.pause_at_minutes:
        raise SpecdecError(f"The run in {run} has already trained {state['elapsed'] / 60:.4g} minutes, past "
                           f"--pause-at-minutes {settings.pause_at_minutes:g}; give a later pause, or leave it out.")
    train_set, held_out, held_ids = split_sequences(data, settings.eval_fraction, settings.max_sequence_length)
    if not train_set:
        raise SpecdecError(f"{data_dir} holds no training sequences; generate data first.")
    eval_prompts = [tokens[~mask.bool()] if (~mask.bool()).any() else tokens[:1] for tokens, mask in
                    held_out[: settings.eval_prompts]]
    eval_ids = held_ids[: settings.eval_prompts]
    if rank == 0 and "eval_ids" in state and state["eval_ids"] != eval_ids:  # saved by an earlier piece
        print("note: the held-out prompts differ from the ones this run evaluated before (other data?), so its "
              "acceptance curve breaks here.", file=sys.stderr, flush=True)
    state["eval_ids"] = eval_ids  # which prompts the acceptance curve is measured on, to compare runs by
    generator = torch.Generator().manual_seed(settings.seed + 7919 * state["epoch"] + rank)
    if "rng/generator" in tensors and rank == 0:  # the anchors a never-stopped run would draw next (rank 0's)
        generator.set_state(tensors["rng/generator"])
    started = time.perf_counter()
    elapsed_before = state["elapsed"]
    # the budget (max_minutes, the cosine's clock, elapsed_seconds) counts training only: evaluation and
    # checkpoint writes are left out, so runs that evaluate more often or save bigger drafts train as long
    not_training = 0.0

    def training_seconds() -> float:
        seconds = elapsed_before + time.perf_counter() - started - not_training
        if distributed:  # rank 0's clock for every rank (only it pauses to evaluate and save): one schedule,
            # and every rank stops (budget or pause) after the same step, so none waits alone at an all_reduce
            clock = torch.tensor([seconds], dtype=torch.float64, device=params[0].device)
            torch.distributed.broadcast(clock, src=0)
            seconds = float(clock)
        return seconds
    window: list[dict[str, float]] = list(state.pop("window", []))  # the progress average spans a resume
    tokens_seen = 0

    def epoch_order(epoch: int) -> list[int]:
        order = list(range(len(train_set)))
        random.Random(settings.seed + epoch).shuffle(order)
        return order[rank::world]

    order = epoch_order(state["epoch"])
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("[bold]train"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeRemainingColumn()]
    guard = InterruptGuard(enabled=not distributed)
    with guard, Progress(*columns, disable=not progress or rank != 0) as bar:
        task = bar.add_task("train", total=settings.steps, completed=state["step"], info="")
        while state["step"] < settings.steps:
            state["elapsed"] = training_seconds()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(state["step"], settings, state["elapsed"])
            optimizer.zero_grad(set_to_none=True)
            metrics: list[dict[str, float]] = []
            pending: list[tuple[torch.Tensor, torch.Tensor]] = []
            for index in range(settings.sequences_per_step):
                if state["position"] >= len(order):
                    state["epoch"] += 1
                    state["position"] = 0
                    # data generated meanwhile (a concurrent `specdec data generate`) joins at epoch boundaries
                    train_set, _, _ = split_sequences(data, settings.eval_fraction, settings.max_sequence_length)
                    order = epoch_order(state["epoch"])
                pending.append(train_set[order[state["position"]]])
                state["position"] += 1
                if len(pending) == settings.sequences_per_forward or index == settings.sequences_per_step - 1:
                    loss, info = objective.batch_loss(pending, generator)
                    (loss * len(pending) / settings.sequences_per_step).backward()
                    metrics.extend([info] * len(pending))
                    tokens_seen += sum(int(tokens.numel()) for tokens, _ in pending)
                    pending = []
            if distributed:
                for p in params:
                    if p.grad is not None:
                        torch.distributed.all_reduce(p.grad)
                        p.grad /= world
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings.grad_clip))
            optimizer.step()
            state["step"] += 1
            summary = {k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]}
            summary.update(step=state["step"], lr=optimizer.param_groups[0]["lr"], grad_norm=grad_norm)
            window.append(summary)
            del window[:-20]
            rate = tokens_seen / max(time.perf_counter() - started - not_training, 1e-9)
            last = window[-20:]
            # the objective's metrics (loss, accuracy and any of its own), averaged over the last 20 steps
            keys = list(dict.fromkeys(k for m in last for k in m if k not in ("step", "lr", "grad_norm")))
            avg = {k: sum(values) / len(values) for k in keys for values in [[m[k] for m in last if k in m]]}
            info_text = f"loss {avg['loss']:.3f} acc@1 {avg['accuracy']:.3f} {rate:.0f} tok/s"
            if state["history"] and "acceptance" in state["history"][-1]:
                info_text += f" τ {state['history'][-1]['acceptance']:.2f}"
            bar.update(task, completed=state["step"], info=info_text)
            state["elapsed"] = training_seconds()
            out_of_time = settings.max_minutes is not None and state["elapsed"] > 60 * settings.max_minutes
            pausing = settings.pause_at_minutes is not None and state["elapsed"] > 60 * settings.pause_at_minutes
            done = state["step"] >= settings.steps or out_of_time or pausing
            saved_now = rank == 0 and (state["step"] % settings.save_every == 0 or done)
            if saved_now:
                paused_at = time.perf_counter()
                record = {"step": state["step"], "epoch": state["epoch"], **avg, "tokens_per_second": rate,
                          "elapsed_seconds": state["elapsed"], "lr": summary["lr"]}
                if done or (settings.eval_every and state["step"] % settings.eval_every == 0):
                    record["acceptance"] = evaluate_acceptance(objective, proposer_name, eval_prompts,
                                                               settings.eval_max_new_tokens)
                state["history"].append(record)
                save_checkpoint(run, objective, optimizer, {**state, "window": window}, generator)
                if not progress:
                    print(json.dumps(record), flush=True)
                not_training += time.perf_counter() - paused_at
            if out_of_time or pausing:
                break
            if guard.signum is not None and not done:
                if not saved_now:  # a checkpoint of this step, with no history record: a resume goes on unchanged
                    save_checkpoint(run, objective, optimizer, {**state, "window": window}, generator)
                raise Interrupted(guard.signum, f"interrupted by {signal.Signals(guard.signum).name} at step "
                                                f"{state['step']}: the run in {run} is saved; continue it "
                                                "with --resume.")
    if distributed:  # rank 0 may still be evaluating and saving: no rank tears the group down before it ends
        torch.distributed.barrier()
        if owns_group:
            torch.distributed.destroy_process_group()
    return state
