"""The hostile suite for the OpenAI API's bodies (``tests/serving/_hostile.py``): structured output
past the grammar engine's limits or matching nothing (``response_format``, ``regex``,
``grammar``, tool parameters), mutated schemas and broken HTTP framing, each answered with a 4xx
and one JSON line (a truthful 200 where a mutation leaves a valid schema) within the time limit,
no traceback, and the server still answering a good request after each class; a limit met mid-answer
ends that request alone (a 400, or an error event in a stream), the others in the batch answered.

One server for the module (the tiny text Llama, ``tests/serving/conftest.py``). The quick part
sends the issue's requests (streamed and not) and its framing cases; the seeded classes are
``slow``. Admission itself, without a server, is ``tests/serving/test_constraints.py``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")
pytest.importorskip("uvicorn", reason="the API is served by uvicorn")
pytest.importorskip("llguidance", reason="structured output runs through llguidance (the serve extra)")
pytest.importorskip("transformers", reason="chat prompts are rendered by transformers' apply_chat_template")

from tests.serving import _hostile  # noqa: E402
from tests.serving._http import request  # noqa: E402
from tests.serving._openai import openai_server  # noqa: E402


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
@pytest.mark.parametrize("cls", list(_hostile.COUNTS))
def test_each_hostile_class_is_refused_in_one_line(served, cls):
    outcomes = _run(served, _hostile.trials(cls, _hostile.COUNTS[cls]))
    assert len(outcomes) == _hostile.COUNTS[cls]
    if cls != "schema-mutation":
        assert not any(o.answered for o in outcomes)


def _post(served, body: dict) -> tuple[int, bytes]:
    status, _, answer = request(_port(served), "POST", "/v1/completions", json.dumps(body).encode(), timeout=60)
    return status, answer



def test_a_limit_met_mid_answer_ends_that_request_alone_with_a_400(served):
    good = {"model": "model", "prompt": "hello the world", "max_tokens": 40, "temperature": 0}
    hostile = {"model": "model", "prompt": "hello", "max_tokens": 300, "temperature": 0,
               "regex": _hostile.DEEP_LIMIT}
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
                                    "regex": _hostile.DEEP_LIMIT, "stream": True})
    events = [line[6:] for line in answer.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert len(text) >= 16 and text.isalpha(), text  # the answer so far, inside the grammar
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error" and "after" in error["message"], error
    assert _hostile.good_answer_ok(_port(served))
