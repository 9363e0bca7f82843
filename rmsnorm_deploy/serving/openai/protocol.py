"""The OpenAI API's request bodies (pydantic, strict), its answers and its error object, for
``serving.openai.app``.

A request is validated whole before anything runs: types are strict (``"max_tokens": "5"`` or
``true`` is refused, not coerced), ranges are OpenAI's (``temperature`` 0 to 2, ``top_p`` in
(0, 1]), unknown parameters are refused, and parameters this server does not implement are
accepted only at the value that asks for nothing (``n`` 1, ``presence_penalty`` 0, ``logprobs``
false, ...): anything else is refused in one line rather than silently ignored. Every refusal is
an :class:`APIError`, answered as ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

#: parameters accepted only at the value that asks for nothing this server does not do
UNSUPPORTED = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (False, True),
    "response_format": ({"type": "text"},),
}
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatRequest(_Request):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

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


def completion(ident: str, model: str, text: str, finish_reason: str, use: dict[str, int]) -> dict[str, Any]:
    return {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}], "usage": use}


def chat_completion(ident: str, model: str, text: str, finish_reason: str, use: dict[str, int]) -> dict[str, Any]:
    return {"id": ident, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": use}


def chunk(ident: str, model: str, *, chat: bool, text: str | None = None, finish_reason: str | None = None,
          role: bool = False, use: dict[str, int] | None = None) -> dict[str, Any]:
    """One server-sent event's data: a piece of text, the finish reason, or (``use``) the usage
    alone with no choices (``stream_options.include_usage``)."""
    base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}
    if use is not None:
        return {**base, "choices": [], "usage": use}
    if chat:
        delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {**base, "choices": [choice]}


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "rmsnorm-deploy"}


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()
