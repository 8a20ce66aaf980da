"""The Python API: `SpeculativeDecoder.from_pretrained(...).generate(...)`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError

from . import loading
from .contracts import KVCache, Proposer, ProposerConfig, Verifier
from .detokenize import StreamingText
from .engine import Engine, GenerationStats
from .errors import SpecdecError
from .plugins import get_cache_class, get_proposer_class, get_registry, get_verifier_class
from .sampling import SamplingParams
from .target import TargetModel

#: the verifiers used when none is named: greedy decoding, and sampling (temperature > 0)
DEFAULT_VERIFIERS = ("greedy", "rejection")


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    stop_reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict(),
                "stop_reason": self.stop_reason}


def default_candidates(model: str | None) -> list[str]:
    """Proposers that need no options for `model` (None: the embedded default), highest `default_priority`
    first (ties by name)."""
    proposers = get_registry().proposers
    ready = [name for name, cls in proposers.items() if cls.default_for(model)]
    return sorted(ready, key=lambda name: (-proposers[name].default_priority, name))


def default_proposer(model: str | None) -> str:
    """The proposer used when none is named: the first of `default_candidates`, else plain decoding."""
    return next(iter(default_candidates(model)), "autoregressive")


def check_verifier(name: str, sampling: SamplingParams | None = None) -> type[Verifier]:
    """The named verifier's class, if it is exact for this kind of decoding; one sentence otherwise."""
    cls = get_verifier_class(name)
    problem = None if sampling is None else cls.inexact_for(sampling.greedy)
    if problem is not None:
        raise SpecdecError(problem)
    return cls


def resolve_cache(cache: str) -> str | type[KVCache]:
    """A --cache value as TargetModel takes it: "auto", or the registered cache class of that name."""
    return cache if cache == "auto" else get_cache_class(cache)


def format_validation_error(proposer: str, exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(part) for part in err["loc"]) or "options"
    if err["type"] == "extra_forbidden":
        cls = get_proposer_class(proposer)
        known = ", ".join(cls.Config.model_fields) or "none"
        return f"Unknown option {key!r} for proposer {proposer!r}; its options are: {known}."
    if err["type"] == "missing":
        return f"Proposer {proposer!r} needs the option {key!r}; pass it with --opt {key}=VALUE."
    return f"Invalid option {key!r} for proposer {proposer!r}: {err['msg']}."


def build_proposer_config(proposer: str, options: Mapping[str, Any]) -> ProposerConfig:
    """Validate options against the proposer's Config before any model is loaded."""
    cls = get_proposer_class(proposer)
    try:
        return cls.Config.model_validate(dict(options))
    except ValidationError as exc:
        raise SpecdecError(format_validation_error(proposer, exc)) from None


