"""``serve``'s process: its options and ports, and ``serve`` started as a child process.

==================  ==========================================================================
ServeOptions        where every endpoint listens (the public fronts, Triton's metrics) and the
                    request limits; ``check_options`` refuses bad names and ports in one line
free_ports          ports free on a host now (tests, benchmarks, Triton's internal ports)
start_serve_process ``rmsnorm-deploy serve`` as a child process, handed back once ready
==================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import errno
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Collection, Sequence

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.serving.engine.engine import EngineOptions

#: 64 MiB: a [8, 256, 4096] float32 batch of hidden states (32 MiB) fits as binary data
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


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
    #: the largest request body (decompressed) or gRPC message the fronts accept
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    #: a generation model's engine (``serving.engine.engine.EngineOptions``; its max_batch is ``max_batch``)
    max_queue: int = 64
    max_tokens_in_flight: int | None = None
    prefill_chunk: int = 32
    prefix_cache_mb: int = EngineOptions.prefix_cache_mb
    drain_timeout_s: float = 30.0
    #: ``--speculative ngram|DRAFT_DIR`` and ``--speculative-k`` (``serving.engine.speculation``)
    speculative: str | None = None
    speculative_k: int | None = None
    #: the OpenAI-compatible API of a KV-cache export with a tokenizer (``serving.openai.serve``)
    openai: bool = True
    openai_port: int | None = None

    def engine_options(self) -> EngineOptions:
        """The generation engine's options (``--max-batch`` is its number of slots, default 16)."""
        if self.max_batch == 0:
            raise UserError("--max-batch 0: a generation model runs at least one stream; give 1 or more")
        return EngineOptions(max_batch=EngineOptions.max_batch if self.max_batch is None else self.max_batch,
                             max_queue=self.max_queue, max_tokens_in_flight=self.max_tokens_in_flight,
                             prefill_chunk=self.prefill_chunk, drain_timeout_s=self.drain_timeout_s,
                             prefix_cache_mb=self.prefix_cache_mb)

    def endpoints(self) -> dict[str, str]:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return {
            "http": f"http://{host}:{self.http_port}",
            "grpc": f"{host}:{self.grpc_port}",
            "metrics": f"http://{host}:{self.metrics_port}/metrics",
            "openai": f"http://{host}:{self.openai_port}",
        }


def check_model_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise UserError(f"--model-name {name!r}: use letters, digits, '_', '.', '-' (at most 128)")


def check_options(options: ServeOptions) -> None:
    """Refuse bad names and ports before anything starts."""
    check_model_name(options.model_name)
    if not 1024 <= options.max_request_bytes <= 1 << 31:
        raise UserError(f"--max-request-bytes {options.max_request_bytes}: give a size from 1024 to {1 << 31} bytes")
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


def free_ports(count: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> list[int]:
    """``count`` distinct ports the system reports free on ``host`` now (for ``--http-port`` and the
    others when any port will do: tests, benchmarks), none of ``avoid`` (ports already given out: a
    port reported free and not yet bound may be reported again). Another process may still take one
    before it is bound; :func:`check_options` then refuses it in one line."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)  # held until the end, so the system reports each port once
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in avoid:
                ports.append(port)
        return ports
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


def start_serve_process(model_dir: str | Path, *, timeout_s: float = 90, args: Sequence[str] = (),
                        wait: bool = True) -> ServeProcess:
    """``rmsnorm-deploy serve MODEL_DIR [args]`` as a child process (this package, this Python) on
    free loopback ports, returned once it is ready both on the wire (``/v2/health/ready``) and in
    its own output (it prints ``ready`` after the server is up), or at once without ``wait``. Raises
    :class:`UserError` with what it printed when it exits first or is not ready within ``timeout_s``
    (then it is killed)."""
    import os
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    given = [str(a) for flag, a in zip(args, list(args)[1:]) if str(flag).endswith("-port") and str(a).isdigit()]
    http, grpc, metrics = free_ports(3, avoid={int(a) for a in given})  # not a port the args already name
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
    if not wait:
        return served
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
