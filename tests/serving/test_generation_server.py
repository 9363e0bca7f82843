"""``serve`` on a KV-cache export: the generation model (token ids in, new token ids out) and its
streaming twin ``<name>_stream`` (one response per new token over gRPC streaming).

One server for the module, on free loopback ports; its answers are compared with ``generate``
called directly on the same folder in this process.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import queue
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (make installs it; see pyproject.toml: serve)")
tritonclient_http = pytest.importorskip("tritonclient.http", reason="serving tests need tritonclient[http,grpc]")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[http,grpc]")
from tritonclient.utils import InferenceServerException  # noqa: E402

from rmsnorm_deploy.decoder.generate import KVCacheModel, generate  # noqa: E402
from tests.serving._serve import post_infer, running_server  # noqa: E402

VOCAB = 512  # the tiny preset's


@pytest.fixture(scope="module")
def served(tiny_kv_export):
    with running_server(tiny_kv_export) as server:
        yield server.http, server.log, server.grpc


@pytest.fixture(scope="module")
def max_length(tiny_kv_export):
    with KVCacheModel(tiny_kv_export) as model:
        return model.layout.max_length


def _inputs(module, prompt: np.ndarray | None, max_new_tokens: int | None) -> list:
    inputs = []
    if prompt is not None:
        inputs.append(module.InferInput("input_ids", list(prompt.shape), "INT64"))
        inputs[-1].set_data_from_numpy(prompt)
    if max_new_tokens is not None:
        inputs.append(module.InferInput("max_new_tokens", [1], "INT64"))
        inputs[-1].set_data_from_numpy(np.array([max_new_tokens], np.int64))
    return inputs


def _generate_http(http: int, prompt: np.ndarray | None, max_new_tokens: int | None) -> np.ndarray:
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{http}")
    return client.infer("model", _inputs(tritonclient_http, prompt, max_new_tokens)).as_numpy("output_ids")


def _generate_grpc(grpc: int, prompt: np.ndarray | None, max_new_tokens: int | None) -> np.ndarray:
    with tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{grpc}") as client:
        return client.infer("model", _inputs(tritonclient_grpc, prompt, max_new_tokens)).as_numpy("output_ids")


def _stream(grpc: int, prompt: np.ndarray | None, max_new_tokens: int | None, *, model: str = "model_stream"):
    """One streaming request: ``(tokens, indices, errors)``, read until the final (empty) response or
    the first error."""
    events: queue.Queue = queue.Queue()
    tokens, indices, errors = [], [], []
    with tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{grpc}") as client:
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        try:
            client.async_stream_infer(model, _inputs(tritonclient_grpc, prompt, max_new_tokens),
                                      enable_empty_final_response=True)
            while True:
                result, error = events.get(timeout=60)
                if error is not None:
                    errors.append(error)
                    break
                response = result.get_response()
                if response.outputs:
                    tokens.extend(result.as_numpy("output_ids").tolist())
                    indices.extend(result.as_numpy("index").tolist())
                if response.parameters["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream()
    return tokens, indices, errors


def _direct(folder: Path, prompt: np.ndarray, max_new_tokens: int | None) -> list[int]:
    kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    with KVCacheModel(folder) as model:
        return generate(model, [prompt.tolist()], **kwargs).tokens[0]


def test_serve_announces_the_generation_model(served):
    text = "".join(served[1])
    assert "as generation model 'model'" in text and "output_ids int64[m]" in text, text
    assert "streaming  'model_stream'" in text, text


@pytest.mark.parametrize("length,max_new_tokens", [(1, 1), (7, 5), (12, None)])
def test_generated_tokens_equal_generate_called_directly(served, tiny_kv_export, length, max_new_tokens):
    http = served[0]
    prompt = np.random.default_rng(length).integers(0, VOCAB, length).astype(np.int64)
    got = _generate_http(http, prompt, max_new_tokens)
    want = _direct(tiny_kv_export, prompt, max_new_tokens)
    assert got.dtype == np.int64 and len(want) >= 1
    assert got.tolist() == want


def _post_infer(http: int, body: dict) -> tuple[int, str]:
    return post_infer(f"http://127.0.0.1:{http}/v2/models/model/infer", body)


@pytest.mark.parametrize("inputs,message", [
    ([{"name": "input_ids", "shape": [3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}],
     "input 'input_ids' has datatype 'FP32' but model 'model' takes INT64"),
    ([{"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]}],
     "input 'input_ids' has shape [1, 3] but model 'model' takes [n] (rank 1)"),
], ids=["wrong-dtype", "wrong-rank"])
def test_malformed_request_gets_a_4xx_and_the_server_keeps_generating(served, tiny_kv_export, inputs, message):
    http = served[0]
    status, text = _post_infer(http, {"inputs": inputs})
    assert status == 400, (status, text)
    assert json.loads(text) == {"error": message}
    prompt = np.array([5, 6, 7], np.int64)
    assert _generate_http(http, prompt, 2).tolist() == _direct(tiny_kv_export, prompt, 2)


#: Requests Triton accepts (right names, datatypes and ranks) that only the model can refuse.
BAD_VALUES = [
    (None, 3, "the request has no input_ids (the prompt's token ids, INT64 [n])"),
    ([3, -1], 2, "token id -1 is outside the model's vocabulary [0, 512)"),
    ([VOCAB], 2, "token id 512 is outside the model's vocabulary [0, 512)"),
    ([1, 2], 0, "max_new_tokens must be an integer >= 1, got 0"),
    ([1, 2], -3, "max_new_tokens must be an integer >= 1, got -3"),
    ([1, 2], "limit", ("2 prompt tokens + {limit} new tokens exceed the model's maximum of {max_length}; "
                       "lower max_new_tokens to at most {room}")),
]
BAD_IDS = ["no-prompt", "negative-token", "token-at-vocab-size", "zero-new-tokens", "negative-new-tokens",
           "over-the-limit"]


def _bad(prompt, max_new_tokens, message, max_length):
    limit = max_length - 1  # one more than the 2-token prompt leaves room for
    if max_new_tokens == "limit":
        max_new_tokens = limit
    message = message.format(limit=limit, max_length=max_length, room=limit - 1)
    return (None if prompt is None else np.array(prompt, np.int64)), max_new_tokens, message


def _still_generating(served, tiny_kv_export):
    prompt = np.array([5, 6, 7], np.int64)
    want = _direct(tiny_kv_export, prompt, 2)
    assert _generate_http(served[0], prompt, 2).tolist() == want
    assert _generate_grpc(served[2], prompt, 2).tolist() == want


@pytest.mark.parametrize("prompt,max_new_tokens,message", BAD_VALUES, ids=BAD_IDS)
def test_bad_values_get_http_400_with_the_one_line_error(served, tiny_kv_export, max_length, prompt,
                                                         max_new_tokens, message):
    """What only the model knows is refused as the client's fault (400), with our message alone."""
    prompt, max_new_tokens, message = _bad(prompt, max_new_tokens, message, max_length)
    inputs = [] if prompt is None else [
        {"name": "input_ids", "shape": [len(prompt)], "datatype": "INT64", "data": prompt.tolist()}]
    inputs.append({"name": "max_new_tokens", "shape": [1], "datatype": "INT64", "data": [max_new_tokens]})
    status, text = _post_infer(served[0], {"inputs": inputs})
    assert status == 400, (status, text)
    assert json.loads(text)["error"] == message, text
    _still_generating(served, tiny_kv_export)


