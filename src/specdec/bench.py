"""`specdec bench`: acceptance, speed and losslessness of proposers on a dataset, side by side in one process.

How it measures (DESIGN.md, "Measuring performance"): the target loads once; every proposer gets its own
`TargetModel` adapter over that same transformers model object, and the external baselines call
`model.generate` on it too. Each runner does one warm-up generation, then the runs are interleaved per
prompt (for each prompt every runner in turn, the starting runner rotating from prompt to prompt) so machine
drift hits all alike. `autoregressive` always runs: it is the reference for speedup and exact match.
Speedups are medians of paired per-prompt tokens/s ratios, with the interquartile range.

Multi-turn records (MT-Bench) are chats: each runner answers turn 2 after its own answer to turn 1.

results.json (schema_version 1; keys are only ever added):

    {"schema_version": 1,
     "meta": {"command", "dataset": {"name", "path", "num_prompts", "num_turns"}, "limit", "max_new_tokens",
              "temperature", "seed", "dtype", "device", "model", "draft", "draft_model", "epsilon",
              "proposer_options", "caches", "baselines", "versions": {"python", "torch", "transformers", "specdec"},
              "platform", "accelerator", "torch_threads", "timestamp", "wall_seconds", "interrupted",
              "peak_rss_mb"},
     "proposers": {NAME: {
         "kind": "specdec" | "hf", "cache": KV cache of a specdec runner ("native", "dynamic", ...) | null,
         "num_prompts", "num_generated_tokens", "seconds",
         "mean_acceptance_length": float | null (hf baselines),
         "acceptance_length_histogram": {"1": steps, "2": steps, ...} | null,
         "acceptance_rate_per_position": [accepted/proposed at draft position 1, 2, ...] | null,
         "tokens_per_second": {"median", "mean"},
         "speedup": {"vs_autoregressive": {"median", "q25", "q75"} | null, "vs_hf_greedy": {...} | null,
                     "vs_hf_pld": {...} | null},
         "exact_match_rate": float | null (sampling),
         "matches": {"exact", "near_tie", "mismatch"} | null,
         "divergences": [{"prompt", "turn", "position", "expected", "got", "gap", "top2_gap", "certified"}],
         "peak_rss_mb", "peak_gpu_memory_mb" | null,
         "time_split_seconds": {"prefill", "propose", "verify", "other"} | null}},
     "per_prompt": [{"id", "runs": {NAME: {"tokens", "seconds", "tokens_per_second",
                                          "mean_acceptance_length", "match"}}}]}

Exact match compares every runner's generated ids with `autoregressive`'s. A divergence counts as a
"near_tie" only in bfloat16/float16 and only when the float32 logit gap of the two tokens at the first
divergent position is below epsilon (specdec.check.DEFAULT_EPSILON = 0.25); see specdec.check.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from .check import (
    DEFAULT_EPSILON,
    NearTieJudge,
    Prompt,
    TurnResult,
    decoder_generate_fn,
    match_status,
    read_prompts_jsonl,
    run_prompt,
)
from .contracts import ProposerConfig
from .errors import SpecdecError

SCHEMA_VERSION = 1
REFERENCE = "autoregressive"
HF_GREEDY = "hf-greedy"
HF_PLD = "hf-pld"
BASELINES = {
    "hf-greedy": "transformers generate(do_sample=False)",
    "hf-pld": "transformers generate with prompt_lookup_num_tokens=10",
    "hf-assisted": "transformers generate with assistant_model (needs --draft-model)",
}
ENV_DATA_DIR = "SPECDEC_DATA_DIR"
DEFAULT_DATA_DIR = Path("..") / "shared" / "datasets"
WARMUP_TOKENS = 32


# -- datasets -----------------------------------------------------------------------------------------------

def dataset_search_path(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where a dataset NAME is looked up, in order: --data-dir, $SPECDEC_DATA_DIR, ../shared/datasets."""
    path = [Path(p) for p in (data_dir, os.environ.get(ENV_DATA_DIR)) if p]
    return path + [DEFAULT_DATA_DIR]


def known_datasets(data_dir: str | os.PathLike | None = None) -> list[str]:
    names: set[str] = set()
    for folder in dataset_search_path(data_dir):
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.jsonl"))
    return sorted(names)


