"""``serve --openai-port``: the OpenAI API in the serving process, on the engine the KServe models
use (a stream on one side holds the slot the other side is refused), named in the startup summary;
refused in one line, exit 2, where it cannot be served."""

from __future__ import annotations

import json
import shutil
import socket
import time

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="serve needs nvidia-pytriton")
pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")
openai = pytest.importorskip("openai", reason="the tests speak through the official openai client")
pytest.importorskip("transformers", reason="chat prompts are rendered by transformers' apply_chat_template")

from rmsnorm_deploy.cli import main  # noqa: E402
from rmsnorm_deploy.decoder.generate import KVCacheModel, generate  # noqa: E402
from rmsnorm_deploy.errors import UserError  # noqa: E402
from rmsnorm_deploy.serving.triton.process import free_ports, start_serve_process  # noqa: E402
from tests.serving._models import fixed_shape_model  # noqa: E402
from tests.serving._serve import post_infer  # noqa: E402

STARTUP_S = 90


def _serve(folder, *args):
    port = free_ports(1)[0]
    try:
        served = start_serve_process(folder, timeout_s=STARTUP_S, args=["--openai-port", str(port), *args])
    except UserError as exc:
        pytest.fail(str(exc))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    return served, client, port


def _kserve_infer(served, ids, n) -> tuple[int, dict]:
    status, text = post_infer(served.url("/v2/models/model/infer"), {"inputs": [
        {"name": "input_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids},
        {"name": "max_new_tokens", "datatype": "INT64", "shape": [1], "data": [n]}]}, timeout=60)
    return status, json.loads(text)


def test_openai_and_kserve_answer_alike_on_one_engine_and_the_summary_names_the_api(text_exports):
    folder = text_exports("ort")
    with KVCacheModel(folder) as model:
        ids = model.encode("hello the world")
        want = generate(model, [ids], max_new_tokens=12)
    served, client, port = _serve(folder)
    try:
        log = "".join(served.log)
        assert (f"  OpenAI   http://127.0.0.1:{port}/v1 (completions, chat completions; chat through the folder's "
                "chat template; the same engine as the KServe models)") in log
        answer = client.completions.create(model="model", prompt="hello the world", max_tokens=12, temperature=0)
        status, kserve = _kserve_infer(served, ids, 12)
        assert status == 200 and kserve["outputs"][0]["data"] == want.tokens[0]
        assert answer.choices[0].text == want.text[0] and answer.usage.completion_tokens == len(want.tokens[0])
        chat = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0)
        assert chat.usage.completion_tokens == 5
    finally:
        served.stop()
    assert served.process.returncode == 0


def test_openai_and_kserve_clients_share_the_engines_one_slot(text_exports):
    """With one slot and no queue, a stream on either API holds the slot the other is refused."""
    folder = text_exports("ort")
    served, client, _ = _serve(folder, "--max-batch", "1", "--max-queue", "0")
    try:
        running = client.completions.create(model="model", prompt="hello", max_tokens=400, temperature=0, stream=True)
        next(iter(running))
        status, refused = _kserve_infer(served, [1, 40, 41], 2)
        assert status == 503 and "the server is busy" in refused["error"]
        running.close()
        deadline = time.monotonic() + 20
        while _kserve_infer(served, [1, 40, 41], 2)[0] != 200:
            assert time.monotonic() < deadline, "the slot was not freed after the OpenAI client went away"
            time.sleep(0.05)

        import tritonclient.grpc as grpc

        events: list = []
        stream_client = grpc.InferenceServerClient(f"127.0.0.1:{served.grpc}")
        stream_client.start_stream(callback=lambda result, error: events.append((result, error)))
        ids = grpc.InferInput("input_ids", [3], "INT64")
        ids.set_data_from_numpy(np.array([1, 40, 41], np.int64))
        count = grpc.InferInput("max_new_tokens", [1], "INT64")
        count.set_data_from_numpy(np.array([400], np.int64))
        stream_client.async_stream_infer("model_stream", [ids, count])
        deadline = time.monotonic() + 20
        while not events:
            assert time.monotonic() < deadline, "the KServe stream did not start"
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError, match="the server is busy"):
            client.completions.create(model="model", prompt="hi", max_tokens=2)
        stream_client.stop_stream(cancel_requests=True)
    finally:
        served.stop()


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("rmsnorm-deploy serve: error: ") and err.count("\n") == 1, err
    return err


def test_openai_port_is_refused_where_the_api_cannot_be_served(tmp_path, capsys, text_exports):
    plain = fixed_shape_model(tmp_path / "model.onnx")
    assert main(["serve", str(plain), "--openai-port", str(free_ports(1)[0])]) == 2
    assert ("--openai-port: this model is a plain graph, which takes tensors, not text; the OpenAI API serves "
            "KV-cache exports (export --kv-cache)") in _one_line_error(capsys)

    bare = tmp_path / "no-tokenizer"
    shutil.copytree(text_exports("ort"), bare)
    (bare / "tokenizer.json").unlink()
    assert main(["serve", str(bare), "--openai-port", str(free_ports(1)[0])]) == 2
    assert f"--openai-port: {bare} has no tokenizer.json, so it cannot take text" in _one_line_error(capsys)

    assert main(["serve", str(text_exports("ort")), "--openai-port", "8123", "--no-openai"]) == 2
    assert "--openai-port and --no-openai contradict each other; give one" in _one_line_error(capsys)

    assert main(["serve", str(text_exports("ort")), "--openai-port", "70000"]) == 2
    assert "--openai-port 70000: a port is a number from 1 to 65535" in _one_line_error(capsys)

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", str(text_exports("ort")), "--openai-port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is in use (--openai-port)" in _one_line_error(capsys)
