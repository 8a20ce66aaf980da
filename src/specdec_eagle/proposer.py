"""The `eagle3` proposer: a one-layer draft fed the target's hidden states guesses token by token, as a
chain or as a dynamic tree (EAGLE-2's expansion)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field

from specdec import DecodeState, Draft, Proposer
from specdec.hidden_state import HiddenStateProposer
from specdec.limits import MAX_VERIFY_TOKENS, VERIFY_WHY, at_most, check_draft_sizes
from specdec.prepacked import route_through_packed
from specdec.sampling import SamplingParams

from .checkpoint import check_against_target, load_draft, read_config_for
from .drafting import ChainDrafter, TreeDrafter
from .model import Eagle3Cache, Eagle3Config

#: the EAGLE-3 draft this project trained for the embedded default target, shipped inside the package
SHIPPED_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-instruct"



class Eagle3Proposer(HiddenStateProposer):
    name = "eagle3"
    description = "EAGLE-3: a one-layer draft fed three target layers' hidden states drafts token by token"
    chain_hint = "--opt tree_size=0"
    shipped_draft = SHIPPED_DRAFT
    check_against_target = staticmethod(check_against_target)

    class Config(HiddenStateProposer.Config):
        draft: str | None = Field(None, description="EAGLE-3 checkpoint folder (default: the shipped SmolLM2 "
                                  "draft, when this package ships one)")
        # each at most MAX_VERIFY_TOKENS: a chain or tree deeper than one verification forward holds, a tree of
        # more nodes, or a tree_width beyond it (at most tree_size nodes of one depth, or children of one node,
        # are verified) cannot be verified
        num_tokens: Annotated[int, at_most(MAX_VERIFY_TOKENS, VERIFY_WHY)] = Field(
            6, ge=1, description="draft forwards per step: the chain's length, the tree's depth")
        tree_size: Annotated[int, at_most(MAX_VERIFY_TOKENS, VERIFY_WHY)] = Field(
            16, ge=0, description="N >= 1: verify the N likeliest draft tokens as a tree (EAGLE-2's dynamic tree; "
            "greedy decoding, or drafting=greedy); 0 = a chain")
        tree_width: Annotated[int, at_most(MAX_VERIFY_TOKENS, VERIFY_WHY)] = Field(
            4, ge=1, description="tree: nodes expanded per depth and children kept per node")
        drafting: Literal["sample", "greedy"] = Field(
            "sample", description="at temperature > 0: draft the chain from the draft's own distribution and "
            "pass it to the verifier (sample), or draft argmax tokens as point masses, a tree when tree_size > 0 "
            "(greedy)")

    def check_sizes(self, max_context: int) -> None:
        config = self.config
        check_draft_sizes(self.name, max_context, num_tokens=config.num_tokens, tree_size=config.tree_size,
                          tree_width=config.tree_width)

    def read_draft_config(self, folder: Path) -> Eagle3Config:
        return read_config_for(folder, self.target.num_layers)  # taps the checkpoint leaves out: the target's

    def load(self, folder: Path, draft_config: Eagle3Config) -> None:
        target = self.target
        self.model = load_draft(folder, dtype=target.dtype, device=target.device, num_target_layers=target.num_layers)
        self.vocab_ids = self.model.target_ids(torch.arange(draft_config.draft_vocab_size, device=target.device))
        self.prepacked = route_through_packed([self.model])  # few-row products, laid out once (bf16 CPU)

    def new_cache(self) -> Eagle3Cache:
        return Eagle3Cache()

    def drafts_trees(self, sampling: SamplingParams) -> bool:
        return bool(self.config.tree_size) and (sampling.greedy or self.config.drafting == "greedy")

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Draft:
        return self.propose_batch([self], [state])[0]

    @classmethod
    @torch.inference_mode()
    def propose_batch(cls, proposers: Sequence[Proposer], states: Sequence[DecodeState]) -> list[Draft]:
        """Every row's draft in lockstep: one draft forward reads every row's pending context, then one per
        depth reads every row's guesses of that depth (a chain's last token, a tree's best nodes), each row
        against its own cache; the head scores all rows' positions in one product."""
        rows = [(proposer, state) for proposer, state in zip(proposers, states, strict=True)]
        lead = rows[0][0]
        assert all(isinstance(p, Eagle3Proposer) and p.model is lead.model for p, _ in rows), \
            "rows of one batch are forks of one proposer"
        model, target = lead.model, lead.target
        assert all(state.batch_size == 1 for _, state in rows), "one row per state, as the engine's rows are"
        contexts = [proposer.take_pending(state) for proposer, state in rows]
        counts = [int(context.states.shape[1]) for context in contexts]
        assert min(counts) > 0, "every row has a committed position the draft has not read"  # (the first token)
        embeds = target.embed_tokens(torch.cat([state.tokens[:, c.start + 1:] for (_, state), c in
                                                zip(rows, contexts, strict=True)], dim=1))
        for (proposer, _), context in zip(rows, contexts, strict=True):
            assert proposer.cache.length() == context.start, "draft cache out of sync"
        # the pending target features (positions p..T-2 of each row, with tokens p+1..T-1) into each row's cache
        outputs = model.forward_rows(embeds, model.fuse(torch.cat([c.states for c in contexts], dim=1)),
                                     torch.cat([c.positions for c in contexts], dim=1), counts,
                                     [p.cache for p, _ in rows], [None] * len(rows))
        last = outputs[0, torch.tensor(counts, device=outputs.device).cumsum(0) - 1]  # [R, H]: each first guess's
        committed = [proposer.cache.length() for proposer, _ in rows]
        try:
            drafters = [proposer._drafter(state, length) for (proposer, state), length in
                        zip(rows, committed, strict=True)]
            logits = model.logits(last)  # [R, V']
            for r, drafter in enumerate(drafters):
                drafter.absorb(last[r: r + 1], logits[r: r + 1])
            while True:
                asked = [(r, step) for r, drafter in enumerate(drafters) if (step := drafter.inputs()) is not None]
                if not asked:
                    return [drafter.draft() for drafter in drafters]
                tokens = torch.cat([step.tokens for _, step in asked]).unsqueeze(0)  # [1, S]
                counts = [int(step.tokens.numel()) for _, step in asked]
                positions = torch.cat([torch.full((n,), step.position, device=tokens.device) for n, (_, step) in
                                       zip(counts, asked, strict=True)]).unsqueeze(0)
                outputs = model.forward_rows(target.embed_tokens(tokens),
                                             torch.cat([step.features for _, step in asked]).unsqueeze(0), positions,
                                             counts, [rows[r][0].cache for r, _ in asked],
                                             [step.mask for _, step in asked])[0]  # [S, H]
                logits = model.logits(outputs)  # [S, V']
                start = 0
                for (r, _), n in zip(asked, counts, strict=True):
                    drafters[r].absorb(outputs[start: start + n], logits[start: start + n])
                    start += n
        finally:
            for (proposer, _), length in zip(rows, committed, strict=True):
                proposer.cache.crop(length)  # the guesses' keys go; the next step reads the target's features

    def _drafter(self, state: DecodeState, committed: int) -> ChainDrafter | TreeDrafter:
        """This row's drafting for this step: a chain, or EAGLE-2's dynamic tree (greedy decoding, or
        drafting=greedy, with tree_size > 0)."""
        k = min(self.config.num_tokens, state.max_draft_tokens)
        sampling = state.sampling
        sampled = sampling is not None and not sampling.greedy and self.config.drafting == "sample"
        if self.config.tree_size and state.batch_size == 1 and not sampled:
            width = min(self.config.tree_width, self.vocab_ids.numel())
            return TreeDrafter(state, k, width, self.config.tree_size, self._kept_per_depth(width), self.vocab_ids,
                               committed)
        return ChainDrafter(state, k, sampled, self.vocab_ids, self.target.vocab_size)

    def _kept_per_depth(self, width: int) -> int:
        """How many nodes of one depth `_tree` keeps: the `tree_size` that can be verified, and at least the
        `width` that are expanded."""
        return max(self.config.tree_size, width)

