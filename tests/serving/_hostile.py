"""Hostile OpenAI requests by class, made by seeded mutation, and the check every answer must pass:
the hostile suite (``tests/serving/test_hostile_openai.py``) and its record
(``benchmarks/hostile_openai.py``) send the same trials.

Each class makes ``count`` trials from a ``random.Random``: structured output past the grammar
engine's limits (a schema that requires itself, ``anyOf`` past 2,000 branches, 10^5 to 10^6
repeats, patterns of hundreds of KB, Lark rules without end), constraints that match no text or
only the empty text, tool parameters of the same kinds, random mutations of a valid schema, and
broken HTTP framing on a raw socket. Requests go to the completions or the chat endpoint, streamed
or not, at random: a refusal must come before the first event, so streaming changes nothing.

:func:`check` is the property: a 4xx whose body is one line of OpenAI's error object naming the
problem, no traceback and none of the engine's internals, within :data:`TIME_LIMIT_S`; a trial
that may be answered (a mutation that leaves a valid schema, a grammar whose limit lies beyond
``max_tokens``) may instead be a 200 whose answer is whole (``stop``: it parses) or cut by
``max_tokens`` (``length``), never an empty ``stop``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import time
from typing import Any, Callable

from tests.serving._http import raw, request

#: seconds a hostile request may take to be answered (the admission of the costliest, a 900 KB
#: pattern or a 3,000-branch anyOf, takes about a second on one free core; the suite's machine is shared)
TIME_LIMIT_S = 10.0
#: what an answer must never show: a traceback, a source line, llguidance's parser state
LEAKS = ("Traceback", 'File "', "<state>", "<non-verbose/>", "Parser: {", "site-packages")
#: the greedy answer of the good request asked after each class (the tiny text Llama, tests/serving/conftest.py)
GOOD_REGEX = "(yes|no), [0-9]{2}"
#: trials per class in the suite's slow part (the benchmark sends a multiple): about 100 requests, ~30 s
COUNTS = {"schema-recursion": 12, "schema-wide-anyof": 3, "regex-repeat": 8, "regex-huge": 2, "regex-empty": 14,
          "grammar-lark": 12, "tool-parameters": 8, "schema-mutation": 30, "framing": 14}
def deep_limit(letters: int = 100) -> str:
    """A regex admitted (the probe walks 16 tokens) whose lexer limit lies ``letters`` characters
    into the answer (about 90 tokens at 100 on the test vocabulary; a vocabulary of long tokens
    needs more to stay past the probe)."""
    return f"[a-z]{{{letters}}}a{{1000000}}"


DEEP_LIMIT = deep_limit()
_EMPTY_CLASSES = (r"[^\s\S]", r"[^\d\D]", r"[^\w\W]", r"[a&&b]")
_ONLY_EMPTY = ("(|)", "a{0}", "(?:)", "(a{0}|)", "()", "(?:b{0}){3}")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One hostile request: a JSON ``body`` for ``path``, or ``raw`` bytes on a socket (framing);
    ``want``: words the refusal's message must hold (lower case); ``may_answer``: a truthful 200
    also passes."""

    cls: str
    name: str
    path: str = "/v1/completions"
    body: dict | None = None
    raw: bytes | None = None
    want: tuple[str, ...] = ()
    may_answer: bool = False
    param: str | None = None


@dataclasses.dataclass
class Outcome:
    trial: Trial
    status: int
    seconds: float
    message: str
    answered: bool = False  # a 200 that passed the check


# -- request bodies ---------------------------------------------------------------------------------
def _request(rng: random.Random, constraint: dict, *, max_tokens: int = 8) -> tuple[str, dict]:
    """A completion or a chat request (at random) carrying ``constraint``, streamed or not."""
    body = {"model": "model", "max_tokens": max_tokens, "temperature": 0, "stream": rng.random() < 0.5, **constraint}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": "hello the world"}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hello"}]}


def _schema_format(schema: Any) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}


