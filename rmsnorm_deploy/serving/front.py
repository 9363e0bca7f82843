"""``serve``'s public fronts, HTTP (Starlette on uvicorn) and gRPC (grpc.aio), in one event loop on
one thread of the serving process, in front of Triton's endpoints on internal loopback ports.

Why fronts rather than Triton's own limits or a supervisor: see ``serving.request_check`` (what
Triton 2.51 trusts), ``serving.http_front`` and ``serving.grpc_front``. The fronts hold no model
state: Triton runs the models (a generation model's engine batches its streams); a front checks a
request, forwards it and hands Triton's answer back, except a generation model's token streams over
gRPC, which it takes from the engine itself (``serving.kserve_generation``). Both answer "ready"
only when Triton says every served model is (``http_front.models_not_ready``): PyTriton's own
``/v2/health/ready`` says 200 seconds before the models load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.serving.grpc_front import GrpcFront
from rmsnorm_deploy.serving.http_front import KServeProxy, kserve_app, models_not_ready
from rmsnorm_deploy.serving.request_check import ServedModel

#: how long a stop waits for requests in flight through the fronts
GRACE_S = 5


@dataclasses.dataclass(frozen=True)
class FrontPorts:
    """Where the fronts listen (public) and where Triton listens (internal, on 127.0.0.1)."""

    host: str
    http: int
    grpc: int
    triton_http: int
    triton_grpc: int


def listening_socket(host: str, port: int, flag: str) -> socket.socket:
    """A listening socket for uvicorn, bound here so that a failure is one line naming ``flag``, not
    uvicorn's exit. IPPROTO_TCP is named because asyncio turns Nagle's algorithm off (TCP_NODELAY)
    only on sockets that say so: without it a response written as head and body, or each
    server-sent event, waits for the client's delayed ACK (40 ms)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror}") from None
    return sock


class Front:
    """Both fronts on one thread: ``start()`` returns once they listen, ``stop()`` drains them."""

    def __init__(self, models: Sequence[ServedModel], ports: FrontPorts, *, max_request_bytes: int,
                 mounts: Sequence[Any] = (), streams: Mapping[str, Callable[[Any], AsyncIterator[bytes]]] | None = None):
        self.models = list(models)
        self.streams = dict(streams or {})
        self.ports = ports
        self.max_request_bytes = max_request_bytes
        self.mounts = mounts
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.http_server: Any = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout_s: float = 30) -> None:
        sock = listening_socket(self.ports.host, self.ports.http, "--http-port")
        sock.set_inheritable(True)
        self.thread = threading.Thread(target=self._run, args=(sock,), name="rmsnorm-deploy-front", daemon=True)
        self.thread.start()
        if not self._started.wait(timeout_s) and self._error is None:
            self._error = TimeoutError(f"the fronts did not start within {timeout_s:g} s")
        if self._error is not None:
            self.stop()
            raise UserError(f"the serving front did not start: {self._error}")

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self) -> None:
        if self.http_server is not None:
            self.http_server.should_exit = True  # uvicorn polls it: stops accepting, drains in-flight requests
        if self.thread is not None:
            self.thread.join(GRACE_S + 10)
            self.thread = None

    def _run(self, sock: socket.socket) -> None:
        try:
            asyncio.run(self._main(sock))
            if not self._started.is_set():
                self._error = RuntimeError("the HTTP front stopped while starting")
        except BaseException as exc:  # noqa: BLE001 - reported by start() or seen as a dead front by serve
            self._error = exc
        finally:
            self._started.set()
            sock.close()

    async def _main(self, sock: socket.socket) -> None:
        import uvicorn


        ports = self.ports
        proxy = KServeProxy(self.models, f"http://127.0.0.1:{ports.triton_http}", self.max_request_bytes)
        names = [m.name for m in self.models]
        grpc_front = GrpcFront(self.models, f"127.0.0.1:{ports.triton_grpc}", self.max_request_bytes,
                               lambda: models_not_ready(proxy.client, names), self.streams)
        config = uvicorn.Config(kserve_app(proxy, self.mounts), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=GRACE_S, timeout_keep_alive=30)
        self.http_server = uvicorn.Server(config)
        try:
            await grpc_front.start(ports.host, ports.grpc)
            serving = asyncio.ensure_future(self.http_server.serve(sockets=[sock]))
            while not self.http_server.started and not serving.done():
                await asyncio.sleep(0.01)
            if not serving.done():
                self._started.set()
            await serving
        finally:
            await grpc_front.stop(GRACE_S)
            await proxy.close()
