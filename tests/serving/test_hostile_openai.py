"""The hostile suite for the OpenAI API's bodies (``tests/serving/_hostile.py``): structured output
past the grammar engine's limits or matching nothing (``response_format``, ``regex``,
``grammar``, tool parameters), mutated schemas and broken HTTP framing, each answered with a 4xx
and one JSON line (a truthful 200 where a mutation leaves a valid schema) within the time limit,
no traceback, and the server still answering a good request after each class.

One server for the module (the tiny text Llama, ``tests/serving/conftest.py``). The quick part
sends the issue's requests (streamed and not) and its framing cases; the seeded classes are
``slow``. Beside them, the admission itself as a property (hypothesis) without a server: any
regex or schema from a grammar of hostile pieces is admitted or refused in one line, never an
exception of another kind, and an admitted one either generates or stops with ``GrammarStopped``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")
pytest.importorskip("uvicorn", reason="the API is served by uvicorn")
pytest.importorskip("llguidance", reason="structured output runs through llguidance (the serve extra)")
pytest.importorskip("transformers", reason="chat prompts are rendered by transformers' apply_chat_template")

from tests.serving import _hostile  # noqa: E402
from tests.serving._http import request  # noqa: E402
from tests.serving._openai import openai_server  # noqa: E402
from tests.serving.conftest import TEXT_VOCAB  # noqa: E402

#: trials per class in the slow part (each class's own seed): about 100 requests, ~30 s on 2 cores
COUNTS = {"schema-recursion": 12, "schema-wide-anyof": 3, "regex-repeat": 8, "regex-huge": 2, "regex-empty": 14,
          "grammar-lark": 12, "tool-parameters": 8, "schema-mutation": 30, "framing": 14}


@pytest.fixture(scope="module")
def served(text_exports):
    with openai_server(text_exports("ort")) as served:
        yield served


def _port(served) -> int:
    return int(served.url.rsplit(":", 1)[1].split("/")[0])


def _run(served, trials) -> list[_hostile.Outcome]:
    port, outcomes = _port(served), []
    for trial in trials:
        status, body, seconds = _hostile.send(port, trial)
        outcomes.append(_hostile.check(trial, status, body, seconds))
    assert _hostile.good_answer_ok(port), "the server stopped answering a good request"
    return outcomes


@pytest.mark.parametrize("trial", _hostile.issue_trials(), ids=lambda t: t.name)
def test_the_issues_requests_are_refused_before_generation(served, trial):
    before = dict(served.engine.counts)
    outcome = _run(served, [trial])[0]
    assert outcome.status in (400, 431), outcome
    if trial.raw is None:  # refused at admission: nothing was queued
        assert served.engine.counts["error"] == before.get("error", 0)


@pytest.mark.slow
@pytest.mark.parametrize("cls", list(COUNTS))
def test_each_hostile_class_is_refused_in_one_line(served, cls):
    outcomes = _run(served, _hostile.trials(cls, COUNTS[cls]))
    assert len(outcomes) == COUNTS[cls]
    if cls != "schema-mutation":
        assert not any(o.answered for o in outcomes)


def _post(served, body: dict) -> tuple[int, bytes]:
    status, _, answer = request(_port(served), "POST", "/v1/completions", json.dumps(body).encode(), timeout=60)
    return status, answer


#: admitted (its probe walks only 16 tokens) but past the lexer's limits some 90 tokens in
DEEP_LIMIT = "[a-z]{100}a{1000000}"


def test_a_limit_met_mid_answer_ends_that_request_alone_with_a_400(served):
    good = {"model": "model", "prompt": "hello the world", "max_tokens": 40, "temperature": 0}
    hostile = {"model": "model", "prompt": "hello", "max_tokens": 300, "temperature": 0, "regex": DEEP_LIMIT}
    _, alone = _post(served, good)
    with ThreadPoolExecutor(2) as pool:
        refused, answered = pool.submit(_post, served, hostile), pool.submit(_post, served, good)
        (status, body), (good_status, good_body) = refused.result(), answered.result()
    assert status == 400 and body.count(b"\n") == 0, body
    error = json.loads(body)["error"]
    assert error["param"] == "regex" and "beyond the grammar engine's limits after" in error["message"], error
    assert good_status == 200 and json.loads(good_body)["choices"] == json.loads(alone)["choices"]


def test_a_limit_met_mid_stream_ends_it_with_an_error_event(served):
    status, answer = _post(served, {"model": "model", "prompt": "hello", "max_tokens": 300, "temperature": 0,
                                    "regex": DEEP_LIMIT, "stream": True})
    events = [line[6:] for line in answer.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert len(text) >= 16 and text.isalpha(), text  # the answer so far, inside the grammar
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error" and "after" in error["message"], error
    assert _hostile.good_answer_ok(_port(served))


# -- admission as a property, without a server ------------------------------------------------------
hypothesis = pytest.importorskip("hypothesis", reason="the admission property is tested with hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

ATOMS = ["a", "b", ".", r"\d", r"[^\s\S]", "[a-c]", "(|)", r"\w", "x"]


def _regexes():
    repeat = st.sampled_from(["", "*", "+", "?", "{2}", "{0}", "{1000}", "{100000}", "{3,9}"])
    piece = st.tuples(st.sampled_from(ATOMS), repeat).map("".join)
    group = st.lists(piece, min_size=1, max_size=4).map(lambda p: "(" + "".join(p) + ")")
    return st.lists(st.one_of(piece, group, group.map(lambda g: g + "{50}")), min_size=1, max_size=5).map("".join)


def _schemas():
    leaf = st.sampled_from([{"type": "integer"}, {"type": "string", "maxLength": 5}, {"enum": ["a", "b"]},
                            {"$ref": "#"}, {"type": "string", "pattern": "^a{100000}$"}, {"type": "boolean"}])
    return st.recursive(leaf, lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(["p", "q", "r"]), inner, min_size=1, max_size=3).flatmap(
            lambda props: st.sampled_from([[], list(props)]).map(
                lambda req: {"type": "object", "properties": props, "required": req})),
        inner.map(lambda s: {"type": "array", "items": s, "minItems": 1}),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs})), max_leaves=8)


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    from rmsnorm_deploy.serving.engine.constraints import Grammars
    from tests.serving._tokenizer import write_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    assert write_tokenizer(folder) == TEXT_VOCAB
    return Grammars((folder / "tokenizer.json").read_text(), TEXT_VOCAB, [2])


def _admitted_or_refused(grammars, kind, source):
    """Admission's property: an InputError in one line (no engine state) or constraints that generate
    up to 48 tokens or stop with GrammarStopped; within the time limit."""
    from rmsnorm_deploy.errors import InputError
    from rmsnorm_deploy.serving.engine.constraints import GrammarStopped

    start = time.perf_counter()
    try:
        constraint = grammars.constraints(kind, source)[0]
    except InputError as exc:
        assert "\n" not in str(exc) and not any(leak in str(exc) for leak in _hostile.LEAKS), str(exc)
        return
    finally:
        assert time.perf_counter() - start < _hostile.TIME_LIMIT_S
    rng = np.random.default_rng(0)
    try:
        for _ in range(48):
            allowed = np.flatnonzero(constraint.allowed())
            assert allowed.size, "a mask that allows nothing must stop the grammar"
            token = int(rng.choice(allowed))
            constraint.advance(token)
            if token == 2:
                assert constraint.matcher.is_accepting()
                return
    except GrammarStopped as exc:
        assert "\n" not in str(exc) and constraint.tokens > 0, str(exc)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(pattern=_regexes())
def test_any_regex_is_admitted_or_refused_in_one_line(grammars, pattern):
    _admitted_or_refused(grammars, "regex", pattern)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(schema=_schemas())
def test_any_schema_is_admitted_or_refused_in_one_line(grammars, schema):
    _admitted_or_refused(grammars, "json_schema", schema)
