"""One sequence being generated (a row of the engine's batch): its tokens, when it stops, its statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .contracts import DecodeState, Proposer, Verifier
from .errors import SpecdecError
from .sampling import SamplingParams


@dataclass
class GenerationStats:
    num_generated_tokens: int = 0
    num_target_forwards: int = 0
    #: tokens committed by each verification step (accepted draft tokens + 1); plain decoding gives 1s
    acceptance_lengths: list[int] = field(default_factory=list)
    #: per draft position j: how many steps proposed a token there, and how many accepted it
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0

    def record_step(self, num_accepted: int, num_proposed: int) -> None:
        """One verification step: `num_proposed` draft positions (a tree's depth), the first `num_accepted`
        of them accepted."""
        self.num_target_forwards += 1
        self.acceptance_lengths.append(num_accepted + 1)
        while len(self.proposed_per_position) < num_proposed:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(num_proposed):
            self.proposed_per_position[j] += 1
            self.accepted_per_position[j] += int(j < num_accepted)

    @property
    def mean_acceptance_length(self) -> float:
        steps = self.acceptance_lengths
        return sum(steps) / len(steps) if steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.wall_seconds - self.prefill_seconds - self.propose_seconds - self.verify_seconds)

    def to_dict(self) -> dict:
        return {
            "num_generated_tokens": self.num_generated_tokens,
            "num_target_forwards": self.num_target_forwards,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_lengths": list(self.acceptance_lengths),
            "tokens_per_second": self.tokens_per_second,
            "wall_seconds": self.wall_seconds,
            "proposed_per_position": list(self.proposed_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "prefill_seconds": self.prefill_seconds,
            "propose_seconds": self.propose_seconds,
            "verify_seconds": self.verify_seconds,
            "other_seconds": self.other_seconds,
        }


@dataclass
class EngineResult:
    token_ids: list[int]
    stats: GenerationStats
    stop_reason: str  # "eos" | "stop_string" | "max_new_tokens" | "context"


class StopChecker:
    """Finds the first newly emitted token that ends generation: an EOS id or the completion of a stop string."""

    def __init__(self, eos_token_ids: set[int], stop_strings: list[str], tokenizer) -> None:
        self.eos = eos_token_ids
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise SpecdecError("Stop strings need a tokenizer to decode text; load the target with its tokenizer.")
        self.tokenizer = tokenizer
        # enough tokens of left context that a stop string is never cut at the window's edge
        self._window = max((len(s) for s in self.stop_strings), default=0) + 8

    def first_stop(self, generated: list[int], num_new: int) -> tuple[int, str] | None:
        """Index into `generated` of the token that stops generation among the last `num_new`, and why."""
        start = len(generated) - num_new
        for i in range(start, len(generated)):
            if generated[i] in self.eos:
                return i, "eos"
            if self.stop_strings:
                text = self.tokenizer.decode(generated[max(0, i + 1 - self._window - num_new): i + 1])
                if any(s in text for s in self.stop_strings):
                    return i, "stop_string"
        return None


class Row:
    """One sequence in the batch: its committed tokens, what it has emitted, when it stops, its statistics,
    and the proposer that drafts for it. `index` is its place among the prompts of the call."""

    def __init__(self, index: int, prompt_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
                 generator: torch.Generator, stops: StopChecker) -> None:
        self.index = index
        self.prompt_length = int(prompt_ids.shape[0])
        self.max_new_tokens = max_new_tokens
        self.sampling, self.generator, self.stops = sampling, generator, stops
        self.buffer = torch.empty(1, self.prompt_length + max_new_tokens, dtype=torch.long,
                                  device=prompt_ids.device)  # [1, prompt + new]
        self.buffer[0, : self.prompt_length] = prompt_ids
        self.length = self.prompt_length
        self.generated: list[int] = []
        self.stats = GenerationStats()
        self.stop_reason = "max_new_tokens"
        self.stopped = False
        self.proposer: Proposer | None = None  # while the row is in the batch
        self.verifier: Verifier | None = None  # set by Engine.make_row for the row's kind of decoding
        self.joined_at = 0.0

    @property
    def prompt_ids(self) -> torch.Tensor:
        """The prompt's ids [T] (the buffer's first prompt_length)."""
        return self.buffer[0, : self.prompt_length]

    @property
    def finished(self) -> bool:
        return self.stopped or len(self.generated) >= self.max_new_tokens

    @property
    def draft_budget(self) -> int:
        """The most draft tokens this row may verify now: one verified step always adds a token of the target's
        own, so a draft of more than the tokens still wanted could only be cut."""
        return self.max_new_tokens - len(self.generated) - 1

    def committed(self) -> torch.Tensor:
        return self.buffer[:, : self.length]

    def state(self, max_draft: int) -> DecodeState:
        return DecodeState(tokens=self.committed(), max_draft_tokens=max_draft, prompt_length=self.prompt_length,
                           sampling=self.sampling, generator=self.generator, lengths=[self.length])

    def commit(self, verified: torch.Tensor) -> list[int]:
        """Append the verified tokens [n], cut at the first that ends generation; returns those kept for output.
        The buffer keeps every verified token: the target's cache holds them all."""
        tokens = verified.tolist()
        self.buffer[0, self.length: self.length + len(tokens)] = verified
        self.length += len(tokens)
        self.generated.extend(tokens)
        stopped = self.stops.first_stop(self.generated, len(tokens))
        if stopped is None:
            return tokens
        cut = stopped[0] + 1
        dropped = len(self.generated) - cut
        del self.generated[cut:]
        self.stop_reason, self.stopped = stopped[1], True
        return tokens[: len(tokens) - dropped]

    def result(self, max_context: int) -> EngineResult:
        if self.stop_reason == "max_new_tokens" and self.prompt_length + len(self.generated) >= max_context:
            self.stop_reason = "context"
        self.stats.num_generated_tokens = len(self.generated)
        return EngineResult(token_ids=self.generated, stats=self.stats, stop_reason=self.stop_reason)
