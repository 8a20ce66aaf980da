"""`specdec serve`: the same target, proposer, draft and options as `specdec run`, behind an OpenAI-compatible
HTTP API (see specdec.serving.app)."""

from __future__ import annotations

import errno
import socket

import click

from ..cli_support import check_count, check_device, checked_proposer, parse_draft_budget, user_errors
from ..errors import SpecdecError

#: the name /v1/models gives the embedded default target
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def check_port_free(host: str, port: int) -> None:
    """One sentence before the model loads if the address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SpecdecError(f"--host {host!r} is not an address this machine can resolve ({exc.strerror}); give an "
                           "IP address such as 127.0.0.1.") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise SpecdecError(f"Port {port} on {host} {why}; choose another with --port.") from None


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 exposes the server to the network (set --api-key then).")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--api-key", default=None, envvar="SPECDEC_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (also from SPECDEC_API_KEY).")
@click.option("--served-model-name", default=None, help="The model name clients send and /v1/models lists. "
              f"Default: --model as given, or {EMBEDDED_NAME} for the embedded target.")
@click.option("--batch-size", "-b", default=None, type=int, help="Requests decoded together; others wait and join "
              "as rows finish. Default: 16 where the target's cache keeps rows of different lengths, else 1.")
@click.option("--max-waiting", default=256, show_default=True, type=int,
              help="Requests that may wait for a batch slot; more are answered 503.")
@click.option("--draft-budget", default="auto", show_default=True, metavar="auto|N",
              help="Draft tokens a row verifies per step (as in `specdec run`).")
@click.option("--max-new-tokens", "-n", default=256, show_default=True, type=int,
              help="New tokens for a request that names no max_tokens.")
@click.option("--proposer", "-p", default=None, help="Proposer name (see `specdec plugins`); default as in run.")
@click.option("--model", "-m", default=None, help="Target, as in `specdec run`. Default: the embedded model.")
@click.option("--draft", default=None, help="Draft checkpoint for proposers that take one (dflash, draft).")
@click.option("--opt", "opts", multiple=True, metavar="KEY=VALUE", help="Proposer option, repeatable.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... Default: cuda when available.")
@click.option("--cache", default="auto", show_default=True, help="Target KV cache, as in `specdec run`.")
@click.option("--verifier", default=None, help="Verifier name; default: greedy at temperature 0, rejection "
              "sampling above.")
@user_errors
def serve(host: str, port: int, api_key: str | None, served_model_name: str | None, batch_size: int | None,
          max_waiting: int, draft_budget: str, max_new_tokens: int, proposer: str | None, model: str | None,
          draft: str | None, opts: tuple[str, ...], dtype: str, device: str | None, cache: str,
          verifier: str | None) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics) with
    speculative decoding and continuous batching across requests."""
    try:
        import uvicorn

        from .app import Settings, create_app
    except ImportError as exc:
        raise SpecdecError(f"specdec serve needs FastAPI and uvicorn ({exc.name} is missing); install them with "
                           "pip install 'specdec[serve]'.") from None
    from ..api import SpeculativeDecoder
    from ..engine import DEFAULT_BATCH_SIZE

    check_count("--port", port, maximum=65535)
    check_count("--batch-size", batch_size)
    check_count("--max-waiting", max_waiting)
    check_count("--max-new-tokens", max_new_tokens)
    if api_key is not None and not api_key.strip():
        raise SpecdecError("--api-key is empty; give a key, or leave the option out to serve without one.")
    budget = parse_draft_budget(draft_budget)
    check_device(device)
    name, options = checked_proposer(proposer, model, draft, opts, verifier)  # before anything loads
    check_port_free(host, port)
    decoder = SpeculativeDecoder.from_pretrained(model, proposer=name, dtype=dtype, device=device, cache=cache,
                                                 verifier=verifier, **options)
    if decoder.target.tokenizer is None:
        raise SpecdecError("The target has no tokenizer; specdec serve takes text, so load a model with one.")
    if batch_size is not None and batch_size > 1 and not decoder.target.can_batch:
        raise SpecdecError(f"--batch-size {batch_size} needs a cache that keeps rows of different lengths; the "
                           f"{decoder.target.cache_name!r} cache does not (the native cache does): use 1.")
    rows = batch_size or (DEFAULT_BATCH_SIZE if decoder.target.can_batch else 1)
    settings = Settings(model_name=served_model_name or model or EMBEDDED_NAME, proposer=name, batch_size=rows,
                        api_key=api_key,
                        max_new_tokens=max_new_tokens, max_waiting=max_waiting, draft_budget=budget)
    click.echo(f"specdec serve: {settings.model_name} with {name} on http://{host}:{port} "
               f"(batch size {settings.batch_size}{', API key required' if api_key else ''})", err=True)
    uvicorn.run(create_app(decoder, settings), host=host, port=port, log_level="warning")