def resolve_dataset(name_or_path: str, data_dir: str | os.PathLike | None = None) -> Path:
    """A JSONL path as given, or NAME -> NAME.jsonl in the first folder of the search path that has it."""
    if not name_or_path or not name_or_path.strip():
        raise SpecdecError("--dataset is empty; give a dataset name (e.g. gsm8k) or a JSONL path.")
    as_path = Path(name_or_path)
    if as_path.suffix == ".jsonl" or os.sep in name_or_path or as_path.is_file():
        if not as_path.is_file():
            raise SpecdecError(f"Dataset file {name_or_path} does not exist; check the path.")
        return as_path
    for folder in dataset_search_path(data_dir):
        candidate = folder / f"{name_or_path}.jsonl"
        if candidate.is_file():
            return candidate
    known = ", ".join(known_datasets(data_dir)) or "none"
    where = ", ".join(str(p) for p in dataset_search_path(data_dir))
    raise SpecdecError(f"Unknown dataset {name_or_path!r}; known datasets: {known} (searched {where}; "
                       f"set --data-dir or ${ENV_DATA_DIR}, or pass a JSONL path).")


def load_dataset(name_or_path: str, data_dir: str | os.PathLike | None = None,
                 limit: int | None = None) -> tuple[Path, list[Prompt]]:
    """(path, prompts): every line is validated; the first `limit` prompts are kept."""
    if limit is not None and limit < 1:
        raise SpecdecError(f"--limit must be at least 1, got {limit}; leave it out to run every prompt.")
    path = resolve_dataset(name_or_path, data_dir)
    prompts = read_prompts_jsonl(path, prefer_dflash=True)
    return path, prompts[:limit] if limit is not None else prompts


# -- runner lists and options -------------------------------------------------------------------------------

def split_names(text: str | None) -> list[str]:
    names: list[str] = []
    for part in (text or "").split(","):
        part = part.strip()
        if part and part not in names:
            names.append(part)
    return names


def proposer_of(runner: str) -> str:
    """A runner is a registered proposer name, or NAME:LABEL for another configuration of that proposer."""
    return runner.partition(":")[0]


def parse_proposers(text: str | None) -> list[str]:
    """Runner names (proposers, or NAME:LABEL variants), `autoregressive` first (it always runs: it is the
    reference)."""
    from .plugins import get_registry

    known = get_registry().proposers
    names = split_names(text)
    if not names:
        raise SpecdecError("--proposers is empty; give a comma-separated list such as autoregressive,ngram.")
    for runner in names:
        name, colon, label = runner.partition(":")
        if colon and not label:
            raise SpecdecError(f"Runner {runner!r} in --proposers has an empty label; write NAME:LABEL, e.g. "
                               "dflash:lookup, and set its options with --opt dflash:lookup.key=value.")
        if name not in known:
            hint = f" ({name} is a baseline: pass it with --baselines)" if name in BASELINES else ""
            raise SpecdecError(f"Unknown proposer {name!r} in --proposers{hint}; choose from: "
                               f"{', '.join(sorted(known))}.")
    return [REFERENCE] + [n for n in names if n != REFERENCE]


def parse_baselines(text: str | None, draft_model: str | None) -> list[str]:
    names = [n for n in split_names(text) if n.lower() != "none"]
    for name in names:
        if name not in BASELINES:
            raise SpecdecError(f"Unknown baseline {name!r} in --baselines; choose from: "
                               f"{', '.join(BASELINES)} (or none).")
    if "hf-assisted" in names and not draft_model:
        raise SpecdecError("The hf-assisted baseline needs a small causal LM as assistant; pass "
                           "--draft-model PATH.")
    return names


def parse_proposer_options(pairs: Iterable[str], proposers: Sequence[str],
                           draft: str | None = None) -> dict[str, ProposerConfig]:
    """`--opt NAME.key=value` pairs (and --draft for each proposer with a `draft` option) -> configs."""
    from .api import build_proposer_config
    from .plugins import get_proposer_class

    raw: dict[str, dict[str, Any]] = {name: {} for name in proposers}
    for name in proposers:
        if draft is not None and "draft" in get_proposer_class(proposer_of(name)).Config.model_fields:
            raw[name]["draft"] = draft
    for pair in pairs:
        key, sep, value = pair.partition("=")
        name, dot, option = key.strip().partition(".")
        if not sep or not dot or not name or not option:
            raise SpecdecError(f"--opt {pair!r} is not of the form PROPOSER.key=value; write e.g. "
                               "--opt ngram.num_tokens=8.")
        if name not in raw:
            raise SpecdecError(f"--opt {pair!r} names proposer {name!r}, which is not in --proposers "
                               f"({', '.join(proposers)}).")
        raw[name][option] = value
    return {name: build_proposer_config(proposer_of(name), options) for name, options in raw.items()}


