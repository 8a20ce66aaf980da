"""What `specdec bench` runs: a proposer through specdec's engine (`SpecdecRunner`) or transformers'
`generate` (`HFRunner`, the baselines), all on the one loaded model; `RunnerRecord` holds what a runner produced."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..check import TurnResult, decoder_generate_fn
from .plan import BenchPlan, proposer_of


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecdecRunner:
    """A proposer through specdec's engine."""

    kind = "specdec"

    def __init__(self, name: str, decoder: Any, draft_budget: int | None = None) -> None:
        self.name, self.decoder, self.draft_budget = name, decoder, draft_budget
        self.device = decoder.target.device

    @property
    def cache(self) -> str:
        return self.decoder.target.cache_name  # read when reported: a target may hand over (TargetModel.reset)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int | None) -> TurnResult:
        _sync(self.device)
        return decoder_generate_fn(self.decoder, max_new_tokens, temperature, seed, self.draft_budget)(prompt_ids)


class HFRunner:
    """transformers `generate` on the same model object, timed with perf_counter around the call."""

    kind = "hf"
    cache = None  # transformers' generate manages its own

    def __init__(self, name: str, model: Any, eos_token_ids: Iterable[int], pad_token_id: int | None,
                 assistant_model: Any = None) -> None:
        self.name, self.model, self.assistant_model = name, model, assistant_model
        self.eos = sorted(eos_token_ids)
        self.pad = pad_token_id if pad_token_id is not None else (self.eos[0] if self.eos else 0)
        self.device = model.get_input_embeddings().weight.device

    def generation_config(self, max_new_tokens: int, temperature: float) -> Any:
        from transformers import GenerationConfig

        # Every processor that would change greedy/sampled output is set to its neutral value explicitly:
        # unset (None) fields would be filled from the model's own generation_config.
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=temperature > 0, num_beams=1,
            repetition_penalty=1.0, no_repeat_ngram_size=0, eos_token_id=self.eos or None,
            pad_token_id=self.pad, use_cache=True)
        if temperature > 0:  # plain sampling at this temperature, as specdec's engine with top_k=0, top_p=1
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0, typical_p=1.0, min_p=0.0)
        if self.name == "hf-pld":
            kwargs["prompt_lookup_num_tokens"] = 10
        return GenerationConfig(**kwargs)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int | None) -> TurnResult:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        config = self.generation_config(max_new_tokens, temperature)
        extra = {"assistant_model": self.assistant_model} if self.assistant_model is not None else {}
        if seed is not None:
            torch.manual_seed(seed)
        _sync(self.device)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)
        _sync(self.device)
        seconds = time.perf_counter() - start
        generated = out[0, ids.shape[1]:].tolist()
        return TurnResult(prompt_ids=list(prompt_ids), token_ids=generated, seconds=seconds)


def build_runners(plan: BenchPlan, model: Any, tokenizer: Any) -> list[Any]:
    from ..api import SpeculativeDecoder, resolve_cache
    from ..plugins import get_proposer_class
    from ..target import TargetModel

    runners: list[Any] = []
    for name, config in plan.proposers.items():
        target = TargetModel(model, tokenizer, cache=resolve_cache(plan.caches.get(name, "auto")))
        proposer = get_proposer_class(proposer_of(name))(config, target)
        decoder = SpeculativeDecoder(target, proposer, verifier=plan.verifier)
        runners.append(SpecdecRunner(name, decoder, plan.draft_budget))
    if plan.baselines:
        eos = TargetModel(model, tokenizer).eos_token_ids
        pad = getattr(tokenizer, "pad_token_id", None)
        assistant = None
        if "hf-assisted" in plan.baselines:
            from .. import loading

            device = model.get_input_embeddings().weight.device
            assistant, _ = loading.load_model(plan.draft_model, next(model.parameters()).dtype, device)
        for name in plan.baselines:
            runners.append(HFRunner(name, model, eos, pad, assistant if name == "hf-assisted" else None))
    return runners


@dataclass
class RunnerRecord:
    """Everything one runner produced: per prompt, its turns."""

    name: str
    kind: str
    cache: str | None = None
    turns: list[list[TurnResult]] = field(default_factory=list)
    peak_rss: int = 0
    peak_gpu: int | None = None
