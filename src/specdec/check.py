"""The lossless regression check: speculative greedy output == plain greedy output, token for token.

`check_lossless(decoder, prompts)` decodes every prompt twice on the same target model, once with plain
(autoregressive) decoding and once with `decoder`'s proposer, and compares the generated ids. In float32
and float64 any difference is a failure. In bfloat16/float16 a k-token verification forward may round
differently from a 1-token forward, so a divergence passes only when it is a *certified near-tie*
(DESIGN.md, "Lossless means"): at the first divergent position, a full forward of a float32 copy of the
target over the common prefix gives logits whose gap between the two competing tokens,
|logit[plain] - logit[speculative]|, is below `epsilon` (default DEFAULT_EPSILON = 0.25). Nothing else is
ever tolerated, and float32/float64 runs (where bugs are caught) must match exactly.

The pieces are shared with `specdec bench`: prompt files (JSONL), multi-turn conversations (each decoder
answers turn 2 after its own answer to turn 1), and the divergence judge.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .engine import GenerationStats
from .errors import SpecdecError
from .jsonl import read_jsonl

#: a divergence in bfloat16/float16 is certified when the float32 logit gap of the two tokens is below this.
#: 0.25 is two bfloat16 rounding steps for logits of magnitude 16-32 (bf16 spacing there is 2**-3), where an
#: LLM's top logits typically sit: two tokens closer than that cannot be told apart by a bf16 forward pass.
#: On the embedded SmolLM2-135M, bf16 divergences measured gaps of 0.051, 0.074 and 0.187 while the same
#: prompts matched exactly in float32 (docs/bench.md).
DEFAULT_EPSILON = 0.25
#: dtypes in which speculative greedy decoding must be exact (no near-tie certification)
EXACT_DTYPES = (torch.float32, torch.float64)

#: the built-in prompt set of `specdec check`: short, varied (arithmetic, code, repetition, chat, a list)
DEFAULT_PROMPTS = (
    "A farmer has 17 sheep and buys 5 more, then sells 8. How many sheep does he have? Think step by step.",
    "Write a Python function `fib(n)` that returns the n-th Fibonacci number, with a docstring and a test.",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "What is the capital of France, and why is it famous? Answer in two sentences.",
    "List the days of the week, one per line, each followed by its number.",
)


@dataclass
class Prompt:
    """One prompt: user turns (a chat, the template applied) or pre-tokenized ids (fed as they are)."""

    id: str
    turns: list[str] = field(default_factory=list)
    ids: list[int] | None = None

    @property
    def label(self) -> str:
        if self.ids is not None:
            return f"{len(self.ids)} token ids"
        text = self.turns[0] if self.turns else ""
        return text if len(text) <= 60 else text[:57] + "..."


def as_prompt(item: Prompt | str | Sequence[int], index: int) -> Prompt:
    if isinstance(item, Prompt):
        return item
    if isinstance(item, str):
        return Prompt(id=str(index), turns=[item])
    ids = [int(i) for i in item]
    if not ids:
        raise SpecdecError(f"Prompt {index} has no token ids; give at least one.")
    return Prompt(id=str(index), ids=ids)


def read_prompts_jsonl(path: str | Path, paper_turns: bool = True) -> list[Prompt]:
    """Prompts from a JSONL file: one object a line with `turns` (list of user turns) or `prompt` (a string).

    `turns_dflash` (the DFlash paper's wording, see ../shared/datasets/README.md) replaces `turns` when
    present and `paper_turns` is true. Every line is validated; a bad one raises SpecdecError naming the
    file and line.
    """
    path = Path(path)
    prompts: list[Prompt] = []
    for where, record in read_jsonl(path, "Prompt file"):
        turns = record.get("turns_dflash") if paper_turns else None
        if turns is None:
            turns = record.get("turns")
        if turns is None and "prompt" in record:
            turns = [record["prompt"]]
        if turns is None:
            raise SpecdecError(f"{where} has neither `turns` nor `prompt`; give the user turns as "
                               '"turns": ["..."].')
        if (not isinstance(turns, list) or not turns
                or not all(isinstance(t, str) and t.strip() for t in turns)):
            raise SpecdecError(f"{where}: `turns` must be a non-empty list of non-empty strings.")
        prompts.append(Prompt(id=str(record.get("id", where.rpartition(" ")[2])), turns=list(turns)))
    if not prompts:
        raise SpecdecError(f"Prompt file {path} holds no prompts; write one JSON object per line.")
    return prompts


def encode_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A chat -> input ids, the generation prompt added; without a chat template the turns are joined."""
    if tokenizer is None:
        raise SpecdecError("Text prompts need a tokenizer; load the target with its tokenizer or pass token "
                           "ids.")
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = "\n\n".join(m["content"] for m in messages)
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


@dataclass
class TurnResult:
    """One generation: the ids fed, the ids generated (stop token included), its time and engine stats."""

    prompt_ids: list[int]
    token_ids: list[int]
    seconds: float = 0.0
    stats: GenerationStats | None = None


#: generate(prompt_ids) -> TurnResult
GenerateFn = Callable[[list[int]], TurnResult]


def run_prompt(generate: GenerateFn, tokenizer: Any, prompt: Prompt) -> list[TurnResult]:
    """Every turn of `prompt`; turn n+1 follows this decoder's own answer to turn n (MT-Bench style)."""
    if prompt.ids is not None:
        return [generate(list(prompt.ids))]
    messages: list[dict[str, str]] = []
    results: list[TurnResult] = []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        result = generate(encode_messages(tokenizer, messages))
        results.append(result)
        answer = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
    return results


def decoder_generate_fn(decoder: Any, max_new_tokens: int, temperature: float = 0.0,
                        seed: int | None = None, draft_budget: int | None = None) -> GenerateFn:
    """A GenerateFn over a SpeculativeDecoder (timed with perf_counter around the whole call); `draft_budget`
    as `SpeculativeDecoder.generate_ids` takes it (None: adaptive)."""

    def generate(prompt_ids: list[int]) -> TurnResult:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        start = time.perf_counter()
        out = decoder.generate_ids(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                   draft_budget=draft_budget)
        seconds = time.perf_counter() - start
        return TurnResult(prompt_ids=list(prompt_ids), token_ids=list(out.token_ids), seconds=seconds,
                          stats=out.stats)

    return generate


# -- divergences --------------------------------------------------------------------------------------------

@dataclass
class Divergence:
    """Where a candidate's output first differs from plain decoding.

    turn: 0-based turn; position: 0-based index into that turn's generated tokens; expected / got: the tokens
    there (None where that output had already ended); gap: |logit[expected] - logit[got]| and top2_gap: the
    gap between the two largest logits, both from a float32 full forward over the common prefix.
    """

    turn: int
    position: int
    expected: int | None
    got: int | None
    gap: float | None = None
    top2_gap: float | None = None
    certified: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "position": self.position, "expected": self.expected, "got": self.got,
                "gap": self.gap, "top2_gap": self.top2_gap, "certified": self.certified}


