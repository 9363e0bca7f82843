"""``rmsnorm-deploy serve``: a real Triton Inference Server (PyTriton) on free loopback ports.

One server per module (it starts in a few seconds); every request goes to 127.0.0.1 only, in
loops bounded in count and time. Outputs are compared bit for bit with the same ONNX Runtime
session called directly.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (make installs it; see pyproject.toml: serve)")
tritonclient_http = pytest.importorskip("tritonclient.http", reason="serving tests need tritonclient[http,grpc]")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[http,grpc]")
from tritonclient.utils import InferenceServerException  # noqa: E402

from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner  # noqa: E402
from tests.serving._serve import post_infer, running_server  # noqa: E402

VOCAB = 512  # the tiny preset's
CLIENTS, REQUESTS_PER_CLIENT = 32, 20


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def served(tiny_export):
    with running_server(tiny_export) as server:
        server.children = _descendants(server.process.pid)
        yield server


def _ids(rows: int, seq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (rows, seq)).astype(np.int64)


@pytest.fixture(scope="module")
def direct(tiny_export):
    """The same model in an ONNX Runtime session of this process: the reference, bit for bit."""
    with OnnxRuntimeRunner(tiny_export / "model.onnx") as runner:
        yield lambda ids: runner.infer({"input_ids": ids})["logits"]


def _infer_http(client, ids):
    inp = tritonclient_http.InferInput("input_ids", list(ids.shape), "INT64")
    inp.set_data_from_numpy(ids, binary_data=True)
    return client.infer("model", [inp]).as_numpy("logits")


def _infer_grpc(client, ids):
    inp = tritonclient_grpc.InferInput("input_ids", list(ids.shape), "INT64")
    inp.set_data_from_numpy(ids)
    return client.infer("model", [inp], client_timeout=30).as_numpy("logits")


def test_serve_says_where_it_listens_and_binds_loopback_only(served):
    text = "".join(served.log)
    assert f"http://127.0.0.1:{served.http}/v2/models/model" in text
    assert f"127.0.0.1:{served.grpc}" in text and "ready" in text
    listening = Path("/proc/net/tcp").read_text().splitlines()[1:] + Path("/proc/net/tcp6").read_text().splitlines()[1:]
    ours = {p: [] for p in (served.http, served.grpc, served.metrics)}
    for line in listening:
        local, state = line.split()[1], line.split()[3]
        port = int(local.rsplit(":", 1)[1], 16)
        if state == "0A" and port in ours:  # LISTEN
            ours[port].append(local.rsplit(":", 1)[0])
    assert all(ours.values()), f"not listening: {ours}"
    # /proc's byte order: 127.0.0.1, and the same as an IPv4-mapped IPv6 address (gRPC binds so);
    # nothing on 0.0.0.0 or ::
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    assert all(addr in loopback for addrs in ours.values() for addr in addrs), ours


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("rows,seq", [(1, 1), (1, 7), (3, 19), (8, 5)])
def test_outputs_are_bit_identical_to_onnxruntime_called_directly(served, direct, protocol, rows, seq):
    ids = _ids(rows, seq, seed=rows * 100 + seq)
    if protocol == "http":
        got = _infer_http(tritonclient_http.InferenceServerClient(f"127.0.0.1:{served.http}"), ids)
    else:
        got = _infer_grpc(tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{served.grpc}"), ids)
    want = direct(ids)
    assert got.dtype == want.dtype == np.float32 and got.shape == (rows, seq, VOCAB)
    assert np.array_equal(got, want), f"max abs difference {np.abs(got - want).max()}"
    assert np.isfinite(got).all()


def test_concurrent_clients_are_all_answered_exactly_and_batched(served, direct):
    pool = [_ids(rows, seq, seed=1000 + i) for i, (rows, seq) in enumerate([(1, 4), (2, 4), (1, 9), (2, 9)] * 2)]
    want = [direct(ids) for ids in pool]
    before = served.stats()

    def client(index: int) -> list[bool]:
        http = index % 2 == 0
        c = (tritonclient_http.InferenceServerClient(f"127.0.0.1:{served.http}", network_timeout=60) if http
             else tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{served.grpc}"))
        results = []
        for r in range(REQUESTS_PER_CLIENT):
            k = (index + r) % len(pool)
            got = _infer_http(c, pool[k]) if http else _infer_grpc(c, pool[k])
            results.append(bool(np.array_equal(got, want[k])))
        return results

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as executor:
        answers = [f.result(timeout=120) for f in [executor.submit(client, i) for i in range(CLIENTS)]]
    elapsed = time.monotonic() - started
    flat = [ok for answer in answers for ok in answer]
    assert len(flat) == CLIENTS * REQUESTS_PER_CLIENT, "requests lost"
    assert all(flat), f"{flat.count(False)} answers differ from ONNX Runtime called directly"
    after = served.stats()
    requests = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests == CLIENTS * REQUESTS_PER_CLIENT
    assert inferences >= requests  # rows: requests of 2 rows count 2
    assert executions < requests, (f"no batching seen: {executions} executions for {requests} requests in "
                                   f"{elapsed:.1f} s")
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"]


def _post_infer(served, body: dict) -> tuple[int, str]:
    return post_infer(served.url("/v2/models/model/infer"), body, timeout=10)


@pytest.mark.parametrize("inputs,message", [
    ([{"name": "input_ids", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}],
     "input 'input_ids' has datatype 'FP32' but model 'model' takes INT64"),
    ([{"name": "input_ids", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]}],
     "input 'input_ids' has shape [3] but model 'model' takes [batch, seq] (rank 2)"),
    ([{"name": "tokens", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]}],
     "model 'model' has no input 'tokens'; it takes input_ids INT64 [batch, seq]"),
    ([{"name": "input_ids", "shape": [9, 1], "datatype": "INT64", "data": list(range(9))}],
     "input 'input_ids' has a batch of 9 but model 'model' takes 1 to 8 rows; split the request"),
], ids=["wrong-dtype", "wrong-rank", "wrong-name", "batch-too-large"])
def test_malformed_requests_get_a_4xx_with_a_message_and_the_server_keeps_serving(served, direct, inputs, message):
    """The front refuses them before Triton sees them, with one line each."""
    status, text = _post_infer(served, {"inputs": inputs})
    assert status == 400, (status, text)
    assert json.loads(text) == {"error": message}
    ids = _ids(1, 3, seed=7)
    got = _infer_http(tritonclient_http.InferenceServerClient(f"127.0.0.1:{served.http}"), ids)
    assert np.array_equal(got, direct(ids))


def test_malformed_grpc_request_is_invalid_argument(served):
    client = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    inp = tritonclient_grpc.InferInput("input_ids", [1, 3], "FP32")
    inp.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("model", [inp])
    assert "INVALID_ARG" in str(info.value.status())
    assert info.value.message() == "input 'input_ids' has datatype 'FP32' but model 'model' takes INT64"


def test_metrics_are_served_on_loopback(served):
    with urllib.request.urlopen(f"http://127.0.0.1:{served.metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'nv_inference_count{model="model",version="1"}' in text


def test_statistics_are_readable_but_the_repository_api_is_guarded(served):
    assert served.stats()["name"] == "model"
    request = urllib.request.Request(served.url("/v2/repository/models/model/unload"), data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert 400 <= info.value.code < 500
    with urllib.request.urlopen(served.url("/v2/models/model/ready"), timeout=10) as response:
        assert response.status == 200


def test_served_answers_pass_against_the_server_over_both_protocols(served, tiny_export):
    from rmsnorm_deploy.serving.kserve.served_answers import main as served_answers_main

    assert served_answers_main([str(tiny_export), "--http", f"127.0.0.1:{served.http}", "--grpc",
                        f"127.0.0.1:{served.grpc}", "--exact"]) == 0


def test_served_answers_reports_other_weights_as_a_failure(served, tiny_export, tmp_path, capsys):
    import onnx

    from rmsnorm_deploy.serving.kserve.served_answers import main as served_answers_main

    model = onnx.load(str(tiny_export / "model.onnx"))
    weight = next(t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2)
    array = onnx.numpy_helper.to_array(weight) * 1.5
    weight.CopyFrom(onnx.numpy_helper.from_array(array, weight.name))
    (tmp_path / "other").mkdir()
    onnx.save(model, str(tmp_path / "other" / "model.onnx"))
    assert served_answers_main([str(tmp_path / "other"), "--http", f"127.0.0.1:{served.http}"]) == 1
    assert "parity over KServe v2: FAIL" in capsys.readouterr().out
    assert served_answers_main([str(tmp_path / "missing"), "--http", f"127.0.0.1:{served.http}"]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_sigterm_stops_the_server_cleanly_and_leaves_no_children(served):
    assert served.children, "the server had no child processes to watch (tritonserver, the Python stub)"
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=40) == 0, "".join(served.log)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in served.children) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = sorted(pid for pid in served.children if _alive(pid))
    assert not left, f"processes left behind: {left}"
    assert "stopping" in "".join(served.log)
    started = next(line for line in served.log if line.startswith("started in"))
    assert float(started.split()[2]) < 60, started
