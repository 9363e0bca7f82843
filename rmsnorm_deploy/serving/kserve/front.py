"""``serve``'s public fronts, HTTP (Starlette on uvicorn) and gRPC (grpc.aio), in one event loop on
one thread of the serving process, in front of Triton's endpoints on internal loopback ports.

Why fronts rather than Triton's own limits or a supervisor: see ``serving.kserve.request_check`` (what
Triton 2.51 trusts), ``serving.kserve.http_front`` and ``serving.kserve.grpc_front``. The fronts hold no model
state: Triton runs the models (a generation model's engine batches its streams); a front checks a
request, forwards it and hands Triton's answer back, except a generation model's token streams over
gRPC, which it takes from the engine itself (``serving.kserve.generation``). Both answer "ready"
only when Triton says every served model is (``http_front.models_not_ready``): PyTriton's own
``/v2/health/ready`` says 200 seconds before the models load.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from rmsnorm_deploy.serving.asgi.uvicorn_thread import GRACE_S, UvicornThread, listening_socket
from rmsnorm_deploy.serving.kserve.grpc_front import GrpcFront
from rmsnorm_deploy.serving.kserve.http_front import KServeProxy, kserve_app, models_not_ready
from rmsnorm_deploy.serving.kserve.request_check import ServedModel


@dataclasses.dataclass(frozen=True)
class FrontPorts:
    """Where the fronts listen (public) and where Triton listens (internal, on 127.0.0.1)."""

    host: str
    http: int
    grpc: int
    triton_http: int
    triton_grpc: int


class Front:
    """Both fronts on one thread (``asgi.uvicorn_thread``): ``start()`` returns once they listen,
    ``stop()`` drains them."""

    def __init__(self, models: Sequence[ServedModel], ports: FrontPorts, *, max_request_bytes: int,
                 mounts: Sequence[Any] = (), streams: Mapping[str, Callable[[Any], AsyncIterator[bytes]]] | None = None):
        self.models = list(models)
        self.streams = dict(streams or {})
        self.ports = ports
        self.max_request_bytes = max_request_bytes
        self.mounts = mounts
        self.thread: UvicornThread | None = None

    def start(self, timeout_s: float = 30) -> None:
        sock = listening_socket(self.ports.host, self.ports.http, "--http-port")
        sock.set_inheritable(True)
        self.thread = UvicornThread(self._setup, sock, name="rmsnorm-deploy-front", what="the serving front")
        self.thread.start(timeout_s)

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self) -> None:
        if self.thread is not None:
            thread, self.thread = self.thread, None
            thread.stop()

    async def _setup(self, stack: contextlib.AsyncExitStack) -> Any:
        """The HTTP front's app; the gRPC front listening in the same loop (both closed by ``stack``)."""
        ports = self.ports
        proxy = KServeProxy(self.models, f"http://127.0.0.1:{ports.triton_http}", self.max_request_bytes)
        stack.push_async_callback(proxy.close)
        names = [m.name for m in self.models]
        grpc_front = GrpcFront(self.models, f"127.0.0.1:{ports.triton_grpc}", self.max_request_bytes,
                               lambda: models_not_ready(proxy.client, names), self.streams)
        stack.push_async_callback(grpc_front.stop, GRACE_S)
        await grpc_front.start(ports.host, ports.grpc)
        return kserve_app(proxy, self.mounts)
