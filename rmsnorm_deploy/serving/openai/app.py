"""The OpenAI-compatible API of ``serve``: text in, text out, on the generation engine every other
front end submits to (OpenAI and KServe clients share one batch).

:func:`openai_app` is a Starlette app (served by uvicorn in the ``serve`` process) over an open
:class:`~rmsnorm_deploy.serving.engine.engine.Engine`:

- ``GET /v1/models`` (and ``/v1/models/NAME``): the one served model;
- ``POST /v1/completions``: a prompt as text (encoded with the folder's ``tokenizer.json``, as
  ``generate --prompt`` encodes it) or token ids;
- ``POST /v1/chat/completions``: messages rendered by the folder's chat template
  (``serving.openai.text.ChatTemplate``); a folder without one refuses chat in one line, completions
  still work;
- ``"stream": true``: server-sent events, one per piece of text (``serving.openai.text.TextStream``:
  never half a character, never part of a stop string), then the finish reason, the usage when
  ``stream_options.include_usage`` asks for it, and ``data: [DONE]``;
- ``GET /health``: 200 once the engine is warm, 503 before and while it drains.

Sampling as OpenAI defines it: ``temperature`` 0 is greedy (``generate``'s tokens), otherwise the
engine samples with ``temperature`` (default 1) and ``top_p`` from ``seed`` (a random one when
none is given), drawing as ``generate --sample --seed S --temperature T --top-p P`` does.

Refusals are OpenAI's error object, one line (``serving.openai.protocol.APIError``): a bad request
400, an unknown model 404, a full engine queue 429, an engine warming up or draining 503, a failed
generation step 500. A client that disconnects cancels its engine stream (its slot is free at the
next step), streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import Any, AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rmsnorm_deploy.decoder.loop import Sampling
from rmsnorm_deploy.errors import InputError, UserError
from rmsnorm_deploy.serving.asgi.body import BODY_TIMEOUT_S, BodyRefused, read_plain_body
from rmsnorm_deploy.serving.engine.engine import StreamCancelled, StreamFailed
from rmsnorm_deploy.serving.engine.submit import Refusal, ending, submit_generation
from rmsnorm_deploy.serving.openai import protocol as api
from rmsnorm_deploy.serving.openai.text import ChatTemplate, TextStream

#: OpenAI's default ``max_tokens`` for ``/v1/completions``; chat's default is the room left in the stream
COMPLETION_MAX_TOKENS = 16
#: OpenAI's default temperature
DEFAULT_TEMPERATURE = 1.0
#: the engine's outcome (``serving.engine.submit``) -> OpenAI's HTTP status, error type and code
OPENAI_ERRORS = {"invalid": (400, "invalid_request_error", None),
                 "busy": (429, "rate_limit_error", "rate_limit_exceeded"),
                 "unavailable": (503, "service_unavailable", None),
                 "cancelled": (503, "service_unavailable", None),
                 "failed": (500, "server_error", None)}


def error_response(error: api.APIError) -> Response:
    return JSONResponse(error.body(), status_code=error.status)


def openai_error(outcome: Refusal, **fields: Any) -> api.APIError:
    """The OpenAI error object of a generation the engine refused or ended early (:data:`OPENAI_ERRORS`)."""
    status, kind, code = OPENAI_ERRORS[outcome.kind]
    return api.APIError(outcome.message, status, type=kind, **{"code": code, **fields})


class OpenAIEndpoints:
    """The routes' handlers over one engine (see the module docstring)."""

    def __init__(self, engine: Any, model_name: str, *, chat: ChatTemplate | None = None,
                 chat_refusal: str | None = None, max_request_bytes: int = 1 << 20,
                 body_timeout_s: float = BODY_TIMEOUT_S):
        model = engine.model
        if model.tokenizer is None:
            raise UserError(f"{model.folder} has no tokenizer.json: the OpenAI API takes and answers text; "
                            "export from a folder with its tokenizer files")
        self.engine, self.model, self.name = engine, model, model_name
        self.chat, self.chat_refusal = chat, chat_refusal or ("" if chat else "this server has no chat template")
        self.max_request_bytes, self.body_timeout_s = max_request_bytes, body_timeout_s
        self.created = int(time.time())

    # -- reading a request ------------------------------------------------------------------------
    async def _body(self, request: Request) -> bytes:
        """The body as the KServe front reads one (``serving.asgi.body``: size, time, encoding)."""
        try:
            return await read_plain_body(request, self.max_request_bytes, timeout_s=self.body_timeout_s)
        except BodyRefused as refused:
            raise api.APIError(refused.message, refused.status) from None

    def _check_model(self, name: str) -> None:
        if name != self.name:
            raise api.APIError(f"the model {name[:100]!r} does not exist; this server serves {self.name!r}", 404,
                               param="model", code="model_not_found")

    # -- routes -----------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [api.model_card(self.name, self.created)]})

    async def model_card(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(api.model_card(self.name, self.created))

    async def health(self, request: Request) -> Response:
        if self.engine.ready:
            return JSONResponse({"status": "ready"})
        return error_response(api.APIError("the model is not ready (warming up or stopping)", 503,
                                           type="service_unavailable"))

    async def completions(self, request: Request) -> Response:
        req = api.parse(api.CompletionRequest, await self._body(request))
        self._check_model(req.model)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            ids = await _in_thread(self._encode, prompt, param="prompt")
        else:
            ids = list(prompt)
        return await self._answer(request, req, ids, chat=False, param="prompt",
                                  max_tokens=req.max_tokens, default_max_tokens=COMPLETION_MAX_TOKENS)

    async def chat_completions(self, request: Request) -> Response:
        req = api.parse(api.ChatRequest, await self._body(request))
        self._check_model(req.model)
        if self.chat is None:
            raise api.APIError(f"chat is not available: {self.chat_refusal}", param="messages",
                               code="chat_template_missing")
        messages = [m.for_template() for m in req.messages]
        ids = await _in_thread(self._chat_ids, messages, param="messages")
        return await self._answer(request, req, ids, chat=True, param="messages", max_tokens=req.new_tokens(),
                                  default_max_tokens=None)

    # -- prompts ----------------------------------------------------------------------------------
    def _encode(self, prompt: str) -> list[int]:
        return self.model.encode(prompt)  # as `generate --prompt`: the folder's special tokens added

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.chat.render(messages)
        ids = list(self.model.tokenizer.encode(text, add_special_tokens=False).ids)  # the template has them
        if not ids:
            raise InputError("the chat template rendered no tokens")
        return ids

    # -- generation -------------------------------------------------------------------------------
    def _submit(self, req: Any, ids: list[int], *, param: str, max_tokens: int | None,
                default_max_tokens: int | None) -> tuple[Any, int]:
        room = self.engine.slot_length - len(ids)
        if max_tokens is None:  # the default: as many as fit (at least 1, so a prompt too long is refused below)
            max_tokens = max(1, room if default_max_tokens is None else min(default_max_tokens, room))
            param_of_length = param
        else:
            param_of_length = "max_tokens" if room > 0 else param
        temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
        sampling = None
        if temperature > 0:
            seed = req.seed if req.seed is not None else secrets.randbits(63)
            sampling = Sampling(do_sample=True, seed=seed, temperature=temperature,
                                top_p=1.0 if req.top_p is None else req.top_p)
        stream = submit_generation(self.engine, ids, max_tokens, sampling=sampling, name="max_tokens")
        if isinstance(stream, Refusal) and stream.kind == "invalid":
            too_long = len(ids) + max_tokens > self.engine.slot_length
            raise openai_error(stream, param=param_of_length if too_long else param,
                               code="context_length_exceeded" if too_long else None)
        if isinstance(stream, Refusal):
            raise openai_error(stream)
        return stream, max_tokens

    async def _answer(self, request: Request, req: Any, ids: list[int], *, chat: bool, param: str,
                      max_tokens: int | None, default_max_tokens: int | None) -> Response:
        text = TextStream(self.model.decode, req.stops())
        stream, _ = self._submit(req, ids, param=param, max_tokens=max_tokens, default_max_tokens=default_max_tokens)
        ident = api.new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(stream, text, ident, chat=chat, prompt_tokens=len(ids), include_usage=include_usage)
            return EventStream(events, stream)
        return await self._whole(request, stream, text, ident, chat=chat, prompt_tokens=len(ids))

    async def _whole(self, request: Request, stream: Any, text: TextStream, ident: str, *, chat: bool,
                     prompt_tokens: int) -> Response:
        async def collect() -> str:
            return "".join([piece async for piece in pieces(stream, text)])

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not collector.done():  # the client is gone: free the slot, nobody reads the answer
            collector.cancel()
            stream.cancel()
            return Response(status_code=499)
        try:
            content = collector.result()
        except (StreamFailed, StreamCancelled) as exc:
            raise openai_error(ending(exc)) from None
        use = api.usage(prompt_tokens, len(text.ids))
        build = api.chat_completion if chat else api.completion
        return JSONResponse(build(ident, self.name, content, finish_reason(stream, text), use))

    async def _events(self, stream: Any, text: TextStream, ident: str, *, chat: bool, prompt_tokens: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
        def event(data: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

        if chat:
            yield event(api.chunk(ident, self.name, chat=True, role=True))
        try:
            async for piece in pieces(stream, text):
                yield event(api.chunk(ident, self.name, chat=chat, text=piece))
            yield event(api.chunk(ident, self.name, chat=chat, finish_reason=finish_reason(stream, text)))
            if include_usage:
                yield event(api.chunk(ident, self.name, chat=chat, use=api.usage(prompt_tokens, len(text.ids))))
        except (StreamFailed, StreamCancelled) as exc:
            yield event(openai_error(ending(exc)).body())
        yield b"data: [DONE]\n\n"


async def pieces(stream: Any, text: TextStream) -> AsyncIterator[str]:
    """The text of ``stream``'s tokens as it comes; at a stop string the engine stream is cancelled
    (its slot freed) and the text ends before it."""
    tokens = stream.tokens_async()
    async with contextlib.aclosing(tokens):
        async for token in tokens:
            piece = text.push(token)
            if piece:
                yield piece
            if text.stopped:
                stream.cancel()
                break
    rest = text.finish()
    if rest:
        yield rest


def finish_reason(stream: Any, text: TextStream) -> str:
    """OpenAI's ``stop`` (a stop string, or the model's end-of-sequence token) or ``length``."""
    return "stop" if text.stopped else stream.finish_reason


class EventStream(StreamingResponse):
    """Server-sent events that cancel their engine stream however the response ends (the client
    gone included), so a slot is never held for nobody."""

    def __init__(self, events: AsyncIterator[bytes], stream: Any):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.stream.done:
                self.stream.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _in_thread(function: Any, argument: Any, *, param: str) -> Any:
    """``function(argument)`` in a worker thread (tokenizing and rendering a template are CPU work that
    would hold every other client's stream); its ``InputError`` as a 400 naming ``param``."""
    import anyio.to_thread  # optional: comes with starlette

    try:
        return await anyio.to_thread.run_sync(function, argument)
    except InputError as exc:
        raise api.APIError(str(exc), param=param) from None


def openai_routes(endpoints: OpenAIEndpoints) -> list[Route]:
    """The routes, under ``/v1`` (and ``/health``)."""
    return [Route("/v1/models", endpoints.models, methods=["GET"]),
            Route("/v1/models/{model:path}", endpoints.model_card, methods=["GET"]),
            Route("/v1/completions", endpoints.completions, methods=["POST"]),
            Route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"]),
            Route("/health", endpoints.health, methods=["GET"])]


def openai_app(engine: Any, model_name: str, *, chat: ChatTemplate | None = None, chat_refusal: str | None = None,
               max_request_bytes: int = 1 << 20, body_timeout_s: float = BODY_TIMEOUT_S,
               routes: Sequence[Route] = ()) -> Starlette:
    """The OpenAI API over ``engine`` as an ASGI app (``routes``: more routes beside, e.g. KServe's)."""
    endpoints = OpenAIEndpoints(engine, model_name, chat=chat, chat_refusal=chat_refusal,
                                max_request_bytes=max_request_bytes, body_timeout_s=body_timeout_s)

    async def refused(request: Request, exc: api.APIError) -> Response:
        return error_response(exc)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            message = f"{request.url.path[:200]} is not an endpoint of this server; see GET /v1/models"
        elif exc.status_code == 405:
            message = f"{request.method[:20]} is not allowed on {request.url.path[:200]}"
        else:
            message = str(exc.detail)
        return error_response(api.APIError(message, exc.status_code))

    async def server_fault(request: Request, exc: Exception) -> Response:
        return error_response(api.APIError(f"the server failed on this request ({type(exc).__name__})", 500,
                                           type="server_error"))

    return Starlette(routes=[*openai_routes(endpoints), *routes],
                     exception_handlers={api.APIError: refused, HTTPException: http_error, Exception: server_fault})