def _tools(rng: random.Random, schema: Any) -> tuple[str, dict]:
    names = [f"tool_{i}" for i in range(rng.randint(1, 3))]
    hostile = rng.choice(names)
    tools = [{"type": "function", "function": {"name": n, "parameters": schema if n == hostile else
                                               {"type": "object", "properties": {"x": {"type": "integer"}}}}}
             for n in names]
    choice = "required" if rng.random() < 0.5 else {"type": "function", "function": {"name": hostile}}
    return "/v1/chat/completions", {"model": "model", "max_tokens": 8, "temperature": 0, "stream": rng.random() < 0.5,
                                    "messages": [{"role": "user", "content": "hello"}], "tools": tools,
                                    "tool_choice": choice}


def _word(rng: random.Random, n: int = 6) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))


# -- schemas that require themselves --------------------------------------------------------------
def recursive_schema(rng: random.Random) -> dict:
    """A schema no finite value matches: a cycle of 1 to 4 required steps (property, items,
    prefixItems, allOf, $ref), with optional decoys around it."""
    names = [_word(rng) for _ in range(rng.randint(1, 4))]
    defs: dict[str, Any] = {}
    for i, name in enumerate(names):
        target = {"$ref": f"#/$defs/{names[(i + 1) % len(names)]}"}
        step = rng.choice(("property", "items", "prefixItems", "allOf", "ref"))
        if step == "property":
            key = _word(rng, 3)
            defs[name] = {"type": "object", "properties": {key: target, "note": {"type": "string"}}, "required": [key]}
        elif step == "items":
            defs[name] = {"type": "array", "items": target, "minItems": rng.randint(1, 3)}
        elif step == "prefixItems":
            defs[name] = {"type": "array", "prefixItems": [target], "minItems": 1}
        elif step == "allOf":
            defs[name] = {"allOf": [target, {"type": "object"}]}
        else:
            defs[name] = target
    if len(names) == 1 and rng.random() < 0.5:  # the plainest: the root requires itself
        key = _word(rng, 3)
        return {"type": "object", "properties": {key: {"$ref": "#"}}, "required": [key]}
    return {"$defs": defs, "$ref": f"#/$defs/{names[0]}"}


def wide_schema(rng: random.Random) -> dict:
    """``anyOf`` with 2,001 to 2,600 object branches (llguidance's row limit is 2,000 items)."""
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                      for i in range(rng.randint(2001, 2600))]}


def long_pattern_schema(rng: random.Random) -> dict:
    """A required string whose pattern repeats one character 2 x 10^5 to 10^6 times."""
    pattern = f"^a{{{rng.randint(200_000, 10**6)}}}$"
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}


# -- the classes ----------------------------------------------------------------------------------
def _schema_recursion(rng: random.Random, i: int) -> Trial:
    path, body = _request(rng, _schema_format(recursive_schema(rng)))
    return Trial("schema-recursion", f"schema-recursion-{i}", path, body, want=("can match no value",),
                 param="response_format")


def _schema_wide(rng: random.Random, i: int) -> Trial:
    path, body = _request(rng, _schema_format(wide_schema(rng)))
    return Trial("schema-wide-anyof", f"schema-wide-anyof-{i}", path, body, want=("limits",), param="response_format")


def _regex_repeat(rng: random.Random, i: int) -> Trial:
    n = rng.randint(200_000, 10**6)
    k = rng.randint(60, 120)
    pattern = rng.choice((f"a{{{n}}}", f"{_word(rng, 2)}x{{{n}}}", f"(?:b{{{n}}})c",
                          f"((((a{{{k}}}){{{k}}}){{{k}}}){{{k}}})"))
    path, body = _request(rng, {"regex": pattern})
    return Trial("regex-repeat", f"regex-repeat-{i}", path, body, want=("limits",), param="regex")


def _regex_huge(rng: random.Random, i: int) -> Trial:
    pattern = "a" * rng.randint(700_000, 900_000)  # within the body limit of 1 MiB
    path, body = _request(rng, {"regex": pattern})
    return Trial("regex-huge", f"regex-huge-{i}", path, body, want=("limits",), param="regex")


