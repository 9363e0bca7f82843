"""The public HTTP front of ``serve``: a Starlette app that checks each KServe v2 request and
forwards what passes to Triton's own HTTP endpoint on an internal loopback port.

Why a front: Triton 2.51 trusts a request's claimed shape (see ``serving.kserve.request_check``) and one
JSON request takes its HTTP front end down. Triton has no option that bounds a claimed shape, and a
supervisor that restarts the server would lose every request in flight; a front on a well-kept ASGI
stack (Starlette on uvicorn) can refuse such a request before Triton parses it. The front:

- reads a body with ``serving.asgi.body`` (the OpenAI API's reader too): up to ``max_request_bytes``
  (``Content-Length`` and the bytes actually sent), within ``body_timeout_s``; a gzip/deflate
  ``Content-Encoding`` is decompressed here, to at most ``max_request_bytes``, and forwarded plain;
- checks the JSON and the binary data extension (``request_check``) against the served models;
- forwards Triton's answer unchanged (status, body, its errors included), and answers
  ``/v2/health/ready`` 200 only when every served model is ready (:func:`models_not_ready`).

Only KServe's read-only endpoints and ``infer`` are routed: the repository, shared-memory, trace and
logging endpoints, and Triton's ``generate`` extension, are not served (404 with one line).
Every refusal is Triton's error form, ``{"error": "<one line>"}``. Later front ends (an OpenAI API)
mount beside these routes on the same app (:func:`kserve_app`'s ``mounts``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Sequence

from rmsnorm_deploy.serving.asgi.body import BODY_TIMEOUT_S, BodyRefused, read_plain_body
from rmsnorm_deploy.serving.kserve.request_check import (
    ServedModel,
    check_inputs,
    claimed_http_inputs,
    parse_http_request,
    stream_only_refusal,
)

#: bodies above this are checked in a worker thread, so small requests are not held up meanwhile
THREAD_ABOVE_BYTES = 1 << 20
#: how many requests with a body over THREAD_ABOVE_BYTES (or of unknown length) are read and checked at once
LARGE_AT_ONCE = 4
#: request headers passed on to Triton; the body goes on decompressed, with its own length
_FORWARDED_REQUEST = ("content-type", "inference-header-content-length", "accept-encoding", "traceparent",
                      "tracestate")
_DROPPED_RESPONSE = ("content-length", "transfer-encoding", "connection", "keep-alive", "date", "server")


def error_response(message: str, status: int):
    from starlette.responses import Response

    return Response(json.dumps({"error": " ".join(message.split())}), status_code=status,
                    media_type="application/json")


async def models_not_ready(client: Any, names: Sequence[str]) -> list[str]:
    """The served models Triton does not report ready (``client``: httpx on Triton's HTTP); empty
    when all are. Triton unreachable counts as none ready."""
    import httpx

    missing = []
    for name in names:
        try:
            response = await client.get(f"/v2/models/{name}/ready")
        except httpx.HTTPError:
            return list(names)
        if response.status_code != 200:
            missing.append(name)
    return missing


def check_infer(model: ServedModel, body: bytes, header_length: str | None) -> None:
    request, binary = parse_http_request(body, header_length)
    check_inputs(model, claimed_http_inputs(request, binary))


class KServeProxy:
    """The KServe v2 routes: checks, then Triton (``upstream``: its internal HTTP base URL)."""

    def __init__(self, models: Sequence[ServedModel], upstream: str, max_request_bytes: int, *,
                 body_timeout_s: float = BODY_TIMEOUT_S):
        import httpx

        self.models = {m.name: m for m in models}
        self.max_request_bytes = max_request_bytes
        self.body_timeout_s = body_timeout_s
        self.large: asyncio.Semaphore | None = None  # made in the front's event loop
        # no pool limit: Triton's own thread pool queues; Triton's answers are read raw, unchanged
        self.client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=5),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def infer(self, request: Any):
        name = request.path_params["model"]
        model = self.models.get(name)
        if model is None:
            return error_response(f"unknown model {name!r}; this server serves {', '.join(map(repr, self.models))}",
                                  404)
        if model.stream_of:  # Triton answers a decoupled model's HTTP infer with 501
            return error_response(stream_only_refusal(model), 400)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) <= THREAD_ABOVE_BYTES:
            return await self._infer(request, model)
        if self.large is None:
            self.large = asyncio.Semaphore(LARGE_AT_ONCE)
        async with self.large:  # large (or chunked) bodies a few at a time: memory stays bounded
            return await self._infer(request, model)

    async def _infer(self, request: Any, model: ServedModel):
        try:
            body = await read_plain_body(request, self.max_request_bytes, timeout_s=self.body_timeout_s)
            header_length = request.headers.get("inference-header-content-length")
            if len(body) > THREAD_ABOVE_BYTES:
                import anyio.to_thread

                await anyio.to_thread.run_sync(check_infer, model, body, header_length)
            else:
                check_infer(model, body, header_length)
        except BodyRefused as refused:  # request_check's Refused included
            return error_response(refused.message, refused.status)
        return await self.forward(request, body)

    async def forward(self, request: Any, body: bytes | None = None):
        """Triton's answer to the same request, status, headers and body as Triton sent them."""
        import httpx
        from starlette.responses import Response

        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_REQUEST}
        headers.setdefault("accept-encoding", "identity")
        target = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1")
        if request.url.query:
            target += "?" + request.url.query
        try:
            upstream = self.client.build_request(request.method, target, headers=headers, content=body)
            response = await self.client.send(upstream, stream=True)
            try:
                content = b"".join([chunk async for chunk in response.aiter_raw()])
            finally:
                await response.aclose()
        except httpx.ConnectError:
            return error_response("the inference server is not running", 503)
        except httpx.HTTPError as exc:
            return error_response(f"the inference server failed to answer ({type(exc).__name__})", 502)
        kept = {k: v for k, v in response.headers.items() if k.lower() not in _DROPPED_RESPONSE}
        return Response(content, status_code=response.status_code, headers=kept)

    async def ready(self, request: Any):
        from starlette.responses import Response

        missing = await models_not_ready(self.client, list(self.models))
        if missing:
            return error_response(f"not ready: {missing}", 503)
        return Response(status_code=200)

    async def close(self) -> None:
        await self.client.aclose()