def first_divergence(reference: Sequence[TurnResult], candidate: Sequence[TurnResult]) -> Divergence | None:
    for turn, (ref, cand) in enumerate(zip(reference, candidate, strict=False)):
        a, b = ref.token_ids, cand.token_ids
        for position in range(max(len(a), len(b))):
            x = a[position] if position < len(a) else None
            y = b[position] if position < len(b) else None
            if x != y:
                return Divergence(turn=turn, position=position, expected=x, got=y)
    if len(reference) != len(candidate):
        turn = min(len(reference), len(candidate))
        return Divergence(turn=turn, position=0, expected=None, got=None)
    return None


class NearTieJudge:
    """Certifies divergences as near-ties of plain decoding (only in dtypes other than float32/float64).

    The float32 reference is the target itself when it already is float32/float64, else a float32 copy made
    on the first divergence (it costs the weights' memory again in float32, once).
    """

    def __init__(self, model: torch.nn.Module, epsilon: float = DEFAULT_EPSILON) -> None:
        if not (math.isfinite(epsilon) and epsilon > 0):  # inf would certify every divergence
            raise SpecdecError(f"epsilon must be a positive finite number, got {epsilon}.")
        self.model = model
        self.epsilon = float(epsilon)
        self.dtype = next(model.parameters()).dtype
        self._reference: torch.nn.Module | None = None

    @property
    def exact(self) -> bool:
        """True when no divergence can be certified (float32/float64: speculative decoding must be exact)."""
        return self.dtype in EXACT_DTYPES

    def reference(self) -> torch.nn.Module:
        if self._reference is None:
            self._reference = self.model if self.exact else copy.deepcopy(self.model).float().eval()
        return self._reference

    @torch.inference_mode()
    def judge(self, divergence: Divergence, prefix_ids: list[int]) -> Divergence:
        """Fill in the float32 gaps at `divergence` (prefix_ids: the prompt + common generated prefix)."""
        if divergence.expected is None or divergence.got is None:
            return divergence  # one output ended early: not a near-tie of anything
        model = self.reference()
        device = next(model.parameters()).device
        logits = model(input_ids=torch.tensor([prefix_ids], device=device)).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        divergence.gap = abs(float(logits[divergence.expected] - logits[divergence.got]))
        divergence.top2_gap = float(top2[0] - top2[1])
        divergence.certified = not self.exact and divergence.gap < self.epsilon
        return divergence

    def compare(self, reference: Sequence[TurnResult], candidate: Sequence[TurnResult]) -> Divergence | None:
        divergence = first_divergence(reference, candidate)
        if divergence is None or divergence.turn >= len(reference):
            return divergence
        ref = reference[divergence.turn]
        return self.judge(divergence, ref.prompt_ids + ref.token_ids[: divergence.position])


def match_status(divergence: Divergence | None) -> str:
    """"exact", "near_tie" (a certified divergence) or "mismatch"."""
    if divergence is None:
        return "exact"
    return "near_tie" if divergence.certified else "mismatch"