def _regex_empty(rng: random.Random, i: int) -> Trial:
    if rng.random() < 0.6:
        pattern = rng.choice(("", _word(rng, rng.randint(1, 4)))) + rng.choice(_EMPTY_CLASSES) + \
            rng.choice(("", "+", "*x", _word(rng, 2)))
        if pattern.endswith("*x"):
            pattern = pattern[:-2] + "x"  # (a star would let the empty class match nothing: the empty text)
        want = ("can match no text",)
    else:
        pattern, want = rng.choice(_ONLY_EMPTY), ("only the empty text",)
    path, body = _request(rng, {"regex": pattern})
    return Trial("regex-empty", f"regex-empty-{i}", path, body, want=want, param="regex")


def _grammar_lark(rng: random.Random, i: int) -> Trial:
    word = _word(rng, 2)
    form = rng.choice(("repeat", "wide", "no-end", "dead-end", "unknown"))
    if form == "repeat":
        grammar, want = f'start: "{word}"{{{rng.randint(100_000, 10**6)}}}', ("limits",)
    elif form == "wide":
        grammar = "start: " + " | ".join(f'"{word}{j}"' for j in range(rng.randint(2001, 4000)))
        want = ("limits",)
    elif form == "no-end":  # a rule that only ever goes on: no text matches
        grammar, want = f'start: x\nx: "{word}" x', ("limits",)
    elif form == "dead-end":
        grammar, want = f'start: "{word}" x\nx: x "b"', ("no way to go on",)
    else:
        grammar, want = f"start: {word}_rule", ("not valid",)
    path, body = _request(rng, {"grammar": grammar})
    return Trial("grammar-lark", f"grammar-lark-{form}-{i}", path, body, want=want, param="grammar")


def _tool_parameters(rng: random.Random, i: int) -> Trial:
    form = rng.choice(("recursion", "wide", "pattern"))
    schema = {"recursion": recursive_schema, "wide": wide_schema, "pattern": long_pattern_schema}[form](rng)
    path, body = _tools(rng, schema)
    want = ("can match no value",) if form == "recursion" else ("limits",)
    return Trial("tool-parameters", f"tool-parameters-{form}-{i}", path, body, want=want, param="tools")


#: junk a mutation puts in a schema keyword (of every JSON type, and values out of range)
_JUNK = (5, -1, 1e308, "x", "(", "", None, True, False, [], [1, "a"], {}, {"$ref": "#/nowhere"},
         {"$ref": "http://127.0.0.1:9/x.json"}, {"type": "nope"}, {"minimum": 5, "maximum": 3}, {"enum": []})
_KEYWORDS = ("type", "properties", "required", "items", "minimum", "maximum", "minLength", "maxLength", "pattern",
             "enum", "const", "anyOf", "allOf", "oneOf", "$ref", "additionalProperties", "minItems", "maxItems",
             "format", "multipleOf", "not", "prefixItems", "$defs")


def base_schema() -> dict:
    return {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "colour": {"enum": ["red", "green"]}}, "required": ["ok", "n", "colour"], "additionalProperties": False}


def _mutate(rng: random.Random, schema: dict) -> dict:
    """1 to 4 random edits of a copy of ``schema``: a keyword set to junk, removed, or nested."""
    schema = json.loads(json.dumps(schema))
    for _ in range(rng.randint(1, 4)):
        nodes = [schema, *schema["properties"].values()] if isinstance(schema.get("properties"), dict) else [schema]
        node = rng.choice([n for n in nodes if isinstance(n, dict)] or [schema])
        edit = rng.random()
        if edit < 0.6:
            node[rng.choice(_KEYWORDS)] = rng.choice(_JUNK)
        elif edit < 0.8 and node:
            node.pop(rng.choice(list(node)))
        else:
            node[rng.choice(("items", "not", "additionalProperties"))] = json.loads(json.dumps(node))
    return schema


def _schema_mutation(rng: random.Random, i: int) -> Trial:
    path, body = _request(rng, _schema_format(_mutate(rng, base_schema())), max_tokens=24)
    return Trial("schema-mutation", f"schema-mutation-{i}", path, body, may_answer=True, param="response_format")


