"""The OpenAI API's request bodies (pydantic, strict), its answers and its error object, for
``serving.openai.app``.

A request is validated whole before anything runs: types are strict (``"max_tokens": "5"`` or
``true`` is refused, not coerced), ranges are OpenAI's (``temperature`` 0 to 2, ``top_p`` in
(0, 1]), unknown parameters are refused, and parameters this server does not implement are
accepted only at the value that asks for nothing (``best_of`` 1, ``echo`` false, ``suffix`` ""):
anything else is refused in one line rather than silently ignored. Beside OpenAI's fields, vLLM's
extras ``top_k``, ``min_p``, ``repetition_penalty`` and the constraints ``regex`` and ``grammar``. Every refusal is
an :class:`APIError`, answered as ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

#: parameters accepted only at the value that asks for nothing this server does not do
UNSUPPORTED = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "parallel_tool_calls": (False, True),
}
#: the most choices one request may ask for (``n``), and the most alternatives per token (``top_logprobs``)
MAX_N, MAX_TOP_LOGPROBS = 8, 20
#: parameters a client may send that change nothing of the answer
IGNORED = ("user", "metadata", "store", "service_tier")
#: a union member's name in pydantic's error locations (not a parameter name)
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


class APIError(Exception):
    """A refusal in the OpenAI API's shape (HTTP ``status``; ``type``, ``param`` and ``code`` as
    OpenAI names them)."""

    def __init__(self, message: str, status: int = 400, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(" ".join(str(message).split()))
        self.message, self.status, self.type, self.param, self.code = str(self), status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    response_format: ResponseFormat | None = None
    regex: str | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    ignore_eos: bool = False  # vLLM's and llama-server's: the end-of-sequence token does not end the answer

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, allowed in UNSUPPORTED.items():
            if name in data and data[name] is not None and not _one_of(data[name], allowed):
                raise ValueError(f"{name}={_short(data[name])} is not supported by this server (it answers "
                                 f"{name}={_short(allowed[0])}); leave {name} out")
        return {k: v for k, v in data.items() if k not in UNSUPPORTED and k not in IGNORED}

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(f"stop has {len(stops)} strings; give at most 4", param="stop")
        if any(not s for s in stops):
            raise APIError("stop holds an empty string; give non-empty strings", param="stop")
        return stops

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """``logit_bias`` as token ids (keys: ids as strings, values -100 to 100, OpenAI's range)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise APIError(f"logit_bias: {key[:40]!r} is not a token id of this model (0 to {vocab_size - 1})",
                               param="logit_bias")
            if not -100 <= value <= 100:
                raise APIError(f"logit_bias[{key}] = {value:g} is outside -100 to 100", param="logit_bias")
            bias[int(key)] = float(value)
        return bias

    def constraint(self) -> tuple[str, Any] | None:
        """``(kind, source)`` of the one constraint asked for (``serving.engine.constraints``), or None."""
        asked = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            asked.append(("json_object", None) if fmt.type == "json_object" else
                         ("json_schema", fmt.json_schema.json_schema if fmt.json_schema else None))
            if asked[-1] == ("json_schema", None):
                raise APIError("response_format json_schema needs its json_schema.schema", param="response_format")
        if self.regex is not None:
            asked.append(("regex", self.regex))
        if self.grammar is not None:
            asked.append(("grammar", self.grammar))
        if len(asked) > 1:
            raise APIError(f"{' and '.join(k for k, _ in asked)} both constrain the answer; give one", param="regex")
        return asked[0] if asked else None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a list of one prompt is that prompt); several are refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(f"prompt holds {len(prompt)} prompts; this server takes one per request (send them "
                               "as separate requests: they are batched together)", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError("prompt is empty; give at least one character or token id", param="prompt")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (a tool call's arguments as an object where they are
        JSON: transformers' convention, which templates such as Qwen's ``tojson``)."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        message: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Request):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def new_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(f"max_tokens {self.max_tokens} and max_completion_tokens {self.max_completion_tokens} "
                           "differ; give one of them", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(model: type[_Request], body: bytes) -> Any:
    """``body`` (JSON) as ``model``, or an :class:`APIError` naming the first problem in one line."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    """One line for pydantic's first error (of a union's errors, the one that went deepest)."""
    errors = exc.errors(include_url=False)
    error = max(errors, key=lambda e: len([p for p in e["loc"] if not _is_tag(p)]))
    path = [str(p) for p in error["loc"] if not _is_tag(p)]
    param = ".".join(path) or None
    kind = error["type"]
    if kind == "json_invalid":
        return APIError(f"the body is not valid JSON ({error['msg'].split(': ', 1)[-1]})")
    if kind == "model_type":
        return APIError("the body must be a JSON object")
    if kind == "extra_forbidden":
        return APIError(f"unknown parameter {param!r}; see the OpenAI API reference for this endpoint's parameters",
                        param=param)
    if kind == "missing":
        return APIError(f"{param} is required", param=param)
    if kind == "value_error":  # ours (UNSUPPORTED): the message says it all
        return APIError(error["msg"].removeprefix("Value error, "), param=_unsupported_name(error["msg"]))
    return APIError(f"{param}: {error['msg'][:1].lower()}{error['msg'][1:]}, got {_short(error.get('input'))}",
                    param=param)


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and bool(_TYPE_TAG.match(part))


def _unsupported_name(message: str) -> str | None:
    found = re.search(r"(\w+)=", message)
    return found.group(1) if found else None


def _one_of(value: Any, allowed: tuple) -> bool:
    return any(type(value) is type(a) and value == a for a in allowed) or (
        isinstance(value, float) and any(type(a) is int and value == a for a in allowed))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- answers --------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(ident: str, model: str, choices: list[dict[str, Any]], use: dict[str, int]) -> dict[str, Any]:
    return {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def chat_completion(ident: str, model: str, choices: list[dict[str, Any]], use: dict[str, int]) -> dict[str, Any]:
    return {"id": ident, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, content: str | None, finish_reason: str, logprobs: Any = None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chunk(ident: str, model: str, *, chat: bool, index: int = 0, text: str | None = None,
          finish_reason: str | None = None, role: bool = False, use: dict[str, int] | None = None,
          logprobs: Any = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One server-sent event's data: a piece of choice ``index``'s text (its tokens' ``logprobs``,
    its ``tool_calls``), its finish reason, or (``use``) the usage alone with no choices
    (``stream_options.include_usage``)."""
    base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}
    if use is not None:
        return {**base, "choices": [], "usage": use}
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
    else:
        choice = completion_choice(index, text or "", finish_reason, logprobs)
    return {**base, "choices": [choice]}


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "rmsnorm-deploy"}


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()
