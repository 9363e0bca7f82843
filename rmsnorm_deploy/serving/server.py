"""``serve``: a real Triton Inference Server (embedded through PyTriton) behind our checking fronts,
in front of our ONNX Runtime runner: the glue that starts the rooms of ``serving`` in one process
(the engine, Triton with the infer functions of ``triton.binding``, the KServe fronts, the OpenAI
API) and stops them cleanly.

The server is Triton's own binary: KServe v2 over HTTP and gRPC, Prometheus metrics, the dynamic
batcher. Clients reach it through ``serving.kserve.front``: our HTTP (Starlette on uvicorn) and gRPC
fronts on the public ports check every inference request against the served models
(``serving.kserve.request_check``: names, datatypes, shapes, sizes, the data carried) before Triton, on
internal 127.0.0.1 ports, sees it; Triton 2.51 trusts a claimed shape and one request could take it
down. Triton checks again and answers with its own errors, which the fronts pass on unchanged.
Inference runs through :class:`OnnxRuntimeRunner`, so the provider checks (never a silent
fallback) hold here too; the callables check what only the model knows (token ids within the
vocabulary) and refuse with HTTP 400 / gRPC INVALID_ARGUMENT and one line.

Safe by default: every endpoint binds to 127.0.0.1 unless ``host`` says otherwise (Triton's own
default is every interface). The endpoints that change the server (model repository, shared
memory, trace and log settings) are not served by the fronts, and need PyTriton's per-process
access token on Triton's own ports; statistics stay readable, since they are how a user sees
batching at work. After any stop, a crash included, nothing of the server is left on disk
(``serving.triton.leftovers``).
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from rmsnorm_deploy.decoder.generate import DEFAULT_SPECULATIVE_K, KVCacheModel, SpeculationOptions
from rmsnorm_deploy.errors import UserError, one_line
from rmsnorm_deploy.optional import require
from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner, set_onnxruntime_log_level
from rmsnorm_deploy.serving.engine.engine import Engine
from rmsnorm_deploy.serving.engine.speculation import SPECULATE_UP_TO
from rmsnorm_deploy.serving.kserve.front import Front, FrontPorts
from rmsnorm_deploy.serving.kserve.generation import (
    GENERATION_INPUTS,
    GENERATION_OUTPUT,
    STREAM_INDEX,
    STREAM_SUFFIX,
    EngineStreams,
)
from rmsnorm_deploy.serving.kserve.signature import TensorSpec, model_path, read_signature
from rmsnorm_deploy.serving.triton.binding import (
    BatchedInference,
    GenerationInference,
    StreamingGenerationInference,
    generation_endpoint,
    pytriton_tensor,
    served_models,
    token_bounds_of,
)
from rmsnorm_deploy.serving.triton.leftovers import new_workspace, remove_leftovers
from rmsnorm_deploy.serving.triton.process import ServeOptions, check_options, free_ports
from rmsnorm_deploy.serving.triton.pytriton_env import prepare_process

#: Triton's endpoints that only an operator should reach (PyTriton's token guards them).
PROTECTED_ENDPOINTS = ["model-repository", "shared-memory", "trace", "logging"]
#: the largest OpenAI request body: JSON parsed into Python objects (a prompt longer than any model fits);
#: ``--max-request-bytes`` lowers it
OPENAI_MAX_REQUEST_BYTES = 8 << 20


def _describe(tensors: Sequence[TensorSpec]) -> str:
    return ", ".join(f"{t.name} {t.dtype}[{', '.join(str(d) for d in t.shape)}]" for t in tensors)


class Server:
    """A running embedded Triton: ``start()``, ``wait()`` until a signal or the server dies, ``stop()``."""

    def __init__(self, model: str | Path, options: ServeOptions, *, say: Callable[[str], None] = print):

        require("pytriton", "serve")
        self.options = options
        self.say = say
        self.path = model_path(model)
        self.signature = read_signature(self.path, max_batch=options.max_batch)
        bf16 = [t.name for t in self.signature.inputs + self.signature.outputs if t.dtype == "bfloat16"]
        if bf16:
            raise UserError(f"{', '.join(bf16)} are bfloat16, which PyTriton cannot carry (numpy has no bfloat16); "
                            "serve a float16/float32 export, or write a repository for the standalone server's "
                            "onnxruntime backend with `rmsnorm-deploy triton-repo`")
        self.generator = generation_endpoint(self.path, self.signature, options.providers)
        if self.generator is not None:
            options.engine_options().check()
        from rmsnorm_deploy.serving.openai.serve import openai_placement  # optional: pydantic, starlette

        self.openai_place, self.openai_note = openai_placement(self.generator, enabled=options.openai,
                                                               port=options.openai_port)
        check_options(options)
        self.draft: Any = None  # --speculative DRAFT_DIR's KVCacheModel
        self.speculation = self._speculation()
        self.models = served_models(self.signature, options.model_name, generation=self.generator is not None)
        self.front: Any = None
        self.workspace: Path | None = None
        self.internal: tuple[int, int] = (0, 0)  # Triton's own HTTP and gRPC ports, on 127.0.0.1
        self.openai: Any = None
        self.engine: Any = None
        self.triton: Any = None
        self.runner: Any = None
        self.log_dir: str | None = None
        self.log_path = Path("tritonserver.log")
        self._stop = threading.Event()

    def _speculation(self) -> Any:
        """``--speculative``'s ``SpeculationOptions`` (``None``: off); the draft model opened, its
        refusals (int8 compute, LongRoPE, another tokenizer) raised when the engine is made."""
        o = self.options
        if o.speculative is None:
            if o.speculative_k is not None:
                raise UserError("--speculative-k needs --speculative ngram|DRAFT_DIR")
            return None
        if self.generator is None:
            raise UserError(f"--speculative needs a KV-cache model (export --kv-cache); {self.path} is a plain graph")
        k = DEFAULT_SPECULATIVE_K if o.speculative_k is None else o.speculative_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UserError(f"--speculative-k must be an integer >= 1, got {k!r}")
        if o.speculative != "ngram":
            self.draft = KVCacheModel(o.speculative, o.providers)
        return SpeculationOptions(self.draft or "ngram", k)

    def start(self) -> None:

        set_onnxruntime_log_level()
        # The runner first: a provider that cannot run is refused before any server starts.
        o = self.options
        if self.generator is not None:
            self.runner = self.generator.runner
        else:
            self.runner = OnnxRuntimeRunner(self.path, o.providers)
        self.runner.activate()
        if self.generator is not None:

            if self.draft is not None:
                self.draft.runner.activate()
            # Warm before Triton loads the models: a model Triton reports ready answers at once.
            self.engine = Engine(self.generator, o.engine_options(), speculation=self.speculation).start()
        prepare_process(answer_later=[o.model_name, o.model_name + STREAM_SUFFIX] if self.engine else ())
        logging.getLogger("pytriton").setLevel(logging.ERROR)
        from pytriton.model_config import DynamicBatcher, ModelConfig
        from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

        remove_leftovers()  # of earlier serve processes that were killed
        # Triton's own log goes to a file (PyTriton would echo it to our stdout line by line).
        self.log_dir = tempfile.mkdtemp(prefix="rmsnorm-deploy-serve-")
        self.log_path = Path(self.log_dir) / "tritonserver.log"
        # Triton's HTTP and gRPC only on loopback: clients reach them through the fronts
        self.internal = (http, grpc) = tuple(free_ports(2))
        config = TritonConfig(
            log_file=self.log_path,
            http_address="127.0.0.1", http_port=http, grpc_address="127.0.0.1", grpc_port=grpc,
            metrics_address=o.host, metrics_port=o.metrics_port, allow_gpu_metrics=False,
            exit_timeout_secs=o.exit_timeout_s, log_verbose=0,
        )
        from pytriton.model_config import Tensor

        sig = self.signature
        streaming: dict[str, Any] = {}
        if self.generator is not None:
            model_config = ModelConfig(batching=False)
            infer_func: Any = GenerationInference(self.engine)
            inputs = [Tensor(name=n, dtype=np.int64, shape=tuple(d), optional=opt) for n, d, opt in GENERATION_INPUTS]
            outputs = [Tensor(name=GENERATION_OUTPUT, dtype=np.int64, shape=(-1,))]
            # the streaming twin submits to the same engine
            streaming = {
                "model_name": o.model_name + STREAM_SUFFIX, "config": ModelConfig(batching=False, decoupled=True),
                "infer_func": StreamingGenerationInference(self.engine), "inputs": inputs,
                "outputs": [Tensor(name=n, dtype=np.int64, shape=(1,)) for n in (GENERATION_OUTPUT, STREAM_INDEX)]}
        else:
            model_config = ModelConfig(
                batching=sig.batched, max_batch_size=sig.max_batch if sig.batched else 0,
                batcher=DynamicBatcher(max_queue_delay_microseconds=o.queue_delay_us),
            )
            infer_func = BatchedInference(self.runner, sig, self.models[0], token_bounds_of(self.path))
            inputs = [pytriton_tensor(t, sig.batched) for t in sig.inputs]
            outputs = [pytriton_tensor(t, sig.batched) for t in sig.outputs]
        try:
            self.workspace = new_workspace()
            self.triton = Triton(config=config, workspace=self.workspace,
                                 security_config=TritonSecurityConfig(restricted_endpoints=list(PROTECTED_ENDPOINTS)))
            self.triton.bind(model_name=o.model_name, infer_func=infer_func, inputs=inputs, outputs=outputs,
                             config=model_config, strict=False)
            if streaming:
                self.triton.bind(**streaming, strict=False)
            self.triton.run()
        except Exception as exc:
            self.stop()
            raise UserError(f"Triton Inference Server did not start: {one_line(exc)}{self._log_tail()}") from None
        self.start_front()
        if self.openai_place == "port":
            self.start_openai()

    def start_front(self) -> None:
        """The public fronts, once Triton serves on its internal ports (``serving.kserve.front``)."""

        o = self.options
        ports = FrontPorts(o.host, o.http_port, o.grpc_port, *self.internal)
        streams = {}
        if self.engine is not None:  # token streams over gRPC straight from the engine (serving.kserve.generation)
            name = o.model_name + STREAM_SUFFIX
            streams[name] = EngineStreams(self.engine, name, (GENERATION_OUTPUT, STREAM_INDEX)).answer
        mounts = []
        if self.engine is not None:  # the engine's Prometheus metrics beside the KServe routes
            from rmsnorm_deploy.serving.engine.metrics import metrics_route  # optional: prometheus-client

            mounts.append(metrics_route(self.engine))
        self.front = Front(self.models, ports, max_request_bytes=o.max_request_bytes, streams=streams, mounts=mounts)
        try:
            self.front.start()
        except UserError:
            self.stop()
            raise

    def start_openai(self) -> None:
        """The OpenAI API on its own port, over the warm engine (``serving.openai.serve``)."""
        from rmsnorm_deploy.serving.openai.serve import OpenAIServer, engine_app  # optional: pydantic, starlette

        o = self.options
        try:
            limit = min(o.max_request_bytes, OPENAI_MAX_REQUEST_BYTES)
            app, self.openai_note = engine_app(self.engine, o.model_name, max_request_bytes=limit)
            self.openai = OpenAIServer(app, o.host, o.openai_port).start()
        except UserError:
            self.stop()
            raise

    def _log_tail(self) -> str:
        try:
            errors = [line for line in self.log_path.read_text(errors="replace").splitlines() if line[:1] == "E"]
        except OSError:
            return ""
        return f"; the server's last error: {' '.join(errors[-1].split()[4:])}" if errors else ""

    def announce(self) -> None:
        sig, o = self.signature, self.options
        ends = o.endpoints()
        if self.generator is not None:
            what = "generation model"
            ins = "input_ids int64[n] (one prompt), max_new_tokens int64[1] (optional)"
            outs = f"{GENERATION_OUTPUT} int64[m] (the new tokens, greedy)"
            batching = (f"{self.engine.batching}; the KV cache ({len(sig.cache)} past/present pairs) stays in the "
                        f"server\n  streaming  {o.model_name + STREAM_SUFFIX!r} (gRPC stream, answered by the front from the "
                        f"engine): the same inputs, one "
                        f"response per new token ({GENERATION_OUTPUT} int64[1], {STREAM_INDEX} int64[1]); both "
                        f"models share the engine")
            if self.speculation is not None:
                when = (f"while at most {SPECULATE_UP_TO} stream(s) decode, each in a one-slot run"
                        if self.engine.refusal is None else "in every stream's turn")
                batching += (f"\n  speculative decoding ({self.speculation.name}, k <= {self.speculation.k}) {when}; "
                             "requests with logit_bias, penalties, min_p, a grammar or logprobs decode without it")
        else:
            what = "model"
            ins, outs = _describe(sig.inputs), _describe(sig.outputs)
            batching = (f"dynamic batching up to {sig.max_batch} rows along {sig.batch_dim!r}" if sig.batched
                        else "no batching (the graph has no shared leading batch dim)")
        http, grpc = self.internal
        openai = ""
        if self.openai is not None:
            openai = (f"  OpenAI   {ends['openai']}/v1 (completions, chat completions; {self.openai_note}; the same "
                      "engine as the KServe models)\n")
        elif self.openai_note:
            openai = f"  OpenAI   {self.openai_note}\n"
        self.say(f"serving {self.path} as {what} {o.model_name!r} on ONNX Runtime "
                 f"[{', '.join(self.runner.actual_providers)}]\n"
                 f"  HTTP     {ends['http']}/v2/models/{o.model_name}\n"
                 f"  gRPC     {ends['grpc']}\n"
                 f"  front    checks every request (HTTP: Starlette on uvicorn, gRPC: grpcio; at most "
                 f"{o.max_request_bytes} bytes), then Triton on 127.0.0.1:{http} (HTTP), 127.0.0.1:{grpc} (gRPC)\n"
                 f"{openai}"
                 f"  metrics  {ends['metrics']}\n"
                 f"  inputs   {ins}\n"
                 f"  outputs  {outs}\n"
                 f"  {batching}\n"
                 f"  server log {self.log_path}\n"
                 "ready; Ctrl-C or SIGTERM stops it")

    def request_stop(self, *_: Any) -> None:
        self._stop.set()

    def wait(self) -> bool:
        """Block until a stop is requested (True) or the server dies on its own (False)."""
        while not self._stop.wait(0.5):
            if self.triton is not None and not self.triton.is_alive():
                return False
            if self.front is not None and not self.front.is_alive():
                return False
            if self.openai is not None and not self.openai.is_alive():
                return False
        return True

    def drain(self) -> None:
        """Stop admitting generations and let those in flight finish (``--drain-timeout``), while
        Triton still serves their answers."""
        if self.engine is None:
            return
        stats = self.engine.stats()
        if stats["running"] or stats["waiting"]:
            self.say(f"draining: {stats['running']} generations running, {stats['waiting']} queued "
                     f"(up to {self.options.drain_timeout_s:g} s)")
        if not self.engine.drain():
            self.say("the drain timed out: the generations left were cancelled")
        counts = self.engine.counts
        self.say(f"generations: {counts['stop'] + counts['length']} finished, {counts['cancelled']} cancelled, "
                 f"{counts['error']} failed; {counts['refused_busy']} refused with the queue full")

    def stop(self, *, keep_log: bool = False) -> None:

        if self.front is not None:
            front, self.front = self.front, None
            front.stop()  # no new requests; those in flight finish first
        if self.engine is not None:
            self.engine.drain(0)
        if self.openai is not None:
            openai, self.openai = self.openai, None
            openai.stop()
        if self.triton is not None:
            triton, self.triton = self.triton, None
            try:
                triton.stop()
            except Exception:  # noqa: BLE001 - stopping must not mask why we stop
                pass
        if self.workspace is not None:
            remove_leftovers(own=self.workspace)  # what a crashed Triton could not remove itself
            self.workspace = None
        if self.runner is not None:
            self.runner.deactivate()
        if self.draft is not None:
            self.draft.runner.deactivate()
        if self.log_dir is not None and keep_log:
            self.say(f"the server's log is kept in {self.log_path}")
        elif self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None


def serve(model: str | Path, options: ServeOptions, *, say: Callable[[str], None] = print) -> int:
    """Run the server until SIGINT/SIGTERM; 0 after a clean stop, 1 if the server died on its own."""
    server = Server(model, options, say=say)
    previous = {s: signal.signal(s, server.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    clean = True
    try:
        started = time.perf_counter()
        server.start()
        server.announce()
        say(f"started in {time.perf_counter() - started:.1f} s")
        clean = server.wait()
        say("stopping" if clean else "Triton Inference Server exited on its own; stopping")
        if clean:
            server.drain()
        return 0 if clean else 1
    finally:
        server.stop(keep_log=not clean)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = ["Server", "serve"]
