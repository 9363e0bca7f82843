"""``serve``'s refusals (one line, exit 2, before any server starts) and what it prepares for PyTriton."""

from __future__ import annotations

import os
import socket
import sysconfig
from pathlib import Path

import pytest

from rmsnorm_deploy.cli import main
from rmsnorm_deploy.serving.triton import proxy_patch, pytriton_env
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.serving.triton.process import check_port_free, free_ports, start_serve_process
from rmsnorm_deploy.serving.kserve.signature import read_signature
from tests.serving._models import external_data_model, fixed_shape_model, kv_cache_model


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("rmsnorm-deploy serve: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port", "--metrics-port"])
def test_port_in_use_is_refused(tmp_path, capsys, flag):
    pytest.importorskip("pytriton", reason="serve needs nvidia-pytriton")
    model = external_data_model(tmp_path / "m")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        others = iter(free_ports(2))
        ports = {f: str(port) if f == flag else str(next(others))
                 for f in ("--http-port", "--grpc-port", "--metrics-port")}
        argv = ["serve", str(model)] + [x for f, p in ports.items() for x in (f, p)]
        assert main(argv) == 2
    assert f"port {port} on 127.0.0.1 is in use ({flag})" in _one_line_error(capsys)


def test_port_out_of_range_is_refused(tmp_path, capsys):
    pytest.importorskip("pytriton", reason="serve needs nvidia-pytriton")
    assert main(["serve", str(external_data_model(tmp_path / "m")), "--grpc-port", "0"]) == 2
    assert "--grpc-port 0: a port is a number from 1 to 65535" in _one_line_error(capsys)