_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
_BODY = b'{"model": "model", "prompt": "hi"}'
#: broken framing: kind -> (header lines, what follows the head)
_FRAMES: dict[str, Callable[[random.Random], tuple[str, bytes]]] = {
    "negative-length": lambda rng: (f"Content-Length: -{rng.randint(1, 10**9)}\r\n", _BODY),
    "doubled-length": lambda rng: (lambda n: (f"Content-Length: {n}\r\nContent-Length: {n + rng.randint(1, 99)}\r\n",
                                               _BODY))(rng.randint(1, 99)),
    "signed-length": lambda rng: (f"Content-Length: +{rng.randint(1, 99)}\r\n", _BODY),
    "spaced-length": lambda rng: (f"Content-Length: {rng.randint(1, 9)} {rng.randint(1, 9)}\r\n", _BODY),
    "unknown-transfer-encoding": lambda rng: (f"Transfer-Encoding: {rng.choice(('gzip', 'br', 'x-' + _word(rng)))}\r\n",
                                              _BODY),
    "bad-chunk": lambda rng: ("Transfer-Encoding: chunked\r\n", _word(rng).encode() + b"\r\n"),
    "header-without-colon": lambda rng: (f"{_word(rng)} {_word(rng)}\r\n", b""),
}


def _framing(rng: random.Random, i: int) -> Trial:
    kind = rng.choice([*_FRAMES, "garbage-request-line"])
    if kind == "garbage-request-line":
        junk = bytes(rng.randrange(1, 256) for _ in range(rng.randint(3, 40))).replace(b"\r", b"").replace(b"\n", b"")
        raw = b"\x01" + junk + b"\r\n\r\n"
    else:
        headers, rest = _FRAMES[kind](rng)
        raw = _HEAD + headers.encode() + b"\r\n" + rest
    return Trial("framing", f"framing-{kind}-{i}", raw=raw, want=("not valid http",))


#: class -> (what it is, its trial maker); the issue's requests are :func:`issue_trials`
CLASSES: dict[str, tuple[str, Callable[[random.Random, int], Trial]]] = {
    "schema-recursion": ("json_schema requiring itself (property, items, prefixItems, allOf, $ref cycles)",
                         _schema_recursion),
    "schema-wide-anyof": ("json_schema anyOf of 2,001-2,600 object branches", _schema_wide),
    "regex-repeat": ("regex repeats of 2x10^5-10^6, nested repeats", _regex_repeat),
    "regex-huge": ("regex of 700-900 KB", _regex_huge),
    "regex-empty": ("regex matching no text or only the empty text", _regex_empty),
    "grammar-lark": ("Lark grammars: 10^5+ repeats, 2,001+ alternatives, rules without end, dead ends, unknown names",
                     _grammar_lark),
    "tool-parameters": ("tool parameters requiring themselves, 2,001+ branches, 10^5+ repeats (required/named)",
                        _tool_parameters),
    "schema-mutation": ("a valid json_schema with 1-4 random edits (junk values, removed or nested keywords)",
                        _schema_mutation),
    "framing": ("broken HTTP framing on a raw socket (Content-Length negative/doubled/signed, chunks, "
                "transfer codings, header and request lines)", _framing),
}


def trials(cls: str, count: int, seed: int = 0) -> list[Trial]:
    rng = random.Random(f"{cls}-{seed}")
    return [CLASSES[cls][1](rng, i) for i in range(count)]


