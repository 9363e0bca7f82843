"""``serve``: a real Triton Inference Server (embedded through PyTriton) in front of our ONNX Runtime runner.

Long: one server process: its ports, its Triton models and its stop, which share their state.

The server is Triton's own binary: KServe v2 over HTTP and gRPC, Prometheus metrics, the dynamic
batcher. Triton checks each request against the model's config (input names, datatypes, ranks,
fixed dims, batch size) and answers a bad one with HTTP 400 / gRPC INVALID_ARGUMENT and a
message before it reaches us. Inference runs through :class:`OnnxRuntimeRunner`, so the
provider checks (never a silent fallback) hold here too.

Safe by default: every endpoint binds to 127.0.0.1 unless ``host`` says otherwise (Triton's own
default is every interface). The endpoints that change the server (model repository, shared
memory, trace and log settings) need PyTriton's per-process access token; statistics stay
readable, since they are how a user sees batching at work.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

import numpy as np

from rmsnorm_deploy.errors import InputError, UserError, one_line
from rmsnorm_deploy.serving.signature import Signature, TensorSpec, model_path, read_signature

#: Triton's endpoints that only an operator should reach (PyTriton's token guards them).
PROTECTED_ENDPOINTS = ["model-repository", "shared-memory", "trace", "logging"]
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    providers: tuple[str, ...] = ("cpu",)
    model_name: str = "model"
    max_batch: int | None = None
    #: how long the dynamic batcher may hold a request to fill a batch
    queue_delay_us: int = 500
    #: how long Triton waits for in-flight requests when stopping
    exit_timeout_s: int = 5
    #: a generation model's engine (``serving.engine.EngineOptions``; its max_batch is ``max_batch``)
    max_queue: int = 64
    max_tokens_in_flight: int | None = None
    prefill_chunk: int = 32
    drain_timeout_s: float = 30.0
    #: the OpenAI-compatible API of a KV-cache export with a tokenizer (``serving.openai_serve``)
    openai: bool = True
    openai_port: int | None = None

    def engine_options(self) -> Any:
        """The generation engine's options (``--max-batch`` is its number of slots, default 16)."""
        from rmsnorm_deploy.serving.engine import EngineOptions

        if self.max_batch == 0:
            raise UserError("--max-batch 0: a generation model runs at least one stream; give 1 or more")
        return EngineOptions(max_batch=EngineOptions.max_batch if self.max_batch is None else self.max_batch,
                             max_queue=self.max_queue, max_tokens_in_flight=self.max_tokens_in_flight,
                             prefill_chunk=self.prefill_chunk, drain_timeout_s=self.drain_timeout_s)

    def endpoints(self) -> dict[str, str]:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return {
            "http": f"http://{host}:{self.http_port}",
            "grpc": f"{host}:{self.grpc_port}",
            "metrics": f"http://{host}:{self.metrics_port}/metrics",
            "openai": f"http://{host}:{self.openai_port}",
        }


def check_model_name(name: str) -> None:
    if not _NAME.match(name):
        raise UserError(f"--model-name {name!r}: use letters, digits, '_', '.', '-' (at most 128)")


def check_options(options: ServeOptions) -> None:
    """Refuse bad names and ports before anything starts."""
    check_model_name(options.model_name)
    ports = {"--http-port": options.http_port, "--grpc-port": options.grpc_port, "--metrics-port": options.metrics_port}
    if options.openai_port is not None:
        ports["--openai-port"] = options.openai_port
    for flag, port in ports.items():
        if not 1 <= port <= 65535:
            raise UserError(f"{flag} {port}: a port is a number from 1 to 65535")
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port in seen:
            raise UserError(f"{flag} and {seen[port]} are both {port}; give each endpoint its own port")
        seen[port] = flag
    for flag, port in ports.items():
        check_port_free(options.host, port, flag)


