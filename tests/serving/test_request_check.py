"""The checks the fronts run on every request, without a server: exact refusals, and the HTTP app's
forwarding and readiness against a stand-in for Triton (httpx's mock transport)."""

from __future__ import annotations

import gzip
import json

import pytest

from rmsnorm_deploy.serving.kserve.request_check import (ClaimedInput, ExpectedInput, Refused, ServedModel,
                                                         check_inputs, claimed_http_inputs, count_data,
                                                         parse_http_request)

PLAIN = ServedModel("model", (ExpectedInput("input_ids", "INT64", ("batch", "seq")),), max_batch=8,
                    ranges={"seq": (1, 256)})
FIXED = ServedModel("fixed", (ExpectedInput("x", "FP32", (4, 3)),))
STREAM = ServedModel("model_stream", PLAIN.inputs, stream_of="model")


@pytest.mark.parametrize("model,claimed,message", [
    (PLAIN, [ClaimedInput("input_ids", "INT64", (1, 4294967296), elements=1)],
     "input 'input_ids' has seq 4294967296 but model 'model' takes seq from 1 to 256"),
    (FIXED, [ClaimedInput("x", "FP32", (4, 3), elements=1)],
     "input 'x' claims shape [4, 3] (12 elements) but carries 1; give a shape that matches the data"),
    (FIXED, [ClaimedInput("x", "FP32", (4, 3), data_bytes=0)],
     "input 'x' claims shape [4, 3] (48 bytes of FP32) but carries 0 bytes; give a shape that matches the data"),
    (FIXED, [ClaimedInput("x", "FP32", (4, 4), elements=16)],
     "input 'x' has shape [4, 4] but model 'fixed' takes [4, 3]"),
    (FIXED, [ClaimedInput("x", "FP32", (4, 3))], "input 'x' carries no data; give 'data' or binary data"),
    (PLAIN, [], "the request has no inputs; model 'model' takes input_ids INT64 [batch, seq]"),
    (PLAIN, [ClaimedInput("input_ids", "INT64", (2, 3), elements=6), ClaimedInput("input_ids", "INT64", (2, 3),
                                                                                  elements=6)],
     "input 'input_ids' is given twice; give each input once"),
], ids=["claim-2^32", "count", "bytes", "fixed-dim", "no-data", "no-inputs", "twice"])
def test_claims_are_refused_in_one_line(model, claimed, message):
    with pytest.raises(Refused) as info:
        check_inputs(model, claimed)
    assert (info.value.status, info.value.message) == (400, message)


def test_a_wrapping_claim_is_counted_exactly():
    """2^61 INT64 elements are 2^64 bytes: 0 in Triton's 64-bit arithmetic, never here."""
    with pytest.raises(Refused, match=r"\(18446744073709551616 bytes of INT64\) but carries 0 bytes"):
        check_inputs(ServedModel("g", (ExpectedInput("input_ids", "INT64", ("n",)),)),
                     [ClaimedInput("input_ids", "INT64", (1 << 61,), data_bytes=0)])


@pytest.mark.parametrize("data,rank,count", [([1, 2, 3], 1, 3), ([[1, 2], [3, 4]], 2, 4), ([1, 2, 3, 4], 2, 4),
                                             ([], 2, 0), ([[], []], 2, 0)])
def test_data_is_counted_flat_or_nested(data, rank, count):
    assert count_data(data, "INT64", rank, "x") == count


@pytest.mark.parametrize("body,header,message", [
    (b"{", None, "the request is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                 "(char 1))"),
    (b"[" * 50000, None, "the request's JSON is nested too deeply"),
    (b"{}", "3", "Inference-Header-Content-Length '3' is not a byte count within the 2-byte body"),
    (b"1", None, "the request must be a JSON object with 'inputs'"),
    (b" " * (8 << 20) + b"{}", None, "the request's JSON is 8388610 bytes, over 8388608; send large tensors as binary "
                                     "data (the binary data extension: Inference-Header-Content-Length)"),
], ids=["truncated", "deep", "header-over-body", "not-object", "json-over-8-mib"])
def test_bodies_are_refused_in_one_line(body, header, message):
    with pytest.raises(Refused) as info:
        parse_http_request(body, header)
    assert info.value.message == message
    assert info.value.status == (413 if "over 8388608" in message else 400)


