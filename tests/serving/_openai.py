"""The OpenAI API served in this process for the tests: a real engine over a model folder, the app,
uvicorn on a free loopback port in a thread; stopped (and the engine drained) when the block ends."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from rmsnorm_deploy.decoder.generate import KVCacheModel
from rmsnorm_deploy.serving.engine import Engine, EngineOptions
from rmsnorm_deploy.serving.openai_app import openai_app
from rmsnorm_deploy.serving.text import ChatTemplate

START_S = 30


@dataclasses.dataclass
class OpenAIServer:
    url: str  # the base URL a client is given: http://127.0.0.1:PORT/v1
    engine: Engine

    def client(self, **options: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60, **options)

    def async_client(self, **options: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60, **options)


@contextlib.contextmanager
def openai_server(folder: Path, *, model_name: str = "model", max_request_bytes: int = 1 << 20,
                  **engine_options: Any) -> Iterator[OpenAIServer]:
    import uvicorn

    with KVCacheModel(folder) as model:
        engine = Engine(model, EngineOptions(**engine_options)).start()
        chat, refusal = ChatTemplate.load(model.folder)
        app = openai_app(engine, model_name, chat=chat, chat_refusal=refusal, max_request_bytes=max_request_bytes)
        # IPPROTO_TCP named so that asyncio turns Nagle's algorithm off on the accepted sockets
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + START_S
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
                time.sleep(0.01)
            yield OpenAIServer(f"http://127.0.0.1:{sock.getsockname()[1]}/v1", engine)
        finally:
            server.should_exit = True
            thread.join(15)
            sock.close()
            engine.drain(5)
