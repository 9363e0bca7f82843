"""Tool calls: ``tools`` rendered by the model's chat template (transformers'
``apply_chat_template(tools=...)``), and the calls read back out of the answer.

``tool_choice``:

- ``"auto"`` (the default with tools): the template shows the tools; the answer is parsed for
  calls in the two conventions templates teach: Hermes / Qwen's ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` (any number, text around them is the content) and Llama 3's
  bare JSON ``{"name": ..., "parameters": {...}}`` (the whole answer, ``;``-separated for
  several, ``<|python_tag|>`` first or not). A call to a function not in ``tools`` is text.
- ``"none"``: no tools in the prompt, no parsing (vLLM's default for ``none``).
- ``"required"`` and a named function: the answer is constrained (``serving.engine.constraints``)
  as vLLM constrains it: a JSON array of ``{"name", "parameters"}`` objects of the given tools
  (at least one), or the named function's parameters as one JSON object.

A template that never mentions ``tools`` cannot show them to the model: ``auto`` is refused there
in one line rather than answered by a model that was never told of the tools.

A call's ``arguments`` are the JSON text the model wrote (checked to parse), so a streamed answer
can send them as they come: :class:`CallStream` reads the text piece by piece and gives OpenAI's
deltas (content; then per call its ``index``, ``id``, ``type`` and ``function.name`` once the name
is whole, then ``function.arguments`` fragments), and the whole answer is read by the same code, so
the calls a client assembles from the stream equal the whole answer's.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from rmsnorm_deploy.serving.engine.schema_recursion import endless_requirement
from rmsnorm_deploy.serving.openai.protocol import APIError

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
#: schema keywords whose values are JSON values, not schemas (a "$ref" key inside is data)
_VALUES = ("const", "enum", "default", "examples")
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(,\s*"(?:arguments|parameters)"\s*:\s*)?')


def tool_plan(req: Any, template_source: str | None) -> tuple[list[dict] | None, tuple[str, Any] | None, str]:
    """``(tools for the template, the constraint, how to read the answer)`` of a chat request; the
    reading is ``"text"``, ``"parse"`` (auto), ``"array"`` (required) or ``"named:NAME"``."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice asks for a tool call but tools is empty; give tools", param="tool_choice")
        return None, None, "text"
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice or "auto"
    if choice == "none":
        return None, None, "text"
    if req.constraint() is not None:
        raise APIError("tools and response_format/regex/grammar both shape the answer; give one", param="tools")
    functions = {t.function.name: t.function.parameters or {"type": "object"} for t in req.tools}
    if choice == "auto":
        if template_source is None or "tools" not in template_source:
            raise APIError("this model's chat template does not take tools, so the model cannot be told of them; "
                           "use tool_choice \"required\" or a named function (the answer is then constrained)",
                           param="tools")
        return tools, None, "parse"
    if choice == "required":
        for name, schema in functions.items():
            _finishable(name, schema)
        defs = {f"tool{i}": _rooted(schema, f"#/$defs/tool{i}") for i, schema in enumerate(functions.values())}
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/tool{i}"}},
                  "required": ["name", "parameters"]} for i, name in enumerate(functions)]
        return tools, ("json_schema", {"$defs": defs, "type": "array", "minItems": 1, "items": {"anyOf": items}}), \
            "array"
    name = choice.function.name
    if name not in functions:
        raise APIError(f"tool_choice names the function {name[:64]!r}, which is not in tools", param="tool_choice")
    _finishable(name, functions[name])
    return tools, ("json_schema", functions[name]), f"named:{name}"


def _finishable(name: str, schema: dict) -> None:
    """Refuse a function whose parameters no finite value matches (``schema_recursion``), naming it."""
    endless = endless_requirement(schema)
    if endless is not None:
        raise APIError(f"the parameters of function {name[:64]!r} can match no value: {endless}", param="tools")


