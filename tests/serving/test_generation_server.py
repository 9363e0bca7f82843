"""``serve`` on a KV-cache export: the generation model (token ids in, new token ids out).

One server for the module, on free loopback ports; its answers are compared with ``generate``
called directly on the same folder in this process.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (make installs it; see pyproject.toml: serve)")
tritonclient_http = pytest.importorskip("tritonclient.http", reason="serving tests need tritonclient[http,grpc]")
from tritonclient.utils import InferenceServerException  # noqa: E402

from rmsnorm_deploy.cli import main  # noqa: E402
from rmsnorm_deploy.serving.generate import KVCacheModel, generate  # noqa: E402
from tests.serving._serve import running_server  # noqa: E402

VOCAB = 512  # the tiny preset's


@pytest.fixture(scope="session")
def tiny_kv_export(tmp_path_factory):
    """``rmsnorm-deploy export tiny --kv-cache -o DIR``: the folder."""
    folder = tmp_path_factory.mktemp("tiny-kv-export")
    assert main(["export", "tiny", "--kv-cache", "-o", str(folder), "--force"]) == 0
    return folder


@pytest.fixture(scope="module")
def served(tiny_kv_export):
    with running_server(tiny_kv_export) as server:
        yield server.http, server.log


def _generate_http(http: int, prompt: np.ndarray, max_new_tokens: int | None) -> np.ndarray:
    client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{http}")
    inputs = [tritonclient_http.InferInput("input_ids", list(prompt.shape), "INT64")]
    inputs[0].set_data_from_numpy(prompt, binary_data=True)
    if max_new_tokens is not None:
        inputs.append(tritonclient_http.InferInput("max_new_tokens", [1], "INT64"))
        inputs[1].set_data_from_numpy(np.array([max_new_tokens], np.int64), binary_data=True)
    return client.infer("model", inputs).as_numpy("output_ids")


def _direct(folder: Path, prompt: np.ndarray, max_new_tokens: int | None) -> list[int]:
    kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    with KVCacheModel(folder) as model:
        return generate(model, [prompt.tolist()], **kwargs).tokens[0]


def test_serve_announces_the_generation_model(served):
    _, log = served
    text = "".join(log)
    assert "as generation model 'model'" in text and "output_ids int64[m]" in text, text


@pytest.mark.parametrize("length,max_new_tokens", [(1, 1), (7, 5), (12, None)])
def test_generated_tokens_equal_generate_called_directly(served, tiny_kv_export, length, max_new_tokens):
    http, _ = served
    prompt = np.random.default_rng(length).integers(0, VOCAB, length).astype(np.int64)
    got = _generate_http(http, prompt, max_new_tokens)
    want = _direct(tiny_kv_export, prompt, max_new_tokens)
    assert got.dtype == np.int64 and len(want) >= 1
    assert got.tolist() == want


def test_a_request_without_a_prompt_is_refused_by_name(served):
    status, text = _post_infer(served[0], {"inputs": [
        {"name": "max_new_tokens", "shape": [1], "datatype": "INT64", "data": [3]}]})
    assert status >= 400 and "the request has no input_ids" in json.loads(text)["error"], (status, text)


def _post_infer(http: int, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/model/infer", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("inputs,message", [
    ([{"name": "input_ids", "shape": [3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}], "data-type"),
    ([{"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]}], "shape"),
], ids=["wrong-dtype", "wrong-rank"])
def test_malformed_request_gets_a_4xx_and_the_server_keeps_generating(served, tiny_kv_export, inputs, message):
    http, _ = served
    status, text = _post_infer(http, {"inputs": inputs})
    assert 400 <= status < 500, (status, text)
    assert message in json.loads(text)["error"].lower(), text
    prompt = np.array([5, 6, 7], np.int64)
    assert _generate_http(http, prompt, 2).tolist() == _direct(tiny_kv_export, prompt, 2)


@pytest.mark.parametrize("prompt,max_new_tokens,message", [
    ([VOCAB], 2, "outside the model's vocabulary"),
    ([1, 2], 0, "max-new-tokens must be an integer >= 1"),
], ids=["token-outside-vocab", "zero-new-tokens"])
def test_bad_values_are_refused_with_the_one_line_error(served, prompt, max_new_tokens, message):
    """Triton checks datatypes and ranks (4xx above); what only the model knows comes back as an
    error with our message (PyTriton answers an infer function's exception with HTTP 500)."""
    http, _ = served
    with pytest.raises(InferenceServerException) as info:
        _generate_http(http, np.array(prompt, np.int64), max_new_tokens)
    assert message in info.value.message(), info.value.message()
