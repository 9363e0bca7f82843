"""``serve`` on a ``--target onnxruntime`` export: both generation models submit to one engine.
Over the wire (loopback only): concurrent streams and whole answers each exact, a full queue
refused with 503 / UNAVAILABLE at once, a client that closes its stream frees its slot, SIGTERM
with generations in flight exits 0 once they are answered, and a client that polls the model's
readiness can call it at once."""

from __future__ import annotations

import concurrent.futures
import json
import queue
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (make installs it; see pyproject.toml: serve)")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[http,grpc]")
from tritonclient.utils import InferenceServerException  # noqa: E402

from rmsnorm_deploy.decoder.generate import KVCacheModel, generate  # noqa: E402
from rmsnorm_deploy.serving.triton.process import start_serve_process  # noqa: E402
from tests.serving._serve import STARTUP_S, post_infer, running_server  # noqa: E402

VOCAB = 256  # the tiny Llama's
LONG = 16000  # new tokens of a stream that outlives what a test does to it (the model holds 16384)


def _body(prompt: list[int], max_new_tokens: int) -> dict:
    return {"inputs": [{"name": "input_ids", "shape": [len(prompt)], "datatype": "INT64", "data": prompt},
                       {"name": "max_new_tokens", "shape": [1], "datatype": "INT64", "data": [max_new_tokens]}]}


def _whole(http: int, prompt: list[int], max_new_tokens: int) -> tuple[int, str]:
    return post_infer(f"http://127.0.0.1:{http}/v2/models/model/infer", _body(prompt, max_new_tokens), timeout=120)


def _tokens(answer: tuple[int, str]) -> list[int]:
    status, text = answer
    assert status == 200, answer
    return json.loads(text)["outputs"][0]["data"]


class GrpcStream:
    """One streaming request over gRPC: its tokens as they come, its error if one comes."""

    def __init__(self, grpc: int, prompt: list[int], max_new_tokens: int):
        self.events: queue.Queue = queue.Queue()
        self.client = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{grpc}")
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))
        inputs = [tritonclient_grpc.InferInput("input_ids", [len(prompt)], "INT64"),
                  tritonclient_grpc.InferInput("max_new_tokens", [1], "INT64")]
        inputs[0].set_data_from_numpy(np.array(prompt, np.int64))
        inputs[1].set_data_from_numpy(np.array([max_new_tokens], np.int64))
        self.client.async_stream_infer("model_stream", inputs, enable_empty_final_response=True)
        self.tokens: list[int] = []
        self.error = None

    def read(self, count: int | None = None) -> list[int]:
        """Up to ``count`` more tokens (all, to the final response, without a count)."""
        while count is None or len(self.tokens) < count:
            result, error = self.events.get(timeout=120)
            if error is not None:
                self.error = error
                break
            if result.get_response().outputs:
                self.tokens.extend(result.as_numpy("output_ids").tolist())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        return self.tokens

    def close(self, *, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _want(folder, prompts_and_counts) -> list[list[int]]:
    with KVCacheModel(folder) as model:
        return [generate(model, [p], max_new_tokens=n).tokens[0] for p, n in prompts_and_counts]


def _summary(log: list[str]) -> str:
    return next(line for line in log if line.startswith("generations: "))


def test_concurrent_streams_and_whole_answers_are_each_exact(engine_exports):
    folder = engine_exports("ort")
    rng = np.random.default_rng(4)
    requests = [(rng.integers(3, VOCAB, int(rng.integers(1, 40))).tolist(), int(rng.integers(1, 60)))
                for _ in range(8)]
    want = _want(folder, requests)
    with running_server(folder, "--max-batch", "4") as server:
        assert "continuous batching: up to 4 streams decoded together in slots of 8192 tokens" in "".join(server.log)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            streamed = [pool.submit(lambda r: (s := GrpcStream(server.grpc, *r)).read() and s.close() or s.tokens, r)
                        for r in requests[:4]]
            whole = [pool.submit(lambda r: _tokens(_whole(server.http, *r)), r) for r in requests[4:]]
            got = [f.result(timeout=120) for f in streamed + whole]
        assert got == want
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http}/metrics", timeout=30) as response:
            scraped = response.read().decode()  # the engine's Prometheus metrics on the KServe front
        assert "rmsnorm_deploy_running_streams 0.0" in scraped, scraped
        assert f"rmsnorm_deploy_generated_tokens_total {float(sum(map(len, want)))}" in scraped, scraped
        assert "rmsnorm_deploy_time_to_first_token_seconds_count 8.0" in scraped, scraped
        server.stop()
        assert server.process.returncode == 0
        assert _summary(server.log) == "generations: 8 finished, 0 cancelled, 0 failed; 0 refused with the queue full\n"


