"""The run of `specdec bench`: a warm-up per runner, then the prompts interleaved across runners (the
starting runner rotating from prompt to prompt), peak memory tracked per runner; Ctrl-C keeps whole prompts."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..check import Prompt, TurnResult, run_prompt
from .plan import BenchPlan
from .runners import RunnerRecord, build_runners
from .summary import summarize

#: tokens of each runner's warm-up: enough steps to pass the draft budget's warm-up (specdec.budget), so that its
#: one-off probe of the forward's cost falls in the warm-up and not in the first timed prompt
WARMUP_TOKENS = 64


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def run_bench(plan: BenchPlan, model: Any = None, tokenizer: Any = None, show_progress: bool = True) -> dict:
    """Load the target (unless given), run every runner on every prompt, return results.json's dict.

    Ctrl-C stops the run; the prompts every runner has finished are summarised (meta.interrupted is true).
    """
    from .. import loading

    started = time.perf_counter()
    if model is None:
        device = loading.resolve_device(plan.device)
        model, tokenizer = loading.load_model(plan.model, loading.resolve_dtype(plan.dtype, device), device)
    runners = build_runners(plan, model, tokenizer)
    if plan.batch_sizes:
        from rich.console import Console

        from .batched import run_batched

        console = Console(stderr=True)
        batched = run_batched(plan, model, tokenizer, runners,
                              progress=(lambda text: console.print(text)) if show_progress else None)
        results = summarize(plan, model, {}, plan.prompts, False, time.perf_counter() - started)
        results["meta"]["dataset"].update(num_prompts=len(plan.prompts), num_turns=len(plan.prompts))
        results["meta"]["batch_sizes"] = list(plan.batch_sizes)
        results["meta"]["rounds"] = plan.rounds
        results["meta"]["caches"] = {r.name: r.cache for r in runners if r.cache is not None}
        results["batched"] = batched
        return results
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
