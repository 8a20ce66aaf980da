"""The `specdec` command line. Bad input exits with code 2 and one sentence, never a traceback.

specdec's own commands are added here; plugins add theirs through the `register_commands` hook (`export`
comes from the plugins that can export), looked up when the command line is used.

The top level (`SpecdecGroup.main` and `SpecdecGroup.invoke`) gives every subcommand, plugin commands
included, the same exits:

- 0: done; 1: the command ran and reports a failure (e.g. `specdec check` found a mismatch), or specdec hit
  an internal error (a bug: one sentence naming the command and asking for a report);
- 2: bad input (a `SpecdecError`, a usage error, a file that is not UTF-8 or not JSON, a file specdec could
  not read or write): `error: <one sentence>` on stderr, before any work where the input can be checked
  first;
- 130: interrupted (Ctrl-C), one line.

`specdec --debug COMMAND ...` (or SPECDEC_DEBUG=1) prints the traceback before the sentence.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, NoReturn

import click

from .bench.cli import bench, check
from .cli_support import (
    check_count,
    check_device,
    check_seed,
    check_temperature,
    check_text,
    check_top_p,
    checked_proposer,
    debug_enabled,
    one_line,
    parse_draft_budget,
    print_traceback,
    set_debug,
    user_errors,
)
from .errors import SpecdecError
from .serving.cli import serve
from .training.cli import data, train

#: exit codes (see the module docstring)
EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def _command_name(ctx: click.Context | None) -> str:
    """`specdec data generate`, whatever name the program was started under (python -m, a test runner)."""
    names = []
    while ctx is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return " ".join(["specdec", *reversed(names[:-1])]).strip()


def _innermost_command(tb: Any, fallback: str) -> str:
    """The deepest click command the traceback passed through (`Command.invoke(self, ctx)` frames)."""
    name = fallback
    while tb is not None:
        ctx = tb.tb_frame.f_locals.get("ctx")
        if isinstance(ctx, click.Context):
            name = _command_name(ctx)
        tb = tb.tb_next
    return name


def _exit(message: str, code: int) -> NoReturn:
    click.echo(one_line(message), err=True)
    sys.exit(code)


def _report(exc: BaseException, command: str) -> NoReturn:
    """One line for an exception that escaped a command, and its exit code (see the module docstring)."""
    print_traceback()
    if isinstance(exc, KeyboardInterrupt):
        _exit(f"interrupted: `{command}` stopped (Ctrl-C).", EXIT_INTERRUPTED)
    if isinstance(exc, SpecdecError):
        _exit(f"error: {exc}", EXIT_USAGE)
    detail = one_line(str(exc)) or type(exc).__name__
    detail = detail if len(detail) <= 300 else detail[:297] + "..."
    # the user's files: a safety net for readers that do not name the file themselves
    if isinstance(exc, UnicodeDecodeError):
        _exit(f"error: a file given to `{command}` is not valid UTF-8 ({detail}); save it with UTF-8 encoding.",
              EXIT_USAGE)
    if isinstance(exc, json.JSONDecodeError):
        _exit(f"error: a JSON file given to `{command}` is not valid JSON ({detail}); fix the file or replace it "
              "with an intact copy.", EXIT_USAGE)
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        _exit(f"error: `{command}` ran out of memory ({detail}); use smaller sizes (tokens, batch, options) or a "
              "machine with more memory.", EXIT_FAILURE)
    if isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError):
        _exit(f"error: `{command}` could not read or write a file ({detail}); check the path, the free space and "
              "the permissions.", EXIT_USAGE)
    hint = "" if debug_enabled() else f" and the output of `{command.replace('specdec', 'specdec --debug', 1)} ...`"
    _exit(f"error: internal error in `{command}` ({type(exc).__name__}: {detail}); this is a bug in specdec, "
          f"please report it with the command line{hint}.", EXIT_FAILURE)


class SpecdecGroup(click.Group):
    """specdec's commands, then those its plugins register (a plugin cannot shadow a built-in command); the
    top level of every command's errors."""

    def _plugin_commands(self) -> dict[str, click.Command]:
        from .plugins import get_commands, get_registry

        try:
            commands = get_commands()
        except SpecdecError as exc:  # e.g. two plugins adding one command: a sentence, not a traceback
            _exit(f"error: {exc}", EXIT_USAGE)
        shadowed = sorted(set(commands) & set(self.commands))
        if shadowed and not getattr(self, "_warned", False):
            origins = get_registry().origins
            click.echo("warning: " + "; ".join(f"{origins[('commands', name)]} adds a command {name!r}, which "
                                               "specdec's own command of that name hides" for name in shadowed),
                       err=True)
            self._warned = True
        return {name: cmd for name, cmd in commands.items() if name not in self.commands}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*self.commands, *self._plugin_commands()])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self.commands.get(cmd_name) or self._plugin_commands().get(cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; whatever escapes it becomes one line and an exit code (`_report`)."""
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, BrokenPipeError):
            raise  # click's own: usage errors are rendered by main(), exits and aborts pass through
        except (Exception, KeyboardInterrupt) as exc:
            _report(exc, _innermost_command(exc.__traceback__, _command_name(ctx)))

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        """click's main, with usage errors as one `error:` line (exit 2) and Ctrl-C as one line (exit 130)."""
        set_debug(False)
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # `specdec` alone: the help, as click prints it
            exc.show()
            sys.exit(exc.exit_code)
        except click.ClickException as exc:  # a usage error (or a click parameter's own): the user's input
            where = _command_name(getattr(exc, "ctx", None))
            message = one_line(exc.format_message()).rstrip(".")
            _exit(f"error: {message}; see `{where} --help`.", EXIT_USAGE)
        except click.Abort:
            _exit("interrupted: `specdec` stopped (Ctrl-C).", EXIT_INTERRUPTED)
        sys.exit(rv if type(rv) is int else 0)


@click.group(cls=SpecdecGroup, name="specdec")
@click.option("--debug", is_flag=True, help="Print the traceback of an error before its one-line message.")
@click.version_option(package_name="specdec")
def main(debug: bool) -> None:
    """specdec: lossless speculative decoding for Hugging Face causal LMs.

    Exit codes: 0 done, 1 a failure the command reports (or an internal error: please report it), 2 bad input
    (one `error:` line), 130 interrupted.
    """
    set_debug(debug)


@main.command()
@click.argument("prompt", required=False)
@click.option("--prompts", "prompts_file", default=None, metavar="FILE.jsonl", help="Many prompts, one JSON object "
              "per line with a \"prompt\" string (and optionally an \"id\"), decoded as a batch instead of PROMPT.")
@click.option("--batch-size", "-b", default=None, type=int, help="With --prompts: rows decoded together (others "
              "join as rows finish). Default: 16 where the target's cache keeps rows of different lengths, else 1.")
@click.option("--draft-budget", default="auto", show_default=True, metavar="auto|N", help="Draft tokens a row "
              "verifies per step: auto (chosen per step, at every batch size, from this machine's measured "
              "forward costs and the acceptance seen) or N (its first N; 0 = plain decoding).")
@click.option("--proposer", "-p", default=None, help="Proposer name (see `specdec plugins`); default: the best "
              "one that needs no options (dflash with the shipped draft on the embedded model, else ngram).")
@click.option("--model", "-m", default=None, help="Target: a local transformers folder, a .gguf file or a hub id. "
              "Default: the embedded SmolLM2-135M-Instruct.")
@click.option("--draft", default=None, help="Draft checkpoint for proposers that take one (dflash, draft).")
@click.option("--opt", "opts", multiple=True, metavar="KEY=VALUE", help="Proposer option, repeatable.")
@click.option("--max-new-tokens", "-n", default=256, show_default=True, type=int,
              help="At most this many new tokens (fewer where the context window ends first).")
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, token_ids, stats and "
              "stop_reason (eos, stop_string, max_new_tokens or context); with --prompts, one per line, in order.")