def test_a_full_queue_is_refused_at_once_with_503_and_unavailable(engine_exports):
    with running_server(engine_exports("ort"), "--max-batch", "1", "--max-queue", "0") as server:
        long = GrpcStream(server.grpc, [5, 6, 7], LONG)
        long.read(1)
        message = "the server is busy: its 1 streams and its queue of 0 are full (--max-batch 1, --max-queue 0); retry later"
        started = time.perf_counter()
        assert _whole(server.http, [1, 2], 2) == (503, json.dumps({"error": message}, separators=(",", ":")))
        with tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{server.grpc}") as client:
            inputs = [tritonclient_grpc.InferInput("input_ids", [2], "INT64")]
            inputs[0].set_data_from_numpy(np.array([1, 2], np.int64))
            with pytest.raises(InferenceServerException) as info:
                client.infer("model", inputs)
        assert time.perf_counter() - started < 5  # refused at once, not after the long stream
        assert (info.value.status(), info.value.message()) == ("StatusCode.UNAVAILABLE", message)
        refused = GrpcStream(server.grpc, [1, 2], 2)
        assert refused.read() == [] and refused.error.message() == message
        refused.close()
        long.close(cancel=True)


def test_a_client_that_closes_its_stream_frees_its_slot(engine_exports):
    folder = engine_exports("ort")
    with running_server(folder, "--max-batch", "1", "--max-queue", "0") as server:
        gone = GrpcStream(server.grpc, [5, 6, 7], LONG)
        assert len(gone.read(3)) == 3
        gone.close(cancel=True)
        deadline = time.monotonic() + 60
        while (answer := _whole(server.http, [8, 9], 3))[0] == 503:  # busy until the slot is freed
            assert time.monotonic() < deadline, answer
            time.sleep(0.05)
        assert _tokens(answer) == _want(folder, [([8, 9], 3)])[0]
        server.stop()
        assert server.process.returncode == 0
        # the closed stream was cancelled, not run to its 16000 tokens (the polls before were refused)
        assert _summary(server.log).startswith("generations: 1 finished, 1 cancelled, 0 failed; ")


def test_sigterm_finishes_the_generations_in_flight_then_exits_0(engine_exports):
    folder = engine_exports("ort")
    requests = [([5, 6, 7], 3000), ([1, 2], 2500), ([11], 2000)]  # still running when SIGTERM comes
    want = _want(folder, requests)
    with running_server(folder, "--max-batch", "2", "--max-queue", "4") as server:
        streams = [GrpcStream(server.grpc, *r) for r in requests[:2]]
        for stream in streams:
            stream.read(1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(_whole, server.http, *requests[2])
            time.sleep(0.2)
            server.process.send_signal(signal.SIGTERM)
            got = [s.read() for s in streams] + [_tokens(whole.result(timeout=120))]
        assert got == want and not any(s.error for s in streams)
        assert server.process.wait(timeout=60) == 0
        text = "".join(server.log)
        assert "draining: " in text and _summary(server.log).startswith("generations: 3 finished, 0 cancelled"), text
        for stream in streams:
            stream.close()


def test_a_client_that_polls_readiness_can_call_at_once(engine_exports):
    folder = engine_exports("ort")
    proc = start_serve_process(folder, wait=False)
    try:
        deadline = time.monotonic() + STARTUP_S
        for model in ("model", "model_stream"):
            while True:
                assert proc.process.poll() is None and time.monotonic() < deadline, "".join(proc.log)
                try:
                    with urllib.request.urlopen(proc.url(f"/v2/models/{model}/ready"), timeout=2) as response:
                        if response.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, OSError):
                    pass
                time.sleep(0.02)
        assert _tokens(_whole(proc.http, [7, 8, 9], 4)) == _want(folder, [([7, 8, 9], 4)])[0]
        stream = GrpcStream(proc.grpc, [7, 8, 9], 4)
        assert stream.read() == _want(folder, [([7, 8, 9], 4)])[0]
        stream.close()
    finally:
        proc.stop()
