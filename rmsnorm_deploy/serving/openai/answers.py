"""A request's choices answered: whole (one JSON body once every choice has ended) or streamed
(server-sent events, the choices' chunks interleaved as their tokens come), with each token's
logprobs where asked and tool calls read out of the text (``serving.openai.tools``).

A streamed answer whose text is read for tool calls (``tools`` given, ``tool_choice`` not
``none``) sends them piece by piece as OpenAI and vLLM do (``serving.openai.tools.CallStream``):
content as it comes (held back where it may begin a call), then per call a delta with its
``index``, ``id``, ``type`` and ``function.name``, then ``function.arguments`` fragments as the
model writes them. ``tool_choice: "required"`` (a JSON array) is sent in one chunk at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rmsnorm_deploy.serving.engine.constraints import GrammarStopped
from rmsnorm_deploy.serving.engine.engine import StreamCancelled, StreamFailed
from rmsnorm_deploy.serving.engine.submit import Refusal, ending
from rmsnorm_deploy.serving.openai import protocol as api
from rmsnorm_deploy.serving.openai.choices import Choice
from rmsnorm_deploy.serving.openai.text import TextStream
from rmsnorm_deploy.serving.openai.tools import CallStream, read_calls

#: the engine's outcome (``serving.engine.submit``) -> OpenAI's HTTP status, error type and code
OPENAI_ERRORS = {"invalid": (400, "invalid_request_error", None),
                 "busy": (429, "rate_limit_error", "rate_limit_exceeded"),
                 "unavailable": (503, "service_unavailable", None),
                 "cancelled": (503, "service_unavailable", None),
                 "failed": (500, "server_error", None)}


def openai_error(outcome: Refusal, **fields: Any) -> api.APIError:
    """The OpenAI error object of a generation the engine refused or ended early (:data:`OPENAI_ERRORS`)."""
    status, kind, code = OPENAI_ERRORS[outcome.kind]
    return api.APIError(outcome.message, status, type=kind, **{"code": code, **fields})


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a request asks of its answer beyond text."""

    chat: bool
    logprobs: bool = False
    top: int = 0  # alternatives per token
    constraint: tuple[str, Any] | None = None  # (kind, source): serving.engine.constraints
    reading: str = "text"  # how the text is read for tool calls (serving.openai.tools.read_calls)
    names: frozenset[str] = frozenset()  # the tools' function names
    #: (what, schema): parts admitted on their own before the whole (tool_choice "required": each
    #: function's parameters, so a limit is found in any of them and named)
    parts: tuple[tuple[str, Any], ...] = ()

    def constraint_names(self) -> tuple[str, str]:
        """``(param, what)``: the request parameter that set the constraint, and how its refusals
        name it."""
        kind = self.constraint[0] if self.constraint else ""
        if self.reading.startswith("named:"):
            return "tools", f"the parameters of function {self.reading.removeprefix('named:')[:64]!r}"
        if self.reading == "array":
            return "tools", 'the tools\' parameters (tool_choice "required")'
        if kind in ("regex", "grammar"):
            return kind, f"the {kind}"
        return "response_format", f"response_format {kind}"

    def refusal(self, outcome: Refusal) -> api.APIError:
        """The OpenAI error of a stream that ended early; a refusal names the constraint's parameter."""
        return openai_error(outcome, param=self.constraint_names()[0] if outcome.kind == "invalid" else None)


