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
none is given), drawing as ``generate --sample --seed S --temperature T --top-p P`` does. Beside
them (``serving.engine.sampling``): ``logprobs`` / ``top_logprobs``, ``n`` choices (up to 8),
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, vLLM's ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``; ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``regex`` / ``grammar`` through constrained decoding (``serving.engine.constraints``); ``tools``
and ``tool_choice`` through the chat template (``serving.openai.tools``). The answers are built in
``serving.openai.answers``.

Refusals are OpenAI's error object, one line (``serving.openai.protocol.APIError``): a bad request
400, an unknown model 404, a full engine queue 429, an engine warming up or draining 503, a failed
generation step 500. A client that disconnects cancels its engine stream (its slot is free at the
next step), streaming or not.
"""

from __future__ import annotations

import threading
import time
from typing import Any, AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rmsnorm_deploy.errors import InputError, UserError
from rmsnorm_deploy.serving.asgi.body import BODY_TIMEOUT_S, BodyRefused, read_plain_body
from rmsnorm_deploy.serving.engine.constraints import Grammars
from rmsnorm_deploy.serving.engine.sampling import Chooser
from rmsnorm_deploy.serving.engine.submit import Refusal, submit_generation
from rmsnorm_deploy.serving.openai import protocol as api
from rmsnorm_deploy.serving.openai.answers import OPENAI_ERRORS, Answers, Plan, openai_error
from rmsnorm_deploy.serving.openai.choices import Choice, TokenTexts, request_seed, sampling_fields
from rmsnorm_deploy.serving.openai.text import ChatTemplate, TextStream
from rmsnorm_deploy.serving.openai.tools import tool_plan

#: OpenAI's default ``max_tokens`` for ``/v1/completions``; chat's default is the room left in the stream
COMPLETION_MAX_TOKENS = 16
#: grammars compiled and admitted at once (each up to about a second of one core: a flood of hostile
#: grammars waits its turn rather than taking every core from the engine)
COMPILERS = 2


def error_response(error: api.APIError) -> Response:
    return JSONResponse(error.body(), status_code=error.status)


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
        self._grammars: Grammars | None = None
        self._compiling = threading.Lock()  # the tokenizer for llguidance is made once
        self._compilers: Any = None  # at most COMPILERS grammars compiled at once (an anyio limiter, made in the loop)
        self._texts: TokenTexts | None = None

    @property
    def texts(self) -> TokenTexts:
        """Token texts for logprobs, made on first use (the tokenizer's JSON is read once)."""
        if self._texts is None:
            self._texts = TokenTexts(self.model.tokenizer)
        return self._texts

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
        plan = Plan(chat=False, logprobs=req.logprobs is not None, top=req.logprobs or 0,
                    constraint=req.constraint())
        return await self._answer(request, req, ids, plan, param="prompt", max_tokens=req.max_tokens,
                                  default_max_tokens=COMPLETION_MAX_TOKENS)

    async def chat_completions(self, request: Request) -> Response:
        req = api.parse(api.ChatRequest, await self._body(request))
        self._check_model(req.model)
        if self.chat is None:
            raise api.APIError(f"chat is not available: {self.chat_refusal}", param="messages",
                               code="chat_template_missing")
        if req.top_logprobs and not req.logprobs:
            raise api.APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        tools, tool_constraint, reading = tool_plan(req, self.chat.source)
        messages = [m.for_template() for m in req.messages]
        ids = await _in_thread(self._chat_ids, (messages, tools), param="messages")
        plan = Plan(chat=True, logprobs=req.logprobs, top=req.top_logprobs or 0,
                    constraint=tool_constraint or req.constraint(), reading=reading,
                    names=frozenset(t.function.name for t in req.tools or ()),
                    parts=tuple((f"the parameters of function {t.function.name!r}", t.function.parameters or
                                 {"type": "object"}) for t in req.tools or ()) if reading == "array" else ())
        return await self._answer(request, req, ids, plan, param="messages", max_tokens=req.new_tokens(),
                                  default_max_tokens=None)

    # -- prompts ----------------------------------------------------------------------------------
    def _encode(self, prompt: str) -> list[int]:
        return self.model.encode(prompt)  # as `generate --prompt`: the folder's special tokens added

    def _chat_ids(self, messages_and_tools: tuple[list[dict[str, Any]], list[dict] | None]) -> list[int]:
        text = self.chat.render(*messages_and_tools)
        ids = list(self.model.tokenizer.encode(text, add_special_tokens=False).ids)  # the template has them
        if not ids:
            raise InputError("the chat template rendered no tokens")
        return ids

    def _constraints(self, plan_and_n: tuple[Plan, int]) -> list[Any]:
        """``n`` fresh matchers of the plan's constraint, compiled and admitted (the model's tokenizer
        made once, on first use)."""
        plan, n = plan_and_n
        with self._compiling:
            if self._grammars is None:
                eos = self.model.special.get("eos_token_id")
                self._grammars = Grammars(self.model.tokenizer.to_str(), self.model.layout.vocab_size,
                                          [eos] if isinstance(eos, int) else list(eos or []))
        for what, schema in plan.parts:
            self._grammars.constraints("json_schema", schema, what=what)
        return self._grammars.constraints(*plan.constraint, n, what=plan.constraint_names()[1])

    # -- generation -------------------------------------------------------------------------------
    def _submit(self, req: Any, ids: list[int], plan: Plan, constraints: list[Any], *, param: str,
                max_tokens: int | None, default_max_tokens: int | None) -> list[Choice]:
        room = self.engine.slot_length - len(ids)
        if max_tokens is None:  # the default: as many as fit (at least 1, so a prompt too long is refused below)
            max_tokens = max(1, room if default_max_tokens is None else min(default_max_tokens, room))
            param_of_length = param
        else:
            param_of_length = "max_tokens" if room > 0 else param
        bias, seed, stops = req.token_bias(self.model.layout.vocab_size), request_seed(req), req.stops()
        choices: list[Choice] = []
        for index in range(req.n):
            fields = sampling_fields(req, index, seed, bias, logprobs=plan.logprobs, top_logprobs=plan.top)
            chooser = Chooser(fields, prompt=ids, constraint=constraints[index] if constraints else None)
            stream = submit_generation(self.engine, ids, max_tokens, name="max_tokens", pick=chooser,
                                       follow=choices[0].stream if choices else None,
                                       **({"eos_token_id": None} if req.ignore_eos else {}))
            if isinstance(stream, Refusal):
                for choice in choices:  # all or nothing: a request is never answered in part
                    choice.stream.cancel()
                too_long = stream.kind == "invalid" and len(ids) + max_tokens > self.engine.slot_length
                raise openai_error(stream, param=param_of_length if too_long else
                                   (param if stream.kind == "invalid" else None),
                                   code="context_length_exceeded" if too_long else OPENAI_ERRORS[stream.kind][2])
            choices.append(Choice(index, stream, chooser, TextStream(self.model.decode, stops)))
        return choices

    async def _answer(self, request: Request, req: Any, ids: list[int], plan: Plan, *, param: str,
                      max_tokens: int | None, default_max_tokens: int | None) -> Response:
        constraints = []
        if plan.constraint is not None:  # compiled and admitted before the request takes a slot
            if self._compilers is None:
                import anyio  # optional: comes with starlette

                self._compilers = anyio.CapacityLimiter(COMPILERS)
            constraints = await _in_thread(self._constraints, (plan, req.n), param=plan.constraint_names()[0],
                                           limiter=self._compilers)
        choices = self._submit(req, ids, plan, constraints, param=param, max_tokens=max_tokens,
                               default_max_tokens=default_max_tokens)
        ident = api.new_id("chatcmpl" if plan.chat else "cmpl")
        answers = Answers(self, plan, ident, len(ids))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(answers.events(choices, include_usage), [c.stream for c in choices])
        return await answers.whole(request, choices)


class EventStream(StreamingResponse):
    """Server-sent events that cancel their engine streams however the response ends (the client
    gone included), so a slot is never held for nobody."""

    def __init__(self, events: AsyncIterator[bytes], streams: list[Any]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                if not stream.done:
                    stream.cancel()


async def _in_thread(function: Any, argument: Any, *, param: str, limiter: Any = None) -> Any:
    """``function(argument)`` in a worker thread (tokenizing and rendering a template are CPU work that
    would hold every other client's stream); its ``InputError`` as a 400 naming ``param``."""
    import anyio.to_thread  # optional: comes with starlette

    try:
        return await anyio.to_thread.run_sync(function, argument, limiter=limiter)
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
