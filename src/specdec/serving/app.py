"""`specdec serve`'s HTTP side: an OpenAI-compatible API (FastAPI) in front of the scheduler's engine thread.

Each request is checked completely (JSON, parameters, model name, the prompt against the context window)
before it reaches the engine; anything wrong is answered with an OpenAI-style JSON error and a 4xx status,
and the server goes on serving. Streaming responses are server-sent events in OpenAI's chunk format ending
with `data: [DONE]`; a client that goes away cancels its request, whose row leaves the batch before the
next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import SpeculativeDecoder
from ..detokenize import StreamingText
from ..errors import SpecdecError
from ..generation import EngineResult
from ..sampling import SamplingParams
from .metrics import Metrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, finish_reason
from .scheduler import NotRunning, QueueFull, Scheduler
from .scheduler import Request as EngineRequest

log = logging.getLogger("specdec.serve")


class Settings(BaseModel):
    model_name: str
    proposer: str
    batch_size: int
    max_new_tokens: int = 256  # when a request names no max_tokens
    api_key: str | None = None
    max_waiting: int = 256
    draft_budget: int | None = None


class _Job:
    """One request's path from the engine thread back to its handler (an asyncio queue on the server's loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: Metrics, prompt_tokens: int) -> None:
        self.loop, self.metrics, self.prompt_tokens = loop, metrics, prompt_tokens
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.started = time.perf_counter()
        self.first_token_seen = False

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: the server is shutting down
            pass

    def on_tokens(self, tokens: list[int]) -> None:  # engine thread
        if not self.first_token_seen:
            self.first_token_seen = True
            self.metrics.first_token(time.perf_counter() - self.started)
        self._put(("tokens", tokens))

    def on_done(self, result: EngineResult | None, error: BaseException | None) -> None:  # engine thread
        if result is not None:  # counted here: a cancelled request's handler is gone
            self.metrics.generation(self.prompt_tokens, result.stats, result.stop_reason)
        elif error is None:
            self.metrics.cancelled_waiting()
        self._put(("done", (result, error)))


