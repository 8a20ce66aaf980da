"""EAGLE-3's training objective (Li et al. 2025): training-time test over a whole sequence at once.

For one sequence of T tokens the frozen target gives its hidden states at the draft's three tap layers.
Step 0 reads row i = (embedding of token i + 1, fused target states at i) for every i and predicts token
i + 2, under a causal mask. Step j > 0 reads row i = (embedding of token i + 1 + j, the draft's own step
j - 1 output at row i) and predicts token i + 2 + j: what the draft does at inference when it guesses j
tokens past position i, with its keys arranged the same way (`Eagle3DraftModel.forward_unrolled`). Each
step's cross-entropy (response tokens only) is weighted decay**j, EAGLE-3's 0.8 by default. Labels are
the data's tokens, which the target itself generated (greedy): its own choices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from specdec.draft_vocab import label_map, most_frequent
from specdec.target import TargetModel
from specdec.training.data import DataDir
from specdec.training.objective import (
    ObjectiveConfig,
    TrainingObjective,
    master_dtype,
    refuse_reshaping,
    target_shaped_fields,
)

from .checkpoint import check_against_target, load_draft, save_draft
from .model import Eagle3Config, Eagle3DraftModel


def step_weights(steps: int, decay: float) -> torch.Tensor:
    """decay**j for unrolled steps j = 0..steps-1."""
    return decay ** torch.arange(steps, dtype=torch.float32)


def unrolled_inputs(tokens: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor, step: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows i = 0..T-2 of right-padded sequences [N, T] at unrolled step `step`: (input token ids
    [N, T-1] = token i + 1 + step, labels [N, T-1] = token i + 2 + step, valid [N, T-1]: the label exists
    within the sequence's length and is a response token)."""
    rows = torch.arange(tokens.shape[1] - 1, device=tokens.device)
    last = tokens.shape[1] - 1
    inputs = tokens[:, (rows + 1 + step).clamp(max=last)]
    label_index = rows + 2 + step
    labels = tokens[:, label_index.clamp(max=last)]
    valid = (label_index.unsqueeze(0) < lengths.unsqueeze(1)) & loss_mask[:, label_index.clamp(max=last)].bool()
    return inputs, labels, valid