# -- the check ----------------------------------------------------------------------------------------------

@dataclass
class PromptCheck:
    index: int
    prompt: Prompt
    reference: list[TurnResult]
    candidate: list[TurnResult]
    divergence: Divergence | None

    @property
    def status(self) -> str:
        return match_status(self.divergence)


@dataclass
class CheckReport:
    proposer: str
    dtype: str
    epsilon: float
    max_new_tokens: int
    results: list[PromptCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.status != "mismatch" for r in self.results)

    @property
    def failures(self) -> list[PromptCheck]:
        return [r for r in self.results if r.status == "mismatch"]

    @property
    def mean_acceptance_length(self) -> float:
        steps = [n for r in self.results for t in r.candidate if t.stats for n in t.stats.acceptance_lengths]
        return sum(steps) / len(steps) if steps else 0.0

    def describe(self, result: PromptCheck, tokenizer: Any = None) -> str:
        """One line for a prompt: ok, certified near-tie, or where and how it diverged."""
        head = f"prompt {result.index} ({result.prompt.label!r})"
        d = result.divergence
        if d is None:
            return f"ok    {head}: identical, {sum(len(t.token_ids) for t in result.candidate)} tokens"
        turn = f" of turn {d.turn + 1}" if len(result.reference) > 1 else ""
        where = f"first divergence at generated token {d.position}{turn}"
        if d.expected is None or d.got is None:
            what = ("plain decoding stopped there" if d.expected is None else
                    f"{self.proposer} stopped there but plain decoding gave {_token(d.expected, tokenizer)}")
            return f"FAIL  {head}: {where}: {what}."
        what = (f"plain decoding gave {_token(d.expected, tokenizer)}, {self.proposer} gave "
                f"{_token(d.got, tokenizer)}; float32 logit gap {d.gap:.4g}")
        if d.certified:
            return (f"tie   {head}: {where}: {what} < epsilon {self.epsilon} (certified {self.dtype} "
                    "near-tie).")
        rule = ("any divergence fails in " + self.dtype) if self.dtype in ("float32", "float64") else \
            f"not below epsilon {self.epsilon}"
        return f"FAIL  {head}: {where}: {what} ({rule})."

    def to_dict(self) -> dict[str, Any]:
        return {
            "proposer": self.proposer, "dtype": self.dtype, "epsilon": self.epsilon,
            "max_new_tokens": self.max_new_tokens, "passed": self.passed,
            "mean_acceptance_length": self.mean_acceptance_length,
            "prompts": [{"index": r.index, "id": r.prompt.id, "status": r.status,
                         "divergence": r.divergence.to_dict() if r.divergence else None,
                         "num_tokens": sum(len(t.token_ids) for t in r.candidate)} for r in self.results],
        }


def _token(token_id: int, tokenizer: Any) -> str:
    if tokenizer is None:
        return f"id {token_id}"
    return f"id {token_id} ({tokenizer.decode([token_id])!r})"


def check_lossless(
    decoder: Any,
    prompts: Iterable[Prompt | str | Sequence[int]] | None = None,
    max_new_tokens: int = 64,
    epsilon: float = DEFAULT_EPSILON,
    reference: Any = None,
    on_result: Callable[[CheckReport, PromptCheck], None] | None = None,
) -> CheckReport:
    """Greedy-decode every prompt with `decoder` (a SpeculativeDecoder) and with plain decoding; compare.

    prompts: strings (one user turn, chat template applied), lists of token ids (fed as they are) or
    `Prompt`s (multi-turn); None = DEFAULT_PROMPTS. reference: the plain decoder (default: the autoregressive
    proposer on the same transformers model object). on_result(report, result) is called after each prompt.
    Returns a CheckReport; `report.passed` is the verdict.
    """
    from .api import SpeculativeDecoder

    if max_new_tokens < 1:
        raise SpecdecError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    items = [as_prompt(p, i) for i, p in enumerate(DEFAULT_PROMPTS if prompts is None else prompts)]
    if not items:
        raise SpecdecError("No prompts to check; give at least one.")
    target = decoder.target
    if reference is None:
        reference = SpeculativeDecoder.from_model(target.model, target.tokenizer, proposer="autoregressive")
    judge = NearTieJudge(target.model, epsilon)
    dtype = str(judge.dtype).removeprefix("torch.")
    report = CheckReport(proposer=type(decoder.proposer).name or type(decoder.proposer).__name__, dtype=dtype,
                         epsilon=judge.epsilon, max_new_tokens=max_new_tokens)
    plain = decoder_generate_fn(reference, max_new_tokens)
    speculative = decoder_generate_fn(decoder, max_new_tokens)
    for index, prompt in enumerate(items):
        expected = run_prompt(plain, target.tokenizer, prompt)
        got = run_prompt(speculative, target.tokenizer, prompt)
        result = PromptCheck(index=index, prompt=prompt, reference=expected, candidate=got,
                             divergence=judge.compare(expected, got))
        report.results.append(result)
        if on_result is not None:
            on_result(report, result)
    return report