def validate_generation_args(prompt: str, max_new_tokens: int, where: str = "The prompt") -> None:
    if not isinstance(prompt, str):
        raise SpecdecError(f"{where} must be a string, got {type(prompt).__name__}; pass text, or token ids to "
                           "generate_ids().")
    if not prompt or not prompt.strip():
        raise SpecdecError(f"{where} is empty; give the text to continue.")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a command-line byte that is not UTF-8 arrives as a lone surrogate
        bad = prompt[exc.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"{bad!r}"
        raise SpecdecError(f"{where} is not valid UTF-8 ({byte} at character {exc.start}); give the text in "
                           "UTF-8.") from None
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpecdecError(f"--max-new-tokens must be at least 1, got {max_new_tokens!r}.")


def validate_prompts(prompts: Any, max_new_tokens: int) -> list[str]:
    """A list of prompts, each checked (the first bad one named by its index) before any work."""
    if isinstance(prompts, str):
        validate_generation_args(prompts, max_new_tokens)
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise SpecdecError(f"The prompt must be a string or a list of strings, got {type(prompts).__name__}.")
    if not prompts:
        raise SpecdecError("The list of prompts is empty; give at least one prompt.")
    for i, prompt in enumerate(prompts):
        validate_generation_args(prompt, max_new_tokens, where=f"Prompt {i}")
    return list(prompts)


class SpeculativeDecoder:
    """A target model, a proposer and the engine that runs them losslessly."""

    def __init__(self, target: TargetModel, proposer: Proposer, verifier: str | None = None) -> None:
        """`verifier`: a registered verifier's name for every generation (it must be exact for the decoding
        asked for); None: greedy for temperature 0, rejection sampling otherwise."""
        self.target = target
        self.proposer = proposer
        if verifier is None:
            greedy, sampled = (get_verifier_class(name)() for name in DEFAULT_VERIFIERS)
        else:
            greedy = sampled = check_verifier(verifier)()
        self.engine = Engine(target, proposer, greedy, sampled)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        proposer: str | None = None,
        dtype: str | torch.dtype = "auto",
        draft: str | None = None,
        device: str | torch.device | None = None,
        cache: str = "auto",
        verifier: str | None = None,
        **proposer_options: Any,
    ) -> SpeculativeDecoder:
        """Load a target (None: the embedded SmolLM2-135M-Instruct) and build a proposer for it.

        `draft` is the proposer's draft checkpoint (its `draft` option); other keyword arguments are
        validated against the proposer's Config, and the cache and verifier names checked, before anything
        is loaded.
        """
        name = proposer or default_proposer(model)
        options = dict(proposer_options)
        if draft is not None:
            options["draft"] = draft
        config = build_proposer_config(name, options)
        cache_choice = resolve_cache(cache)  # an unknown name fails here, before the model loads
        if verifier is not None:
            check_verifier(verifier)
        torch_device = loading.resolve_device(device)
        torch_dtype = loading.resolve_dtype(dtype, torch_device)
        hf_model, tokenizer = loading.load_model(model, torch_dtype, torch_device)
        target = TargetModel(hf_model, tokenizer, cache=cache_choice)
        return cls(target, get_proposer_class(name)(config, target), verifier=verifier)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any = None, proposer: str = "autoregressive",
                   cache: str = "auto", verifier: str | None = None,
                   **proposer_options: Any) -> SpeculativeDecoder:
        """Wrap an already loaded transformers model (tests and notebooks)."""
        config = build_proposer_config(proposer, proposer_options)
        if verifier is not None:
            check_verifier(verifier)
        target = TargetModel(model, tokenizer, cache=resolve_cache(cache))
        return cls(target, get_proposer_class(proposer)(config, target), verifier=verifier)

    def encode_prompt(self, prompt: str, raw: bool = False) -> torch.Tensor:
        """A user message -> input ids [1, T]; the chat template is applied when the tokenizer has one."""
        tokenizer = self.target.tokenizer
        if tokenizer is None:
            raise SpecdecError("This decoder has no tokenizer; call generate_ids with token ids instead.")
        if not raw and getattr(tokenizer, "chat_template", None):
            ids = self.encode_chat([{"role": "user", "content": prompt}])
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long, device=self.target.device)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation ([{"role": ..., "content": ...}], ending with the user's turn) -> the ids the model
        continues with the assistant's reply, by the tokenizer's chat template."""
        tokenizer = self.target.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise SpecdecError("This model's tokenizer has no chat template; send the text as a plain prompt "
                               "(/v1/completions, or raw=True).")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return list(ids)

    def generate(
        self,
        prompt: str | list[str],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        raw: bool = False,
        on_text: Callable[..., None] | None = None,
        batch_size: int | None = None,
        draft_budget: int | None = None,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Continue one prompt (a string: one output) or several (a list: one output per prompt, in order).

        Several prompts decode as a batch of at most `batch_size` rows (None: see Engine.generate_batch), each
        with exactly the output it would have alone: greedy output token for token, and sampled output with
        the same `seed` the same draw. `on_text(text)` streams one prompt's text; with a list it is called as
        `on_text(index, text)`. `draft_budget` pins the draft tokens a row verifies per step (None: adaptive
        for batches, see specdec.budget)."""
        prompts = validate_prompts(prompt, max_new_tokens)
        ids = [self.encode_prompt(p, raw=raw)[0] for p in prompts]
        if isinstance(prompt, str):
            return self.generate_ids(ids[0].unsqueeze(0), max_new_tokens, temperature, top_k, top_p, seed, stop,
                                     on_text, draft_budget=draft_budget)
        return self.generate_ids(ids, max_new_tokens, temperature, top_k, top_p, seed, stop, on_text,
                                 batch_size=batch_size, draft_budget=draft_budget)

    def generate_ids(
        self,
        input_ids: torch.Tensor | list[int] | list[list[int]] | list[torch.Tensor],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        on_text: Callable[..., None] | None = None,
        batch_size: int | None = None,
        draft_budget: int | None = None,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Continue token ids: one prompt ([1, T] or a list of ints: one output) or several (a list of id lists
        or 1-D tensors, or [B, T] with B > 1: one output per prompt, in order)."""
        many = _as_prompt_list(input_ids)
        stop = as_stop_strings(stop)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        tokenizer = self.target.tokenizer
        if many is None:
            ids = torch.as_tensor(input_ids, dtype=torch.long)
            ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
            streamer = _TextStreamer(tokenizer, on_text) if on_text is not None and tokenizer is not None else None
            result = self.engine.generate(ids.to(self.target.device), max_new_tokens, sampling, seed=seed,
                                          stop_strings=stop, on_tokens=streamer, draft_budget=draft_budget)
            return self._output(result)
        streams: dict[int, _TextStreamer] = {}

        def on_tokens(index: int, tokens: list[int]) -> None:
            if index not in streams:
                streams[index] = _TextStreamer(tokenizer, lambda text: on_text(index, text))  # type: ignore[misc]
            streams[index](tokens)

        callback = on_tokens if on_text is not None and tokenizer is not None else None
        results = self.engine.generate_batch(many, max_new_tokens, sampling, seeds=[seed] * len(many),
                                             stop_strings=stop, batch_size=batch_size, on_tokens=callback,
                                             draft_budget=draft_budget)
        return [self._output(result) for result in results]

    def _output(self, result: Any) -> GenerationOutput:
        tokenizer = self.target.tokenizer
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True) if tokenizer is not None else ""
        return GenerationOutput(text=text, token_ids=result.token_ids, stats=result.stats,
                                stop_reason=result.stop_reason)


def _as_prompt_list(input_ids: Any) -> list[torch.Tensor] | None:
    """Several prompts as 1-D tensors, or None for one prompt ([1, T], [T] or a list of ints)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] > 1:
            return list(input_ids)
        return None
    if isinstance(input_ids, (list, tuple)) and input_ids and all(
            isinstance(p, (list, tuple, torch.Tensor)) for p in input_ids):
        return [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in input_ids]
    if isinstance(input_ids, (list, tuple)) and not input_ids:
        raise SpecdecError("No prompts were given; pass token ids, or a list of token-id lists.")
    return None


def as_stop_strings(stop: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """`stop` as a list of stop strings: one string given alone is one stop string, not its characters."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    stops = list(stop)
    for item in stops:
        if not isinstance(item, str):
            raise SpecdecError(f"Each stop string must be a string, got {type(item).__name__} {item!r}; pass "
                               "stop=\"text\" or stop=[\"a\", \"b\"].")
    return stops


class _TextStreamer:
    """Turns committed token ids into new text for on_text (incrementally: specdec.detokenize.StreamingText)."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None]) -> None:
        self.text, self.on_text = StreamingText(tokenizer), on_text

    def __call__(self, new_ids: list[int]) -> None:
        piece = self.text.push(new_ids)
        if piece:
            self.on_text(piece)