@pytest.mark.parametrize("prompt,max_new_tokens,message", BAD_VALUES, ids=BAD_IDS)
def test_bad_values_get_grpc_invalid_argument_with_the_one_line_error(served, tiny_kv_export, max_length, prompt,
                                                                      max_new_tokens, message):
    prompt, max_new_tokens, message = _bad(prompt, max_new_tokens, message, max_length)
    with pytest.raises(InferenceServerException) as info:
        _generate_grpc(served[2], prompt, max_new_tokens)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", (info.value.status(), info.value.message())
    assert info.value.message() == message
    _still_generating(served, tiny_kv_export)


# -- streaming ------------------------------------------------------------------------------------

@pytest.mark.parametrize("length,max_new_tokens", [(1, 1), (1, 6), (7, 5), (7, None)])
def test_streamed_tokens_equal_the_whole_answer_and_generate(served, tiny_kv_export, length, max_new_tokens):
    prompt = np.random.default_rng(100 + length).integers(0, VOCAB, length).astype(np.int64)
    tokens, indices, errors = _stream(served[2], prompt, max_new_tokens)
    want = _direct(tiny_kv_export, prompt, max_new_tokens)
    assert not errors, [e.message() for e in errors]
    assert tokens == want == _generate_http(served[0], prompt, max_new_tokens).tolist()
    assert indices == list(range(len(want)))  # one response per new token, in order


@pytest.mark.parametrize("prompt,max_new_tokens,message", BAD_VALUES, ids=BAD_IDS)
def test_a_bad_streaming_request_gets_the_error_on_the_stream(served, tiny_kv_export, max_length, prompt,
                                                              max_new_tokens, message):
    prompt, max_new_tokens, message = _bad(prompt, max_new_tokens, message, max_length)
    tokens, _, errors = _stream(served[2], prompt, max_new_tokens)
    assert tokens == [] and [e.message() for e in errors] == [message]
    good = np.array([9, 8], np.int64)
    assert _stream(served[2], good, 3)[0] == _direct(tiny_kv_export, good, 3)
    _still_generating(served, tiny_kv_export)