@user_errors
def run(prompt: str | None, prompts_file: str | None, batch_size: int | None, draft_budget: str,
        proposer: str | None,
        model: str | None, draft: str | None, opts: tuple[str, ...], max_new_tokens: int, temperature: float,
        top_k: int, top_p: float, seed: int | None, stop: tuple[str, ...], dtype: str, device: str | None,
        cache: str, verifier: str | None, raw: bool, as_json: bool) -> None:
    """Generate a reply to PROMPT (a user message) with speculative decoding; or to every prompt of a JSONL
    file (--prompts), as a batch."""
    from .api import (
        SpeculativeDecoder,
        validate_generation_args,
    )
    from .sampling import SamplingParams

    if (prompt is None) == (prompts_file is None):
        raise SpecdecError("Give either PROMPT or --prompts FILE.jsonl (not both, not neither); see `specdec run "
                           "--help`.")
    if batch_size is not None and prompts_file is None:
        raise SpecdecError("--batch-size needs --prompts FILE.jsonl (one PROMPT is one row).")
    check_count("--batch-size", batch_size)
    budget = parse_draft_budget(draft_budget)
    if prompts_file is not None:
        ids, texts = read_prompts(prompts_file)
    else:
        validate_generation_args(prompt, max_new_tokens)
        ids, texts = [None], [prompt]
    check_count("--max-new-tokens", max_new_tokens)
    check_temperature("--temperature", temperature)
    check_count("--top-k", top_k, minimum=0, off="0 turns it off")
    check_top_p("--top-p", top_p)
    check_seed("--seed", seed)
    for text in stop:
        check_text("--stop", text)
    check_device(device)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    name, options = checked_proposer(proposer, model, draft, opts, verifier, sampling)  # before anything loads
    decoder = SpeculativeDecoder.from_pretrained(model, proposer=name, dtype=dtype, device=device, cache=cache,
                                                 verifier=verifier, **options)
    if prompts_file is not None:
        _run_batch(decoder, name, ids, texts, batch_size, as_json, dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop=list(stop), raw=raw, draft_budget=budget))
        return
    stream = not as_json and sys.stdout.isatty()
    on_text = (lambda text: (click.echo(text, nl=False), sys.stdout.flush())) if stream else None
    out = decoder.generate(texts[0], max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, stop=list(stop), raw=raw, on_text=on_text, draft_budget=budget)
    if as_json:
        click.echo(json.dumps(_json_record(out)))
        return
    if stream:
        click.echo()
    else:
        click.echo(out.text)
    s = out.stats
    click.echo(f"[{name}] {s.num_generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, mean acceptance "
               f"length {s.mean_acceptance_length:.2f}, {s.num_target_forwards} target forwards", err=True)


