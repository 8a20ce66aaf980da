"""DFlash's training objective (arXiv 2602.06036, section 4): packed anchor blocks, decaying position weights.

For one sequence: the frozen target gives hidden states at the draft's tap layers for every position.
Random anchors are drawn among response positions; each anchor p becomes a block
``[token p, mask x (B-1)]`` whose slot k (1..B-1) must predict token p + k. All blocks are packed into one
draft forward whose attention mask lets a block see the context strictly before its anchor (exactly what
the proposer sees at inference) and its own block in both directions, nothing of other blocks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from specdec.backends import decoder_layers
from specdec.errors import SpecdecError
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
from .distillation import distillation_ce, soft_targets
from .grow import deepen, widen
from .model import DFlashConfig, DFlashDraftModel
from .vocab import head_rows, inherited_source, label_map, load_vocab, most_frequent, save_vocab


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """w_k = exp(-(k - 1) / gamma) for slots k = 1..B-1; gamma 7 for B=16, 5 for B=10, 4 for B=8 (the paper's)."""
    if gamma is None:
        gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, (block_size - 2) / 2))
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted anchor positions [A]: response positions with at least one token after them."""
    length = loss_mask.shape[0]
    candidates = torch.nonzero(loss_mask[: length - 1]).flatten()
    if candidates.numel() == 0:
        return candidates
    if candidates.numel() > num_anchors:
        keep = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[keep]
    return candidates.sort().values


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block ids [A*B], block positions [A*B], labels [A, B-1], label valid [A, B-1]).

    Slot k of the block anchored at p sits at position p + k and predicts tokens[p + k] (k >= 1).
    """
    length = tokens.shape[0]
    offsets = torch.arange(block_size, device=tokens.device)
    positions = anchors.unsqueeze(1) + offsets  # [A, B]
    ids = torch.full_like(positions, mask_token_id)
    ids[:, 0] = tokens[anchors]
    label_positions = positions[:, 1:]
    valid = label_positions < length
    labels = torch.where(valid, tokens[label_positions.clamp(max=length - 1)], -100)
    return ids.flatten(), positions.flatten(), labels, valid


def packed_attention_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """[A*B, context_length + A*B] bool, True where a query may attend.

    Query slot of block a sees context positions j < anchors[a] and every slot of block a.
    """
    num_blocks = anchors.shape[0]
    device = anchors.device
    block_of_query = torch.arange(num_blocks, device=device).repeat_interleave(block_size)  # [A*B]
    context = torch.arange(context_length, device=device).unsqueeze(0) < anchors[block_of_query].unsqueeze(1)
    same_block = block_of_query.unsqueeze(1) == block_of_query.unsqueeze(0)
    return torch.cat([context, same_block], dim=1)


def pick_mask_token(tokenizer) -> int:
    """An unused special token for a target without a mask token: the last special token that is neither
    bos, eos, pad nor unk, and does not appear in the chat template."""
    if tokenizer is None:
        raise SpecdecError("Choosing a mask token needs the target's tokenizer; pass --opt mask_token_id=ID.")
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None:
        return int(mask)
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = [i for i, tok in sorted(decoder.items())
                  if getattr(tok, "special", False) and i not in reserved and str(tok) not in template]
    if not candidates:
        raise SpecdecError("The target's tokenizer has no unused special token to use as the DFlash mask; pass "
                           "--opt mask_token_id=ID with a token id that never occurs in text.")
    return int(candidates[-1])


