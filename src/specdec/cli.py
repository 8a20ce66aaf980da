"""The `specdec` command line. Bad input exits with code 2 and one sentence, never a traceback.

specdec's own commands are added here; plugins add theirs through the `register_commands` hook (`export`
comes from the plugins that can export), looked up when the command line is used.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from .bench.cli import bench, check
from .cli_support import parse_options, user_errors
from .errors import SpecdecError
from .training.cli import data, train


class SpecdecGroup(click.Group):
    """specdec's commands, then those its plugins register (a plugin cannot shadow a built-in command)."""

    def _plugin_commands(self) -> dict[str, click.Command]:
        from .plugins import get_registry

        try:
            commands = get_registry().commands
        except SpecdecError as exc:  # e.g. two plugins adding one command: a sentence, not a traceback
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        return {name: cmd for name, cmd in commands.items() if name not in self.commands}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*self.commands, *self._plugin_commands()])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self.commands.get(cmd_name) or self._plugin_commands().get(cmd_name)


@click.group(cls=SpecdecGroup)
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
@click.option("--verifier", default=None, help="Verifier name (see `specdec plugins`); default: greedy at "
              "temperature 0, rejection sampling above.")
@click.option("--raw", is_flag=True, help="Feed the prompt as is, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, token_ids and stats.")
@user_errors
def run(prompt: str, proposer: str | None, model: str | None, draft: str | None, opts: tuple[str, ...],
        max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
        stop: tuple[str, ...], dtype: str, device: str | None, cache: str, verifier: str | None, raw: bool,
        as_json: bool) -> None:
    """Generate a reply to PROMPT (a user message) with speculative decoding."""
    from .api import (
        SpeculativeDecoder,
        build_proposer_config,
        check_verifier,
        default_proposer,
        validate_generation_args,
    )
    from .sampling import SamplingParams

    validate_generation_args(prompt, max_new_tokens)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    options: dict[str, Any] = parse_options(opts)
    if draft is not None:
        options["draft"] = draft
    name = proposer or default_proposer(model)
    build_proposer_config(name, options)  # validate before loading anything
    if verifier is not None:
        check_verifier(verifier, sampling)
    decoder = SpeculativeDecoder.from_pretrained(model, proposer=name, dtype=dtype, device=device, cache=cache,
                                                 verifier=verifier, **options)
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
    """List every registered proposer, verifier, cache and plugin command, with the distribution it came from."""
    from .api import default_proposer
    from .plugins import get_registry

    registry = get_registry()
    default = default_proposer(None)
    rows = []
    for kind in ("proposers", "verifiers", "caches", "commands"):
        for name, obj in sorted(getattr(registry, kind).items()):
            description = getattr(obj, "description", "")
            if kind == "commands":
                description = (obj.get_short_help_str(limit=100) if isinstance(obj, click.Command) else "")
            entry = {"kind": kind[:-1], "name": name, "distribution": registry.origins[(kind, name)],
                     "description": description}
            if kind == "proposers":
                entry["options"] = {key: _describe_field(field) for key, field in obj.Config.model_fields.items()}
                entry["default_priority"] = obj.default_priority
                entry["default"] = name == default
            if kind == "verifiers":
                entry["supports"] = [what for what, yes in (("greedy", obj.supports_greedy),
                                                            ("sampling", obj.supports_sampling),
                                                            ("trees", obj.supports_trees)) if yes]
            rows.append(entry)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("kind", "name", "from", "options / supports", "priority", "description")
    for row in rows:
        priority = "" if "default_priority" not in row else f"{row['default_priority']}" + \
            (" (default)" if row["default"] else "")
        table.add_row(row["kind"], row["name"], row["distribution"],
                      ", ".join(row.get("options", row.get("supports", []))), priority, row["description"])
    Console().print(table)


def _describe_field(field: Any) -> dict[str, Any]:
    default = None if field.is_required() else field.default
    return {"type": getattr(field.annotation, "__name__", str(field.annotation)), "required": field.is_required(),
            "default": default if isinstance(default, (int, float, str, bool, type(None))) else str(default),
            "description": field.description or ""}


for _command in (bench, check, data, train):
    main.add_command(_command)

if __name__ == "__main__":  # pragma: no cover
    main()
