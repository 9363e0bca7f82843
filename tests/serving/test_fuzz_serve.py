"""Hostile requests to one running ``serve`` over plain HTTP (http.client, raw sockets) and gRPC:
each gets a 4xx (gRPC: a client-fault status) with one line and no traceback, and after each the
server is alive and answers a good request exactly as the model run here.

Bounded: one plain-model server (``--max-request-bytes 1048576``, so the huge bodies stay small
here) and one generation server, loopback only, every request with a timeout.
"""

from __future__ import annotations

import gzip
import json
import zlib

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (make installs it; see pyproject.toml: serve)")
pytest.importorskip("uvicorn", reason="serve's front needs uvicorn and starlette (the serve extra)")
grpc = pytest.importorskip("grpc", reason="the gRPC cases need grpcio (the serve extra)")
service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2", reason="the gRPC cases need tritonclient[grpc]")
from tritonclient.grpc import service_pb2_grpc  # noqa: E402

from rmsnorm_deploy.decoder.generate import KVCacheModel, generate  # noqa: E402
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402
from rmsnorm_deploy.serving.triton.process import start_serve_process  # noqa: E402
from tests.serving._http import raw as _raw, request as _request  # noqa: E402

LIMIT = 1 << 20  # --max-request-bytes of the plain server
VOCAB = 512  # the tiny preset's
I64 = (1 << 63) - 1
GOOD_IDS = np.array([[5, 6, 7]], np.int64)
#: the request of issue 22, verbatim, and its variants: each killed Triton 2.51's HTTP front end
ISSUE_REQUEST = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [4294967296], "data": [1]}]}


def _served(folder, *args):
    try:
        proc = start_serve_process(folder, timeout_s=90, args=args)
    except Exception as exc:  # noqa: BLE001 - a server that does not start fails the module with its output
        pytest.fail(str(exc))
    return proc


@pytest.fixture(scope="module")
def plain(tiny_export):
    proc = _served(tiny_export, "--max-request-bytes", str(LIMIT))
    with OnnxRuntimeRunner(tiny_export / "model.onnx") as runner:
        want = runner.infer({"input_ids": GOOD_IDS})["logits"]
        yield proc, want
    proc.stop()
    assert proc.process.returncode == 0, "".join(proc.log)
    assert "Traceback" not in "".join(proc.log), "".join(proc.log)


@pytest.fixture(scope="module")
def generation(tiny_kv_export):
    proc = _served(tiny_kv_export)
    with KVCacheModel(tiny_kv_export) as model:
        want = generate(model, [[5, 6, 7]], max_new_tokens=4).tokens[0]
    yield proc, want
    proc.stop()
    assert proc.process.returncode == 0 and "Traceback" not in "".join(proc.log), "".join(proc.log)


def _assert_one_line_refusal(status: int, body: bytes, want_status: int | tuple) -> str:
    text = body.decode("utf-8", "replace")
    assert status in (want_status if isinstance(want_status, tuple) else (want_status,)), (status, text)
    assert 400 <= status < 500 and text.strip().count("\n") == 0, (status, text)
    assert "Traceback" not in text and 'File "' not in text and "model.py" not in text, text
    return json.loads(text)["error"] if text.startswith("{") else text


def _still_exact(port: int, want: np.ndarray) -> None:
    """A good request over plain HTTP, logits back as binary data: equal bit for bit."""
    body = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": list(GOOD_IDS.shape),
                                   "data": GOOD_IDS.ravel().tolist()}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
    status, headers, payload = _request(port, "POST", "/v2/models/model/infer", body)
    assert status == 200, payload[:300]
    header = int({k.lower(): v for k, v in headers.items()}["inference-header-content-length"])
    got = np.frombuffer(payload[header:], np.float32).reshape(want.shape)
    assert np.array_equal(got, want)


def _ids_request(shape, data, **extra) -> bytes:
    item = {"name": "input_ids", "datatype": "INT64", "shape": shape, "data": data, **extra}
    return json.dumps({"inputs": [item]}).encode()


def _binary_request(shape, sizes, payload: bytes, *, header_length: str | None = None):
    head = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": shape,
                                   "parameters": {"binary_data_size": sizes}}]}).encode()
    return head + payload, {"Inference-Header-Content-Length": header_length or str(len(head))}


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