def parse_caches(pairs: Iterable[str], runners: Sequence[str]) -> dict[str, str]:
    """`--cache RUNNER=NAME` pairs -> {runner: cache}; runners not named use "auto"."""
    from .plugins import get_registry

    known = ["auto", *sorted(get_registry().caches)]
    caches: dict[str, str] = {}
    for pair in pairs:
        runner, sep, name = (part.strip() for part in pair.partition("="))
        if not sep or not runner or not name:
            raise SpecdecError(f"--cache {pair!r} is not of the form RUNNER=CACHE; write e.g. "
                               "--cache autoregressive:hf=dynamic.")
        if runner not in runners:
            raise SpecdecError(f"--cache {pair!r} names runner {runner!r}, which is not in --proposers "
                               f"({', '.join(runners)}).")
        if name not in known:
            raise SpecdecError(f"--cache {pair!r}: unknown cache {name!r}; choose one of {', '.join(known)}.")
        caches[runner] = name
    return caches


@dataclass
class BenchPlan:
    """Everything `specdec bench` needs, validated; nothing loaded yet."""

    dataset: str
    dataset_path: Path
    prompts: list[Prompt]
    proposers: dict[str, ProposerConfig]
    baselines: list[str] = field(default_factory=lambda: [HF_GREEDY])
    limit: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "auto"
    device: str | None = None
    model: str | None = None
    draft: str | None = None
    draft_model: str | None = None
    epsilon: float = DEFAULT_EPSILON
    out: Path = Path("specdec-bench")
    caches: dict[str, str] = field(default_factory=dict)  # runner -> KV cache; "auto" when absent
    command: str = ""

    @property
    def runner_names(self) -> list[str]:
        return list(self.proposers) + list(self.baselines)


def plan_bench(dataset: str, proposers: str | None, baselines: str | None = HF_GREEDY,
               limit: int | None = None, max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
               dtype: str = "auto", device: str | None = None, model: str | None = None,
               draft: str | None = None, draft_model: str | None = None, data_dir: str | None = None,
               out: str | os.PathLike | None = None, options: Iterable[str] = (),
               epsilon: float = DEFAULT_EPSILON, command: str = "", caches: Iterable[str] = ()) -> BenchPlan:
    """Validate every argument (before any model loads); SpecdecError with one sentence on bad input."""
    from .loading import DTYPES

    if limit is not None and limit < 1:
        raise SpecdecError(f"--limit must be at least 1, got {limit}; leave it out to run every prompt.")
    if max_new_tokens < 1:
        raise SpecdecError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    if temperature < 0:
        raise SpecdecError(f"--temperature must be 0 (greedy) or positive, got {temperature}.")
    if dtype != "auto" and dtype not in DTYPES:
        raise SpecdecError(f"Unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}.")
    if not epsilon > 0:
        raise SpecdecError(f"--epsilon must be positive, got {epsilon}.")
    looks_local = draft_model and (os.sep in draft_model or draft_model.startswith("."))
    if looks_local and not os.path.isdir(draft_model):
        raise SpecdecError(f"--draft-model folder {draft_model} does not exist; check the path.")
    names = parse_proposers(proposers)
    runner_baselines = parse_baselines(baselines, draft_model)
    configs = parse_proposer_options(options, names, draft)
    runner_caches = parse_caches(caches, names)
    path, prompts = load_dataset(dataset, data_dir, limit)
    if out is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("specdec-bench") / f"{path.stem}-{stamp}"
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SpecdecError(f"--out {out} is a file; give a folder for results.json, results.md and the "
                           "plots.")
    return BenchPlan(dataset=dataset, dataset_path=path, prompts=prompts, proposers=configs,
                     baselines=runner_baselines, limit=limit, max_new_tokens=max_new_tokens,
                     temperature=temperature, seed=seed, dtype=dtype, device=device, model=model, draft=draft,
                     draft_model=draft_model, epsilon=epsilon, out=out, command=command, caches=runner_caches)