class DFlashObjective(TrainingObjective):
    name = "dflash"
    keeps_taps = True  # its taps come from target_taps (--tap-cache)

    class Config(ObjectiveConfig):
        num_layers: int = Field(3, ge=1, description="draft decoder layers (new drafts); with --init, more than the "
                            "draft's own appends layers that start by changing nothing (specdec_dflash.grow)")
        block_size: int | None = Field(None, ge=2, description="block size: 16 for a new draft; with --init, the "
                                       "draft's own or a smaller one, which the saved draft then records")
        num_anchors: int = Field(64, ge=1, description="anchor blocks per sequence, resampled every epoch")
        gamma: float | None = Field(None, gt=0, description="loss decay; default by block size (7 for 16)")
        mask_token_id: int | None = Field(None, ge=0, description="default: an unused special token")
        target_layer_ids: list[int] | None = Field(None, description="default: spread over the target's depth")
        intermediate_size: int | None = Field(None, gt=0, description="MLP units: the target's for a new draft; "
                                              "with --init, more than the draft's own adds units that start by "
                                              "changing nothing (specdec_dflash.grow)")
        draft_vocab_size: int | None = Field(None, ge=1, description="score only the N most frequent response "
                                             "tokens of the data (FR-Spec, EAGLE-3's d2t); default: the --init "
                                             "draft's vocabulary, else the whole vocabulary")
        init_layers: list[int] | None = Field(None, description="new drafts: start draft layer i from target layer "
                                              "init_layers[i] (its attention, MLP and norms; the draft's k/v "
                                              "projections then also project the injected context); default: "
                                              "random")
        normalize_taps: bool | None = Field(None, description="RMS-normalise each tapped hidden state (its own "
                                            "weight) before the fusion layer (specdec's own: z-lab's layout has no "
                                            "place for it); default: off for new drafts, the --init draft's own")
        distill_top_k: int = Field(0, ge=0, description="0 = train on the data's tokens (hard labels); K >= 1 = on "
                                   "the target's own next-token distribution at each slot, its K likeliest tokens "
                                   "renormalised (computed in the same target forward that gives the taps)")
        distill_temperature: float = Field(1.0, gt=0, description="temperature of the target's distribution when "
                                           "distill_top_k >= 1")
        vocab_from_data: bool = Field(False, description="with --init: choose the draft vocabulary afresh from the "
                                      "data (draft_vocab_size tokens, default the init draft's count) instead of "
                                      "keeping the init draft's; its rows are the target's LM head, so nothing "
                                      "trained is lost")

        def for_resume(self) -> DFlashObjective.Config:
            # the vocabulary was counted when the run began; a resume keeps it, even on grown data
            # init_layers made the run's first draft; a resume starts from the run's own
            return self.model_copy(update={"vocab_from_data": False, "init_layers": None})

    def __init__(self, config: Config, target: TargetModel, init: str | Path | None = None) -> None:
        super().__init__(config, target)
        draft = self._initial_draft(config, target, init)
        self.draft = draft.to(master_dtype(target)).train()
        self.vocab_ids: torch.Tensor | None = None
        self.vocab_source = ""
        if init is not None:
            inherited = load_vocab(init, target.vocab_size)
            if inherited is not None:
                self._set_vocab(inherited, inherited_source(init))
        self.block_size = draft.config.block_size
        self.weights = loss_weights(self.block_size, config.gamma).to(target.device)
        target.request_taps(list(self.draft.config.target_layer_ids))
        for p in target.model.parameters():
            p.requires_grad_(False)

    def _initial_draft(self, config: Config, target: TargetModel, init: str | Path | None) -> DFlashDraftModel:
        """The draft training starts from: `init`'s (checked against the target and the packed training mask),
        or a new one shaped by the options, randomly initialised."""
        if init is not None:
            if config.init_layers is not None:
                raise SpecdecError("init_layers starts a new draft from target layers, but --init names a draft to "
                                   "start from; drop one of them.")
            draft = load_draft(init, dtype=torch.float32, device=target.device)
            if type(draft) is not DFlashDraftModel and self.name == "dflash":
                raise SpecdecError(f"The draft {init} is a DFlash2 draft; train it with --proposer dflash2.")
            check_against_target(draft.config, target.hidden_size, target.num_layers, target.vocab_size, str(init))
            refuse_reshaping(config, draft.config, init, ("target_layer_ids", "mask_token_id"))
            if any(draft.config.window_of(i) is not None for i in range(draft.config.num_hidden_layers)):
                # the packed training mask shows each block its whole context; such a draft would train on
                # more context than its windowed layers see when it drafts
                raise SpecdecError(f"The draft {init} has sliding-window layers (sliding_window "
                                   f"{draft.config.sliding_window}), which training does not support yet; "
                                   "start from a draft without a window or from random weights.")
            causal = [i for i in range(draft.config.num_hidden_layers) if draft.config.causal_of(i)]
            if causal:
                # the packed training mask lets every block position see its whole block
                raise SpecdecError(f"The draft {init} has layers causal inside the block (layers {causal}; "
                                   "is_causal or sliding_attention layer_types), which training does not support "
                                   "yet; start from a draft with is_causal false or from random weights.")
            if config.normalize_taps is not None and config.normalize_taps != draft.config.tap_norm:
                raise SpecdecError(f"normalize_taps={str(config.normalize_taps).lower()}, but the draft {init} was "
                                   f"trained with tap_norm {str(draft.config.tap_norm).lower()}; drop the option "
                                   "or start from random weights.")
            if config.block_size is not None:
                if config.block_size > draft.config.block_size:
                    raise SpecdecError(f"block_size {config.block_size} is larger than the "
                                       f"{draft.config.block_size} the draft {init} was trained for; use "
                                       f"--opt block_size={draft.config.block_size} or less.")
                # fine-tuned for a shorter block: the saved config, and so the proposer's default, follows
                draft.config = draft.config.model_copy(update={"block_size": config.block_size})
            if config.intermediate_size is not None:  # honoured: new units that change nothing yet
                draft = widen(draft, config.intermediate_size)
            if "num_layers" in config.model_fields_set:  # honoured: new layers (copies of the widened last)
                draft = deepen(draft, config.num_layers)
        else:
            layer_ids = config.target_layer_ids or DFlashConfig.default_target_layer_ids(target.num_layers,
                                                                                         config.num_layers)
            draft_config = DFlashConfig(
                **target_shaped_fields(target, config.intermediate_size),
                num_hidden_layers=config.num_layers,
                block_size=config.block_size or 16,
                mask_token_id=config.mask_token_id if config.mask_token_id is not None
                else pick_mask_token(target.tokenizer),
                target_layer_ids=layer_ids,
                tap_norm=bool(config.normalize_taps),
            )
            check_against_target(draft_config, target.hidden_size, target.num_layers, target.vocab_size, "(new)")
            draft = DFlashDraftModel(draft_config).to(target.device)
            _init_weights(draft)
            if config.init_layers is not None:
                copy_target_layers(draft, target, config.init_layers)
        return draft

    @property
    def module(self) -> DFlashDraftModel:
        return self.draft

    def _set_vocab(self, token_ids: torch.Tensor, source: str) -> None:
        device = self.target.device
        self.vocab_ids = token_ids.to(device)
        self.vocab_source = source
        self.to_draft = label_map(self.vocab_ids, self.target.vocab_size)
        self.head_weight, self.head_bias = head_rows(self.target.lm_head, self.vocab_ids)

    def use_data(self, data: DataDir) -> None:
        size = self.config.draft_vocab_size
        if self.config.vocab_from_data:  # count afresh, by default as many tokens as the init draft's subset
            if size is None and self.vocab_ids is None:
                raise SpecdecError("vocab_from_data has no vocabulary to recount: give --opt draft_vocab_size=N, or "
                                   "--init a draft that has a draft_vocab.json.")
            size = size or self.vocab_ids.numel()
        elif size is None or (self.vocab_ids is not None and self.vocab_ids.numel() == size):
            return  # the whole vocabulary, or the init draft's subset of this size (a resume keeps its own)
        token_ids = most_frequent(data.response_token_counts(self.target.vocab_size), size).to(self.target.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast(token_ids, src=0)  # data may grow between ranks' reads: rank 0's subset wins
        self._set_vocab(token_ids, f"the {size} most frequent response tokens of {data.path}")

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V'] logits over the draft vocabulary (the whole one if none was set)."""
        logits = self.target.lm_head(hidden) if self.vocab_ids is None else \
            F.linear(hidden, self.head_weight, self.head_bias)
        return self.draft.transform_logits(logits)

    def draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft vocabulary indices; -100 (ignored) for tokens outside it or unlabelled."""
        if self.vocab_ids is None:
            return labels
        mapped = self.to_draft[labels.clamp(min=0)]
        return torch.where((labels >= 0) & (mapped >= 0), mapped, torch.full_like(labels, -100))

    def loss(self, tokens: torch.Tensor, loss_mask: torch.Tensor,
             generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        return self.batch_loss([(tokens, loss_mask)], generator)

    def batch_loss(self, sequences: list[tuple[torch.Tensor, torch.Tensor]],
                   generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean over the sequences of each one's weighted loss, in one target and one draft forward.

        Sequences are right-padded to the longest (the causal target never looks ahead, and no block's
        mask reaches past its own anchor) and their anchor blocks to the most anchors; each padding slot
        sees only itself and carries no label.
        """
        device = self.target.device
        size, mask_id = self.block_size, self.draft.config.mask_token_id
        drawn = []
        for tokens, loss_mask in sequences:  # anchors drawn in order: the same draws as one by one
            tokens = tokens.to(device)
            drawn.append((tokens, sample_anchors(loss_mask.to(device), self.config.num_anchors, generator).to(device)))
        count = len(drawn)
        if all(anchors.numel() == 0 for _, anchors in drawn):
            zero = sum(p.sum() for p in self.draft.parameters()) * 0.0
            return zero, {"loss": 0.0, "accuracy": 0.0}
        length = max(tokens.shape[0] for tokens, _ in drawn)
        blocks = max(anchors.numel() for _, anchors in drawn)
        width = blocks * size
        batch_tokens = torch.zeros(count, length, dtype=torch.long, device=device)
        ids = torch.full((count, width), mask_id, dtype=torch.long, device=device)
        positions = torch.zeros(count, width, dtype=torch.long, device=device)
        labels = torch.full((count, blocks, size - 1), -100, dtype=torch.long, device=device)
        valid = torch.zeros(count, blocks, size - 1, dtype=torch.bool, device=device)
        mask = torch.zeros(count, 1, width, length + width, dtype=torch.bool, device=device)
        own = torch.arange(width, device=device)
        mask[:, 0, own, length + own] = True  # padding slots see themselves: no row of the mask is empty
        for row, (tokens, anchors) in enumerate(drawn):
            batch_tokens[row, : tokens.shape[0]] = tokens
            used = anchors.numel() * size
            if not used:
                continue
            row_ids, row_positions, row_labels, row_valid = block_inputs(tokens, anchors, size, mask_id)
            ids[row, :used], positions[row, :used] = row_ids, row_positions
            labels[row, : anchors.numel()], valid[row, : anchors.numel()] = row_labels, row_valid
            packed = packed_attention_mask(anchors, tokens.shape[0], size)
            mask[row, 0, :used, : tokens.shape[0]] = packed[:, : tokens.shape[0]]
            mask[row, 0, :used, length: length + used] = packed[:, tokens.shape[0]:]
        distill = self.config.distill_top_k
        if distill:  # the target's distribution comes from the same forward as its taps
            target_out = self.target.tap_hidden_states(batch_tokens, with_logits=True)
            tapped = target_out.tapped(self.draft.config.target_layer_ids)
        else:
            tapped = self.target_taps(batch_tokens, [int(tokens.shape[0]) for tokens, _ in drawn],
                                      self.draft.config.target_layer_ids)
        tapped = tapped.clone()  # an inference-mode tensor cannot be saved for backward; a clone can
        context_positions = torch.arange(length, device=device).unsqueeze(0).expand(count, -1)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type in ("cpu", "cuda")):
            embeds = self.target.embed_tokens(ids).detach()
            hidden = self.draft(embeds, tapped, context_positions, positions, attention_mask=mask,
                                block_size=size)
            hidden = hidden.view(count, blocks, size, -1)[:, :, 1:]  # slots 1..B-1
            logits = self.draft_logits(hidden.contiguous()).float()  # [N, A, B-1, V']
        target_labels, labels = labels, self.draft_labels(labels)
        if distill:  # slot k of the block at p learns the target's distribution after position p + k - 1
            probs, teacher_ids = soft_targets(target_out.logits, distill, self.config.distill_temperature)
            before = positions.view(count, blocks, size)[:, :, :-1].clamp(max=length - 1).flatten(1)  # [N, A*S]
            pick = before.unsqueeze(-1).expand(-1, -1, probs.shape[-1])
            probs = probs.gather(1, pick).view(count, blocks, size - 1, -1)
            teacher_ids = self.draft_labels(teacher_ids.gather(1, pick).view(count, blocks, size - 1, -1))
            ce, any_inside = distillation_ce(logits, probs, teacher_ids)
            valid = valid & any_inside
        else:
            valid = valid & (labels >= 0)  # a token outside the draft vocabulary cannot be drafted: no loss there
            ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), ignore_index=-100, reduction="none")
        weights = self.weights * valid
        per_sequence = (ce.view_as(weights) * weights).sum((1, 2)) / weights.sum((1, 2)).clamp(min=1e-6)
        loss = per_sequence.mean()
        anchor_tokens = ids.view(count, blocks, size)[:, :, 0]
        extra, metrics = self.extra_loss(hidden, logits, target_labels, valid, weights, anchor_tokens)
        if extra is not None:
            metrics["draft_loss"] = float(loss.detach())  # DFlash's own part, beside the total
            loss = loss + extra
        with torch.no_grad():  # slot-1 accuracy (the first draft token); argmax over slot 1 only, it is not cheap
            correct = ((logits[:, :, 0].argmax(-1) == labels[:, :, 0]) & valid[:, :, 0]).sum(1)
            anchors_per_row = torch.tensor([max(a.numel(), 1) for _, a in drawn], device=device)
            accuracy = (correct / anchors_per_row).mean().item()
        return loss, {"loss": float(loss.detach()), "accuracy": accuracy, **metrics}

    def extra_loss(self, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                   weights: torch.Tensor, anchor_tokens: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, float]]:
        """A loss a subclass adds to DFlash's (DFlash2's selector), from the slots' final-normed states [N, A, S, H],
        their draft logits [N, A, S, V'], the target's tokens [N, A, S] (-100: none), which slots count [N, A, S],
        their position weights [N, A, S] and each block's anchor token [N, A]; None: nothing added."""
        return None, {}

    def proposer_options(self, folder: str | Path) -> dict[str, Any]:
        # the draft's own acceptance: its argmax chain, without the tree or prompt lookup it is served with
        return {"draft": str(folder), "tree_size": 0, "lookup": 0}

    def save_draft(self, folder: str | Path) -> Path:
        path = save_draft(self.draft, folder)
        if self.vocab_ids is not None:
            save_vocab(self.vocab_ids.cpu(), path, source=self.vocab_source)
        return path