def issue_trials() -> list[Trial]:
    """The issue's requests that ended in HTTP 500 or an empty 200, and its framing cases."""
    rng = random.Random(0)
    self_ref = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    wide = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                      for i in range(3000)]}
    cases = [
        ("self-requiring-property", _schema_format(self_ref), ("can match no value",), "response_format"),
        ("anyof-3000-branches", _schema_format(wide), ("limits",), "response_format"),
        ("regex-repeat-10^6", {"regex": "a{1000000}"}, ("limits",), "regex"),
        ("regex-900kb", {"regex": "a" * 900_000}, ("limits",), "regex"),
        ("regex-nested-repeats", {"regex": "((((a{50}){50}){50}){50})"}, ("limits",), "regex"),
        ("grammar-repeat-10^6", {"grammar": 'start: "a"{1000000}'}, ("limits",), "grammar"),
        ("regex-matches-nothing", {"regex": r"[^\s\S]"}, ("can match no text",), "regex"),
    ]
    out = []
    for stream in (False, True):
        for name, constraint, want, param in cases:
            if stream and ("900kb" in name or "3000" in name):
                continue  # the costliest two (a second each) once: streaming is the same admission
            body = {"model": "model", "prompt": "hello", "max_tokens": 8, "temperature": 0, "stream": stream,
                    **constraint}
            out.append(Trial("issue", f"{name}{'-stream' if stream else ''}", "/v1/completions", body, want=want,
                             param=param))
    for name, schema in (("tool-self-requiring", self_ref),):
        path, body = _tools(rng, schema)
        out.append(Trial("issue", name, path, {**body, "tool_choice": "required", "stream": False},
                         want=("can match no value",), param="tools"))
    for name, extra in (("negative-content-length", b"Content-Length: -5\r\n"),
                        ("doubled-content-length", b"Content-Length: 5\r\nContent-Length: 7\r\n")):
        out.append(Trial("issue", name, raw=_HEAD + extra + b"\r\n" + _BODY, want=("not valid http",)))
    return out


# -- sending and checking ---------------------------------------------------------------------------
def send(port: int, trial: Trial) -> tuple[int, bytes, float]:
    """The trial's request on 127.0.0.1:``port``: status, whole body (a stream read to its end), seconds."""
    start = time.perf_counter()
    if trial.raw is not None:
        status, body = raw(port, trial.raw)
    else:
        status, _, body = request(port, "POST", trial.path, json.dumps(trial.body).encode(), timeout=60)
    return status, body, time.perf_counter() - start


def check(trial: Trial, status: int, body: bytes, seconds: float) -> Outcome:
    """The property (see the module docstring); AssertionError naming the trial when it fails."""
    text = body.decode("utf-8", "replace")
    where = f"{trial.name}: {status} {text[:300]!r}"
    assert seconds < TIME_LIMIT_S, f"{where}: answered in {seconds:.1f} s"
    assert not any(leak in text for leak in LEAKS), where
    if status == 200 and trial.may_answer:
        _check_answer(trial, text)
        return Outcome(trial, status, seconds, "", answered=True)
    assert 400 <= status < 500, where
    assert text.strip().count("\n") == 0, where
    error = json.loads(text)["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert isinstance(message, str) and message and len(message) < 1000, where
    assert all(w in message.lower() for w in trial.want), f"{where}: wanted {trial.want}"
    if trial.param is not None:
        assert error["param"] == trial.param, where
    return Outcome(trial, status, seconds, message)


def _check_answer(trial: Trial, text: str) -> None:
    """A 200 to a trial that may be answered: every choice whole JSON (``stop``) or cut by ``length``;
    a stream carries no error event."""
    if trial.body.get("stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", trial.name
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), f"{trial.name}: {text[:300]}"
        pieces = "".join((c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "")
                         for c in chunks if c.get("choices"))
        reason = next(c["choices"][0]["finish_reason"] for c in reversed(chunks)
                      if c.get("choices") and c["choices"][0]["finish_reason"])
        answers = [(pieces, reason)]
    else:
        choices = json.loads(text)["choices"]
        answers = [(c.get("text", (c.get("message") or {}).get("content")), c["finish_reason"]) for c in choices]
    for content, reason in answers:
        assert reason in ("stop", "length"), f"{trial.name}: {reason}"
        if reason == "stop":  # a whole value: never empty
            assert content, f"{trial.name}: an empty answer ended with stop"
            json.loads(content)


def good_answer_ok(port: int) -> bool:
    """The server still answers: a constrained request gives a text that matches its regex."""
    body = {"model": "model", "prompt": "hello", "max_tokens": 16, "temperature": 0, "regex": GOOD_REGEX}
    status, _, answer = request(port, "POST", "/v1/completions", json.dumps(body).encode(), timeout=60)
    return status == 200 and re.fullmatch(GOOD_REGEX, json.loads(answer)["choices"][0]["text"]) is not None