class Answers:
    """The answers of one request over ``endpoints`` (its model name, token texts, the model's eos)."""

    def __init__(self, endpoints: Any, plan: Plan, ident: str, prompt_tokens: int):
        self.name, self.texts, self.plan, self.ident = endpoints.name, endpoints.texts, plan, ident
        eos = endpoints.model.special.get("eos_token_id")
        self.eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.prompt_tokens = prompt_tokens

    def _logprobs(self, choice: Choice, *, final: bool, offset: int = 0) -> Any:
        if not self.plan.logprobs:
            return None
        records = choice.shown_records(self.eos, final=final)
        return self.texts.chat(records) if self.plan.chat else self.texts.completion(records, offset)

    def _usage(self, choices: list[Choice]) -> dict[str, int]:
        return api.usage(self.prompt_tokens, sum(len(c.text.ids) for c in choices))

    def _ending(self, choice: Choice, text: str) -> tuple[str | None, list[dict[str, Any]], str]:
        """``(content, tool_calls, finish_reason)`` of an ended choice."""
        reason = finish_reason(choice.stream, choice.text)
        if self.plan.reading == "text":
            return text, [], reason
        try:
            content, calls = read_calls(text, self.plan.reading, set(self.plan.names))
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens: not a whole call
            return text, [], reason
        return content, calls, "tool_calls" if calls else reason

    # -- whole ------------------------------------------------------------------------------------
    async def whole(self, request: Request, choices: list[Choice]) -> Response:
        async def collect(choice: Choice) -> str:
            return "".join([piece async for piece in pieces(choice.stream, choice.text)])

        collector = asyncio.ensure_future(asyncio.gather(*(collect(c) for c in choices)))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not collector.done():  # the client is gone: free the slots, nobody reads the answer
            collector.cancel()
            for choice in choices:
                choice.stream.cancel()
            return Response(status_code=499)
        try:
            texts = collector.result()
        except (StreamFailed, GrammarStopped, StreamCancelled) as exc:
            for choice in choices:
                choice.stream.cancel()
            raise self.plan.refusal(ending(exc)) from None
        answers = []
        for choice, text in zip(choices, texts):
            content, calls, reason = self._ending(choice, text)
            logprobs = self._logprobs(choice, final=True)
            answers.append(api.chat_choice(choice.index, content, reason, logprobs, calls) if self.plan.chat else
                           api.completion_choice(choice.index, text, reason, logprobs))
        build = api.chat_completion if self.plan.chat else api.completion
        return JSONResponse(build(self.ident, self.name, answers, self._usage(choices)))

    # -- streamed ---------------------------------------------------------------------------------
    async def events(self, choices: list[Choice], include_usage: bool) -> AsyncIterator[bytes]:
        def event(data: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

        queue: asyncio.Queue = asyncio.Queue()

        async def run(choice: Choice) -> None:
            try:
                async for data in self._choice_chunks(choice):
                    await queue.put(data)
            except (StreamFailed, GrammarStopped, StreamCancelled) as exc:
                await queue.put(exc)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(run(c)) for c in choices]
        try:
            for ended in range(len(choices)):
                while (data := await queue.get()) is not None:
                    if isinstance(data, BaseException):
                        yield event(self.plan.refusal(ending(data)).body())
                        yield b"data: [DONE]\n\n"
                        return
                    yield event(data)
            if include_usage:
                yield event(api.chunk(self.ident, self.name, chat=self.plan.chat, use=self._usage(choices)))
            yield b"data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    async def _choice_chunks(self, choice: Choice) -> AsyncIterator[dict[str, Any]]:
        chat, index, offset = self.plan.chat, choice.index, 0
        if chat:
            yield api.chunk(self.ident, self.name, chat=True, index=index, role=True)
        if self.plan.reading == "text":
            async for piece in pieces(choice.stream, choice.text):
                yield api.chunk(self.ident, self.name, chat=chat, index=index, text=piece,
                                logprobs=self._logprobs(choice, final=False, offset=offset))
                offset += len(piece)
            content, calls, reason = None, [], finish_reason(choice.stream, choice.text)
        elif self.plan.reading != "array":
            reader = CallStream(self.plan.reading, set(self.plan.names))
            async for piece in pieces(choice.stream, choice.text):
                for delta in reader.push(piece):
                    yield api.chunk(self.ident, self.name, chat=chat, index=index, text=delta.get("content"),
                                    tool_calls=delta.get("tool_calls"))
            for delta in reader.finish():
                yield api.chunk(self.ident, self.name, chat=chat, index=index, text=delta.get("content"),
                                tool_calls=delta.get("tool_calls"))
            content, calls, reason = None, [], self._ending(choice, reader.text)[2]
        else:
            text = "".join([piece async for piece in pieces(choice.stream, choice.text)])
            content, calls, reason = self._ending(choice, text)
        rest = self._logprobs(choice, final=True, offset=offset)
        if content or calls or (rest and (rest.get("content") or rest.get("tokens"))):
            yield api.chunk(self.ident, self.name, chat=chat, index=index, text=content, tool_calls=calls,
                            logprobs=rest)
        yield api.chunk(self.ident, self.name, chat=chat, index=index, finish_reason=reason)


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


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