GOOD_ITEM = {"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}
BOMB = gzip.compress(b"0" * (64 << 20))  # 64 MiB of zeros in about 64 KiB
# (id, method, path, body, headers, status, message the error contains)
HTTP_CASES = [
    ("truncated-json", "POST", "/v2/models/model/infer", b"{", {}, 400, "not valid JSON"),
    ("not-json", "POST", "/v2/models/model/infer", b"not json", {}, 400, "not valid JSON"),
    ("empty-body", "POST", "/v2/models/model/infer", b"", {}, 400, "not valid JSON"),
    ("invalid-utf8", "POST", "/v2/models/model/infer", b"\xff\xfe{}", {}, 400, "not valid JSON"),
    ("json-array", "POST", "/v2/models/model/infer", b"[]", {}, 400, "must be a JSON object"),
    ("nested-100k", "POST", "/v2/models/model/infer", b"[" * 100000 + b"]" * 100000, {}, 400, "nested too deeply"),
    ("nested-parameters", "POST", "/v2/models/model/infer",
     json.dumps({"inputs": [GOOD_ITEM], "parameters": _nested(20)}).encode(), {}, 400, "nested deeper than 8"),
    ("5000-digit-number", "POST", "/v2/models/model/infer", b'{"inputs": [{"name": "input_ids", "datatype": "INT64", '
     b'"shape": [1, 1], "data": [' + b"9" * 5000 + b']}]}', {}, 400,
     "not valid JSON"),
    ("no-inputs", "POST", "/v2/models/model/infer", b"{}", {}, 400, "'inputs' must be a list"),
    ("inputs-object", "POST", "/v2/models/model/infer", b'{"inputs": {}}', {}, 400, "'inputs' must be a list"),
    ("input-not-object", "POST", "/v2/models/model/infer", b'{"inputs": [1]}', {}, 400, "'inputs' must be a list"),
    ("name-not-string", "POST", "/v2/models/model/infer",
     json.dumps({"inputs": [{**GOOD_ITEM, "name": 5}]}).encode(), {}, 400, "needs 'name' (a string)"),
    ("shape-string", "POST", "/v2/models/model/infer", _ids_request("1,3", [1, 2, 3]), {}, 400, "'shape' (a list)"),
    ("shape-negative", "POST", "/v2/models/model/infer", _ids_request([-1, 3], [1, 2, 3]), {}, 400,
     "non-negative integers"),
    ("shape-float", "POST", "/v2/models/model/infer", _ids_request([1.5, 2], [1, 2, 3]), {}, 400,
     "non-negative integers"),
    ("shape-bool", "POST", "/v2/models/model/infer", _ids_request([True, 3], [1, 2, 3]), {}, 400,
     "non-negative integers"),
    ("data-not-list", "POST", "/v2/models/model/infer", _ids_request([1, 1], 5), {}, 400, "'data' must be a list"),
    ("data-too-deep", "POST", "/v2/models/model/infer", _ids_request([1, 1], [[[1]]]), {}, 400,
     "nested deeper than its rank 2"),
    ("data-strings", "POST", "/v2/models/model/infer", _ids_request([1, 1], ["a"]), {}, 400, "not an integer"),
    ("data-bools", "POST", "/v2/models/model/infer", _ids_request([1, 1], [True]), {}, 400, "not an integer"),
    ("data-floats", "POST", "/v2/models/model/infer", _ids_request([1, 1], [1.5]), {}, 400, "not an integer"),
    ("data-nan", "POST", "/v2/models/model/infer", b'{"inputs": [{"name": "input_ids", "datatype": "INT64", '
     b'"shape": [1, 1], "data": [NaN]}]}', {}, 400, "not an integer"),
    ("data-over-int64", "POST", "/v2/models/model/infer", _ids_request([1, 1], [I64 + 1]), {}, 400,
     "outside [-9223372036854775808, 9223372036854775807]"),
    ("datatype-fp32", "POST", "/v2/models/model/infer",
     json.dumps({"inputs": [{**GOOD_ITEM, "datatype": "FP32"}]}).encode(), {}, 400, "takes INT64"),
    ("datatype-bytes", "POST", "/v2/models/model/infer",
     json.dumps({"inputs": [{**GOOD_ITEM, "datatype": "BYTES"}]}).encode(), {}, 400,
     "which this server does not carry"),
    ("datatype-unknown", "POST", "/v2/models/model/infer",
     json.dumps({"inputs": [{**GOOD_ITEM, "datatype": "FOO"}]}).encode(), {}, 400, "which this server does not carry"),
    ("rank-1", "POST", "/v2/models/model/infer", _ids_request([3], [1, 2, 3]), {}, 400, "(rank 2)"),
    ("rank-3", "POST", "/v2/models/model/infer", _ids_request([1, 1, 3], [1, 2, 3]), {}, 400, "(rank 2)"),
    ("rank-1000", "POST", "/v2/models/model/infer", _ids_request([1] * 1000, [1]), {}, 400, "(rank 2)"),
    ("batch-9", "POST", "/v2/models/model/infer", _ids_request([9, 1], list(range(9))), {}, 400, "a batch of 9"),
    ("batch-0", "POST", "/v2/models/model/infer", _ids_request([0, 3], []), {}, 400, "a batch of 0"),
    ("empty-sequence", "POST", "/v2/models/model/infer", _ids_request([1, 0], []), {}, 400,
     "has seq 0 but model 'model' takes seq from 1 to 256"),
    ("sequence-257", "POST", "/v2/models/model/infer", _ids_request([1, 257], [1] * 257), {}, 400, "seq 257"),
    ("unknown-input", "POST", "/v2/models/model/infer",
     json.dumps({"inputs": [{**GOOD_ITEM, "name": "tokens"}]}).encode(), {}, 400, "has no input 'tokens'"),
    ("input-twice", "POST", "/v2/models/model/infer", json.dumps({"inputs": [GOOD_ITEM, GOOD_ITEM]}).encode(),
     {}, 400, "given twice"),
    ("count-mismatch", "POST", "/v2/models/model/infer", _ids_request([1, 3], [1, 2]), {}, 400,
     "(3 elements) but carries 2"),
    ("shape-2^32", "POST", "/v2/models/model/infer", _ids_request([1, 4294967296], [1]), {}, 400, "seq 4294967296"),
    ("shape-2^62", "POST", "/v2/models/model/infer", _ids_request([1, 1 << 62], [1]), {}, 400, "seq"),
    ("shape-2^61-no-data", "POST", "/v2/models/model/infer", _ids_request([1, 1 << 61], []), {}, 400, "seq"),
    ("shape-2^32-squared", "POST", "/v2/models/model/infer", _ids_request([1 << 32, 1 << 32], [1]), {}, 400,
     "a batch of 4294967296"),
    ("shape-2^64", "POST", "/v2/models/model/infer", _ids_request([1, 1 << 64], [1]), {}, 400, "seq"),
    ("negative-id", "POST", "/v2/models/model/infer", _ids_request([1, 2], [-1, 2]), {}, 400,
     "input 'input_ids' holds token ids from -1 to 2, outside the embedding table's [0, 512); give ids in that range"),
    ("id-at-vocab", "POST", "/v2/models/model/infer", _ids_request([1, 1], [VOCAB]), {}, 400, "from 512 to 512"),
    ("id-int64-max", "POST", "/v2/models/model/infer", _ids_request([1, 1], [I64]), {}, 400, "outside the embedding"),
    ("id-int64-min", "POST", "/v2/models/model/infer", _ids_request([1, 1], [-I64 - 1]), {}, 400,
     "outside the embedding"),
    ("shared-memory", "POST", "/v2/models/model/infer",
     _ids_request([1, 3], [1, 2, 3], parameters={"shared_memory_region": "r"}), {}, 400, "registers no shared memory"),
    ("header-length-over-body", "POST", "/v2/models/model/infer", b"{}", {"Inference-Header-Content-Length": "999"},
     400, "not a byte count within the 2-byte body"),
    ("header-length-text", "POST", "/v2/models/model/infer", b"{}", {"Inference-Header-Content-Length": "abc"},
     400, "not a byte count"),
    ("header-length-negative", "POST", "/v2/models/model/infer", b"{}", {"Inference-Header-Content-Length": "-1"},
     400, "not a byte count"),
    ("binary-size-too-small", "POST", "/v2/models/model/infer", *_binary_request([1, 3], 8, b"\0" * 8), 400,
     "(24 bytes of INT64) but carries 8 bytes"),
    ("binary-bytes-missing", "POST", "/v2/models/model/infer", *_binary_request([1, 3], 24, b"\0" * 8), 400,
     "add up to 24 bytes but 8 bytes follow"),
    ("binary-size-negative", "POST", "/v2/models/model/infer", *_binary_request([1, 3], -8, b""), 400,
     "binary_data_size must be a byte count"),
    ("binary-2^61-zero-bytes", "POST", "/v2/models/model/infer", *_binary_request([1, 1 << 61], 0, b""), 400, "seq"),
    ("binary-2^32-8-bytes", "POST", "/v2/models/model/infer", *_binary_request([1, 1 << 32], 8, b"\1" + b"\0" * 7),
     400, "seq"),
    ("gzip-bomb", "POST", "/v2/models/model/infer", BOMB, {"Content-Encoding": "gzip"}, 413,
     "decompresses to more than this server's limit"),
    ("deflate-bomb", "POST", "/v2/models/model/infer", zlib.compress(b"0" * (64 << 20)),
     {"Content-Encoding": "deflate"}, 413, "decompresses to more than"),
    ("gzip-garbage", "POST", "/v2/models/model/infer", b"not gzip at all", {"Content-Encoding": "gzip"}, 400,
     "not valid gzip"),
    ("gzip-truncated", "POST", "/v2/models/model/infer", gzip.compress(_ids_request([1, 3], [1, 2, 3]))[:20],
     {"Content-Encoding": "gzip"}, 400, "truncated"),
    ("brotli", "POST", "/v2/models/model/infer", b"{}", {"Content-Encoding": "br"}, 415, "'br' is not supported"),
    ("unknown-model", "POST", "/v2/models/nope/infer", _ids_request([1, 3], [1, 2, 3]), {}, 404,
     "unknown model 'nope'"),
    ("stream-twin-of-plain", "POST", "/v2/models/model_stream/infer", _ids_request([1, 3], [1, 2, 3]), {}, 404,
     "unknown model"),
    ("unknown-version", "POST", "/v2/models/model/versions/7/infer", _ids_request([1, 3], [1, 2, 3]), {}, 404,
     "Request for unknown model: 'model' version 7 is not found"),  # Triton's own answer, passed on
    ("get-infer", "GET", "/v2/models/model/infer", b"", {}, 405, "GET is not allowed"),
    ("put-infer", "PUT", "/v2/models/model/infer", b"{}", {}, 405, "PUT is not allowed"),
    ("post-ready", "POST", "/v2/health/ready", b"", {}, 405, "POST is not allowed"),
    ("delete-root", "DELETE", "/v2", b"", {}, 405, "DELETE is not allowed"),
    ("repository-index", "POST", "/v2/repository/index", b"{}", {}, 404, "not an endpoint"),
    ("repository-unload", "POST", "/v2/repository/models/model/unload", b"{}", {}, 404, "not an endpoint"),
    ("shm-register", "POST", "/v2/systemsharedmemory/region/r/register", b"{}", {}, 404, "not an endpoint"),
    ("generate-extension", "POST", "/v2/models/model/generate", b'{"input_ids": [1]}', {}, 404, "not an endpoint"),
    ("logging", "POST", "/v2/logging", b'{"log_verbose_level": 1}', {}, 404, "not an endpoint"),
    ("no-such-path", "GET", "/nope", b"", {}, 404, "not an endpoint"),
    ("dot-dot", "GET", "/v2/models/../../etc/passwd", b"", {}, 404, "not an endpoint"),
]


@pytest.mark.parametrize("method,path,body,headers,status,message", [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])
def test_hostile_http_request_is_refused_in_one_line_and_the_server_stays_exact(plain, method, path, body, headers,
                                                                                 status, message):
    proc, want = plain
    got_status, _, got_body = _request(proc.http, method, path, body, headers)
    assert message in _assert_one_line_refusal(got_status, got_body, status)
    _still_exact(proc.http, want)


RAW_CASES = [
    ("garbage-request-line", b"\x00\x01 nonsense\r\n\r\n"),
    # more than h11's 16 KiB for a request head that has not ended, all read by the server at once
    ("header-too-large", b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000),
    ("content-length-text", b"POST /v2/models/model/infer HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}"),
    ("content-length-huge",
     b"POST /v2/models/model/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1099511627776\r\n\r\n"),
    ("chunked-over-limit", b"POST /v2/models/model/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     + (b"100000\r\n" + b" " * 0x100000 + b"\r\n") * 2 + b"0\r\n\r\n"),
]


@pytest.mark.parametrize("data", [c[1] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_broken_http_on_the_wire_is_refused_in_one_line(plain, data):
    proc, want = plain
    status, body = _raw(proc.http, data)
    _assert_one_line_refusal(status, body, (400, 413, 431))
    _still_exact(proc.http, want)


def test_a_gzip_request_within_the_limit_is_answered(plain):
    proc, want = plain
    body = gzip.compress(_ids_request(list(GOOD_IDS.shape), GOOD_IDS.ravel().tolist()))
    status, _, payload = _request(proc.http, "POST", "/v2/models/model/infer", body, {"Content-Encoding": "gzip"})
    assert status == 200, payload[:300]
    logits = json.loads(payload)["outputs"][0]
    assert logits["shape"] == list(want.shape)


def test_the_issues_request_for_the_plain_model_is_refused(plain):
    proc, want = plain
    body = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 4294967296],
                                   "data": [1]}]}).encode()
    status, _, text = _request(proc.http, "POST", "/v2/models/model/infer", body)
    assert (status, json.loads(text)) == (400, {
        "error": "input 'input_ids' has seq 4294967296 but model 'model' takes seq from 1 to 256"})
    _still_exact(proc.http, want)


