"""How ``serve`` runs the OpenAI-compatible API (``serving.openai_app``): whether and where
(:func:`openai_placement`), the app over the engine with the folder's chat template
(:func:`engine_app`), and on a port of its own (:class:`OpenAIServer`: uvicorn on a thread of the
serving process, listening once the engine is warm).

Where, and why on by default: a KV-cache export whose folder has ``tokenizer.json`` is a text
model, and text is what its users send; the API costs nothing until called and every request goes
through the engine the KServe models use. So it is on unless ``--no-openai``; ``--openai-port PORT``
serves it on a port of its own. A plain graph has no text API, and a folder without
``tokenizer.json`` cannot take text: asking for the API there is an error, and without asking
the startup summary says why it is off.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.serving.front import listening_socket
from rmsnorm_deploy.serving.openai_app import openai_app
from rmsnorm_deploy.serving.text import ChatTemplate


def openai_placement(model: Any, *, enabled: bool, port: int | None) -> tuple[str | None, str | None]:
    """``("port" | None, why it is off)`` for ``model`` (a ``KVCacheModel``, or None for a plain
    graph); refuses (``UserError``) ``--openai-port`` where the API cannot be served."""
    if port is not None and not enabled:
        raise UserError("--openai-port and --no-openai contradict each other; give one")
    if model is None:
        if port is not None:
            raise UserError("--openai-port: this model is a plain graph, which takes tensors, not text; the OpenAI "
                            "API serves KV-cache exports (export --kv-cache)")
        return None, None
    if not enabled:
        return None, "off (--no-openai)"
    if model.tokenizer is None:
        if port is not None:
            raise UserError(f"--openai-port: {model.folder} has no tokenizer.json, so it cannot take text; export "
                            "from a folder with its tokenizer files, or leave --openai-port out")
        return None, f"off: {model.folder} has no tokenizer.json (text cannot be encoded)"
    if port is None:
        return None, "off: give --openai-port PORT to serve it"
    return "port", None


def engine_app(engine: Any, model_name: str, *, max_request_bytes: int) -> tuple[Any, str]:
    """The OpenAI app over ``engine`` (its model's folder gives the chat template), and what the
    startup summary says of chat."""
    chat, refusal = ChatTemplate.load(engine.model.folder)
    app = openai_app(engine, model_name, chat=chat, chat_refusal=refusal, max_request_bytes=max_request_bytes)
    return app, ("chat through the folder's chat template" if chat else f"no chat ({refusal})")


class OpenAIServer:
    """The app on ``host:port``, served by uvicorn on its own thread: ``start()`` returns once it
    listens, ``stop()`` lets requests in flight finish (``grace_s``) and returns."""

    def __init__(self, app: Any, host: str, port: int, *, grace_s: float = 5):
        self.app, self.host, self.port, self.grace_s = app, host, port, grace_s
        self.server: Any = None
        self.thread: threading.Thread | None = None
        self.sock: socket.socket | None = None

    def start(self, timeout_s: float = 30) -> OpenAIServer:
        import uvicorn  # optional: the serve extra

        self.sock = listening_socket(self.host, self.port, "--openai-port")
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=self.grace_s, timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="rmsnorm-deploy-openai", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise UserError(f"the OpenAI API did not start on {self.host}:{self.port} within {timeout_s:g} s")
            time.sleep(0.01)
        return self

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(self.grace_s + 10)
            self.thread = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
