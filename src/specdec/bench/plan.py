"""The runs of `specdec bench`: runner lists and options parsed from the command line, validated into a
`BenchPlan` before any model loads."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..check import DEFAULT_EPSILON, Prompt
from ..contracts import ProposerConfig
from ..errors import SpecdecError
from .datasets import load_dataset

REFERENCE = "autoregressive"
HF_GREEDY = "hf-greedy"
HF_PLD = "hf-pld"
BASELINES = {
    "hf-greedy": "transformers generate(do_sample=False)",
    "hf-pld": "transformers generate with prompt_lookup_num_tokens=10",
    "hf-assisted": "transformers generate with assistant_model (needs --draft-model)",
}


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
    from ..plugins import get_registry

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


#: the largest --batch-size (rows held at once; the cache grows with the tokens they hold)
MAX_BATCH_SIZE = 1024


def parse_batch_sizes(text: str | None, baselines: Sequence[str]) -> list[int]:
    """`--batch-size 1,4,16` -> [1, 4, 16] (in the order given, repeats dropped); [] without the option."""
    if text is None:
        return []
    sizes: list[int] = []
    for part in split_names(text):
        try:
            size = int(part)
        except ValueError:
            size = 0
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise SpecdecError(f"--batch-size {text!r}: {part!r} is not a whole number from 1 to {MAX_BATCH_SIZE}; "
                               "write e.g. --batch-size 1,4,16.")
        if size not in sizes:
            sizes.append(size)
    if not sizes:
        raise SpecdecError("--batch-size is empty; write e.g. --batch-size 1,4,16.")
    other = [b for b in baselines if b != HF_GREEDY]
    if other:
        raise SpecdecError(f"The baseline {other[0]} has no batched form in transformers; with --batch-size use "
                           "--baselines hf-greedy (or none).")
    return sizes


def parse_proposer_options(pairs: Iterable[str], proposers: Sequence[str],
                           draft: str | None = None) -> dict[str, ProposerConfig]:
    """`--opt NAME.key=value` pairs (and --draft for each proposer with a `draft` option) -> configs."""
    from ..api import build_proposer_config
    from ..plugins import get_proposer_class

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
    from ..plugins import get_registry

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


#: what `specdec bench` writes into its --out folder (results.md and the plots are rewritten with it)
RESULTS_FILE = "results.json"


def check_output_folder(out: Path, overwrite: bool) -> None:
    """--out must be a folder for this run alone: not a file, not another bench run's results (unless
    `overwrite`), not a folder another specdec command owns; claim_output_dir then refuses folders holding
    files specdec did not write. Nothing is written here."""
    from ..files import OWNER_MARKER

    if out.exists() and not out.is_dir():
        raise SpecdecError(f"--out {out} is a file; give a folder for results.json, results.md and the "
                           "plots.")
    if not out.is_dir() or overwrite:
        return
    if (out / RESULTS_FILE).exists():
        raise SpecdecError(f"--out {out} already holds results.json from another run; choose a new folder, or "
                           "pass --overwrite to replace that run's results.")
    marker = out / OWNER_MARKER
    if marker.is_file():
        try:
            owner = marker.read_text(encoding="utf-8", errors="replace").strip().removeprefix("written by ")
        except OSError:
            owner = ""
        if owner and owner != "specdec bench":
            raise SpecdecError(f"--out {out} belongs to `{owner}`; choose a new folder for the bench results, or "
                               "pass --overwrite to write them there anyway.")


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
    verifier: str | None = None  # every specdec runner's verifier; None: greedy, or rejection when sampling
    batch_sizes: list[int] = field(default_factory=list)  # --batch-size: the batched comparison instead
    rounds: int = 1  # --rounds: batched passes per runner and batch size (medians reported)
    draft_budget: int | None = None  # --draft-budget: every specdec runner's draft tokens per row (None: adaptive)

    @property
    def runner_names(self) -> list[str]:
        return list(self.proposers) + list(self.baselines)


def plan_bench(dataset: str, proposers: str | None, baselines: str | None = HF_GREEDY,
               limit: int | None = None, max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
               dtype: str = "auto", device: str | None = None, model: str | None = None,
               draft: str | None = None, draft_model: str | None = None, data_dir: str | None = None,
               out: str | os.PathLike | None = None, options: Iterable[str] = (),
               epsilon: float = DEFAULT_EPSILON, command: str = "", caches: Iterable[str] = (),
               verifier: str | None = None, overwrite: bool = False, batch_sizes: str | None = None,
               rounds: int = 1, draft_budget: str = "auto") -> BenchPlan:
    """Validate every argument (before any model loads); SpecdecError with one sentence on bad input.
    Nothing is written: the bench command claims the output folder (`specdec.files.claim_output_dir`)
    once the plan is made."""
    from ..cli_support import (
        check_count,
        check_device,
        check_positive,
        check_seed,
        check_temperature,
        parse_draft_budget,
    )
    from ..loading import DTYPES, check_model

    if limit is not None and limit < 1:
        raise SpecdecError(f"--limit must be at least 1, got {limit}; leave it out to run every prompt.")
    check_count("--limit", limit)
    check_count("--max-new-tokens", max_new_tokens)
    check_temperature("--temperature", temperature)
    check_seed("--seed", seed)
    if verifier is not None:
        from ..api import check_verifier
        from ..sampling import SamplingParams

        check_verifier(verifier, SamplingParams(temperature=temperature))
    if dtype != "auto" and dtype not in DTYPES:
        raise SpecdecError(f"Unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}.")
    check_positive("--epsilon", epsilon)
    check_device(device)
    looks_local = draft_model and (os.sep in draft_model or draft_model.startswith("."))
    if looks_local and not os.path.isdir(draft_model):
        raise SpecdecError(f"--draft-model folder {draft_model} does not exist; check the path.")
    check_model(model)  # a missing or damaged local target is refused before the bench starts
    if draft_model:
        check_model(draft_model)
    names = parse_proposers(proposers)
    runner_baselines = parse_baselines(baselines, draft_model)
    sizes = parse_batch_sizes(batch_sizes, runner_baselines)
    check_count("--rounds", rounds, maximum=20)
    budget = parse_draft_budget(draft_budget)
    if rounds > 1 and not sizes:
        raise SpecdecError("--rounds repeats the batched comparison; give --batch-size too (the per-prompt "
                           "comparison already interleaves runners prompt by prompt).")
    configs = parse_proposer_options(options, names, draft)
    runner_caches = parse_caches(caches, names)
    path, prompts = load_dataset(dataset, data_dir, limit)
    if out is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("specdec-bench") / f"{path.stem}-{stamp}"
    out = Path(out)
    check_output_folder(out, overwrite)
    return BenchPlan(dataset=dataset, dataset_path=path, prompts=prompts, proposers=configs,
                     baselines=runner_baselines, limit=limit, max_new_tokens=max_new_tokens,
                     temperature=temperature, seed=seed, dtype=dtype, device=device, model=model, draft=draft,
                     draft_model=draft_model, epsilon=epsilon, out=out, command=command, caches=runner_caches,
                     verifier=verifier, batch_sizes=sizes, rounds=rounds, draft_budget=budget)