@pytest.mark.parametrize("shape", [[4294967296], [1 << 62]], ids=["2^32", "2^62"])
def test_the_issues_request_for_the_generation_model_is_refused(generation, shape):
    proc, want = generation
    request = json.loads(json.dumps(ISSUE_REQUEST))
    request["inputs"][0]["shape"] = shape
    status, _, text = _request(proc.http, "POST", "/v2/models/model/infer", json.dumps(request).encode())
    assert (status, json.loads(text)) == (400, {
        "error": f"input 'input_ids' claims shape {shape} ({shape[0]} elements) but carries 1; give a shape that "
                 "matches the data"})
    body = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [3], "data": [5, 6, 7]},
                                  {"name": "max_new_tokens", "datatype": "INT64", "shape": [1], "data": [4]}]})
    status, _, text = _request(proc.http, "POST", "/v2/models/model/infer", body.encode())
    assert status == 200 and json.loads(text)["outputs"][0]["data"] == want


def test_the_last_fuzz_runs_finds_are_refused_in_one_line(generation):
    """``"sequence_id": -1`` was Triton's 500; HTTP infer on the streaming twin was Triton's 501."""
    proc, want = generation
    inputs = [{"name": "input_ids", "datatype": "INT64", "shape": [3], "data": [5, 6, 7]}]
    body = json.dumps({"inputs": inputs, "parameters": {"sequence_id": -1}}).encode()
    status, _, text = _request(proc.http, "POST", "/v2/models/model/infer", body)
    assert (status, json.loads(text)) == (400, {
        "error": "the request's parameter sequence_id is -1; give an integer from 0 to 2^64-1 or a string"})
    body = json.dumps({"inputs": inputs}).encode()
    status, _, text = _request(proc.http, "POST", "/v2/models/model_stream/infer", body)
    assert status == 400 and "over a gRPC stream only" in json.loads(text)["error"]
    body = json.dumps({"inputs": inputs + [{"name": "max_new_tokens", "datatype": "INT64", "shape": [1], "data": [4]}]})
    status, _, text = _request(proc.http, "POST", "/v2/models/model/infer", body.encode())
    assert status == 200 and json.loads(text)["outputs"][0]["data"] == want


