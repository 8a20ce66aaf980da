"""The command the dflash plugin adds to `specdec` (through the `register_commands` hook): `specdec export`.

It exports DFlash drafts and every draft another plugin registers an exporter for (`register_exporters`: the
eagle3 plugin's EAGLE-3 drafts), picked by the architecture in the draft's config.json; with `--target`, the
target model as a plain Hugging Face folder."""

from __future__ import annotations

import click

from specdec.cli_support import user_errors
from specdec.errors import SpecdecError


def _exporters() -> list:
    from specdec.plugins import get_registry

    from .export import DFlashExporter

    return [DFlashExporter, *get_registry().exporters.values()]


class FormatName(click.ParamType):
    """A layout some exporter writes (the draft's own exporter checks it is one of its layouts)."""

    name = "format"

    def convert(self, value, param, ctx):
        formats = sorted({f for exporter in _exporters() for f in exporter.formats})
        if value not in formats:
            self.fail(f"{value!r} is not one of: {', '.join(formats)}.", param, ctx)
        return value


@click.command()
@click.option("--draft", default=None, help="Draft checkpoint folder (e.g. RUN/draft): a DFlash draft, or one of "
              "another plugin's kinds (EAGLE-3), picked by its config.json.")
@click.option("--format", "fmt", default=None, type=FormatName(),
              help="Layout: DFlash drafts zlab, vllm or speculators; EAGLE-3 drafts vllm or specforge.")
@click.option("--target", "target", is_flag=True, help="Export the target model instead of a draft: --model (default "
              "the embedded SmolLM2, converted from its GGUF) as a plain Hugging Face folder for vLLM or SGLang.")
@click.option("--model", default=None, help="With --target: the model folder, .gguf file or hub id to export.")
@click.option("--dtype", default="float32", show_default=True, help="With --target: float32, bfloat16 or float16 "
              "weights (float32 is the model specdec verifies with in float32).")
@click.option("--out", required=True, help="Folder to write: new, empty, or one a previous export wrote (its "
              "draft is replaced entirely); never the draft's own folder.")
@click.option("--verifier", default=None, help="Target name or path recorded in the speculators config.")
@click.option("--overwrite", is_flag=True, help="Export into a folder that holds other files: its config.json, "
              ".safetensors weights, draft_vocab.json and README.md are replaced, other files left alone.")
@click.pass_context
@user_errors
def export(ctx, draft, fmt, target, model, dtype, out, verifier, overwrite) -> None:
    """Export a draft so vLLM and SGLang can serve it (`method: dflash` or `eagle3`), or the target (--target)."""
    from .export import export_draft, export_target

    given = {p.name for p in ctx.command.params
             if ctx.get_parameter_source(p.name) is not click.core.ParameterSource.DEFAULT}
    if target:
        extra = sorted(given & {"draft", "fmt", "verifier"})
        if extra:
            names = {"draft": "--draft", "fmt": "--format", "verifier": "--verifier"}
            raise SpecdecError(f"--target writes the target model as a plain Hugging Face folder; drop "
                               f"{names[extra[0]]}, which applies to drafts.")
        folder = export_target(out, model=model, dtype=dtype, overwrite=overwrite)
        click.echo(f"wrote the target ({model or 'the embedded SmolLM2-135M-Instruct'}, {dtype}) to {folder}")
        return
    if draft is None or fmt is None:
        raise SpecdecError("Give --draft and --format to export a draft, or --target to export the target model.")
    if given & {"model", "dtype"}:
        raise SpecdecError("--model and --dtype apply to --target; a draft is written in its own dtype (bfloat16).")
    folder = export_draft(draft, out, fmt, verifier=verifier, overwrite=overwrite, exporters=_exporters())
    click.echo(f"wrote {fmt} draft to {folder}")
