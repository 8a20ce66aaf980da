"""Classic speculative decoding (Leviathan et al. 2023): a small causal LM drafts autoregressively.

The rows of a batch draft together: one draft KV cache holds every row (`DraftRows`, the native cache's
ragged rows), so each draft step is one forward for all of them, as the target's verification is. A draft
model whose forward cannot hold ragged rows (the transformers backend) drafts each row with a cache of its own.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Annotated

import torch
from pydantic import Field

from ..contracts import DecodeState, Draft, Proposer, ProposerConfig
from ..errors import SpecdecError
from ..limits import MAX_VERIFY_TOKENS, VERIFY_WHY, at_most, check_draft_sizes
from ..sampling import logits_to_probs
from ..target import TargetModel


class DraftRows:
    """One draft cache shared by the proposers of a batch: row r holds the keys and values of `fed[r]`, the
    tokens `members[r]` has fed the draft so far. With a draft that cannot batch it has at most one member."""

    def __init__(self, draft: TargetModel) -> None:
        self.draft = draft.fork()  # the loaded draft's weights, a cache of this group's own
        self.members: list[DraftModelProposer] = []
        self.fed: list[torch.Tensor] = []  # per row: token ids [T_r]

    def row_of(self, member: DraftModelProposer) -> int | None:
        return next((r for r, m in enumerate(self.members) if m is member), None)

    def leave(self, members: Sequence[DraftModelProposer]) -> None:
        """These members' rows leave the cache, in one cache copy however many they are."""
        rows = [r for r, m in enumerate(self.members) if any(m is member for member in members)]
        if not rows:
            return
        self.members = [m for r, m in enumerate(self.members) if r not in rows]
        self.fed = [t for r, t in enumerate(self.fed) if r not in rows]
        if self.members:
            self.draft.drop_rows(rows)
        else:
            self.draft.reset()

    def feed(self, tokens: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """One draft forward: row r reads `tokens[r]` ([n_r], at least one) after what it holds; rows not named
        read right padding the cache does not count. Returns each named row's logits [V] after its last token."""
        width = max(t.numel() for t in tokens.values())
        ids = torch.zeros(len(self.members), width, dtype=torch.long, device=self.draft.device)  # [B, width]
        for r, t in tokens.items():
            ids[r, : t.numel()] = t
        counts = [tokens[r].numel() if r in tokens else 0 for r in range(len(self.members))]
        # the LM head only at each row's last token: catching up feeds several tokens, and the rest's
        # logits would be thrown away
        logits = self.draft.forward_last(ids, counts).logits  # [B, 1, V]
        for r, t in tokens.items():
            self.fed[r] = torch.cat([self.fed[r], t])
        return {r: logits[r, 0] for r in tokens}

    def catch_up(self, members: Sequence[DraftModelProposer],
                 contexts: Sequence[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
        """Bring each member's row to exactly its context ([T], committed tokens), reusing the longest prefix the
        row already holds; members without a row join. Returns each member's cache row, and its draft logits
        [V] after its context."""
        # rows not drafting now have finished (the engine asks every row that drafts)
        self.leave([m for m in self.members if not any(m is member for member in members)])
        feeds: dict[int, torch.Tensor] = {}
        after: dict[int, torch.Tensor] = {}
        for member, context in zip(members, contexts, strict=True):
            row = self.row_of(member)
            if row is None:
                continue
            held = self.fed[row]
            common = min(held.numel(), context.numel())
            same = (held[:common] == context[:common]).to(torch.int64)
            keep = min(int(same.cumprod(0).sum()), context.numel() - 1)  # feed at least one token for logits
            self.fed[row] = held[:keep]
            feeds[row] = context[keep:]
        if feeds:
            self.draft.crop([self.fed[r].numel() for r in range(len(self.members))])
            after = self.feed(feeds)
        joining = [(m, c) for m, c in zip(members, contexts, strict=True) if self.row_of(m) is None]
        if joining:
            if not self.members:
                self.draft.reset()  # a fresh cache, and the draft's forward and weights looked at again
            if self.draft.can_batch:
                out = self.draft.add_rows([c for _, c in joining]).logits[:, -1]  # [k, V]
            else:  # a cache of one row
                assert not self.members and len(joining) == 1, "a draft that cannot batch drafts one row"
                out = self.draft.prefill(joining[0][1].unsqueeze(0)).logits[:, -1]
            for j, (member, context) in enumerate(joining):
                self.members.append(member)
                self.fed.append(context)
                after[len(self.members) - 1] = out[j]
        rows: list[int] = [self.row_of(m) for m in members]  # type: ignore[misc]
        return rows, [after[r] for r in rows]


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
        self.rows = DraftRows(self.draft)

    def reset(self) -> None:
        self.rows.leave([self])  # a new sequence: its row is read afresh at the next draft

    def fork(self) -> DraftModelProposer:
        clone = copy.copy(self)
        # rows of a batch share one draft cache where the draft's forward holds ragged rows; else one each
        if not self.draft.can_batch:
            clone.rows = DraftRows(self.draft)
        return clone

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Draft:
        return self.propose_batch([self], [state])[0]

    @classmethod
    @torch.inference_mode()
    def propose_batch(cls, proposers: Sequence[Proposer], states: Sequence[DecodeState]) -> list[Draft]:
        """Every row's k-th draft token from one draft forward over all rows that share a cache."""
        drafts: list[Draft | None] = [None] * len(proposers)
        groups: dict[int, list[int]] = {}
        for i, proposer in enumerate(proposers):
            assert isinstance(proposer, DraftModelProposer) and states[i].batch_size == 1
            groups.setdefault(id(proposer.rows), []).append(i)
        for indices in groups.values():
            made = cls._draft_rows([proposers[i] for i in indices], [states[i] for i in indices])  # type: ignore[misc]
            for i, draft in zip(indices, made, strict=True):
                drafts[i] = draft
        return drafts  # type: ignore[return-value]

    @staticmethod
    def _draft_rows(proposers: Sequence[DraftModelProposer], states: Sequence[DecodeState]) -> list[Draft]:
        rows = proposers[0].rows
        if len(proposers) > 1 and not rows.draft.can_batch:
            raise SpecdecError(f"The draft model {proposers[0].config.draft} no longer runs on specdec's own "
                               "forward (a forward hook added to it since it loaded?), so a batch's rows cannot "
                               "share its cache; remove the hook, or make a new SpeculativeDecoder.")
        if all(state.max_draft_tokens < 1 for state in states):
            return [Draft(tokens=state.tokens.new_empty(1, 0)) for state in states]
        index, logits = rows.catch_up(proposers, [state.tokens[0] for state in states])  # cache rows; per row [V]
        ks = [min(p.config.num_tokens, s.max_draft_tokens) for p, s in zip(proposers, states, strict=True)]
        tokens: list[list[torch.Tensor]] = [[] for _ in proposers]
        probs: list[list[torch.Tensor]] = [[] for _ in proposers]
        for i in range(max(ks)):
            for j, state in enumerate(states):
                if i >= ks[j]:
                    continue
                sampled = state.sampling is not None and not state.sampling.greedy
                if sampled:
                    p = logits_to_probs(logits[j].unsqueeze(0), state.sampling)  # [1, V]
                    tokens[j].append(torch.multinomial(p, 1, generator=state.generator)[0])
                    probs[j].append(p)
                else:
                    tokens[j].append(logits[j].argmax(dim=-1, keepdim=True))
            # the rows still drafting read their new token (the cache then holds drafted tokens 1..k-1; the next
            # catch-up drops whatever the target rejected)
            going = [j for j in range(len(proposers)) if i + 1 < ks[j]]
            if going:
                after = rows.feed({index[j]: tokens[j][-1] for j in going})
                for j in going:
                    logits[j] = after[index[j]]
        return [Draft(tokens=torch.cat(t).unsqueeze(0) if t else state.tokens.new_empty(1, 0),
                      probs=torch.stack(q, dim=1) if q else None)
                for t, q, state in zip(tokens, probs, states, strict=True)]


def check_same_vocabulary(target: TargetModel, draft_model, draft_tokenizer, where: str) -> None:
    draft_vocab = int(draft_model.get_output_embeddings().weight.shape[0])
    if draft_vocab != target.vocab_size:
        raise SpecdecError(f"The draft model {where} has a vocabulary of {draft_vocab} tokens but the target has "
                           f"{target.vocab_size}; use a draft that shares the target's tokenizer.")
    if target.tokenizer is not None and draft_tokenizer is not None:
        if target.tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise SpecdecError(f"The draft model {where} uses a different tokenizer from the target; use a draft "
                               "that shares the target's tokenizer.")
