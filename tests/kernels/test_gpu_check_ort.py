"""benchmarks/gpu_check_ort.py (the GPU check's ONNX Runtime steps) must work on its first GPU run: each
step's code runs here on the CPU provider (the IOBinding decode, the sweep's cases with every node required
on the provider), and what only a GPU host can show (which onnxruntime imported, a provider that does not
load, TensorRT-RTX's refusal) through fakes of the objects ONNX Runtime hands over."""

from __future__ import annotations

import http.server
import importlib.util
import json
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("onnxruntime", reason="the ONNX Runtime steps run ONNX Runtime CPU here")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")
ort_steps = sys.modules["gpu_check_ort"]


def _args(tmp_path, *extra):
    return gpu_check.parse_args(["--dry-run", "--out-dir", str(tmp_path), *extra])


class FakeOrt:
    __version__ = "1.31.1"
    __file__ = "/tmp/bundle/site/onnxruntime/__init__.py"

    def __init__(self, providers, preload_error=None):
        self.providers, self.preload_error, self.preloaded = providers, preload_error, False

    def get_available_providers(self):
        return self.providers

    def preload_dlls(self):
        if self.preload_error:
            raise OSError(self.preload_error)
        self.preloaded = True


CUDA = "CUDAExecutionProvider"


def test_a_cpu_only_onnxruntime_is_not_run_with_the_fix_and_fails_once_the_bundle_is_sourced(monkeypatch):
    monkeypatch.delenv(ort_steps.BUNDLE_ENV, raising=False)
    result = ort_steps.provider_check(FakeOrt(["CPUExecutionProvider"]), CUDA)
    assert result["status"] == "not run" and "run benchmarks/gpu_bundle.py install and source its env.sh" in result["detail"]
    assert result["version"] == "1.31.1" and result["file"] == "/tmp/bundle/site/onnxruntime"
    monkeypatch.setenv(ort_steps.BUNDLE_ENV, "/tmp/bundle/site")
    result = ort_steps.provider_check(FakeOrt(["CPUExecutionProvider"]), CUDA)
    assert result["status"] == "FAIL" and "yet this onnxruntime has no CUDAExecutionProvider" in result["detail"]


def test_the_cuda_provider_passes_only_when_a_session_really_runs_on_it():
    ort = FakeOrt([CUDA, "CPUExecutionProvider"])
    result = ort_steps.provider_check(ort, CUDA, probe=lambda p: "loads", missing_libraries=lambda p: [])
    assert result["status"] == "pass" and ort.preloaded
    assert "preload_dlls() ok; a session on CUDAExecutionProvider: loads" in result["detail"]
    result = ort_steps.provider_check(ort, CUDA, probe=lambda p: "falls back to CPUExecutionProvider: EP Error",
                                      missing_libraries=lambda p: [])
    assert result["status"] == "FAIL" and "falls back to CPUExecutionProvider" in result["detail"]
    result = ort_steps.provider_check(ort, CUDA, probe=lambda p: "loads",
                                      missing_libraries=lambda p: ["libcudnn.so.9", "libcublasLt.so.13"])
    assert result["status"] == "FAIL" and "missing libcudnn.so.9, libcublasLt.so.13" in result["detail"]
    result = ort_steps.provider_check(FakeOrt([CUDA], preload_error="libcudart.so.13: cannot open"), CUDA,
                                      probe=lambda p: "loads", missing_libraries=lambda p: [])
    assert result["status"] == "FAIL" and "preload_dlls() failed: libcudart.so.13: cannot open" in result["detail"]


def test_the_ort_cuda_step_rehearses_on_the_cpu_provider_and_says_not_run(tmp_path):
    result = ort_steps.onnxruntime_cuda(_args(tmp_path), 30.0)
    assert result["status"] == "not run" and result["detail"].startswith("no GPU; CPU rehearsal pass:")
    assert "a session on CPUExecutionProvider: loads" in result["detail"]


def test_the_lowerings_step_runs_the_sweeps_cases_with_every_node_required_on_the_provider(tmp_path, monkeypatch):
    from rmsnorm_deploy.validate import lowering_sweep

    seen = []
    real = lowering_sweep.run_case

    def spy(case):
        seen.append((case.lowering, case.dtype, case.provider, case.require_all_nodes_on_provider))
        return real(case)

    monkeypatch.setattr(lowering_sweep, "run_case", spy)
    monkeypatch.setattr(ort_steps, "LOWERING_DTYPES", ("float32",))
    result = ort_steps.lowerings(_args(tmp_path), 60.0)
    assert result["status"] == "not run", result["detail"]
    assert result["detail"].startswith("no GPU; CPU rehearsal pass: 5 of 5 lowering x dtype cases pass on cpu")
    assert sorted(seen) == sorted((low, "float32", "cpu", True) for low in ("function", "native", "ort", "inline",
                                                                           "plugin"))


