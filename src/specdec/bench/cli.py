"""`specdec bench` and `specdec check`: plain click commands, which specdec.cli._load_subcommands adds to the
`specdec` group."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any

import click

from ..check import DEFAULT_EPSILON
from ..cli_support import check_count, check_device, check_positive, parse_options, user_errors
from ..errors import PluginError

DTYPE_CHOICES = click.Choice(["auto", "float32", "bfloat16", "float16"])
MODEL_HELP = "Target model folder, .gguf or hub id (default: the embedded SmolLM2-135M-Instruct)."


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


@click.command()
@click.option("--dataset", "-d", required=True, help="A dataset name (gsm8k, humaneval, mbpp, mt_bench, ...: "
              "NAME.jsonl in --data-dir, $SPECDEC_DATA_DIR or ../shared/datasets) or a JSONL path.")
@click.option("--proposers", "-p", default=None, help="Comma-separated proposers; autoregressive always runs "
              "(the reference). Default: autoregressive, ngram and dflash where it needs no options.")
@click.option("--baselines", default="hf-greedy", show_default=True,
              help="Comma-separated transformers baselines: hf-greedy, hf-pld, hf-assisted (or none).")
@click.option("--limit", "-l", default=None, type=int, help="Only the first N prompts.")
@click.option("--max-new-tokens", "-n", default=256, show_default=True, type=int)
@click.option("--temperature", "-t", default=0.0, show_default=True, type=float,
              help="0 = greedy (exact match is checked); >0 samples (no exact match).")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Base seed when sampling (seed + prompt index).")
@click.option("--dtype", default="auto", show_default=True, type=DTYPE_CHOICES)
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... Default: cuda when available.")
@click.option("--model", "-m", default=None, help=MODEL_HELP)
@click.option("--draft", default=None, help="Draft checkpoint for every listed proposer that takes one.")
@click.option("--draft-model", default=None, help="Assistant causal LM for the hf-assisted baseline.")
@click.option("--opt", "opts", multiple=True, metavar="PROPOSER.KEY=VALUE",
              help="Proposer option, repeatable, e.g. --opt ngram.num_tokens=8.")
@click.option("--cache", "caches", multiple=True, metavar="RUNNER=CACHE",
              help="KV cache for one runner, repeatable: auto (the default: native for Llama/Qwen targets, "
              "else dynamic), native (specdec's own forward) or dynamic (transformers' forward), e.g. "
              "--cache autoregressive:hf=dynamic.")
@click.option("--data-dir", default=None, help="Folder of NAME.jsonl datasets (searched first).")
@click.option("--out", "-o", default=None, help="Output folder (default: specdec-bench/DATASET-TIMESTAMP); a "
              "new or empty one, or one an earlier bench wrote into without results.")
@click.option("--overwrite", is_flag=True, help="Write into --out even if it holds another run's results or "
              "files specdec did not write (specdec replaces only its own files there).")
@click.option("--verifier", default=None, help="Verifier of every specdec runner (see `specdec plugins`); "
              "default: greedy, or rejection sampling at temperature > 0.")
@click.option("--epsilon", default=DEFAULT_EPSILON, show_default=True, type=float,
              help="Near-tie threshold on the float32 logit gap for bf16/fp16 divergences.")
@click.option("--batch-size", "batch_sizes", default=None, metavar="B[,B...]", help="Compare the runners at "
              "these batch sizes instead (each prompt's first turn; transformers' batched generate, left-padded, as "
              "the hf-greedy baseline): throughput and speedup by batch size, table and plots.")
@click.option("--rounds", default=1, show_default=True, type=int, help="With --batch-size: passes of every "
              "runner at each batch size, in rotating order; tokens/s is the median pass, ratios are of medians.")
@click.option("--draft-budget", default="auto", show_default=True, metavar="auto|N", help="Draft tokens a row "
              "verifies per step, for every specdec runner: auto (adaptive, from this machine's measured forward "
              "costs, at batch 1 too) or N (its first N; a large N verifies every draft whole, which measures the "
              "drafts' own acceptance whatever the machine).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@user_errors
def bench(dataset: str, proposers: str | None, baselines: str, limit: int | None, max_new_tokens: int,
          temperature: float, seed: int, dtype: str, device: str | None, model: str | None, draft: str | None,
          draft_model: str | None, opts: tuple[str, ...], caches: tuple[str, ...], data_dir: str | None,
          out: str | None, overwrite: bool, verifier: str | None, epsilon: float, batch_sizes: str | None,
          rounds: int, draft_budget: str, no_progress: bool) -> None:
    """Benchmark proposers (and transformers baselines) on a dataset: acceptance, speed, exact match.

    Writes results.json, results.md and PNG plots to --out, each atomically. Ctrl-C writes what has finished.
    """
    from ..files import claim_output_dir
    from .measure import run_bench
    from .plan import plan_bench
    from .report import write_results

    if proposers is None:
        proposers = ",".join(_default_proposers(model))
    plan = plan_bench(dataset, proposers, baselines=baselines, limit=limit, max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed, dtype=dtype, device=device, model=model,
                      draft=draft, draft_model=draft_model, data_dir=data_dir, out=out, options=opts,
                      epsilon=epsilon, command=shlex.join(["specdec", *sys.argv[1:]]), caches=caches,
                      verifier=verifier, overwrite=overwrite, batch_sizes=batch_sizes, rounds=rounds,
                      draft_budget=draft_budget)
    claim_output_dir(plan.out, "bench", overwrite=overwrite, option="--out")  # before any model loads
    _quiet_transformers()
    click.echo(f"bench: {len(plan.prompts)} prompts from {plan.dataset_path}; runners: "
               f"{', '.join(plan.runner_names)}", err=True)
    results = run_bench(plan, show_progress=not no_progress)
    paths = write_results(results, plan.out)
    for batch, runners in results.get("batched", {}).items():
        for name, r in runners.items():
            ratio = r["speedup_vs_autoregressive"]
            tau = r["mean_acceptance_length"]
            click.echo(f"[batch {batch}] [{name}] {r['tokens_per_second']:.1f} tok/s"
                       + ("" if ratio is None else f", {ratio:.2f}x vs autoregressive")
                       + ("" if tau is None else f", mean acceptance length {tau:.2f}"), err=True)
    for name, r in results["proposers"].items():
        tau = r["mean_acceptance_length"]
        tau = "" if tau is None else f", mean acceptance length {tau:.2f}"
        speedup = r["speedup"]["vs_autoregressive"]
        ratio = f", {speedup['median']:.2f}x vs autoregressive" if speedup else ""
        match = "" if r["exact_match_rate"] is None else f", exact match {100 * r['exact_match_rate']:.0f}%"
        click.echo(f"[{name}] {r['tokens_per_second']['median']:.1f} tok/s{ratio}{tau}{match}", err=True)
    click.echo(f"wrote {', '.join(str(p) for p in paths)}", err=True)
    if results["meta"]["interrupted"]:
        done = results["meta"]["dataset"]["num_prompts"]
        click.echo(f"interrupted: results cover the {done} prompts every runner finished.", err=True)
        sys.exit(130)


def _default_proposers(model: str | None) -> list[str]:
    """The reference, prompt lookup, and every proposer that needs no options for this model."""
    from ..api import default_candidates

    names = ["autoregressive", "ngram"]
    names += [name for name in reversed(default_candidates(model)) if name not in names]
    return names


@click.command()
@click.option("--proposer", "-p", required=True,
              help="The proposer to check (any registered one, third-party too).")
@click.option("--opt", "opts", multiple=True, metavar="KEY=VALUE", help="Proposer option, repeatable.")
@click.option("--model", "-m", default=None, help=MODEL_HELP)
@click.option("--draft", default=None, help="Draft checkpoint for proposers that take one.")
@click.option("--prompts", "prompts_file", default=None, metavar="FILE",
              help="JSONL, one object a line with `prompt` (a string) or `turns` (user turns). Default: 5 "
              "built-in prompts.")
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=int)
@click.option("--dtype", default="float32", show_default=True, type=DTYPE_CHOICES,
              help="float32 demands exact equality; bfloat16/float16 allow certified near-ties only.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... Default: cuda when available.")
@click.option("--verifier", default=None, help="The verifier to check PROPOSER with (see `specdec plugins`); "
              "default: greedy.")
@click.option("--epsilon", default=DEFAULT_EPSILON, show_default=True, type=float,
              help="Near-tie threshold on the float32 logit gap (bfloat16/float16 only).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@user_errors
def check(proposer: str, opts: tuple[str, ...], model: str | None, draft: str | None,
          prompts_file: str | None, max_new_tokens: int, dtype: str, device: str | None, verifier: str | None,
          epsilon: float, as_json: bool) -> None:
    """Check that PROPOSER is lossless: its greedy output equals plain greedy decoding, token for token.

    Exit 0 when every prompt matches (in bf16/fp16: or diverges only at a certified near-tie), 1 otherwise.
    """
    from ..api import SpeculativeDecoder, build_proposer_config, check_verifier
    from ..check import check_lossless, read_prompts_jsonl
    from ..sampling import SamplingParams

    options: dict[str, Any] = parse_options(opts)
    if draft is not None:
        options["draft"] = draft
    build_proposer_config(proposer, options)  # validate before loading anything
    if verifier is not None:
        check_verifier(verifier, SamplingParams())  # the check decodes greedily
    check_count("--max-new-tokens", max_new_tokens)
    check_positive("--epsilon", epsilon)
    check_device(device)
    prompts = read_prompts_jsonl(prompts_file, paper_turns=False) if prompts_file else None
    _quiet_transformers()
    decoder = SpeculativeDecoder.from_pretrained(model, proposer=proposer, dtype=dtype, device=device,
                                                 verifier=verifier, **options)
    tokenizer = decoder.target.tokenizer
    on_result = None if as_json else (lambda report, result: click.echo(report.describe(result, tokenizer)))
    try:
        report = check_lossless(decoder, prompts, max_new_tokens=max_new_tokens, epsilon=epsilon,
                                on_result=on_result)
    except PluginError as exc:  # the plugin broke a contract mid-generation: the check fails
        click.echo(f"FAIL  proposer {proposer!r} broke a contract: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    failures = report.failures
    certified = sum(r.status == "near_tie" for r in report.results)
    ties = f", {certified} certified near-ties" if certified else ""
    summary = (f"{proposer}: {len(report.results) - len(failures)}/{len(report.results)} prompts lossless "
               f"({report.dtype}, {max_new_tokens} new tokens, mean acceptance length "
               f"{report.mean_acceptance_length:.2f}{ties})")
    if failures:
        first = report.describe(failures[0], tokenizer).removeprefix("FAIL  ")
        click.echo(f"{summary}. NOT LOSSLESS: {first}", err=True)
        sys.exit(1)
    click.echo(f"{summary}.", err=True)

