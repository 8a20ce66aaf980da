"""Plain decoding through the speculative engine: the reference every proposer is compared against."""

from __future__ import annotations

from ..contracts import DecodeState, Draft, Proposer


class AutoregressiveProposer(Proposer):
    name = "autoregressive"
    description = "proposes nothing: plain decoding, one target forward per token"

    def propose(self, state: DecodeState) -> Draft:
        return Draft(tokens=state.tokens.new_empty(state.batch_size, 0))