def test_a_compute_node_off_the_provider_fails_the_lowerings_step(tmp_path, monkeypatch):
    from rmsnorm_deploy.errors import ProviderError
    from rmsnorm_deploy.validate import lowering_sweep

    def refuse(case):
        raise ProviderError("1 of 9 nodes run outside the requested provider(s) cuda: n0 (Mul) on cpu")

    monkeypatch.setattr(lowering_sweep, "run_case", refuse)
    monkeypatch.setattr(ort_steps, "LOWERING_DTYPES", ("bfloat16",))
    result = ort_steps.lowerings(gpu_check.parse_args(["--out-dir", str(tmp_path)]), 60.0)
    assert result["status"] == "FAIL" and "function/bfloat16: FAIL 1 of 9 nodes run outside" in result["detail"]
    assert [r["status"] for r in result["rows"] if r["case"] == "plugin/bfloat16"] == ["not applicable"]


def test_sweep_cases_take_the_provider_and_the_node_requirement():
    from rmsnorm_deploy.contract.spec import named_specs
    from rmsnorm_deploy.validate.lowering_sweep import SweepCase, run_case

    row = run_case(SweepCase("llama", named_specs()["llama"], "float16", "function", provider="cpu",
                             require_all_nodes_on_provider=True, shape=(3, 7)))
    assert row.status == "pass" and row.ulp_vs_oracle is not None


@pytest.mark.slow
def test_the_kv_decode_compares_the_provider_with_the_cpu_through_iobinding(tmp_path):
    """~15-30 s: a tiny Llama with a chat template exported with --kv-cache --target onnxruntime, then
    decode_rows' two sessions (the provider's is the CPU here: its IOBinding path, warm-up and timed run,
    node assignment) on the prompt the chat template renders, as serve's chat endpoint does."""
    from rmsnorm_deploy.cli import main
    from rmsnorm_deploy.exporter import hf
    from tests.serving._tokenizer import write_tokenizer

    source, folder = tmp_path / "hf", tmp_path / "kv"
    hf.from_config({**hf.TINY_CONFIGS["llama"], "vocab_size": 292}, "float32", seed=0).module.model.save_pretrained(source)
    write_tokenizer(source)
    assert main(["export", str(source), "--kv-cache", "--target", "onnxruntime", "-o", str(folder), "--force"]) == 0
    rows = ort_steps.decode_rows(folder, "cpu", new_tokens=6)
    assert len(rows["prompt_ids"]) > 10  # the chat template's turn markers around the prompt
    cpu, device = rows["cpu"], rows["device"]
    assert len(cpu["tokens"]) == 6 and device["tokens"] == cpu["tokens"] and device["provider"] == "cpu"
    assert device["decode_ms"] > 0 and device["prefill_ms"] > 0 and device["providers"] == ["CPUExecutionProvider"]
    assert device["nodes"].endswith("on cpu") and rows["prompt_ids"]


class _OpenAI(http.server.BaseHTTPRequestHandler):
    answer = "The sea is wide."

    def log_message(self, *args):
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "model", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0 and body["max_tokens"] == ort_steps.SERVED_TOKENS
        assert body["messages"] == [{"role": "user", "content": ort_steps.PROMPT}]
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": self.answer}}],
                         "usage": {"completion_tokens": 5}})


@pytest.fixture
def openai_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_served_completion_must_be_the_cpus_greedy_text(openai_server):
    assert ort_steps.ask(openai_server, "The sea is wide.")["status"] == "pass"
    result = ort_steps.ask(openai_server, "The sea is deep.")
    assert result["status"] == "FAIL" and "DIFFERING from 'The sea is deep.'" in result["detail"]


def test_a_server_that_dies_before_answering_is_named(openai_server):
    dead = types.SimpleNamespace(poll=lambda: 2, returncode=2)
    assert ort_steps.wait_ready(openai_server + "/v1/models", dead, 1e18) == "serve exited 2 before it answered"
    alive = types.SimpleNamespace(poll=lambda: None)
    assert ort_steps.wait_ready(openai_server + "/v1/models", alive, 1e18) is None


def test_serve_without_an_export_is_not_run(tmp_path):
    result = ort_steps.serve(gpu_check.parse_args(["--out-dir", str(tmp_path)]), 10.0)
    assert result == {"status": "not run", "detail": "the smollm2 step made no KV-cache export to serve"}


