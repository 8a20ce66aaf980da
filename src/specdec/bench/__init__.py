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
              "proposer_options", "caches", "baselines", "draft_budget" (null: adaptive),
              "versions": {"python", "torch", "transformers", "specdec"},
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

The package, one module a part, each importing only modules listed before it:
`datasets` (where a dataset NAME is found, loading its prompts), `plan` (command-line strings -> a validated
`BenchPlan`), `plots` and `report` (results.md, the PNGs, write_results), `runners` (specdec's engine and the
transformers baselines), `summary` (results.json's dict, statistics), `measure` (the interleaved run), `cli`
(the `bench` and `check` click commands, added to the `specdec` group by specdec.cli).
"""

from __future__ import annotations

from .datasets import DEFAULT_DATA_DIR, ENV_DATA_DIR, dataset_search_path, known_datasets, load_dataset, resolve_dataset
from .measure import WARMUP_TOKENS, run_bench
from .plan import (
    BASELINES,
    HF_GREEDY,
    HF_PLD,
    REFERENCE,
    BenchPlan,
    parse_baselines,
    parse_caches,
    parse_proposer_options,
    parse_proposers,
    plan_bench,
    proposer_of,
    split_names,
)
from .plots import write_plots
from .report import render_markdown, write_results
from .runners import HFRunner, RunnerRecord, SpecdecRunner, build_runners
from .summary import SCHEMA_VERSION, summarize

__all__ = [
    "BASELINES",
    "DEFAULT_DATA_DIR",
    "ENV_DATA_DIR",
    "HF_GREEDY",
    "HF_PLD",
    "REFERENCE",
    "SCHEMA_VERSION",
    "WARMUP_TOKENS",
    "BenchPlan",
    "HFRunner",
    "RunnerRecord",
    "SpecdecRunner",
    "build_runners",
    "dataset_search_path",
    "known_datasets",
    "load_dataset",
    "parse_baselines",
    "parse_caches",
    "parse_proposer_options",
    "parse_proposers",
    "plan_bench",
    "proposer_of",
    "render_markdown",
    "resolve_dataset",
    "run_bench",
    "split_names",
    "summarize",
    "write_plots",
    "write_results",
]