_JSON_STATS = ("num_generated_tokens", "num_target_forwards", "mean_acceptance_length", "acceptance_lengths",
               "tokens_per_second", "wall_seconds")


def _json_record(out: Any) -> dict[str, Any]:
    stats = out.stats.to_dict()
    return {"text": out.text, "token_ids": out.token_ids, "stats": {k: stats[k] for k in _JSON_STATS},
            "stop_reason": out.stop_reason}


def read_prompts(path: str) -> tuple[list[Any], list[str]]:
    """The ids and prompt texts of a --prompts JSONL file, every line checked before any model loads."""
    from .api import validate_generation_args
    from .jsonl import json_type, read_jsonl

    ids, texts = [], []
    for where, record in read_jsonl(path, "--prompts file"):
        text = record.get("prompt")
        if not isinstance(text, str):
            got = "no \"prompt\"" if "prompt" not in record else f"a JSON {json_type(text)} as \"prompt\""
            raise SpecdecError(f"{where} has {got}; write {{\"prompt\": \"...\"}} on each line.")
        validate_generation_args(text, 1, where=f"The prompt on {where}")
        ids.append(record.get("id"))
        texts.append(text)
    if not texts:
        raise SpecdecError(f"{path} holds no prompts; write one JSON object per line, {{\"prompt\": \"...\"}}.")
    return ids, texts


def _run_batch(decoder: Any, name: str, ids: list[Any], texts: list[str], batch_size: int | None, as_json: bool,
               options: dict[str, Any]) -> None:
    """Every prompt as a batch; one JSON line per prompt in order (--json), else each reply under a header."""
    start = time.perf_counter()
    outs = decoder.generate(texts, batch_size=batch_size, **options)
    wall = time.perf_counter() - start
    for index, (ident, out) in enumerate(zip(ids, outs, strict=True)):
        if as_json:
            record = {"index": index, **({"id": ident} if ident is not None else {}), **_json_record(out)}
            click.echo(json.dumps(record))
        else:
            click.echo(f"### {index if ident is None else ident}\n{out.text}\n")
    tokens = sum(out.stats.num_generated_tokens for out in outs)
    steps = [n for out in outs for n in out.stats.acceptance_lengths]
    click.echo(f"[{name}] {len(outs)} prompts, {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s), "
               f"mean acceptance length {sum(steps) / max(1, len(steps)):.2f}", err=True)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@user_errors
def plugins(as_json: bool) -> None:
    """List every registered proposer, verifier, cache and plugin command, with the distribution it came from."""
    from .api import default_proposer
    from .contracts import Proposer
    from .plugins import get_commands, get_registry

    registry = get_registry()
    get_commands()  # plugin commands are collected on first use
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
                # rows of a batch drafted in one call (propose_batch overridden), or each row in turn
                shared = obj.propose_batch.__func__ is not Proposer.propose_batch.__func__
                entry["drafts_rows"] = "together" if shared else "one by one"
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

    table = Table("kind", "name", "from", "options / supports", "priority", "batch rows", "description")
    for row in rows:
        priority = "" if "default_priority" not in row else f"{row['default_priority']}" + \
            (" (default)" if row["default"] else "")
        table.add_row(row["kind"], row["name"], row["distribution"],
                      ", ".join(row.get("options", row.get("supports", []))), priority,
                      row.get("drafts_rows", ""), row["description"])
    Console().print(table)


def _describe_field(field: Any) -> dict[str, Any]:
    default = None if field.is_required() else field.default
    return {"type": getattr(field.annotation, "__name__", str(field.annotation)), "required": field.is_required(),
            "default": default if isinstance(default, (int, float, str, bool, type(None))) else str(default),
            "description": field.description or ""}


for _command in (bench, check, data, train, serve):
    main.add_command(_command)

if __name__ == "__main__":  # pragma: no cover
    main()