def _rooted(schema: Any, root: str) -> Any:
    """``schema`` with its local ``$ref`` s (``#``, ``#/...``) pointing under ``root``, where it is
    placed inside the array schema of ``tool_choice: "required"`` (each function's parameters stay
    their own document)."""
    if isinstance(schema, list):
        return [_rooted(part, root) for part in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _VALUES else _rooted(value, root) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


def read_calls(text: str, reading: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of an answer (see the module docstring)."""
    if reading == "text":
        return text, []
    if reading.startswith("named:"):
        json.loads(text)  # a whole JSON value (else ValueError: the answer stays text)
        return None, [_call(reading.removeprefix("named:"), text.strip())]
    if reading == "array":
        return None, [_call(c["name"], c.get("parameters", {})) for c in json.loads(text)]
    calls, rest = [], text
    found = [m for m in _HERMES.finditer(text)]
    for match in found:
        call = _parsed(match.group(1), names)
        if call is not None:
            calls.append(call)
            rest = rest.replace(match.group(0), "", 1)
    if not found:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        parts = [_parsed(p, names) for p in body.split(";")] if body.startswith("{") else [None]
        if parts and all(p is not None for p in parts):
            calls, rest = parts, ""
    rest = rest.strip()
    return (rest or None) if calls else text, calls


def _parsed(text: str, names: set[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    raw = _raw_arguments(text)
    return _call(value["name"], raw if raw is not None and not isinstance(arguments, str) else arguments)


def _raw_arguments(call: str) -> str | None:
    """The arguments' JSON text as written in a call's JSON ``call`` (name first), or None."""
    match = _NAME.match(call)
    if not match or not match.group(2):
        return None
    end = _value_end(call, match.end())
    return call[match.end():end] if end is not None else None


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at ``start`` ends (exclusive), None while unclosed."""
    depth, quoted, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if quoted:
            escaped, quoted = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not c.isspace():
            return None  # not an object or array
    return None


class CallStream:
    """An answer read for tool calls as it comes (``reading`` "parse" or "named:NAME"): :meth:`push`
    each piece of text, then :meth:`finish`; each gives the deltas to send, ``{"content": str}`` or
    ``{"tool_calls": [delta]}``. Text that may still turn out to be a call is held back; what the
    deltas assemble to is :func:`read_calls` of the whole text (calls without their ids)."""

    def __init__(self, reading: str, names: set[str]):
        self.reading, self.names, self.text = reading, names, ""
        self.content_sent = ""  # the content handed out so far
        self.calls: dict[int, dict[str, Any]] = {}  # per call started (keyed by where it starts): index, id, sent
        self.mode = "named" if reading.startswith("named:") else None  # then "hermes" or "json"

    def push(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        return self._deltas(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(final=True)

    def _deltas(self, *, final: bool) -> list[dict[str, Any]]:
        text, out = self.text, []
        if self.mode is None:
            head = text.lstrip()
            if head.startswith(("{", _PYTHON_TAG)):
                self.mode = "json"
            elif head and not _PYTHON_TAG.startswith(head):
                self.mode = "hermes"
            elif not final:
                return []
        if self.mode == "named":
            out += self._call(0, '{"name": ' + json.dumps(self.reading.removeprefix("named:")) + ', "arguments": ' +
                              text.lstrip(), known=True)
            return out
        if self.mode == "json":
            body = text.lstrip().removeprefix(_PYTHON_TAG).lstrip()
            for number, part in enumerate(_split_calls(body)):
                out += self._call(number, part)
            content = "" if self.calls or not final else text
        else:
            for block in _HERMES.finditer(text):
                out += self._call(block.start(), block.group(1))
            opened = text.find(_OPEN)
            content = text[:opened] if opened >= 0 else text[:len(text) - _could_open(text)]
            content = content.rstrip()
        if final:
            whole_content, whole = read_calls(text, "parse", self.names)
            content = whole_content or "" if self.mode == "hermes" else content
            if len(whole) == len(self.calls):  # arguments not written right after the name: sent whole now
                for entry, call in zip(sorted(self.calls.values(), key=lambda e: e["index"]), whole):
                    if not entry["sent"] and call["function"]["arguments"]:
                        entry["sent"] = len(call["function"]["arguments"])
                        out.append({"tool_calls": [{"index": entry["index"],
                                                    "function": {"arguments": call["function"]["arguments"]}}]})
        if content.startswith(self.content_sent) and len(content) > len(self.content_sent):
            out.insert(0, {"content": content[len(self.content_sent):]})
            self.content_sent = content
        return out

    def _call(self, key: int, call: str, *, known: bool = False) -> list[dict[str, Any]]:
        """The deltas of the call starting at ``key`` (its JSON text so far): its start once its name
        is whole and one of the tools', then the arguments written since the last time."""
        match = _NAME.match(call)
        if match is None:
            return []
        name, out = json.loads(match.group(1)), []
        if not known and name not in self.names:
            return []
        if key not in self.calls:
            self.calls[key] = {"index": len(self.calls), "id": f"call_{uuid.uuid4().hex[:24]}", "sent": 0}
            out.append({"tool_calls": [{"index": self.calls[key]["index"], "id": self.calls[key]["id"],
                                        "type": "function", "function": {"name": name, "arguments": ""}}]})
        entry = self.calls[key]
        if match.group(2):
            end = _value_end(call, match.end())
            written = call[match.end():end if end is not None else len(call)].rstrip()
            if len(written) > entry["sent"]:
                out.append({"tool_calls": [{"index": entry["index"],
                                            "function": {"arguments": written[entry["sent"]:]}}]})
                entry["sent"] = len(written)
        return out


def _could_open(text: str) -> int:
    """How many trailing characters of ``text`` could begin ``<tool_call>`` (held back as content)."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0


def _split_calls(body: str) -> list[str]:
    """Llama 3's ``;``-separated calls as written so far (each a JSON object's text, perhaps unclosed)."""
    parts, start = [], 0
    while start < len(body):
        end = _value_end(body, start)
        if end is None:
            parts.append(body[start:])
            break
        parts.append(body[start:end])
        rest = body[end:].lstrip()
        if not rest.startswith(";"):
            break
        start = len(body) - len(rest) + 1
        while start < len(body) and body[start].isspace():
            start += 1
    return parts


def _call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
