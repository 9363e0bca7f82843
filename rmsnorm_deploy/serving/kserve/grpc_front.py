"""The public gRPC front of ``serve``: KServe v2's ``GRPCInferenceService``, each inference request
checked (``serving.kserve.request_check``) before it is forwarded to Triton's gRPC endpoint on an internal
loopback port.

Measured with Triton 2.51: its gRPC front end refuses the issue's shape claims with a byte-size
mismatch, but computes that byte size in 64-bit integers, so ``[2^61]`` INT64 with no data
(2^64 bytes, wrapping to 0) passes and kills the model's Python-backend stub; every later request to
that model fails with "Stub process is not healthy" while the server stays up. So gRPC gets a front
too. It is a pass-through of serialized messages (grpcio's generic handlers): only ``ModelInfer``
and ``ModelStreamInfer`` requests are parsed and checked; ``ServerReady`` says true only when every
served model is ready; Triton's answers and errors (code and message) go back unchanged. Messages
over ``max_request_bytes`` are refused by grpcio itself (``RESOURCE_EXHAUSTED``), compressed ones
by their decompressed size. The endpoints that change the server (repository, shared memory,
trace, logging) are refused with ``PERMISSION_DENIED``. A generation model's token streams are
answered by the engine in this loop, not through Triton (``serving.kserve.generation`` says why).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence

from rmsnorm_deploy.serving.kserve.request_check import (
    Refused,
    ServedModel,
    check_inputs,
    claimed_grpc_inputs,
    stream_only_refusal,
)

SERVICE = "inference.GRPCInferenceService"
#: methods forwarded as they are (no request worth checking)
PASS_THROUGH = ("ServerLive", "ServerMetadata", "ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics")
#: methods that change the server: never forwarded
NOT_EXPOSED = ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus",
               "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus",
               "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings")
_END = object()


class GrpcFront:
    """The gRPC front (grpc.aio) forwarding to ``upstream`` (``host:port`` of Triton's gRPC).

    ``streams`` answers the stream requests of the models it names in this loop instead
    (``serving.kserve.generation``: a generation model's tokens, from the engine in this process).
    """

    def __init__(self, models: Sequence[ServedModel], upstream: str, max_request_bytes: int,
                 not_ready: Callable[[], Awaitable[list[str]]],
                 streams: Mapping[str, Callable[[Any], AsyncIterator[bytes]]] | None = None):
        self.models = {m.name: m for m in models}
        self.streams = dict(streams or {})
        self.upstream = upstream
        self.max_request_bytes = max_request_bytes
        self.not_ready = not_ready
        self.server: Any = None
        self.channel: Any = None

    async def start(self, host: str, port: int) -> None:
        import grpc

        unlimited = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
        self.channel = grpc.aio.insecure_channel(self.upstream, options=unlimited)
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.max_request_bytes),
                                               ("grpc.max_send_message_length", -1),
                                               ("grpc.so_reuseport", 0)])
        self.server.add_generic_rpc_handlers((self._handler(),))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self.server.add_insecure_port(address) != port:
            raise OSError(f"cannot listen on {address}")
        await self.server.start()

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.channel is not None:
            await self.channel.close()

    def _handler(self) -> Any:
        import grpc

        front = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: Any) -> Any:
                service, _, method = details.method.lstrip("/").partition("/")
                if service != SERVICE:
                    return None  # UNIMPLEMENTED
                if method == "ModelInfer":
                    return grpc.unary_unary_rpc_method_handler(front.infer)
                if method == "ModelStreamInfer":
                    return grpc.stream_stream_rpc_method_handler(front.stream_infer)
                if method == "ServerReady":
                    return grpc.unary_unary_rpc_method_handler(front.server_ready)
                if method in PASS_THROUGH:
                    async def forward(request: bytes, context: Any) -> bytes:
                        return await front.forward(details.method, request, context)

                    return grpc.unary_unary_rpc_method_handler(forward)
                if method in NOT_EXPOSED:
                    async def refuse(request: bytes, context: Any) -> bytes:
                        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                            f"{method} is not exposed by this server")

                    return grpc.unary_unary_rpc_method_handler(refuse)
                return None

        return Handler()

    def check(self, raw: bytes) -> Any:
        """The parsed ``ModelInferRequest``, or :class:`Refused` (status 404: an unknown model)."""
        from google.protobuf.message import DecodeError
        from tritonclient.grpc import service_pb2

        try:
            request = service_pb2.ModelInferRequest.FromString(raw)
        except DecodeError:
            raise Refused("the request is not a ModelInferRequest message") from None
        model = self.models.get(request.model_name)
        if model is None:
            raise Refused(f"unknown model {request.model_name[:128]!r}; this server serves "
                          f"{', '.join(map(repr, self.models))}", 404)
        check_inputs(model, claimed_grpc_inputs(request))
        return request

    async def infer(self, raw: bytes, context: Any) -> bytes:
        import grpc

        try:
            request = self.check(raw)
            if self.models[request.model_name].stream_of:
                raise Refused(stream_only_refusal(self.models[request.model_name]))
        except Refused as refused:
            code = grpc.StatusCode.NOT_FOUND if refused.status == 404 else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, refused.message)
        return await self.forward(f"/{SERVICE}/ModelInfer", raw, context)

    async def forward(self, method: str, raw: bytes, context: Any) -> bytes:
        import grpc

        call = self.channel.unary_unary(method)
        try:
            return await call(raw, metadata=_metadata(context), timeout=context.time_remaining())
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")

    async def server_ready(self, raw: bytes, context: Any) -> bytes:
        from tritonclient.grpc import service_pb2

        return service_pb2.ServerReadyResponse(ready=not await self.not_ready()).SerializeToString()

    async def stream_infer(self, requests: Any, context: Any):
        """A stream: checked requests go on to Triton's stream (opened for the first that goes there),
        or are answered in this loop for the models in ``streams``; a refused one gets an error
        response in this stream (as Triton answers its own refusals) and the stream goes on."""
        import grpc
        from tritonclient.grpc import service_pb2

        outgoing: asyncio.Queue = asyncio.Queue()
        answers: asyncio.Queue = asyncio.Queue()

        async def checked():
            while (item := await outgoing.get()) is not _END:
                yield item

        here: set[asyncio.Task] = set()  # requests answered in this loop, for the models in self.streams
        upstream: list[Any] = []  # Triton's stream, opened for the first request that goes there

        async def answer_here(answer: AsyncIterator[bytes]) -> None:
            try:
                async for item in answer:
                    await answers.put(item)
            finally:
                await answer.aclose()  # a cancelled task leaves the engine's stream: it is cancelled

        async def read_triton(call: Any) -> None:
            try:
                async for raw in call:
                    await answers.put(raw)
                await answers.put(_END)
            except grpc.aio.AioRpcError as error:
                await answers.put(error)

        async def read_client() -> None:
            try:
                async for raw in requests:
                    try:
                        request = self.check(raw)
                    except Refused as refused:
                        response = service_pb2.ModelStreamInferResponse(error_message=refused.message)
                        await answers.put(response.SerializeToString())
                        continue
                    if request.model_name in self.streams:
                        task = asyncio.ensure_future(answer_here(self.streams[request.model_name](request)))
                        here.add(task)
                        task.add_done_callback(here.discard)
                        continue
                    if not upstream:
                        call = self.channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(
                            checked(), metadata=_metadata(context))
                        upstream.extend([call, asyncio.ensure_future(read_triton(call))])
                    await outgoing.put(raw)
                await asyncio.gather(*here, return_exceptions=True)  # the client has sent all: answer it all
            finally:
                await outgoing.put(_END)
                if not upstream:
                    await answers.put(_END)

        reader = asyncio.ensure_future(read_client())
        try:
            while (item := await answers.get()) is not _END:
                if isinstance(item, grpc.aio.AioRpcError):
                    await context.abort(item.code(), item.details() or "")
                yield item
        finally:
            if upstream:
                upstream[0].cancel()
                upstream[1].cancel()
            for task in [reader, *here]:
                task.cancel()


def _metadata(context: Any) -> tuple[tuple[str, Any], ...]:
    """The client's own metadata (not the transport's) for the call to Triton."""
    return tuple((k, v) for k, v in (context.invocation_metadata() or ())
                 if not k.startswith((":", "grpc-")) and k not in ("user-agent", "content-type", "te"))
