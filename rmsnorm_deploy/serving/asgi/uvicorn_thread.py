"""An ASGI app served by uvicorn on a thread of the serving process: the KServe front (with the gRPC
front in the same event loop) and the OpenAI API both run this way.

:func:`listening_socket` binds the port here, so a port in use is one line naming its flag rather
than uvicorn's exit. :class:`UvicornThread` runs one event loop on its own thread: ``setup``
builds the app inside that loop (clients and servers that belong to the loop, such as httpx's and
grpc.aio's, are made there and closed through the exit stack it is given), uvicorn serves it on
the socket, ``start()`` returns once it listens, ``stop()`` lets requests in flight finish
(``grace_s``) and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any, Awaitable, Callable

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.serving.asgi.framing import RefusalBody, framing_protocol, kserve_refusal

#: how long a stop waits for requests in flight
GRACE_S = 5
#: seconds an idle keep-alive connection stays open
KEEP_ALIVE_S = 30


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


class UvicornThread:
    """``setup(stack)`` -> the ASGI app, served on ``sock`` by uvicorn in an event loop on a thread
    named ``name``; ``what`` names it in the one-line error of a start that fails; ``refusal_body``:
    the JSON body of a request whose HTTP framing is broken (``asgi.framing``; KServe's shape by default)."""

    def __init__(self, setup: Callable[[contextlib.AsyncExitStack], Awaitable[Any]], sock: socket.socket, *,
                 name: str, what: str, grace_s: float = GRACE_S, refusal_body: RefusalBody = kserve_refusal):
        self.setup, self.sock, self.name, self.what, self.grace_s = setup, sock, name, what, grace_s
        self.refusal_body = refusal_body
        self.server: Any = None
        self.thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self, timeout_s: float = 30) -> UvicornThread:
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()
        if not self._started.wait(timeout_s) and self._error is None:
            self._error = TimeoutError(f"not listening within {timeout_s:g} s")
        if self._error is not None:
            self.stop()
            raise UserError(f"{self.what} did not start: {self._error}")
        return self

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True  # uvicorn polls it: stops accepting, drains in-flight requests
        if self.thread is not None:
            self.thread.join(self.grace_s + 10)
            self.thread = None
        self.sock.close()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
            if not self._started.is_set():
                self._error = RuntimeError("it stopped while starting")
        except BaseException as exc:  # noqa: BLE001 - reported by start() or seen as a dead thread by serve
            self._error = exc
        finally:
            self._started.set()

    async def _main(self) -> None:
        import uvicorn  # optional: the serve extra

        async with contextlib.AsyncExitStack() as stack:
            app = await self.setup(stack)
            config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=self.grace_s, timeout_keep_alive=KEEP_ALIVE_S,
                                    http=framing_protocol(self.refusal_body))
            self.server = uvicorn.Server(config)
            serving = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
            while not self.server.started and not serving.done():
                await asyncio.sleep(0.01)
            if not serving.done():
                self._started.set()
            await serving
