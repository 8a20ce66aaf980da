"""The decoding loop: propose, verify in one target forward, commit, roll back (DESIGN.md, data path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from . import tree
from .contracts import DecodeState, Draft, Proposer, Verdict, Verifier
from .errors import PluginError, SpecdecError
from .sampling import SamplingParams
from .target import TargetModel


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


class Engine:
    def __init__(self, target: TargetModel, proposer: Proposer, greedy_verifier: Verifier,
                 sampling_verifier: Verifier) -> None:
        self.target = target
        self.proposer = proposer
        self.greedy_verifier = greedy_verifier
        self.sampling_verifier = sampling_verifier

    def _check_draft(self, draft: Draft, state: DecodeState, verifier: Verifier) -> None:
        """A proposer may suggest anything, but only in the shape the contract allows."""
        name = f"Proposer {type(self.proposer).name!r} ({type(self.proposer).__module__})"
        tokens = draft.tokens
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] != state.batch_size:
            shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise PluginError(f"{name} returned draft tokens of shape {shape}; expected a LongTensor "
                              f"[{state.batch_size}, k].")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise PluginError(f"{name} returned draft tokens of dtype {tokens.dtype}; expected torch.long.")
        if draft.parents is not None:
            self._check_tree(name, draft, state, verifier)
        elif tokens.shape[1] > state.max_draft_tokens:
            raise PluginError(f"{name} proposed {tokens.shape[1]} tokens but at most {state.max_draft_tokens} "
                              "were allowed (state.max_draft_tokens).")
        vocab = self.target.vocab_size
        if tokens.numel() and bool(((tokens < 0) | (tokens >= vocab)).any()):
            raise PluginError(f"{name} proposed token ids outside the vocabulary [0, {vocab}).")
        if draft.probs is not None and tuple(draft.probs.shape) != (state.batch_size, tokens.shape[1], vocab):
            raise PluginError(f"{name} returned draft probs of shape {tuple(draft.probs.shape)}; expected "
                              f"[{state.batch_size}, {tokens.shape[1]}, {vocab}].")

    def _check_tree(self, name: str, draft: Draft, state: DecodeState, verifier: Verifier) -> None:
        parents = draft.parents
        if not isinstance(parents, list) or len(parents) != draft.num_tokens:
            raise PluginError(f"{name} returned a tree draft whose parents are not a list of {draft.num_tokens} "
                              "ints, one per draft token.")
        problem = tree.check_parents(parents)
        if problem is not None:
            raise PluginError(f"{name} returned a malformed tree draft: {problem}.")
        if draft.probs is not None:
            raise PluginError(f"{name} returned a tree draft with probs; tree drafts must be point masses "
                              "(leave Draft.probs None).")
        depth = max(tree.depths(parents), default=0)
        if depth > state.max_draft_tokens:
            raise PluginError(f"{name} proposed a tree {depth} tokens deep but at most {state.max_draft_tokens} "
                              "were allowed (state.max_draft_tokens).")
        if not self.target.can_retain:
            raise SpecdecError(f"{name} returned a tree draft, but the target's KV cache cannot keep a "
                               "tree's accepted path for this model (sliding-window attention); use a chain draft"
                               f"{_chain_hint(self.proposer)}.")
        if not verifier.supports_trees:  # a proposer that says so in drafts_trees() is refused before any work
            raise PluginError(f"{name} returned a tree draft but the verifier {type(verifier).name!r} takes "
                              "chains only, and the proposer's drafts_trees() did not say it would draft trees.")

    def verifier_for(self, sampling: SamplingParams) -> Verifier:
        """The verifier for this kind of decoding; one sentence, before any work, if it is not exact for it or
        cannot take the trees the proposer will draft."""
        verifier = self.greedy_verifier if sampling.greedy else self.sampling_verifier
        problem = type(verifier).inexact_for(sampling.greedy)
        if problem is not None:
            raise SpecdecError(problem)
        if not verifier.supports_trees and self.proposer.drafts_trees(sampling):
            raise SpecdecError(_chains_only(verifier, self.proposer))
        return verifier

    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingParams,
        seed: int | None = None,
        stop_strings: list[str] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> EngineResult:
        """Generate after `prompt_ids` [B, T]; returns the generated ids (the stop token included).

        Calls from several threads are serialised: a generation holds the target's lock (one per model
        object) from its prefill to its last step, since the KV cache, the proposer's draft state and the
        model's tap hooks belong to the sequence in progress. Input is checked before the lock is taken.
        """
        if prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
            raise SpecdecError("The prompt is empty; give at least one token of text.")
        if prompt_ids.shape[0] != 1:
            raise SpecdecError(f"Batch size {prompt_ids.shape[0]} is not supported yet; generate one prompt at a time.")
        if max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
        context = self.target.max_context
        prompt_length = int(prompt_ids.shape[1])
        if prompt_length >= context:
            raise SpecdecError(f"The prompt has {prompt_length} tokens but the model's context window is {context}; "
                               "shorten the prompt.")
        verifier = self.verifier_for(sampling)
        device = self.target.device
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        run = Generation(prompt_ids.to(device), min(max_new_tokens, context - prompt_length), sampling, generator,
                         StopChecker(self.target.eos_token_ids, stop_strings or [], self.target.tokenizer))
        with self.target.lock.hold():
            return self._run(run, verifier, on_tokens)

    def _run(self, run: Generation, verifier: Verifier, on_tokens: Callable[[list[int]], None] | None) -> EngineResult:
        start = time.perf_counter()
        self.proposer.reset()
        self.prefill(run, verifier)
        run.stats.prefill_seconds = time.perf_counter() - start  # the proposer's reset included
        if on_tokens is not None:
            on_tokens(list(run.generated))
        while not run.finished:
            new_tokens = self.step(run, verifier)
            if on_tokens is not None and new_tokens:
                on_tokens(new_tokens)
        if run.stop_reason == "max_new_tokens" and run.prompt_length + len(run.generated) >= self.target.max_context:
            run.stop_reason = "context"
        run.stats.num_generated_tokens = len(run.generated)
        run.stats.wall_seconds = time.perf_counter() - start
        return EngineResult(token_ids=run.generated, stats=run.stats, stop_reason=run.stop_reason)

    def prefill(self, run: Generation, verifier: Verifier) -> None:
        """The target reads the prompt; its logits give the first token (a step with an empty draft). Called
        by `generate` with the target's lock held, as is `step`."""
        out = self.target.prefill(run.committed())
        verdict = verifier.verify(out.logits, Draft(tokens=run.buffer.new_empty(1, 0)), run.sampling, run.generator)
        run.commit(verdict.emitted[0, :1])
        run.stats.num_target_forwards += 1
        if not run.finished:
            self.proposer.prefill(run.state(0), out)

    def step(self, run: Generation, verifier: Verifier) -> list[int]:
        """Propose, verify in one target forward, commit, roll the cache back; returns the committed tokens."""
        t0 = time.perf_counter()
        max_draft = run.max_new_tokens - len(run.generated) - 1
        current = run.state(max_draft)
        draft = self.proposer.propose(current) if max_draft > 0 else Draft(tokens=run.buffer.new_empty(1, 0))
        self._check_draft(draft, current, verifier)
        draft = _on_device(draft, run.buffer.device)
        t1 = time.perf_counter()
        length = run.length
        feed = torch.cat([run.buffer[:, length - 1: length], draft.tokens.to(run.buffer.dtype)], dim=1)
        parents = None if draft.parents is None or tree.is_chain(draft.parents) else draft.parents
        out = self.target.forward(feed, tree_parents=parents)
        verdict: Verdict = verifier.verify(out.logits, draft, run.sampling, run.generator)
        n = int(verdict.num_accepted[0])
        if parents is None:
            proposed = draft.num_tokens
            self.target.crop([length + n])
        else:  # keep the accepted path in the cache, and show the proposer the chain it became
            proposed = max(tree.depths(parents))
            assert verdict.path is not None, "tree verifiers return the accepted path"
            path = verdict.path[:, :n].to(run.buffer.device)
            self.target.retain([length], path)
            out = out.select(torch.cat([path.new_zeros(1), path[0] + 1]))
        run.stats.record_step(n, proposed)
        run.stats.propose_seconds += t1 - t0
        run.stats.verify_seconds += time.perf_counter() - t1
        new_tokens = run.commit(verdict.emitted[0, : n + 1])
        if not run.finished:
            t3 = time.perf_counter()
            self.proposer.observe(run.state(0), verdict, out)
            run.stats.propose_seconds += time.perf_counter() - t3
        return new_tokens