def test_streams_and_whole_answers_at_the_same_time_are_each_exact(served, tiny_kv_export):
    """Two streams and a plain request in flight together: the streams' steps interleave and the plain
    request waits for the session between them; nobody waits forever, every answer is its own."""
    prompts = {"a": np.array([3, 1, 4, 1, 5], np.int64), "b": np.array([9], np.int64), "c": np.array([2, 7], np.int64)}
    want = {k: _direct(tiny_kv_export, p, 24) for k, p in prompts.items()}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = {k: pool.submit(_stream, served[2], prompts[k], 24) for k in ("a", "b")}
        whole = pool.submit(_generate_http, served[0], prompts["c"], 24)
        got = {k: f.result(timeout=120)[0] for k, f in streams.items()}
        got["c"] = whole.result(timeout=120).tolist()
    assert got == want


# -- the front answers token streams from the engine, as Triton would ------------------------------

def _triton_grpc_port(log: list[str]) -> int:
    match = re.search(r"then Triton on 127\.0\.0\.1:\d+ \(HTTP\), 127\.0\.0\.1:(\d+) \(gRPC\)", "".join(log))
    assert match, "".join(log)
    return int(match.group(1))


def _raw_request(prompt, max_new_tokens=None, *, id="", empty_final=True, outputs=(), typed=False,
                 model="model_stream") -> bytes:
    """A ``ModelInferRequest`` as tritonclient would write it (raw contents), or with typed contents."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model, id=id)
    for name, values in (("input_ids", prompt), ("max_new_tokens", None if max_new_tokens is None else [max_new_tokens])):
        if values is None:
            continue
        tensor = request.inputs.add(name=name, datatype="INT64", shape=[len(values)])
        if typed:
            tensor.contents.int64_contents.extend(values)
        else:
            request.raw_input_contents.append(np.array(values, np.int64).tobytes())
    if empty_final:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name in outputs:
        request.outputs.add(name=name)
    return request.SerializeToString()


def _raw_stream(port: int, requests: list[bytes]) -> list[bytes]:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        return list(call(iter(requests), timeout=60))


STREAM_REQUESTS = {
    "tokens-and-final": ([[3, 1, 4], 4], {"id": "a-1"}),
    "no-empty-final": ([[3, 1, 4], 2], {"empty_final": False}),
    "typed-contents": ([[9, 2], 3], {"typed": True, "id": "t"}),
    "one-output-asked": ([[5], 2], {"outputs": ["output_ids"]}),
    "default-max-new-tokens": ([[5, 6, 7, 8]], {}),
    "token-outside-the-vocabulary": ([[1, VOCAB], 2], {"id": "r"}),
    "zero-new-tokens": ([[1, 2], 0], {}),
    "refused-without-empty-final": ([[1, VOCAB], 2], {"empty_final": False}),
    "no-prompt": ([None, 2], {}),
    "an-output-it-does-not-have": ([[1], 1], {"outputs": ["logits"]}),
}


@pytest.mark.parametrize("case", STREAM_REQUESTS.values(), ids=list(STREAM_REQUESTS))
def test_the_fronts_token_stream_is_tritons_byte_for_byte(served, case):
    """The public gRPC front answers ``model_stream`` from the engine itself: each response (tokens,
    the empty final one, refusals) is the message Triton's own port sends for the same request."""
    args, kwargs = case
    request = _raw_request(*args, **kwargs)
    front = _raw_stream(served[2], [request])
    assert front == _raw_stream(_triton_grpc_port(served[1]), [request])
    assert front  # something was compared


def test_one_grpc_stream_carries_several_requests_answered_each_in_full(served, tiny_kv_export):
    """Requests on one stream run at once in the engine; each request's responses are its own."""
    from tritonclient.grpc import service_pb2

    prompts = {"x": [3, 1, 4], "y": [9], "z": [2, 7, 1]}
    answers = _raw_stream(served[2], [_raw_request(p, 6, id=k) for k, p in prompts.items()]
                          + [_raw_request([1], 2, id="w", model="model")])
    got: dict[str, list[int]] = {}
    for raw in answers:
        response = service_pb2.ModelStreamInferResponse.FromString(raw)
        assert not response.error_message
        r = response.infer_response
        if r.outputs:
            got.setdefault(r.id, []).extend(np.frombuffer(r.raw_output_contents[0], "<i8").tolist())
    want = {k: _direct(tiny_kv_export, np.array(p, np.int64), 6) for k, p in prompts.items()}
    assert got == {**want, "w": _direct(tiny_kv_export, np.array([1], np.int64), 2)}