#: what a draft layer takes from a target layer: every tensor the two share by name and shape (Qwen3 targets
#: also give q_norm and k_norm; a Llama target has none, and the draft's stay at one)
LAYER_PARTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "input_layernorm.weight", "post_attention_layernorm.weight")


def copy_target_layers(draft: DFlashDraftModel, target: TargetModel, layer_ids: list[int]) -> None:
    """Draft layer i <- target layer layer_ids[i]: the projections and norms (LAYER_PARTS, and q/k norms where
    the target has them). Refused, with the reason, where the shapes cannot match."""
    layers = decoder_layers(target.model)
    if len(layer_ids) != len(draft.layers):
        raise SpecdecError(f"init_layers names {len(layer_ids)} target layers for a draft of {len(draft.layers)}; "
                           "name one per draft layer (--opt num_layers=N).")
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise SpecdecError(f"init_layers names target layers {bad}, but the target has {len(layers)}; use layers "
                           f"0 to {len(layers) - 1}.")
    for layer, source_id in zip(draft.layers, layer_ids, strict=True):
        source = layers[source_id].state_dict()
        mine = layer.state_dict()
        names = [n for n in mine if n in source and source[n].shape == mine[n].shape]
        extra = sorted(set(source) - set(names))
        if extra:  # a bias, say: the copied layer would not compute what the target's does
            raise SpecdecError(f"Target layer {source_id} holds {extra[0]}, which a DFlash draft layer has no place "
                               "for; init_layers works for targets with Llama/Qwen3-style layers.")
        norms = {type(m).__name__ for n, m in layers[source_id].named_modules() if n.endswith("layernorm")}
        if not norms <= {"LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"}:
            raise SpecdecError(f"Target layer {source_id} normalises with {sorted(norms)}, not the plain RMSNorm "
                               "of a DFlash draft layer; init_layers works for Llama/Qwen-style targets.")
        missing = [n for n in LAYER_PARTS if n not in names]
        if missing:
            raise SpecdecError(f"Target layer {source_id} has no {missing[0]} of the draft's shape "
                               f"{tuple(mine[missing[0]].shape)}; init_layers needs the draft shaped as the target "
                               "(leave intermediate_size at its default).")
        with torch.no_grad():
            for name in names:
                mine[name].copy_(source[name])


def _init_weights(model: DFlashDraftModel, std: float = 0.02) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=std)
    # residual projections scaled down with depth (GPT-2 style) so the untrained draft starts near identity
    for layer in model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            torch.nn.init.normal_(proj.weight, std=std / math.sqrt(2 * len(model.layers)))