def test_binary_sizes_must_add_up_to_the_bytes_after_the_json():
    request = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [4, 3], "parameters": {"binary_data_size": 48}}]}
    assert claimed_http_inputs(request, b"\0" * 48) == [ClaimedInput("x", "FP32", (4, 3), data_bytes=48)]
    with pytest.raises(Refused, match="add up to 48 bytes but 47 bytes follow the JSON header"):
        claimed_http_inputs(request, b"\0" * 47)


# -- the HTTP app against a stand-in for Triton ------------------------------------------------------

@pytest.fixture
def app_with(monkeypatch):
    httpx = pytest.importorskip("httpx", reason="the front needs httpx (the serve extra)")
    pytest.importorskip("starlette", reason="the front needs starlette (the serve extra)")
    from starlette.testclient import TestClient

    from rmsnorm_deploy.serving.kserve.http_front import KServeProxy, kserve_app

    def make(handler, limit=1 << 20, models=(PLAIN,)):
        proxy = KServeProxy(list(models), "http://triton", limit)
        proxy.client = httpx.AsyncClient(base_url="http://triton", transport=httpx.MockTransport(handler))
        return TestClient(kserve_app(proxy))

    return make


def test_triton_answers_come_back_unchanged(app_with):
    import httpx

    seen = []

    def triton(request):
        seen.append((request.method, request.url.path, request.content))
        return httpx.Response(400, headers={"content-type": "application/json", "x-triton": "1"},
                              stream=httpx.ByteStream(b'{"error":"Triton\'s own words"}'))

    body = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]}]})
    response = app_with(triton).post("/v2/models/model/infer", content=gzip.compress(body.encode()),
                                     headers={"Content-Encoding": "gzip"})
    assert (response.status_code, response.content, response.headers["x-triton"]) == (
        400, b'{"error":"Triton\'s own words"}', "1")
    assert seen == [("POST", "/v2/models/model/infer", body.encode())]  # forwarded decompressed


@pytest.mark.parametrize("answers,status", [({"model": 200}, 200), ({"model": 400}, 503), ({}, 503)],
                         ids=["model-ready", "model-loading", "triton-down"])
def test_ready_only_when_triton_says_every_model_is(app_with, answers, status):
    import httpx

    def triton(request):
        name = request.url.path.split("/")[3]
        if name not in answers:
            raise httpx.ConnectError("refused")
        return httpx.Response(answers[name])

    response = app_with(triton).get("/v2/health/ready")
    assert response.status_code == status
    if status != 200:
        assert response.json() == {"error": "not ready: ['model']"}


def test_triton_not_running_is_a_503_in_one_line(app_with):
    import httpx

    def triton(request):
        raise httpx.ConnectError("refused")

    response = app_with(triton).get("/v2/models/model")
    assert (response.status_code, response.json()) == (503, {"error": "the inference server is not running"})


def test_the_public_sockets_listen_with_nagle_off():
    """asyncio sets TCP_NODELAY only on sockets created as IPPROTO_TCP; without it every forwarded
    answer (head and body written apart) and each server-sent event waited 40 ms for the client's
    delayed ACK. The HTTP front and the OpenAI server listen on this one kind of socket."""
    import socket

    from rmsnorm_deploy.errors import UserError
    from rmsnorm_deploy.serving.asgi.uvicorn_thread import listening_socket

    sock = listening_socket("127.0.0.1", 0, "--http-port")
    try:
        assert sock.proto == socket.IPPROTO_TCP
        port = sock.getsockname()[1]
        with pytest.raises(UserError, match=rf"^cannot listen on 127\.0\.0\.1:{port} \(--openai-port\): "):
            listening_socket("127.0.0.1", port, "--openai-port").close()
    finally:
        sock.close()


