"""The OpenAI API served in this process for the tests, as ``serve --openai-port`` serves it (a
real engine over a model folder, ``serving.openai.serve``: the app with the folder's chat template,
uvicorn on a free loopback port); stopped, and the engine drained, when the block ends."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Iterator

from rmsnorm_deploy.decoder.generate import KVCacheModel
from rmsnorm_deploy.serving.engine.engine import Engine, EngineOptions
from rmsnorm_deploy.serving.openai.serve import OpenAIServer, engine_app


@dataclasses.dataclass
class Served:
    url: str  # the base URL a client is given: http://127.0.0.1:PORT/v1
    engine: Engine

    def client(self, **options: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60, **options)

    def async_client(self, **options: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60, **options)


@contextlib.contextmanager
def openai_server(folder: Path, *, model_name: str = "model", max_request_bytes: int = 1 << 20, port: int = 0,
                  **engine_options: Any) -> Iterator[Served]:
    """``port`` 0: a free one."""
    with KVCacheModel(folder) as model:
        engine = Engine(model, EngineOptions(**engine_options)).start()
        app, _ = engine_app(engine, model_name, max_request_bytes=max_request_bytes)
        server = OpenAIServer(app, "127.0.0.1", port).start()
        try:
            yield Served(f"http://127.0.0.1:{server.port}/v1", engine)
        finally:
            server.stop()
            engine.drain(5)
