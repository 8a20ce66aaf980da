"""The `specdec` command line. Bad input exits with code 2 and one sentence, never a traceback."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from .cli_support import parse_options, user_errors


@click.group()
@click.version_option(package_name="specdec")
def main() -> None:
    """specdec: lossless speculative decoding for Hugging Face causal LMs."""


@main.command()
@click.argument("prompt")
@click.option("--proposer", "-p", default=None, help="Proposer name (see `specdec plugins`); default: the best "
              "one that needs no options (dflash with the shipped draft on the embedded model, else ngram).")
@click.option("--model", "-m", default=None, help="Target: a local transformers folder, a .gguf file or a hub id. "
              "Default: the embedded SmolLM2-135M-Instruct.")
@click.option("--draft", default=None, help="Draft checkpoint for proposers that take one (dflash, draft).")
@click.option("--opt", "opts", multiple=True, metavar="KEY=VALUE", help="Proposer option, repeatable.")
@click.option("--max-new-tokens", "-n", default=256, show_default=True, type=int)
@click.option("--temperature", "-t", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=int, help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="1 = off.")
@click.option("--seed", default=None, type=int, help="Seed for sampling; the same seed reproduces a run.")
@click.option("--stop", multiple=True, help="Stop string, repeatable; the completing token is kept.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... Default: cuda when available.")
@click.option("--cache", default="auto", show_default=True, help="Target KV cache: auto (native for Llama/Qwen "
              "targets, else dynamic), native (specdec's own forward, bit-identical), dynamic (transformers').")
@click.option("--raw", is_flag=True, help="Feed the prompt as is, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, token_ids and stats.")
@user_errors
def run(prompt: str, proposer: str | None, model: str | None, draft: str | None, opts: tuple[str, ...],
        max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
        stop: tuple[str, ...], dtype: str, device: str | None, cache: str, raw: bool, as_json: bool) -> None:
    """Generate a reply to PROMPT (a user message) with speculative decoding."""
    from .api import SpeculativeDecoder, build_proposer_config, default_proposer, validate_generation_args
    from .sampling import SamplingParams

    validate_generation_args(prompt, max_new_tokens)
    SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    options: dict[str, Any] = parse_options(opts)
    if draft is not None:
        options["draft"] = draft
    name = proposer or default_proposer(model)
    build_proposer_config(name, options)  # validate before loading anything
    decoder = SpeculativeDecoder.from_pretrained(model, proposer=name, dtype=dtype, device=device, cache=cache,
                                                 **options)
    stream = not as_json and sys.stdout.isatty()
    on_text = (lambda text: (click.echo(text, nl=False), sys.stdout.flush())) if stream else None
    out = decoder.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, stop=list(stop), raw=raw, on_text=on_text)
    if as_json:
        stats = out.stats.to_dict()
        keys = ("num_generated_tokens", "num_target_forwards", "mean_acceptance_length", "acceptance_lengths",
                "tokens_per_second", "wall_seconds")
        click.echo(json.dumps({"text": out.text, "token_ids": out.token_ids,
                               "stats": {k: stats[k] for k in keys}}))
        return
    if stream:
        click.echo()
    else:
        click.echo(out.text)
    s = out.stats
    click.echo(f"[{name}] {s.num_generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, mean acceptance "
               f"length {s.mean_acceptance_length:.2f}, {s.num_target_forwards} target forwards", err=True)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@user_errors
def plugins(as_json: bool) -> None:
    """List every registered proposer, verifier and cache, with the distribution it came from."""
    from .plugins import get_registry

    registry = get_registry()
    rows = []
    for kind in ("proposers", "verifiers", "caches"):
        for name, cls in sorted(getattr(registry, kind).items()):
            entry = {"kind": kind[:-1], "name": name, "distribution": registry.origins[(kind, name)],
                     "description": getattr(cls, "description", "")}
            if kind == "proposers":
                entry["options"] = {key: _describe_field(field) for key, field in cls.Config.model_fields.items()}
            rows.append(entry)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("kind", "name", "from", "options", "description")
    for row in rows:
        table.add_row(row["kind"], row["name"], row["distribution"], ", ".join(row.get("options", {})),
                      row["description"])
    Console().print(table)


def _describe_field(field: Any) -> dict[str, Any]:
    default = None if field.is_required() else field.default
    return {"type": getattr(field.annotation, "__name__", str(field.annotation)), "required": field.is_required(),
            "default": default if isinstance(default, (int, float, str, bool, type(None))) else str(default),
            "description": field.description or ""}


def register_command(command: click.Command) -> None:
    """Lets subsystems (bench, training) add their commands to the `specdec` group."""
    main.add_command(command)


def _load_subcommands() -> None:
    import importlib

    from .bench.cli import bench, check

    main.add_command(bench)
    main.add_command(check)
    for module in ("specdec.training.cli",):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


_load_subcommands()

if __name__ == "__main__":  # pragma: no cover
    main()