# -- what the last fuzz run found ------------------------------------------------------------------------

def _never_triton(request):
    raise AssertionError(f"Triton was asked {request.url.path}")


@pytest.mark.parametrize("parameters,message", [
    ({"sequence_id": -1}, "the request's parameter sequence_id is -1; give an integer from 0 to 2^64-1 or a string"),
    ({"sequence_id": 1.5}, "the request's parameter sequence_id is 1.5; give an integer from 0 to 2^64-1 or a string"),
    ({"sequence_start": 1}, "the request's parameter sequence_start is 1; give true or false"),
    ({"priority": -3}, "the request's parameter priority is -3; give an integer from 0 to 2^64-1"),
    ({"timeout": 1 << 64}, "the request's parameter timeout is 18446744073709551616; give an integer from 0 to "
                           "2^64-1 (microseconds)"),
])
def test_request_parameters_triton_cannot_parse_are_a_400_not_its_500(app_with, parameters, message):
    """Triton 2.51 answered ``"sequence_id": -1`` with a 500 carrying its parse error."""
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]}],
            "parameters": parameters}
    response = app_with(_never_triton).post("/v2/models/model/infer", content=json.dumps(body))
    assert (response.status_code, response.json()) == (400, {"error": message})


def test_request_parameters_triton_parses_pass_when_well_formed():
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]}],
            "parameters": {"sequence_id": "abc", "sequence_start": True, "priority": 0, "timeout": 5, "custom": -1}}
    assert len(claimed_http_inputs(body, b"")) == 1


def test_http_infer_on_a_streaming_twin_says_where_its_tokens_come(app_with):
    """Triton answers a decoupled model's HTTP infer with its 501; the front answers 400 and the way."""
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]}]}
    app = app_with(_never_triton, models=(PLAIN, STREAM))
    response = app.post("/v2/models/model_stream/infer", content=json.dumps(body))
    assert (response.status_code, response.json()) == (400, {"error": (
        "model 'model_stream' streams its tokens over a gRPC stream only (ModelStreamInfer); for the whole answer in "
        "one response, infer with model 'model' (HTTP: POST /v2/models/model/infer)")})


async def _call(app, path: str, first: bytes, then: str) -> list[dict]:
    """``app`` called as uvicorn calls it: a POST whose body starts with ``first``, then the client
    stalls (``"stall"``) or closes its connection (``"close"``); the messages the app sent."""
    import asyncio

    sent: list[dict] = []
    messages = [{"type": "http.request", "body": first, "more_body": True}]

    async def receive():
        if messages:
            return messages.pop(0)
        if then == "stall":
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


def _kserve_app(body_timeout_s: float = 30):
    pytest.importorskip("httpx", reason="the front needs httpx (the serve extra)")
    pytest.importorskip("starlette", reason="the front needs starlette (the serve extra)")
    from rmsnorm_deploy.serving.kserve.http_front import KServeProxy, kserve_app

    return kserve_app(KServeProxy([PLAIN], "http://triton", 1 << 20, body_timeout_s=body_timeout_s))


def test_a_client_that_closes_mid_body_is_one_log_line_not_a_traceback(caplog):
    """Starlette's ``ClientDisconnect`` went up through the app and uvicorn logged its traceback."""
    import asyncio
    import logging

    with caplog.at_level(logging.WARNING):
        sent = asyncio.run(_call(_kserve_app(), "/v2/models/model/infer", b'{"inputs": [', "close"))
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in records] == [
        "a client closed its connection after 12 bytes of its body to /v2/models/model/infer; nothing was answered"]
    assert not any(r.exc_info for r in records)
    assert sent[0]["status"] == 499  # nobody reads it


def test_a_slow_body_is_a_408_at_the_configured_timeout():
    import asyncio

    sent = asyncio.run(_call(_kserve_app(body_timeout_s=0.2), "/v2/models/model/infer", b'{"inputs": [', "stall"))
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"]) == {"error": "the body did not arrive within 0.2 s"}
