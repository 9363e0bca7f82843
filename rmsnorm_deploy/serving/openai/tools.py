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
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from rmsnorm_deploy.serving.openai.protocol import APIError

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


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
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in functions.items()]
        return tools, ("json_schema", {"type": "array", "minItems": 1, "items": {"anyOf": items}}), "array"
    name = choice.function.name
    if name not in functions:
        raise APIError(f"tool_choice names the function {name[:64]!r}, which is not in tools", param="tool_choice")
    return tools, ("json_schema", functions[name]), f"named:{name}"


def read_calls(text: str, reading: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of an answer (see the module docstring)."""
    if reading == "text":
        return text, []
    if reading.startswith("named:"):
        return None, [_call(reading.removeprefix("named:"), json.loads(text))]
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
    return _call(value["name"], arguments)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
