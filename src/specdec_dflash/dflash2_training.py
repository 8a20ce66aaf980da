"""DFlash2's training objective: DFlash's (packed anchor blocks, decaying position weights) plus the selector's.

The draft's logits are trained as DFlash's are (cross-entropy at every slot against the target's tokens). The
candidate selector is trained by teacher forcing along each block, as SpecForge trains it (z-lab's trainer is
not public): at slot j the candidates are the top-k of the draft's (transformed) logits, the predecessor is the
*true* token at slot j - 1 (the anchor at slot 1), and the loss is the cross-entropy of the selector's scores
over the candidates against the true token's index, at slots whose true token is among the candidates (a
selector cannot choose a token it is not offered), with DFlash's position weights and denominator. Total:
DFlash's loss + `selector_loss_weight` x the selector's.

A run may start from a DFlash (v1) draft with `--init`: its weights are kept, the convolutions start as the
identity and the successor codebook at zero, so the new DFlash2 draft drafts exactly what the DFlash draft did
until training moves it. That is the fair starting point for comparing the two at equal budget.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field

from specdec.errors import SpecdecError
from specdec.target import TargetModel
from specdec.training.objective import refuse_reshaping

from .dflash2_model import DFlash2Config, DFlash2DraftModel, GroupedDynamicCausalConv
from .model import DFlashDraftModel
from .training import DFlashObjective


def upgrade_to_dflash2(draft: DFlashDraftModel, conv_kernel_size: int, conv_group_size: int, selector_rank: int,
                       selector_top_k: int, std: float = 0.02) -> DFlash2DraftModel:
    """A DFlash2 draft that drafts what `draft` (a DFlash draft) drafts: its weights, identity convolutions, a
    selector whose edge term is zero (successor codebook 0; predecessor codebook and projection small random,
    so that the edge term's gradient is not zero too)."""
    fields = draft.config.model_dump() | dict(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                                              selector_rank=selector_rank, selector_top_k=selector_top_k)
    if fields.get("vocab_size") is None:
        raise SpecdecError("The DFlash draft to upgrade does not record its vocabulary size, which the selector's "
                           "codebooks need; start from a draft whose config.json has vocab_size.")
    model = DFlash2DraftModel(DFlash2Config(**fields)).to(next(draft.parameters()).device)
    missing, unexpected = model.load_state_dict(draft.state_dict(), strict=False)
    odd = unexpected + [k for k in missing if "conv" not in k and "candidate_selector" not in k]
    if odd:
        raise SpecdecError(f"The DFlash draft does not map onto a DFlash2 one (tensor {odd[0]}); upgrade a draft "
                           "written by specdec or z-lab.")
    reset_dflash2_parts(model, std)
    return model


def reset_dflash2_parts(model: DFlash2DraftModel, std: float = 0.02) -> None:
    """The convolutions to the identity and the selector to a zero edge term (see upgrade_to_dflash2)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_to_identity()
        selector = model.candidate_selector
        selector.successor_codebook.zero_()
        torch.nn.init.normal_(selector.predecessor_codebook, std=std)
        torch.nn.init.normal_(selector.hidden_projection.weight, std=std)


#: the options that shape a new DFlash2 draft's convolutions and selector
SHAPE_OPTIONS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DFlash2Objective(DFlashObjective):
    name = "dflash2"

    class Config(DFlashObjective.Config):
        conv_kernel_size: int = Field(2, ge=1, description="convolution taps (new drafts, or a DFlash --init)")
        conv_group_size: int = Field(16, ge=1, description="channels per convolution group; divides the hidden size")
        selector_rank: int = Field(64, ge=1, description="rank of the selector's bilinear term")
        selector_top_k: int = Field(16, ge=1, description="candidates the selector rescores per slot")
        selector_loss_weight: float = Field(1.0, ge=0, description="weight of the selector's loss beside DFlash's")

    def _initial_draft(self, config: Config, target: TargetModel, init: str | Path | None) -> DFlash2DraftModel:
        draft = super()._initial_draft(config, target, init)
        if isinstance(draft, DFlash2DraftModel):  # it goes on with its own convolution and selector sizes
            refuse_reshaping(config, draft.config, init, SHAPE_OPTIONS)
            return draft
        if target.hidden_size % config.conv_group_size:
            raise SpecdecError(f"conv_group_size {config.conv_group_size} does not divide the target's hidden size "
                               f"{target.hidden_size}; pass --opt conv_group_size=N with N dividing it.")
        return upgrade_to_dflash2(draft, config.conv_kernel_size, config.conv_group_size, config.selector_rank,
                                  config.selector_top_k)

    def extra_loss(self, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                   weights: torch.Tensor, anchor_tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The selector's teacher-forced loss (module docstring). hidden [N, A, S, H] final-normed slot states;
        logits [N, A, S, V'] transformed; labels [N, A, S] target token ids (-100: none); valid [N, A, S];
        weights [N, A, S] DFlash's position weights x valid; anchor_tokens [N, A]."""
        selector = self.draft.candidate_selector
        width = min(selector.top_k, logits.shape[-1])
        with torch.no_grad():  # which tokens are offered is not differentiable; their scores are
            picks = logits.topk(width, dim=-1).indices  # [N, A, S, k]
        unary = logits.gather(-1, picks)
        candidates = picks if self.vocab_ids is None else self.vocab_ids[picks]  # target token ids
        truth = labels.clamp(min=0)
        previous = torch.cat([anchor_tokens.unsqueeze(-1), truth[..., :-1]], dim=-1)  # [N, A, S]
        projected = selector.hidden_projection(hidden)  # [N, A, S, r]
        edge = torch.einsum("nasr,naskr->nask", selector.predecessor_codebook[previous].float() * projected.float(),
                            selector.successor_codebook[candidates].float())
        scores = unary.float() + edge  # [N, A, S, k]
        hit = candidates == truth.unsqueeze(-1)  # [N, A, S, k]
        offered = hit.any(-1) & valid
        ce = F.cross_entropy(scores.flatten(0, 2), hit.float().argmax(-1).flatten(), reduction="none")
        chosen = weights * offered
        per_sequence = (ce.view_as(chosen) * chosen).sum((1, 2)) / weights.sum((1, 2)).clamp(min=1e-6)
        loss = per_sequence.mean()
        with torch.no_grad():
            first = offered[:, :, 0]
            right = (scores[:, :, 0].argmax(-1) == hit[:, :, 0].float().argmax(-1)) & first
            metrics = {"selector_loss": float(loss.detach()),
                       "selector_offered": float(offered.sum() / valid.sum().clamp(min=1)),
                       "selector_accuracy": float(right.sum() / first.sum().clamp(min=1))}
        return self.config.selector_loss_weight * loss, metrics