def kserve_routes(proxy: KServeProxy) -> list:
    """The KServe v2 endpoints this server answers (every other path is a 404)."""
    from starlette.routing import Route

    get = ["GET"]
    routes = [Route("/v2", proxy.forward, methods=get), Route("/v2/health/live", proxy.forward, methods=get),
              Route("/v2/health/ready", proxy.ready, methods=get),
              Route("/v2/models/stats", proxy.forward, methods=get)]
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes.append(Route(base, proxy.forward, methods=get))
        routes += [Route(f"{base}/{leaf}", proxy.forward, methods=get) for leaf in ("ready", "config", "stats")]
        routes.append(Route(f"{base}/infer", proxy.infer, methods=["POST"]))
    return routes


def kserve_app(proxy: KServeProxy, mounts: Sequence[Any] = ()):
    """The front's ASGI app: the KServe routes, ``mounts`` beside them, one-line JSON errors."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException

    async def not_found(request: Any, exc: Exception):
        return error_response(f"{request.url.path[:200]} is not an endpoint of this server; KServe v2 inference is "
                              "POST /v2/models/NAME/infer", 404)

    async def not_allowed(request: Any, exc: Exception):
        return error_response(f"{request.method[:20]} is not allowed on {request.url.path[:200]}", 405)

    async def http_error(request: Any, exc: HTTPException):
        return error_response(exc.detail, exc.status_code)

    async def server_fault(request: Any, exc: Exception):
        return error_response(f"the front failed on this request ({type(exc).__name__})", 500)

    return Starlette(routes=[*mounts, *kserve_routes(proxy)],
                     exception_handlers={404: not_found, 405: not_allowed, HTTPException: http_error,
                                         Exception: server_fault})