def check_port_free(host: str, port: int, flag: str) -> None:
    """A one-line error if ``host:port`` cannot be bound (in use, or an address not on this machine)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"--host {host!r} is not an address of this machine ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use ({flag}); stop what holds it or choose another "
                                f"port with {flag}") from None
            raise UserError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror}") from None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the system reports free on ``host`` now (for ``--http-port`` and the
    others when any port will do: tests, benchmarks). Another process may still take one before it
    is bound; :func:`check_options` then refuses it in one line."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclasses.dataclass
class ServeProcess:
    """An ``rmsnorm-deploy serve`` child process on loopback ports, and everything it printed."""

    process: Any  # subprocess.Popen
    http: int
    grpc: int
    metrics: int
    log: list[str]
    startup_s: float = 0.0  # from the start to ready

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http}{path}"

    def stop(self, timeout_s: float = 40) -> None:
        """SIGTERM (the server stops cleanly), then SIGKILL if it is still there after ``timeout_s``."""
        import subprocess

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


def start_serve_process(model_dir: str | Path, *, timeout_s: float = 90, args: Sequence[str] = ()) -> ServeProcess:
    """``rmsnorm-deploy serve MODEL_DIR [args]`` as a child process (this package, this Python) on free
    loopback ports, returned once it is ready both on the wire (``/v2/health/ready``) and in its own
    output (it prints ``ready`` after the server is up). Raises :class:`UserError` with what it
    printed when it exits first or is not ready within ``timeout_s`` (then it is killed)."""
    import os
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    http, grpc, metrics = free_ports(3)
    package_root = str(Path(__file__).resolve().parents[2])  # the child imports this very package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "rmsnorm_deploy", "serve", str(model_dir), "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(process.stdout), daemon=True).start()
    served = ServeProcess(process, http, grpc, metrics, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(f"serve exited with {process.returncode} before it was ready:\n{''.join(log)}")
        try:
            with urllib.request.urlopen(served.url("/v2/health/ready"), timeout=2) as response:
                if response.status == 200 and any(line.startswith("ready") for line in log):
                    served.startup_s = time.perf_counter() - started
                    return served
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    process.kill()
    process.wait(timeout=30)
    raise UserError(f"serve was not ready within {timeout_s:g} s:\n{''.join(log)}")


class BatchedInference:
    """PyTriton's infer function: the requests of one batch, run through the runner, split back.

    Triton's dynamic batcher hands over requests whose non-batch dims may still differ (a
    sequence of 9 tokens and one of 12): those are grouped by shape, each group stacked along
    the batch dim and run once, each request answered with its own rows. Rows are computed the
    same way alone or stacked (the serving tests check this bit for bit).
    """

    def __init__(self, runner: Any, signature: Signature):
        self.runner = runner
        self.signature = signature
        self.input_names = [t.name for t in signature.inputs]
        self.lock = threading.Lock()

    def __call__(self, requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        feeds = [{name: np.asarray(request[name]) for name in self.input_names} for request in requests]
        if not self.signature.batched:
            return [self._run(feed) for feed in feeds]
        results: list[dict[str, np.ndarray] | None] = [None] * len(feeds)
        groups: dict[tuple, list[int]] = {}
        for index, feed in enumerate(feeds):
            key = tuple((name, feed[name].dtype.str, feed[name].shape[1:]) for name in self.input_names)
            groups.setdefault(key, []).append(index)
        for members in groups.values():
            if len(members) == 1:
                results[members[0]] = self._run(feeds[members[0]])
                continue
            stacked = {name: np.concatenate([feeds[i][name] for i in members]) for name in self.input_names}
            outputs = self._run(stacked)
            start = 0
            for i in members:
                rows = len(feeds[i][self.input_names[0]])
                results[i] = {k: v[start:start + rows] for k, v in outputs.items()}
                start += rows
        return [r for r in results if r is not None]

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            return self.runner.infer(feed)


#: the largest OpenAI request body: JSON parsed into Python objects (a prompt longer than any model fits)
OPENAI_MAX_REQUEST_BYTES = 8 << 20
#: The generation model's interface (a KV-cache graph is served as this, under ``--model-name``).
GENERATION_INPUTS = (("input_ids", [-1], False), ("max_new_tokens", [1], True))  # (name, dims, optional)
GENERATION_OUTPUT = "output_ids"
#: The streaming twin, ``<model name>`` + this suffix: one response per new token.
STREAM_SUFFIX = "_stream"
#: Its second output: the new token's position among the new tokens (0, 1, ...).
STREAM_INDEX = "index"


class GenerationInference:
    """PyTriton's infer function for a KV-cache graph's whole answers: each request goes to the
    generation engine (``serving.engine``) and is answered when its stream ends.

    ``input_ids`` INT64 [n] is one prompt; ``max_new_tokens`` INT64 [1] is optional (default
    :data:`~rmsnorm_deploy.decoder.generate.DEFAULT_MAX_NEW_TOKENS`); ``output_ids`` INT64 [m] are
    the new tokens, greedy, ending at the folder's end-of-sequence token if one comes: the tokens
    ``generate(model, [prompt])`` returns, whatever else the engine runs meanwhile. Nothing is
    locked across a generation: the function awaits its stream in PyTriton's event loop, so the
    model's instance takes the next request at once (its proxy answers through the request's
    sender: ``pytriton_env``'s ``answer_later``).

    Refused (:func:`~rmsnorm_deploy.serving.pytriton_env.refusal`, one line): a bad request (no
    ``input_ids``, ids outside the vocabulary, too long, ``max_new_tokens`` < 1) with HTTP 400 /
    gRPC ``INVALID_ARGUMENT``; a full queue, a model still warming up or a server that is stopping
    with HTTP 503 / gRPC ``UNAVAILABLE``; a failed generation step with HTTP 500 / gRPC
    ``INTERNAL``. The proxy's notice that Triton cancelled a request cancels its stream.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        #: streams by the proxy's request number, for its cancellation notices
        self.streams: dict[int, Any] = {}

    async def __call__(self, requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        import asyncio

        return list(await asyncio.gather(*(self._one(request) for request in requests)))

    async def _one(self, request: Any) -> dict[str, np.ndarray]:
        if self.cancel_notice(request):
            return {}  # nobody waits for this answer
        stream = self.submit(request)
        if isinstance(stream, dict):
            return stream
        try:
            tokens = await stream.result_async()
        except Exception as exc:  # noqa: BLE001 - StreamFailed / StreamCancelled: one line to the client
            return stream_refusal(exc)
        finally:
            self.forget(request)
        return {GENERATION_OUTPUT: np.asarray(tokens, dtype=np.int64)}

    def submit(self, request: Any) -> Any:
        """The request's ``Stream`` in the engine, or the refusal to answer it with."""
        from rmsnorm_deploy.serving.engine import EngineBusy, EngineUnavailable
        from rmsnorm_deploy.serving.pytriton_env import refusal

        try:
            prompt, max_new_tokens = parse_generation_request(request)
            stream = self.engine.submit(prompt, max_new_tokens=max_new_tokens, name="max_new_tokens")
        except (EngineBusy, EngineUnavailable) as exc:
            return refusal(str(exc), "unavailable")
        except InputError as exc:
            return refusal(str(exc))
        number = _request_number(request)
        if number is not None:
            self.streams[number] = stream
        return stream

    def forget(self, request: Any) -> None:
        number = _request_number(request)
        if number is not None:
            self.streams.pop(number, None)

    def cancel_notice(self, request: Any) -> bool:
        """True when ``request`` is the proxy's notice that Triton cancelled requests; their streams
        are cancelled (the engine frees their slots at its next step)."""
        from rmsnorm_deploy.serving.pytriton_env import CANCELLED

        if CANCELLED not in request.keys():
            return False
        for number in np.asarray(request[CANCELLED]).reshape(-1).tolist():
            stream = self.streams.pop(int(number), None)
            if stream is not None:
                stream.cancel()
        return True


class StreamingGenerationInference(GenerationInference):
    """The decoupled twin of :class:`GenerationInference` (model ``<name>_stream``): one response per
    new token as the engine makes it (``output_ids`` INT64 [1], ``index`` INT64 [1]), then Triton's
    final (empty) response. The tokens are those ``generate`` returns for the same request.

    A refused request, and a stream that fails or is cancelled by the server, get one error
    response on the stream (the codes of :class:`GenerationInference`). A client that closes its
    stream is reported by the proxy: its generation is cancelled and its slot freed.
    """

    async def __call__(self, requests: Sequence[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:  # type: ignore[override]
        if len(requests) != 1:  # Triton hands an unbatched model's requests over one by one
            raise RuntimeError(f"the streaming model got {len(requests)} requests at once; it answers one at a time")
        request = requests[0]
        if self.cancel_notice(request):
            return
        stream = self.submit(request)
        if isinstance(stream, dict):
            yield [stream]
            return
        index = 0
        try:
            async for token in stream:
                yield [{GENERATION_OUTPUT: np.array([token], dtype=np.int64),
                        STREAM_INDEX: np.array([index], dtype=np.int64)}]
                index += 1
        except Exception as exc:  # noqa: BLE001 - StreamFailed / StreamCancelled: one line to the client
            yield [stream_refusal(exc)]
        finally:
            self.forget(request)


def parse_generation_request(request: Any) -> tuple[list[int], int]:
    """The prompt and ``max_new_tokens`` of one KServe request (``InputError`` when malformed);
    the engine checks them against the model."""
    from rmsnorm_deploy.decoder.generate import DEFAULT_MAX_NEW_TOKENS

    if "input_ids" not in request.keys():
        raise InputError("the request has no input_ids (the prompt's token ids, INT64 [n])")
    prompt = [int(t) for t in np.asarray(request["input_ids"]).reshape(-1)]
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if "max_new_tokens" in request.keys():
        given = np.asarray(request["max_new_tokens"]).reshape(-1)
        if given.size != 1:
            raise InputError(f"max_new_tokens must hold one number, got {given.size}")
        max_new_tokens = int(given[0])
    return prompt, max_new_tokens


def stream_refusal(exc: BaseException) -> dict[str, np.ndarray]:
    """The answer to a stream that did not end normally: a failed step is a server fault (500), a
    stream cancelled by the server (a drain out of time) is unavailable (503)."""
    from rmsnorm_deploy.serving.engine import StreamCancelled, StreamFailed
    from rmsnorm_deploy.serving.pytriton_env import refusal

    if isinstance(exc, StreamCancelled):
        return refusal(str(exc), "unavailable")
    if isinstance(exc, StreamFailed):
        return refusal(str(exc), "internal")
    return refusal(f"generation failed: {one_line(exc)}", "internal")


def _request_number(request: Any) -> int | None:
    from rmsnorm_deploy.serving.pytriton_env import REQUEST_NUMBER

    number = (getattr(request, "parameters", None) or {}).get(REQUEST_NUMBER)
    return number if isinstance(number, int) else None


def generation_endpoint(path: Path, signature: Signature, providers: Sequence[str]) -> Any:
    """The ``KVCacheModel`` a KV-cache graph is served through, or ``None`` for a stateless graph.

    A KV-cache graph's ``present`` outputs are the next step's ``past`` inputs, so it is not served
    as a stateless model (every client would run its own cache round trip): it becomes a
    generation model (:class:`GenerationInference`) with the same name. Its metadata and inputs
    are checked here, before any port is opened: a graph with past/present pairs but no
    ``kv_cache`` metadata is refused in one line.
    """
    if not signature.is_kv_cache:
        return None
    from rmsnorm_deploy.decoder.generate import KVCacheModel

    return KVCacheModel(path, providers)


def _pytriton_tensor(spec: TensorSpec, batched: bool):
    from pytriton.model_config import Tensor

    return Tensor(name=spec.name, dtype=np.dtype(spec.dtype), shape=tuple(spec.dims(batched=batched)))


def _describe(tensors: Sequence[TensorSpec]) -> str:
    return ", ".join(f"{t.name} {t.dtype}[{', '.join(str(d) for d in t.shape)}]" for t in tensors)


class Server:
    """A running embedded Triton: ``start()``, ``wait()`` until a signal or the server dies, ``stop()``."""

    def __init__(self, model: str | Path, options: ServeOptions, *, say: Callable[[str], None] = print):
        from rmsnorm_deploy.optional import require

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
        from rmsnorm_deploy.serving.openai_serve import openai_placement  # optional: pydantic, starlette

        self.openai_place, self.openai_note = openai_placement(self.generator, enabled=options.openai,
                                                               port=options.openai_port)
        check_options(options)
        self.openai: Any = None
        self.engine: Any = None
        self.triton: Any = None
        self.runner: Any = None
        self.log_dir: str | None = None
        self.log_path = Path("tritonserver.log")
        self._stop = threading.Event()

    def start(self) -> None:
        from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner, set_onnxruntime_log_level
        from rmsnorm_deploy.serving.pytriton_env import prepare_process

        set_onnxruntime_log_level()
        # The runner first: a provider that cannot run is refused before any server starts.
        o = self.options
        if self.generator is not None:
            self.runner = self.generator.runner
        else:
            self.runner = OnnxRuntimeRunner(self.path, o.providers)
        self.runner.activate()
        if self.generator is not None:
            from rmsnorm_deploy.serving.engine import Engine

            # Warm before Triton loads the models: a model Triton reports ready answers at once.
            self.engine = Engine(self.generator, o.engine_options()).start()
        prepare_process(answer_later=[o.model_name, o.model_name + STREAM_SUFFIX] if self.engine else ())
        logging.getLogger("pytriton").setLevel(logging.ERROR)
        from pytriton.model_config import DynamicBatcher, ModelConfig
        from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

        # Triton's own log goes to a file (PyTriton would echo it to our stdout line by line).
        self.log_dir = tempfile.mkdtemp(prefix="rmsnorm-deploy-serve-")
        self.log_path = Path(self.log_dir) / "tritonserver.log"
        config = TritonConfig(
            log_file=self.log_path,
            http_address=o.host, http_port=o.http_port, grpc_address=o.host, grpc_port=o.grpc_port,
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
            infer_func = BatchedInference(self.runner, sig)
            inputs = [_pytriton_tensor(t, sig.batched) for t in sig.inputs]
            outputs = [_pytriton_tensor(t, sig.batched) for t in sig.outputs]
        try:
            self.triton = Triton(config=config,
                                 security_config=TritonSecurityConfig(restricted_endpoints=list(PROTECTED_ENDPOINTS)))
            self.triton.bind(model_name=o.model_name, infer_func=infer_func, inputs=inputs, outputs=outputs,
                             config=model_config, strict=False)
            if streaming:
                self.triton.bind(**streaming, strict=False)
            self.triton.run()
        except Exception as exc:
            self.stop()
            raise UserError(f"Triton Inference Server did not start: {one_line(exc)}{self._log_tail()}") from None
        if self.openai_place == "port":
            self.start_openai()

    def start_openai(self) -> None:
        """The OpenAI API on its own port, over the warm engine (``serving.openai_serve``)."""
        from rmsnorm_deploy.serving.openai_serve import OpenAIServer, engine_app  # optional: pydantic, starlette

        o = self.options
        try:
            app, self.openai_note = engine_app(self.engine, o.model_name, max_request_bytes=OPENAI_MAX_REQUEST_BYTES)
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
                        f"server\n  streaming  {o.model_name + STREAM_SUFFIX!r} (gRPC stream): the same inputs, one "
                        f"response per new token ({GENERATION_OUTPUT} int64[1], {STREAM_INDEX} int64[1]); both "
                        f"models share the engine")
        else:
            what = "model"
            ins, outs = _describe(sig.inputs), _describe(sig.outputs)
            batching = (f"dynamic batching up to {sig.max_batch} rows along {sig.batch_dim!r}" if sig.batched
                        else "no batching (the graph has no shared leading batch dim)")
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

    def stop(self, *, keep_log: bool = False) -> None:
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
        if self.runner is not None:
            self.runner.deactivate()
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


__all__ = ["ServeOptions", "Server", "serve", "BatchedInference", "GenerationInference",
           "StreamingGenerationInference", "check_options", "free_ports",
           "generation_endpoint", "InputError"]
