"""Classic speculative decoding (Leviathan et al. 2023): a small causal LM drafts autoregressively."""

from __future__ import annotations

import copy
from typing import Annotated

import torch
from pydantic import Field

from ..contracts import DecodeState, Draft, Proposer, ProposerConfig
from ..errors import SpecdecError
from ..limits import MAX_VERIFY_TOKENS, VERIFY_WHY, at_most, check_draft_sizes
from ..sampling import logits_to_probs
from ..target import TargetModel


class DraftModelProposer(Proposer):
    name = "draft"
    description = "a small causal LM with the target's tokenizer drafts token by token"

    class Config(ProposerConfig):
        draft: str = Field(..., description="path or hub id of the draft causal LM")
        num_tokens: Annotated[int, at_most(MAX_VERIFY_TOKENS, VERIFY_WHY)] = Field(
            4, ge=1, description=f"tokens drafted per step (at most {MAX_VERIFY_TOKENS})")

    def __init__(self, config: Config, target: TargetModel) -> None:
        from .. import loading

        super().__init__(config, target)
        check_draft_sizes(self.name, target.max_context, num_tokens=config.num_tokens)  # before the draft loads
        model, tokenizer = loading.load_model(config.draft, dtype=target.dtype, device=target.device)
        check_same_vocabulary(target, model, tokenizer, config.draft)
        self.draft = TargetModel(model, tokenizer)
        self._cached: torch.Tensor | None = None  # token ids whose keys/values the draft cache holds

    def reset(self) -> None:
        self._cached = None

    def fork(self) -> DraftModelProposer:
        clone = copy.copy(self)
        clone.draft = self.draft.fork()  # the same draft weights, a KV cache per row
        clone.reset()
        return clone

    def _catch_up(self, tokens: torch.Tensor) -> torch.Tensor:
        """Bring the draft cache to exactly `tokens` [1, T]; returns the draft's logits [1, 1, V] after them."""
        if self._cached is None:
            out = self.draft.prefill(tokens)
        else:
            common = min(self._cached.shape[1], tokens.shape[1])
            same = (self._cached[0, :common] == tokens[0, :common]).to(torch.int64)
            keep = min(int(same.cumprod(0).sum()), tokens.shape[1] - 1)  # feed at least one token for logits
            self.draft.crop(keep)
            out = self.draft.forward(tokens[:, keep:])
        self._cached = tokens
        return out.logits[:, -1:]

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Draft:
        k = min(self.config.num_tokens, state.max_draft_tokens)
        logits = self._catch_up(state.tokens)
        sampled = state.sampling is not None and not state.sampling.greedy
        tokens, probs = [], []
        for i in range(k):
            if sampled:
                p = logits_to_probs(logits[:, -1], state.sampling)
                token = torch.multinomial(p, 1, generator=state.generator)
                probs.append(p)
            else:
                token = logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(token)
            if i + 1 < k:
                logits = self.draft.forward(token).logits
        drafted = torch.cat(tokens, dim=1)
        # The draft cache now also holds drafted tokens 1..k-1; the next _catch_up drops whatever was rejected.
        self._cached = torch.cat([state.tokens, drafted[:, :-1]], dim=1)
        return Draft(tokens=drafted, probs=torch.stack(probs, dim=1) if sampled else None)


def check_same_vocabulary(target: TargetModel, draft_model, draft_tokenizer, where: str) -> None:
    draft_vocab = int(draft_model.get_output_embeddings().weight.shape[0])
    if draft_vocab != target.vocab_size:
        raise SpecdecError(f"The draft model {where} has a vocabulary of {draft_vocab} tokens but the target has "
                           f"{target.vocab_size}; use a draft that shares the target's tokenizer.")
    if target.tokenizer is not None and draft_tokenizer is not None:
        if target.tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise SpecdecError(f"The draft model {where} uses a different tokenizer from the target; use a draft "
                               "that shares the target's tokenizer.")