class Eagle3Objective(TrainingObjective):
    name = "eagle3"
    keeps_taps = True  # its taps come from target_taps (--tap-cache)

    class Config(ObjectiveConfig):
        ttt_steps: int = Field(7, ge=1, description="unrolled draft steps per position (training-time test; "
                               "EAGLE-3 uses 7)")
        step_decay: float = Field(0.8, gt=0, le=1, description="loss weight of unrolled step j: decay**j")
        draft_vocab_size: int = Field(8192, ge=1, description="new drafts: score only the N most frequent response "
                                      "tokens of the data (EAGLE-3's d2t; capped at the target's vocabulary)")
        target_layer_ids: list[int] | None = Field(None, description="default: layers 1, L/2 - 1 and L - 4")
        intermediate_size: int | None = Field(None, gt=0, description="default: the target's")

    def __init__(self, config: Config, target: TargetModel, init: str | Path | None = None) -> None:
        super().__init__(config, target)
        self.fresh = init is None  # a new draft takes its vocabulary from the data (use_data)
        if init is not None:
            draft = load_draft(init, dtype=torch.float32, device=target.device, num_target_layers=target.num_layers)
            check_against_target(draft.config, target.hidden_size, target.num_layers, target.vocab_size, str(init))
            refuse_reshaping(config, draft.config, init, ("target_layer_ids", "intermediate_size", "draft_vocab_size"))
        else:
            draft_config = Eagle3Config(
                **target_shaped_fields(target, config.intermediate_size),
                draft_vocab_size=min(config.draft_vocab_size, target.vocab_size),
                target_layer_ids=config.target_layer_ids or Eagle3Config.default_target_layer_ids(target.num_layers),
            )
            check_against_target(draft_config, target.hidden_size, target.num_layers, target.vocab_size, "(new)")
            draft = Eagle3DraftModel(draft_config).to(target.device)
            _init_weights(draft)
            if draft_config.draft_vocab_size == target.vocab_size:
                self._use_vocabulary(draft, torch.arange(target.vocab_size, device=target.device))
        self.draft = draft.to(master_dtype(target)).train()
        self.vocab_source = "" if init is None else f"inherited from {init}"
        self.to_draft = self._label_map()
        self.weights = step_weights(config.ttt_steps, config.step_decay).tolist()
        target.request_taps(list(self.draft.config.target_layer_ids))
        for p in target.model.parameters():
            p.requires_grad_(False)

    @property
    def module(self) -> Eagle3DraftModel:
        return self.draft

    def _use_vocabulary(self, draft: Eagle3DraftModel, token_ids: torch.Tensor) -> None:
        """Draft over `token_ids`; the head starts from the target's LM head rows for them (EAGLE-3 trains it)."""
        draft.set_vocabulary(token_ids)
        with torch.no_grad():
            draft.lm_head.weight.copy_(self.target.lm_head.weight[token_ids].float())

    def _label_map(self) -> torch.Tensor:
        ids = self.draft.target_ids(torch.arange(self.draft.config.draft_vocab_size, device=self.target.device))
        return label_map(ids, self.target.vocab_size)

    def use_data(self, data: DataDir) -> None:
        size = self.draft.config.draft_vocab_size
        if not self.fresh or size == self.target.vocab_size:
            return
        token_ids = most_frequent(data.response_token_counts(self.target.vocab_size), size).to(self.target.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast(token_ids, src=0)  # data may grow between ranks' reads: rank 0's subset wins
        self._use_vocabulary(self.draft, token_ids)
        self.to_draft = self._label_map()
        self.vocab_source = f"the {size} most frequent response tokens of {data.path}"

    def loss(self, tokens: torch.Tensor, loss_mask: torch.Tensor,
             generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        return self.batch_loss([(tokens, loss_mask)], generator)

    def batch_loss(self, sequences: list[tuple[torch.Tensor, torch.Tensor]],
                   generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean over the sequences of each one's step-weighted loss, the sequences right-padded into one
        batch (the causal draft and target never look ahead, so padding changes no real row)."""
        device = self.target.device
        count, length = len(sequences), max(int(t.shape[0]) for t, _ in sequences)
        if length < 3:  # no row has a label two tokens ahead
            return self._no_loss()
        tokens = torch.zeros(count, length, dtype=torch.long, device=device)
        mask = torch.zeros(count, length, dtype=torch.bool, device=device)
        lengths = torch.tensor([int(t.shape[0]) for t, _ in sequences], device=device)
        for row, (seq, seq_mask) in enumerate(sequences):
            tokens[row, : seq.shape[0]] = seq.to(device)
            mask[row, : seq.shape[0]] = seq_mask.to(device).bool()
        tapped = self.target_taps(tokens, lengths.tolist(), self.draft.config.target_layer_ids)
        tapped = tapped[:, :-1].clone()  # rows 0..T-2; an inference-mode tensor cannot be saved for backward
        positions = torch.arange(length - 1, device=device).unsqueeze(0).expand(count, -1)
        total = torch.zeros(count, device=device)
        weight_sum = torch.zeros(count, device=device)
        accuracy = 0.0
        earlier: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type in ("cpu", "cuda")):
            features = self.draft.fuse(tapped)
            for step, weight in enumerate(self.weights):
                inputs, labels, valid = unrolled_inputs(tokens, lengths, mask, step)
                embeds = self.target.embed_tokens(inputs).detach()
                features, kv = self.draft.forward_unrolled(embeds, features, positions + step, earlier)
                earlier.append(kv)
                labels = self.to_draft[labels]
                valid = valid & (labels >= 0)  # a token outside the draft vocabulary cannot be drafted: no loss
                if not valid.any():
                    continue
                # the head only where there is a label: most rows of a prompt-heavy sequence have none
                logits = self.draft.logits(features[valid]).float()  # [n_valid, V']
                ce = F.cross_entropy(logits, labels[valid], reduction="none")
                owner = torch.nonzero(valid)[:, 0]
                per_sequence = torch.zeros(count, device=device).index_add(0, owner, ce)
                counts = valid.sum(1)
                total = total + weight * per_sequence / counts.clamp(min=1)
                weight_sum = weight_sum + weight * (counts > 0)
                if step == 0:
                    with torch.no_grad():
                        hits = (logits.argmax(-1) == labels[valid]).float()
                        per_hits = torch.zeros(count, device=device).index_add(0, owner, hits)
                        accuracy = float((per_hits / counts.clamp(min=1))[counts > 0].mean())
        has_labels = weight_sum > 0
        if not has_labels.any():
            return self._no_loss()
        loss = (total[has_labels] / weight_sum[has_labels]).mean()
        return loss, {"loss": float(loss.detach()), "accuracy": accuracy}

    def _no_loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        """A zero loss still connected to every parameter (DDP ranks all-reduce the same gradients)."""
        return sum(p.sum() for p in self.draft.parameters()) * 0.0, {"loss": 0.0, "accuracy": 0.0}

    def proposer_options(self, folder: str | Path) -> dict[str, Any]:
        # the draft's own acceptance: its chain, without the tree it is served with
        return {"draft": str(folder), "tree_size": 0}

    def save_draft(self, folder: str | Path) -> Path:
        return save_draft(self.draft, folder)


def _init_weights(model: Eagle3DraftModel, std: float = 0.02) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=std)

