"""The command the dflash plugin adds to `specdec` (through the `register_commands` hook): `specdec export`."""

from __future__ import annotations

import click

from specdec.cli_support import user_errors


@click.command()
@click.option("--draft", required=True, help="Draft checkpoint folder (e.g. RUN/draft).")
@click.option("--format", "fmt", required=True, type=click.Choice(["zlab", "speculators"]))
@click.option("--out", required=True, help="Folder to write: new, empty, or one a previous export wrote (its "
              "draft is replaced entirely); never the draft's own folder.")
@click.option("--verifier", default=None, help="Target name or path recorded in the speculators config.")
@click.option("--overwrite", is_flag=True, help="Export into a folder that holds other files: its config.json, "
              ".safetensors weights, draft_vocab.json and README.md are replaced, other files left alone.")
@user_errors
def export(draft, fmt, out, verifier, overwrite) -> None:
    """Export a DFlash draft so vLLM and SGLang can serve it (`method: dflash`)."""
    from .export import export_draft

    folder = export_draft(draft, out, fmt, verifier=verifier, overwrite=overwrite)
    click.echo(f"wrote {fmt} draft to {folder}")