# -- runners ------------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecdecRunner:
    """A proposer through specdec's engine."""

    kind = "specdec"

    def __init__(self, name: str, decoder: Any) -> None:
        self.name, self.decoder = name, decoder
        self.device = decoder.target.device

    @property
    def cache(self) -> str:
        return self.decoder.target.cache_name  # read when reported: a target may hand over (TargetModel.reset)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int | None) -> TurnResult:
        _sync(self.device)
        return decoder_generate_fn(self.decoder, max_new_tokens, temperature, seed)(prompt_ids)


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
    from .api import SpeculativeDecoder
    from .plugins import get_proposer_class
    from .target import TargetModel

    runners: list[Any] = []
    for name, config in plan.proposers.items():
        target = TargetModel(model, tokenizer, cache=plan.caches.get(name, "auto"))
        proposer = get_proposer_class(proposer_of(name))(config, target)
        runners.append(SpecdecRunner(name, SpeculativeDecoder(target, proposer)))
    if plan.baselines:
        eos = TargetModel(model, tokenizer).eos_token_ids
        pad = getattr(tokenizer, "pad_token_id", None)
        assistant = None
        if "hf-assisted" in plan.baselines:
            from . import loading

            device = model.get_input_embeddings().weight.device
            assistant, _ = loading.load_model(plan.draft_model, next(model.parameters()).dtype, device)
        for name in plan.baselines:
            runners.append(HFRunner(name, model, eos, pad, assistant if name == "hf-assisted" else None))
    return runners


# -- the run ------------------------------------------------------------------------------------------------

@dataclass
class RunnerRecord:
    """Everything one runner produced: per prompt, its turns."""

    name: str
    kind: str
    cache: str | None = None
    turns: list[list[TurnResult]] = field(default_factory=list)
    peak_rss: int = 0
    peak_gpu: int | None = None


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def run_bench(plan: BenchPlan, model: Any = None, tokenizer: Any = None, show_progress: bool = True) -> dict:
    """Load the target (unless given), run every runner on every prompt, return results.json's dict.

    Ctrl-C stops the run; the prompts every runner has finished are summarised (meta.interrupted is true).
    """
    from . import loading

    started = time.perf_counter()
    if model is None:
        device = loading.resolve_device(plan.device)
        model, tokenizer = loading.load_model(plan.model, loading.resolve_dtype(plan.dtype, device), device)
    runners = build_runners(plan, model, tokenizer)
    records = {r.name: RunnerRecord(r.name, r.kind, r.cache) for r in runners}
    prompts = plan.prompts
    first = prompts[0]
    warmup = Prompt(id="warmup", turns=first.turns[:1], ids=first.ids)
    interrupted = False
    device = model.get_input_embeddings().weight.device
    cuda = device.type == "cuda"

    def one(runner: Any, prompt: Prompt, index: int, max_new: int) -> list[TurnResult]:
        seed = plan.seed + index if plan.temperature > 0 else None
        fn = lambda ids: runner.generate(ids, max_new, plan.temperature, seed)  # noqa: E731
        return run_prompt(fn, tokenizer, prompt)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=Console(stderr=True), disable=not show_progress,
                        transient=False)
    try:
        with progress:
            task = progress.add_task("warm-up", total=len(prompts) * len(runners))
            for runner in runners:
                progress.update(task, description=f"warm-up {runner.name}")
                one(runner, warmup, 0, min(plan.max_new_tokens, WARMUP_TOKENS))
            for index, prompt in enumerate(prompts):
                start = index % len(runners)
                done: dict[str, list[TurnResult]] = {}
                for runner in runners[start:] + runners[:start]:
                    progress.update(task, description=f"prompt {index + 1}/{len(prompts)} {runner.name}")
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    done[runner.name] = one(runner, prompt, index, plan.max_new_tokens)
                    record = records[runner.name]
                    record.peak_rss = max(record.peak_rss, _rss())
                    if cuda:
                        peak = int(torch.cuda.max_memory_allocated(device))
                        record.peak_gpu = max(record.peak_gpu or 0, peak)
                    progress.advance(task)
                for name, turns in done.items():  # only whole prompts count: the pairing stays intact
                    records[name].turns.append(turns)
    except KeyboardInterrupt:
        interrupted = True
    for runner in runners:
        records[runner.name].cache = runner.cache
    return summarize(plan, model, records, prompts, interrupted, time.perf_counter() - started)


# -- the summary --------------------------------------------------------------------------------------------