class FakeRtxOrt:
    """ONNX Runtime's plugin-EP API as the TensorRT-RTX step calls it."""

    def __init__(self, register_error=None, devices=1, providers=(ort_steps.RTX_PROVIDER,), wrong=False):
        self.register_error, self.devices, self.providers, self.wrong = register_error, devices, providers, wrong
        self.registered = None

    def register_execution_provider_library(self, name, path):
        if self.register_error:
            raise RuntimeError(self.register_error)
        self.registered = (name, path)

    def get_ep_devices(self):
        return [types.SimpleNamespace(ep_name=ort_steps.RTX_PROVIDER)] * self.devices

    def SessionOptions(self):  # noqa: N802 - ONNX Runtime's name
        return types.SimpleNamespace(add_provider_for_devices=lambda devices, options: None)

    def InferenceSession(self, model, sess_options):  # noqa: N802
        fake = self

        class Session:
            def get_providers(self):
                return list(fake.providers)

            def run(self, outputs, feed):
                from rmsnorm_deploy.contract.dtypes import to_torch
                from rmsnorm_deploy.contract.reference import reference
                from rmsnorm_deploy.contract.spec import named_specs

                y = reference(named_specs()["llama"], to_torch(feed["x"]), to_torch(feed["weight"])).numpy()
                return [y * np.float16(1.5) if fake.wrong else y]

        return Session()


EP = types.SimpleNamespace(get_library_path=lambda: "/site/onnxruntime_ep_nv_tensorrt_rtx/libprovider.so")


def test_tensorrt_rtx_records_the_exact_refusal_or_holds_the_engine_to_the_oracle():
    refused = ort_steps.run_rtx(FakeRtxOrt(register_error="CUDA driver version is insufficient"), EP)
    assert refused == {"status": "not run",
                       "detail": "TensorRT-RTX refused: RuntimeError: CUDA driver version is insufficient"}
    assert "offers no device here" in ort_steps.run_rtx(FakeRtxOrt(devices=0), EP)["detail"]
    ok = ort_steps.run_rtx(FakeRtxOrt(), EP)
    assert ok["status"] == "pass" and ok["detail"].startswith("engine built, session on NvTensorRTRTXExecutionProvider")
    assert ort_steps.run_rtx(FakeRtxOrt(wrong=True), EP)["status"] == "FAIL"
    other = ort_steps.run_rtx(FakeRtxOrt(providers=("CPUExecutionProvider",)), EP)
    assert other["status"] == "FAIL" and "not NvTensorRTRTXExecutionProvider" in other["detail"]


def test_the_dry_run_lists_every_step_and_says_the_gpu_ones_are_not_run(tmp_path, monkeypatch):
    """The heavy rehearsals (SmolLM2, serve) are replaced: main's bookkeeping of 'not run' is under test."""
    assert gpu_check.STEPS[:5] == ("ort-cuda", "lowerings", "smollm2", "serve", "trt-rtx")
    assert gpu_check.parse_args(["--out-dir", str(tmp_path)]).steps == list(gpu_check.STEPS)
    monkeypatch.setitem(gpu_check.RUNNERS, "smollm2", lambda a, t: ort_steps._rehearsed(
        {"status": "pass", "detail": "tokens equal"}, a))
    monkeypatch.setitem(gpu_check.RUNNERS, "lowerings", lambda a, t: ort_steps._rehearsed(
        {"status": "pass", "detail": "15 of 15"}, a))
    out = tmp_path / "out"
    code = gpu_check.main(["--dry-run", "--steps", "ort-cuda,lowerings,smollm2,serve,trt-rtx", "--out-dir", str(out),
                           "--copy-to", str(tmp_path / "copy")])
    summary = json.loads((out / "gpu_check.json").read_text())
    assert code == 3 and summary["counts"] == {"pass": 0, "FAIL": 0, "not run": 5}
    assert all(s["status"] == "not run" for s in summary["steps"])
    assert [s["detail"].split(";")[0] for s in summary["steps"][:3]] == ["no GPU"] * 3
    text = (out / "gpu_check.md").read_text()
    assert "| trt-rtx | not run |" in text and "NOT ALL RUN: 0 passed, 0 failed, 5 not run" in text


def test_exit_codes_fail_over_not_run_over_pass():
    assert gpu_check.exit_code([{"status": "pass"}, {"status": "not run"}]) == 3
    assert gpu_check.exit_code([{"status": "FAIL"}, {"status": "not run"}]) == 1
    assert gpu_check.exit_code([{"status": "pass"}]) == 0 and gpu_check.exit_code([]) == 1
