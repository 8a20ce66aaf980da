"""results.json's dict from the records of a `specdec bench` run: per-runner acceptance, tokens/s, paired
speedups (median and interquartile range), exact match against `autoregressive`, per-prompt rows, and the
meta block (versions, accelerator, peak RSS). The schema is in the package docstring (specdec.bench)."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import torch

from ..check import NearTieJudge, Prompt, TurnResult, match_status
from .plan import HF_GREEDY, HF_PLD, REFERENCE, BenchPlan
from .runners import RunnerRecord

SCHEMA_VERSION = 1


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

    from .. import __version__

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
        "verifier": plan.verifier,
        "draft_budget": plan.draft_budget,
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