def test_ready_means_every_model_is_ready(generation, plain):
    for proc in (generation[0], plain[0]):
        status, _, body = _request(proc.http, "GET", "/v2/health/ready")
        assert (status, body) == (200, b"")
        for name in (["model", "model_stream"] if proc is generation[0] else ["model"]):
            assert _request(proc.http, "GET", f"/v2/models/{name}/ready")[0] == 200


# -- gRPC -------------------------------------------------------------------------------------------

def _grpc_request(model="model", shape=(1, 3), raw=None, contents=None, datatype="INT64", parameters=None):
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="input_ids", datatype=datatype, shape=list(shape))
    if contents is not None:
        getattr(tensor.contents, contents[0]).extend(contents[1])
    else:
        request.raw_input_contents.append(np.asarray([1, 2, 3] if raw is None else raw, np.int64).tobytes()
                                          if not isinstance(raw, bytes) else raw)
    for key, value in (parameters or {}).items():
        tensor.parameters[key].string_param = value
    return request


GRPC_CASES = [
    ("issue-shape-2^32", _grpc_request(shape=[1, 4294967296], raw=[1]), grpc.StatusCode.INVALID_ARGUMENT, "seq"),
    ("wrapping-2^61-no-data", _grpc_request(shape=[1, 1 << 61], raw=b""), grpc.StatusCode.INVALID_ARGUMENT, "seq"),
    ("raw-size-mismatch", _grpc_request(raw=[1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "(24 bytes of INT64)"),
    ("typed-count-mismatch", _grpc_request(contents=("int64_contents", [1])), grpc.StatusCode.INVALID_ARGUMENT,
     "(3 elements) but carries 1"),
    ("typed-wrong-field", _grpc_request(contents=("fp32_contents", [1.0, 2.0, 3.0])),
     grpc.StatusCode.INVALID_ARGUMENT, "use int64_contents"),
    ("wrong-datatype", _grpc_request(datatype="FP32", raw=np.zeros(3, np.float32).tobytes()),
     grpc.StatusCode.INVALID_ARGUMENT, "takes INT64"),
    ("negative-id", _grpc_request(raw=[-1, 2, 3]), grpc.StatusCode.INVALID_ARGUMENT, "from -1 to 3"),
    ("shared-memory", _grpc_request(parameters={"shared_memory_region": "r"}), grpc.StatusCode.INVALID_ARGUMENT,
     "registers no shared memory"),
    ("unknown-model", _grpc_request(model="nope"), grpc.StatusCode.NOT_FOUND, "unknown model 'nope'"),
    ("over-the-limit", _grpc_request(shape=[1, LIMIT], raw=np.zeros(LIMIT, np.int64).tobytes()),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
]


def _grpc_good(stub, want) -> None:
    response = stub.ModelInfer(_grpc_request(raw=GOOD_IDS.ravel(), shape=GOOD_IDS.shape), timeout=30)
    assert np.array_equal(np.frombuffer(response.raw_output_contents[0], np.float32).reshape(want.shape), want)


@pytest.mark.parametrize("request_,code,message", [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES])
def test_hostile_grpc_request_is_refused_and_the_model_stays_exact(plain, request_, code, message):
    proc, want = plain
    with grpc.insecure_channel(f"127.0.0.1:{proc.grpc}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request_, timeout=30)
        assert info.value.code() == code, info.value.details()
        assert message in info.value.details() and "\n" not in info.value.details() and "Traceback" not in \
            info.value.details()
        _grpc_good(stub, want)


def test_a_refused_streamed_request_gets_an_error_and_the_stream_goes_on(generation):
    proc, want = generation
    bad = service_pb2.ModelInferRequest(model_name="model_stream", id="bad")
    bad.inputs.add(name="input_ids", datatype="INT64", shape=[1 << 61])
    bad.raw_input_contents.append(b"")
    good = service_pb2.ModelInferRequest(model_name="model_stream", id="good")
    good.inputs.add(name="input_ids", datatype="INT64", shape=[3]).contents.int64_contents.extend([5, 6, 7])
    good.inputs.add(name="max_new_tokens", datatype="INT64", shape=[1]).contents.int64_contents.append(4)
    with grpc.insecure_channel(f"127.0.0.1:{proc.grpc}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        responses = list(stub.ModelStreamInfer(iter([bad, good]), timeout=60))
    errors = [r.error_message for r in responses if r.error_message]
    assert errors == ["input 'input_ids' claims shape [2305843009213693952] (18446744073709551616 bytes of INT64) "
                      "but carries 0 bytes; give a shape that matches the data"]
    tokens = [int(np.frombuffer(r.infer_response.raw_output_contents[0], np.int64)[0])
              for r in responses if not r.error_message and r.infer_response.raw_output_contents]
    assert tokens == want


def test_grpc_server_ready_and_the_endpoints_that_change_the_server(plain):
    proc, _ = plain
    with grpc.insecure_channel(f"127.0.0.1:{proc.grpc}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
        assert stub.ModelReady(service_pb2.ModelReadyRequest(name="model"), timeout=10).ready
        with pytest.raises(grpc.RpcError) as info:
            stub.RepositoryModelUnload(service_pb2.RepositoryModelUnloadRequest(model_name="model"), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert info.value.details() == "RepositoryModelUnload is not exposed by this server"


def test_a_compressed_grpc_message_is_held_to_the_limit_by_its_decompressed_size(plain):
    proc, want = plain
    zeros = np.zeros((1, 2 * LIMIT // 8), np.int64)  # 2 MiB of zeros, a few KiB gzipped
    with grpc.insecure_channel(f"127.0.0.1:{proc.grpc}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_grpc_request(shape=zeros.shape, raw=zeros.tobytes()), timeout=30,
                            compression=grpc.Compression.Gzip)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        _grpc_good(stub, want)