def create_app(decoder: SpeculativeDecoder, settings: Settings) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it."""
    engine = decoder.engine
    engine.draft_budget = settings.draft_budget
    scheduler = Scheduler(engine, settings.batch_size, settings.max_waiting)
    metrics = Metrics()
    tokenizer = decoder.target.tokenizer
    context = decoder.target.max_context

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.settings = scheduler, metrics, settings

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("an internal error answered a request")
        return JSONResponse(APIError(500, f"Internal error: {type(exc).__name__}: {exc} (please report it).",
                                     kind="server_error").body(), status_code=500)

    endpoints = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}

    @app.middleware("http")
    async def _count(request: Request, call_next: Any) -> Response:
        path = request.url.path if request.url.path in endpoints else "other"  # bounded label values
        try:
            response = await call_next(request)
        except Exception:  # answered by the 500 handler, outside this middleware
            metrics.request(path, 500)
            raise
        metrics.request(path, response.status_code)
        return response

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
            raise APIError(401, "Missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                                "key the server was started with (--api-key).", code="invalid_api_key")

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        authorize(request)
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"The request body is not valid JSON ({exc}); send a JSON object.") from None
        if not isinstance(data, dict):
            raise APIError(400, "The request body must be a JSON object.")
        try:
            body = model.model_validate(data)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"]) or None
            if error["type"] == "extra_forbidden":
                raise APIError(400, f"Unrecognized request argument supplied: {where}.", param=where) from None
            raise APIError(400, f"{where}: {error['msg']}." if where else f"{error['msg']}.", param=where) from None
        if body.model != settings.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                                f"'{settings.model_name}'.", param="model", code="model_not_found")
        body.refuse_unsupported()
        return body

    def sampling_of(body: Any) -> SamplingParams:
        try:
            sampling = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                      top_k=max(0, body.top_k or 0), top_p=1.0 if body.top_p is None else body.top_p)
            engine.verifier_for(sampling)
        except SpecdecError as exc:
            raise APIError(400, str(exc)) from None
        return sampling

    def check_prompt(ids: list[int], asked: int | None) -> None:
        if not ids:
            raise APIError(400, "The prompt is empty; give at least one token of text.", param="prompt")
        if len(ids) >= context:
            raise APIError(400, f"The prompt has {len(ids)} tokens but the model's context window is {context}; "
                                "shorten it.", code="context_length_exceeded")
        if asked is not None and len(ids) + asked > context:  # as OpenAI and vLLM: refused, not cut short
            raise APIError(400, f"The prompt ({len(ids)} tokens) and max_tokens ({asked}) exceed the model's "
                                f"context window of {context} tokens; ask for at most {context - len(ids)}.",
                           param="max_tokens", code="context_length_exceeded")

    async def generate(request: Request, body: Any, ids: list[int], chat: bool) -> Response:
        sampling = sampling_of(body)
        check_prompt(ids, body.new_tokens())
        job = _Job(asyncio.get_running_loop(), metrics, len(ids))
        new_tokens = body.new_tokens() or settings.max_new_tokens  # the default is cut at the context window
        work = EngineRequest(prompt_ids=ids, max_new_tokens=new_tokens, sampling=sampling, seed=body.seed,
                             stop=body.stop, on_tokens=job.on_tokens, on_done=job.on_done)
        try:
            scheduler.submit(work)
        except QueueFull:
            raise APIError(503, f"The server is busy ({settings.max_waiting} requests wait already); try again "
                                "shortly.", kind="server_error", code="queue_full") from None
        except NotRunning:
            raise APIError(503, "The engine is not running (see /health); restart the server.",
                           kind="server_error", code="engine_stopped") from None
        reply = _Reply(chat, settings.model_name, len(ids), StreamingText(tokenizer, body.stop), body.return_token_ids)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(request, job, work, reply, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(job.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        scheduler.cancel(work)
                        return Response(status_code=499)
                    continue
                if kind == "tokens":  # the whole text is decoded once, at the end
                    continue
                result = finished(payload)
                return JSONResponse(reply.whole(result))
        except asyncio.CancelledError:
            scheduler.cancel(work)
            raise

    def finished(payload: tuple[EngineResult | None, BaseException | None]) -> EngineResult:
        result, error = payload
        if error is not None:
            raise APIError(500, f"Generation failed: {type(error).__name__}: {error}", kind="server_error")
        if result is None:
            raise APIError(499, "The request was cancelled.")
        return result

    async def stream(request: Request, job: _Job, work: EngineRequest, reply: _Reply,
                     include_usage: bool) -> AsyncIterator[str]:
        done = False
        try:
            if reply.chat:
                yield reply.event(reply.chunk(role=True))
            while True:
                kind, payload = await job.queue.get()
                if kind == "tokens":
                    text = reply.text.push(payload)
                    if text:
                        yield reply.event(reply.chunk(text=text))
                    continue
                done = True
                try:
                    result = finished(payload)
                except APIError as exc:
                    yield reply.event(exc.body())
                    break
                rest = reply.text.finish()
                if rest:
                    yield reply.event(reply.chunk(text=rest))
                yield reply.event(reply.chunk(reason=finish_reason(result.stop_reason)))
                if include_usage:
                    yield reply.event(reply.usage_chunk(result))
                break
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (the server cancels this generator): free the row
                scheduler.cancel(work)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await parse(request, CompletionRequest)
        if isinstance(body.prompt, str):
            ids = list(tokenizer(body.prompt, add_special_tokens=True)["input_ids"])
        else:
            ids = body.prompt
            vocab = decoder.target.vocab_size
            if any(not 0 <= i < vocab for i in ids):
                raise APIError(400, f"The prompt's token ids must lie in [0, {vocab}) for this model.",
                               param="prompt")
        return await generate(request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = decoder.encode_chat(messages)
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception ("roles must alternate") is the client's
            raise APIError(400, f"The chat template refused these messages: {exc}", param="messages") from None
        return await generate(request, body, ids, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec"}]}

    @app.get("/health")
    async def health() -> Response:
        if scheduler.alive:
            return JSONResponse({"status": "ok", "proposer": settings.proposer})
        why = "not started" if scheduler.error is None else f"{type(scheduler.error).__name__}: {scheduler.error}"
        return JSONResponse(APIError(503, f"The engine thread is not running ({why}).", kind="server_error").body(),
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(scheduler.waiting, scheduler.running),
                                 media_type="text/plain; version=0.0.4")

    return app


class _Reply:
    """OpenAI's response and chunk objects for one request."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, text: StreamingText, token_ids: bool) -> None:
        self.chat, self.model, self.prompt_tokens, self.text = chat, model, prompt_tokens, text
        self.token_ids = token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    @staticmethod
    def event(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def _usage(self, result: EngineResult) -> dict[str, int]:
        completion = result.stats.num_generated_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None = None, role: bool = False, reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]}

    def usage_chunk(self, result: EngineResult) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self._usage(result)}

    def whole(self, result: EngineResult) -> dict[str, Any]:
        text = self.text.full(result.token_ids)
        reason = finish_reason(result.stop_reason)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.token_ids:
            choice["token_ids"] = result.token_ids
        stats = result.stats
        return {**self._head(self.object), "choices": [choice], "usage": self._usage(result),
                "specdec": {"mean_acceptance_length": stats.mean_acceptance_length,
                            "target_forwards": stats.num_target_forwards, "stop_reason": result.stop_reason}}