@pytest.mark.parametrize("argv,message", [
    (["serve", "{missing}"], "no such file or folder"),
    (["serve", "{empty}"], "no model.onnx in this folder"),
    (["serve", "{notonnx}"], "not a readable ONNX model"),
    (["serve", "{model}", "--providers", "tpu"], "unknown provider 'tpu'"),
    (["serve", "{model}", "--providers", "cuda"], "CUDAExecutionProvider"),
    (["serve", "{model}", "--http-port", "9100", "--grpc-port", "9100"], "both 9100"),
    (["serve", "{model}", "--host", "no-such-host.invalid"], "not an address of this machine"),
    (["serve", "{model}", "--model-name", "../x"], "--model-name"),
    (["serve", "{model}", "--model-name", "model\n"], "--model-name 'model\\n'"),
    (["serve", "{model}", "--max-batch", "-1"], "--max-batch -1"),
    (["serve", "{fixed}", "--max-batch", "4"], "needs a leading dynamic batch dim"),
    # past/present pairs but no kv_cache metadata: no generation model can be built from it
    (["serve", "{kv}"], "is not a KV-cache model (its metadata records no kv_cache)"),
], ids=["missing", "empty-folder", "not-onnx", "unknown-provider", "provider-not-in-build", "same-port",
        "bad-host", "bad-name", "name-with-newline", "negative-batch", "unbatchable", "kv-cache-without-metadata"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    pytest.importorskip("pytriton", reason="serve needs nvidia-pytriton")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.onnx").write_text("not onnx")
    paths = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "notonnx": tmp_path / "bad.onnx",
             "model": external_data_model(tmp_path / "m"), "fixed": fixed_shape_model(tmp_path / "fixed.onnx"),
             "kv": kv_cache_model(tmp_path / "kv.onnx", layers=1)}
    assert main([a.format(**paths) for a in argv]) == 2
    assert message in _one_line_error(capsys)


@pytest.mark.parametrize("argv,message", [
    (["--speculative-k", "3"], "--speculative-k needs --speculative ngram|DRAFT_DIR"),
    (["--speculative", "ngram"], "--speculative needs a KV-cache model (export --kv-cache)"),
])
def test_speculation_on_a_plain_graph_is_one_line_and_exit_2(tiny_export, capsys, argv, message):
    pytest.importorskip("pytriton", reason="serve needs nvidia-pytriton")
    http, grpc, metrics = free_ports(3)
    assert main(["serve", str(tiny_export), "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
                 str(metrics), *argv]) == 2
    assert message in _one_line_error(capsys)


def test_signature_reads_the_batch_dim_and_the_metadata_range(tiny_export, tmp_path):
    sig = read_signature(tiny_export)
    assert sig.batch_dim == "batch" and sig.max_batch == 8 and not sig.is_kv_cache
    assert [(t.name, t.dtype, t.shape, t.kserve_type) for t in sig.inputs] == [
        ("input_ids", "int64", ("batch", "seq"), "INT64")]
    assert sig.outputs[0].dims(batched=True) == [-1, 512]
    assert read_signature(tiny_export, max_batch=0).batched is False
    kv = read_signature(kv_cache_model(tmp_path / "kv.onnx", layers=3))
    assert len(kv.cache) == 6 and [t.name for t in kv.stateless_outputs()] == ["logits"]


def test_server_environment_puts_this_pythons_libdir_first_once():
    libdir = pytriton_env.libpython_dir()
    if libdir is None:
        pytest.skip("this Python has no shared libpython (the embedded stub then needs no LD_LIBRARY_PATH)")
    assert libdir == sysconfig.get_config_var("LIBDIR")
    env = {"LD_LIBRARY_PATH": "/opt/a:" + libdir + ":/opt/b"}
    change = pytriton_env.server_environment(env)
    assert change == {"LD_LIBRARY_PATH": f"{libdir}:/opt/a:/opt/b"}
    assert pytriton_env.server_environment(change) == {}
    assert pytriton_env.server_environment({}) == {"LD_LIBRARY_PATH": libdir}


def test_proxy_patch_is_applied_once_to_the_file_pytriton_loads_into_the_server(monkeypatch):
    pytest.importorskip("pytriton", reason="the patch applies to nvidia-pytriton's proxy model")
    from pytriton.models.model import Model

    monkeypatch.setattr(pytriton_env, "_ANSWER_LATER", {"generating"})

    pytriton_env.patch_proxy()
    pytriton_env.patch_proxy()

    class Fake:
        model_version = 1
        SCRIPT_FILES_TO_COPY = Model.SCRIPT_FILES_TO_COPY

        def __init__(self, model_name):
            self.model_name = model_name

    text = Model.get_proxy_model_files(Fake("plain"))["file:1/model.py"].decode()
    # the changes are a module of the package, loaded by its path in the stub, applied once
    assert text.count("_rd_patch.apply(globals(), dlpack=True, answer_later=False)") == 1
    assert f"spec_from_file_location('rmsnorm_deploy_proxy_patch', {str(Path(proxy_patch.__file__))!r})" in text
    generating = Model.get_proxy_model_files(Fake("generating"))["file:1/model.py"].decode()
    assert generating.count("_rd_patch.apply(globals(), dlpack=True, answer_later=True)") == 1
    assert "answer_later=False" not in generating
    for source in (text, generating):
        compile(source, "model.py", "exec")
    # the names the patches rely on are still the proxy's own
    proxy = text.split("# --- rmsnorm_deploy")[0]
    for name in ("class TritonRequestsServer", "def _wrap_response(", "import triton_python_backend_utils as pb_utils",
                 "from .types import Request", "class DecoupledResponsesHandler", "async def handle_responses(",
                 "class TritonPythonModel", "def initialize(self, args)", "def push(self, requests_id: bytes, "
                 "triton_requests, spans=None)", "self._requests = {}", "self._requests_server = TritonRequestsServer(",
                 "self._serializer_deserializer", "def send_requests(", "PyTritonResponseFlags"):
        assert name in proxy + _communication(), name


def _communication() -> str:
    """PyTriton's proxy communication module, where ``RequestsServer.send_requests`` lives."""
    from pytriton.proxy import communication

    return Path(communication.__file__).read_text()


@pytest.mark.parametrize("answer_later,switched", [((), False), (("model", "model_stream"), True)])
def test_generation_models_pass_their_tensors_in_messages(monkeypatch, answer_later, switched):
    """One-token tensors cost more through PyTriton's shared-memory store than in the message."""
    monkeypatch.setattr(pytriton_env.os, "environ", {k: v for k, v in os.environ.items()
                                                     if k != pytriton_env.NO_TENSORSTORE})
    monkeypatch.setattr(pytriton_env, "_ANSWER_LATER", set())
    monkeypatch.setattr(pytriton_env, "patch_proxy", lambda: None)
    changes = pytriton_env.prepare_process(answer_later=answer_later)
    assert (changes.get(pytriton_env.NO_TENSORSTORE) == "1") is switched
    assert (pytriton_env.os.environ.get(pytriton_env.NO_TENSORSTORE) == "1") is switched


def _patched_proxy(*, dlpack: bool, answer_later: bool):
    """A fresh copy of PyTriton's proxy ``model.py`` (with a stand-in for the stub's ``pb_utils``),
    patched as the stub patches it, and the module that patched it."""
    import importlib.util
    import sys
    import types

    pytest.importorskip("pytriton", reason="the patch applies to nvidia-pytriton's proxy model")
    pb_utils = types.ModuleType("triton_python_backend_utils")

    class TritonError:
        INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    pb_utils.TritonError = TritonError
    pb_utils.InferenceResponse = lambda output_tensors=(), error=None: ("response", list(output_tensors), error)
    from pytriton import proxy

    source = Path(proxy.__file__).parent / "model.py"
    spec = importlib.util.spec_from_file_location("pytriton.proxy.rd_test_copy", source)
    model = importlib.util.module_from_spec(spec)
    sys.modules["triton_python_backend_utils"] = pb_utils  # the stub's module, for this copy only
    try:
        spec.loader.exec_module(model)
    finally:
        del sys.modules["triton_python_backend_utils"]
    spec = importlib.util.spec_from_file_location("rd_test_proxy_patch", proxy_patch.__file__)
    patch = importlib.util.module_from_spec(spec)  # loaded by path, as the stub loads it
    spec.loader.exec_module(patch)
    patch.apply(vars(model), dlpack=dlpack, answer_later=answer_later)
    return model, patch


@pytest.mark.parametrize("dlpack", [False, True])
def test_a_refusal_answer_becomes_the_triton_error_it_names_in_the_patched_proxy(dlpack):
    from pytriton.proxy.types import Response

    model, patch = _patched_proxy(dlpack=dlpack, answer_later=False)
    assert model._wrap_response is patch._wrap_response_refused
    assert (model.TritonRequestsServer._wrap_request is patch._wrap_request_dlpack) is dlpack
    answer = pytriton_env.refusal("the queue is full", "unavailable")
    kind, tensors, error = model._wrap_response(Response(data=answer), [], {})
    assert (kind, tensors, error.message, error.code) == ("response", [], "the queue is full", "UNAVAILABLE")


def test_the_answer_later_patch_takes_over_the_senders_and_numbers_the_requests():
    model, patch = _patched_proxy(dlpack=True, answer_later=True)
    assert model.DecoupledResponsesHandler.handle_responses is patch._respond
    assert model.TritonRequestsServer.push is patch._push_sent
    assert model.TritonRequestsServer._wrap_request is patch._wrap_request_numbered
    assert patch._wrap_request is patch._wrap_request_dlpack  # numbering wraps the DLPack exchange
    assert model.TritonPythonModel.initialize is patch._initialize_answer_later


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(1024 <= p <= 65535 for p in ports)
    for port in ports:
        check_port_free("127.0.0.1", port, "--http-port")  # raises a UserError if it cannot be bound


def test_a_serve_process_that_exits_before_ready_is_reported_with_its_output(tmp_path):
    with pytest.raises(UserError, match=r"serve exited with 2 before it was ready:\n.*missing"):
        start_serve_process(tmp_path / "missing", timeout_s=60)
