"""How ``serve`` runs the OpenAI-compatible API (``serving.openai.app``): whether and where
(:func:`openai_placement`), the app over the engine with the folder's chat template
(:func:`engine_app`), and on a port of its own (:class:`OpenAIServer`: uvicorn on a thread of the
serving process, listening once the engine is warm).

Where: on a port of its own, given with ``--openai-port PORT`` (the KServe front keeps
``--http-port``); without it the API is off and the startup summary says how to turn it on. Every
request goes through the engine the KServe models use. A plain graph has no text API, and a
folder without ``tokenizer.json`` cannot take text: asking for the API there is an error, and
without asking the startup summary says why it is off.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.serving.asgi.body import BODY_TIMEOUT_S
from rmsnorm_deploy.serving.asgi.uvicorn_thread import GRACE_S, UvicornThread, listening_socket
from rmsnorm_deploy.serving.openai.app import openai_app
from rmsnorm_deploy.serving.openai.protocol import APIError
from rmsnorm_deploy.serving.openai.text import ChatTemplate


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


def engine_app(engine: Any, model_name: str, *, max_request_bytes: int,
               body_timeout_s: float = BODY_TIMEOUT_S) -> tuple[Any, str]:
    """The OpenAI app over ``engine`` (its model's folder gives the chat template), and what the
    startup summary says of chat."""
    chat, refusal = ChatTemplate.load(engine.model.folder)
    from rmsnorm_deploy.serving.engine.metrics import metrics_route  # optional: prometheus-client

    app = openai_app(engine, model_name, chat=chat, chat_refusal=refusal, max_request_bytes=max_request_bytes,
                     body_timeout_s=body_timeout_s, routes=[metrics_route(engine)])
    return app, ("chat through the folder's chat template" if chat else f"no chat ({refusal})")


def openai_refusal(message: str) -> bytes:
    """The OpenAI error object of a request the HTTP layer refused (``asgi.framing``)."""
    return json.dumps(APIError(message, code="malformed_http").body()).encode()


class OpenAIServer:
    """The app on ``host:port`` (``asgi.uvicorn_thread``: uvicorn on its own thread): ``start()``
    returns once it listens (``port`` is then the port it got), ``stop()`` lets requests in flight
    finish (``grace_s``) and returns."""

    def __init__(self, app: Any, host: str, port: int, *, grace_s: float = GRACE_S):
        self.app, self.host, self.port, self.grace_s = app, host, port, grace_s
        self.thread: UvicornThread | None = None

    def start(self, timeout_s: float = 30) -> OpenAIServer:
        sock = listening_socket(self.host, self.port, "--openai-port")
        self.port = sock.getsockname()[1]

        async def setup(stack: contextlib.AsyncExitStack) -> Any:
            return self.app

        self.thread = UvicornThread(setup, sock, name="rmsnorm-deploy-openai", grace_s=self.grace_s,
                                    what=f"the OpenAI API on {self.host}:{self.port}", refusal_body=openai_refusal)
        self.thread.start(timeout_s)
        return self

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self) -> None:
        if self.thread is not None:
            thread, self.thread = self.thread, None
            thread.stop()