class Generation:
    """One sequence being generated: its committed tokens, what it has emitted, when it stops, its statistics."""

    def __init__(self, prompt_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
                 generator: torch.Generator, stops: StopChecker) -> None:
        self.prompt_length = int(prompt_ids.shape[1])
        self.max_new_tokens = max_new_tokens
        self.sampling, self.generator, self.stops = sampling, generator, stops
        self.buffer = torch.empty(1, self.prompt_length + max_new_tokens, dtype=torch.long,
                                  device=prompt_ids.device)  # [1, prompt + new]
        self.buffer[:, : self.prompt_length] = prompt_ids
        self.length = self.prompt_length
        self.generated: list[int] = []
        self.stats = GenerationStats()
        self.stop_reason = "max_new_tokens"
        self.stopped = False

    @property
    def finished(self) -> bool:
        return self.stopped or len(self.generated) >= self.max_new_tokens

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


def _chain_hint(proposer: Proposer) -> str:
    hint = type(proposer).chain_hint
    return f" ({hint})" if hint else ""


def _chains_only(verifier: Verifier, proposer: Proposer) -> str:
    return (f"The verifier {type(verifier).name!r} takes chains only but the proposer {type(proposer).name!r} "
            f"drafts trees; choose a verifier that takes trees, or a chain draft{_chain_hint(proposer)}.")


def _on_device(draft: Draft, device: torch.device) -> Draft:
    """The draft on the target's device: a proposer may well draft on the host (n-gram tables, a CPU draft)."""
    if draft.tokens.device == device and (draft.probs is None or draft.probs.device == device):
        return draft
    return replace(draft, tokens=draft.tokens.to(device),
                   probs=None if draft.probs is None else draft.probs.to(device))