def _quartiles(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    import numpy as np

    q25, median, q75 = np.percentile(np.asarray(values, dtype=float), [25, 50, 75])
    return {"median": float(median), "q25": float(q25), "q75": float(q75)}


def _tps(turns: Sequence[TurnResult]) -> float:
    seconds = sum(t.seconds for t in turns)
    return sum(len(t.token_ids) for t in turns) / seconds if seconds > 0 else 0.0


def _paired_speedup(mine: Sequence[float], base: Sequence[float]) -> dict[str, float] | None:
    return _quartiles([a / b for a, b in zip(mine, base, strict=True) if a > 0 and b > 0])


def _versions() -> dict[str, str]:
    import transformers

    from . import __version__

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "specdec": __version__}


def _accelerator(model: Any) -> str:
    device = model.get_input_embeddings().weight.device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / (1024 * 1024) if sys.platform == "darwin" else kb / 1024


def summarize(plan: BenchPlan, model: Any, records: Mapping[str, RunnerRecord], prompts: Sequence[Prompt],
              interrupted: bool, wall_seconds: float) -> dict:
    done = min((len(r.turns) for r in records.values()), default=0)
    greedy = plan.temperature == 0
    judge = NearTieJudge(model, plan.epsilon)
    reference = records.get(REFERENCE)
    tps = {name: [_tps(t) for t in rec.turns[:done]] for name, rec in records.items()}
    matches: dict[str, list[str | None]] = {}
    per_runner: dict[str, dict] = {}
    for name, rec in records.items():
        runs = rec.turns[:done]
        stats = [t.stats for turns in runs for t in turns if t.stats is not None]
        steps = [n for s in stats for n in s.acceptance_lengths]
        divergences: list[dict] = []
        statuses: list[str | None] = []
        for i, turns in enumerate(runs):
            if not greedy or reference is None:
                statuses.append(None)
                continue
            d = None if name == REFERENCE else judge.compare(reference.turns[i], turns)
            statuses.append(match_status(d))
            if d is not None:
                divergences.append({"prompt": prompts[i].id, **d.to_dict()})
        matches[name] = statuses
        entry: dict[str, Any] = {
            "kind": rec.kind,
            "cache": rec.cache,
            "num_prompts": done,
            "num_generated_tokens": sum(len(t.token_ids) for turns in runs for t in turns),
            "seconds": sum(t.seconds for turns in runs for t in turns),
            "mean_acceptance_length": sum(steps) / len(steps) if steps else None,
            "acceptance_length_histogram": None,
            "acceptance_rate_per_position": None,
            "tokens_per_second": {"median": statistics.median(tps[name]) if tps[name] else 0.0,
                                  "mean": statistics.fmean(tps[name]) if tps[name] else 0.0},
            "speedup": {
                "vs_autoregressive": _paired_speedup(tps[name], tps[REFERENCE]) if REFERENCE in tps else None,
                "vs_hf_greedy": _paired_speedup(tps[name], tps[HF_GREEDY]) if HF_GREEDY in tps else None,
                "vs_hf_pld": _paired_speedup(tps[name], tps[HF_PLD]) if HF_PLD in tps else None,
            },
            "exact_match_rate": None,
            "matches": None,
            "divergences": divergences,
            "peak_rss_mb": rec.peak_rss / 2**20,
            "peak_gpu_memory_mb": rec.peak_gpu / 2**20 if rec.peak_gpu is not None else None,
            "time_split_seconds": None,
        }
        if stats:
            histogram: dict[str, int] = {}
            for n in sorted(set(steps)):
                histogram[str(n)] = steps.count(n)
            entry["acceptance_length_histogram"] = histogram
            width = max((len(s.proposed_per_position) for s in stats), default=0)
            proposed = [sum(s.proposed_per_position[j] for s in stats if j < len(s.proposed_per_position))
                        for j in range(width)]
            accepted = [sum(s.accepted_per_position[j] for s in stats if j < len(s.accepted_per_position))
                        for j in range(width)]
            entry["acceptance_rate_per_position"] = [a / p if p else 0.0 for a, p in zip(accepted, proposed,
                                                                                      strict=True)]
            entry["time_split_seconds"] = {key: sum(getattr(s, f"{key}_seconds") for s in stats)
                                           for key in ("prefill", "propose", "verify", "other")}
        if greedy and reference is not None and done:
            counts = {key: statuses.count(key) for key in ("exact", "near_tie", "mismatch")}
            entry["matches"] = counts
            entry["exact_match_rate"] = counts["exact"] / done
        per_runner[name] = entry
    per_prompt = []
    for i in range(done):
        runs = {}
        for name, rec in records.items():
            turns = rec.turns[i]
            steps = [n for t in turns if t.stats for n in t.stats.acceptance_lengths]
            runs[name] = {"tokens": sum(len(t.token_ids) for t in turns),
                          "seconds": sum(t.seconds for t in turns), "tokens_per_second": tps[name][i],
                          "mean_acceptance_length": sum(steps) / len(steps) if steps else None,
                          "match": matches[name][i]}
        per_prompt.append({"id": prompts[i].id, "runs": runs})
    meta = {
        "command": plan.command,
        "dataset": {"name": plan.dataset, "path": str(plan.dataset_path), "num_prompts": done,
                    "num_turns": sum(len(p.turns) or 1 for p in prompts[:done])},
        "limit": plan.limit, "max_new_tokens": plan.max_new_tokens, "temperature": plan.temperature,
        "seed": plan.seed, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(model.get_input_embeddings().weight.device), "model": plan.model or "embedded default",
        "draft": plan.draft, "draft_model": plan.draft_model, "epsilon": plan.epsilon,
        "proposer_options": {name: config.model_dump(mode="json") for name, config in plan.proposers.items()},
        "caches": {name: rec.cache for name, rec in records.items() if rec.cache is not None},
        "baselines": list(plan.baselines), "versions": _versions(), "platform": platform.platform(),
        "accelerator": _accelerator(model), "torch_threads": torch.get_num_threads(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_seconds": wall_seconds,
        "interrupted": interrupted, "peak_rss_mb": _peak_rss_mb(),
    }
    return {"schema_version": SCHEMA_VERSION, "meta": meta, "proposers": per_runner, "per_prompt": per_prompt}


# -- outputs ------------------------------------------------------------------------------------------------

def _fmt_speedup(s: Mapping[str, float] | None) -> str:
    return "n/a" if not s else f"{s['median']:.2f}x [{s['q25']:.2f}-{s['q75']:.2f}]"


def render_markdown(results: Mapping[str, Any]) -> str:
    meta, runners = results["meta"], results["proposers"]
    ds = meta["dataset"]
    lines = [
        f"# specdec bench: {ds['name']} ({ds['num_prompts']} prompts, {ds['num_turns']} turns)",
        "",
        f"`{meta['command']}`" if meta["command"] else "",
        "",
        f"model {meta['model']}, {meta['dtype']} on {meta['accelerator']}; "
        f"max_new_tokens {meta['max_new_tokens']}, temperature {meta['temperature']}; "
        f"torch {meta['versions']['torch']}, transformers {meta['versions']['transformers']}; "
        f"{meta['timestamp']}"
        + ("; **interrupted: partial results**" if meta["interrupted"] else ""),
        "",
    ]
    if meta.get("caches"):  # which forward each specdec runner used (native: specdec's own, dynamic: transformers')
        lines += ["KV cache: " + ", ".join(f"{name} {cache}" for name, cache in meta["caches"].items()), ""]
    # the hf-pld column only when that baseline ran (results written before it existed lack the key)
    with_pld = any(r["speedup"].get("vs_hf_pld") for r in runners.values())
    lines += [
        "| runner | mean acceptance length | tokens/s (median) | speedup vs autoregressive "
        "| speedup vs hf-greedy |" + (" speedup vs hf-pld |" if with_pld else "") + " exact match | peak RSS (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if with_pld else "") + " ---: | ---: |",
    ]
    for name, r in runners.items():
        tau = "n/a" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        if r["exact_match_rate"] is None:
            match = "n/a"
        else:
            match = f"{100 * r['exact_match_rate']:.0f}%"
            labels = {"near_tie": ("near-tie", "near-ties"), "mismatch": ("mismatch", "mismatches")}
            extra = [f"{n} {labels[k][n != 1]}" for k, n in r["matches"].items() if k in labels and n]
            match += f" ({', '.join(extra)})" if extra else ""
        speedup = r["speedup"]
        lines.append(f"| {name} | {tau} | {r['tokens_per_second']['median']:.1f} | "
                     f"{_fmt_speedup(speedup['vs_autoregressive'])} | "
                     f"{_fmt_speedup(speedup['vs_hf_greedy'])} | "
                     + (f"{_fmt_speedup(speedup.get('vs_hf_pld'))} | " if with_pld else "")
                     + f"{match} | {r['peak_rss_mb']:.0f} |")
    lines += ["", "Speedup: median of paired per-prompt tokens/s ratios, interquartile range in brackets. "
              "Mean acceptance length counts the bonus token (plain decoding = 1.00). A near-tie is a "
              f"bf16/fp16 divergence whose float32 logit gap is below epsilon = {meta['epsilon']}.", ""]
    with_positions = {n: r["acceptance_rate_per_position"] for n, r in runners.items()
                      if r["acceptance_rate_per_position"]}
    if with_positions:
        width = max(len(v) for v in with_positions.values())
        lines += ["## Acceptance rate per draft position", "",
                  "| runner | " + " | ".join(str(j + 1) for j in range(width)) + " |",
                  "| --- |" + " ---: |" * width]
        for name, rates in with_positions.items():
            cells = [f"{rates[j]:.2f}" if j < len(rates) else "" for j in range(width)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    split = {n: r["time_split_seconds"] for n, r in runners.items() if r["time_split_seconds"]}
    if split:
        lines += ["## Time split (seconds, summed over prompts)", "",
                  "| runner | prefill | propose | verify | other | total |", "| --- |" + " ---: |" * 5]
        for name, s in split.items():
            lines.append(f"| {name} | {s['prefill']:.3f} | {s['propose']:.3f} | {s['verify']:.3f} | "
                         f"{s['other']:.3f} | {runners[name]['seconds']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def _figure(width: float = 6.4, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)  # Agg, headless, no pyplot global state
    return fig


def write_plots(results: Mapping[str, Any], out: Path) -> list[Path]:
    """acceptance_lengths.png, acceptance_per_position.png, speedup.png (where there is data for them)."""
    runners = results["proposers"]
    written: list[Path] = []
    hists = {n: r["acceptance_length_histogram"] for n, r in runners.items()
             if r["acceptance_length_histogram"]}
    if hists:
        fig = _figure()
        ax = fig.add_subplot()
        longest = max(int(k) for h in hists.values() for k in h)
        width = 0.8 / len(hists)
        for i, (name, hist) in enumerate(hists.items()):
            total = sum(hist.values())
            xs = list(range(1, longest + 1))
            fractions = [hist.get(str(x), 0) / total for x in xs]
            ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], fractions, width, label=name)
        ax.set_xticks(list(range(1, longest + 1)))
        ax.set_xlabel("tokens committed per target forward (acceptance length)")
        ax.set_ylabel("fraction of steps")
        ax.set_title("Acceptance length distribution")
        ax.legend()
        fig.tight_layout()
        written.append(out / "acceptance_lengths.png")
        fig.savefig(written[-1])
    curves = {n: r["acceptance_rate_per_position"] for n, r in runners.items()
              if r["acceptance_rate_per_position"]}
    if curves:
        fig = _figure()
        ax = fig.add_subplot()
        for name, rates in curves.items():
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.05)
        ax.set_title("Per-position acceptance rate")
        ax.legend()
        fig.tight_layout()
        written.append(out / "acceptance_per_position.png")
        fig.savefig(written[-1])
    has_hf = any(r["speedup"]["vs_hf_greedy"] for r in runners.values())
    key = "vs_hf_greedy" if has_hf else "vs_autoregressive"
    bars = {n: r["speedup"][key] for n, r in runners.items() if r["speedup"][key]}
    if bars:
        fig = _figure()
        ax = fig.add_subplot()
        names = list(bars)
        medians = [bars[n]["median"] for n in names]
        errors = [[bars[n]["median"] - bars[n]["q25"] for n in names], [bars[n]["q75"] - bars[n]["median"]
                                                                       for n in names]]
        ax.bar(names, medians, yerr=errors, capsize=4, color="tab:blue")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_ylabel("speedup vs hf-greedy" if key == "vs_hf_greedy" else "speedup vs autoregressive")
        ax.set_title("Speedup (median of per-prompt ratios, IQR bars)")
        ax.tick_params(axis="x", labelrotation=20)
        fig.tight_layout()
        written.append(out / "speedup.png")
        fig.savefig(written[-1])
    return written


def write_results(results: Mapping[str, Any], out: str | os.PathLike) -> list[Path]:
    """results.json, results.md and the plots in `out` (created); returns the paths written."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(render_markdown(results), encoding="utf-8")
    return [out / "results.json", out / "results.md"] + write_plots(results, out)
