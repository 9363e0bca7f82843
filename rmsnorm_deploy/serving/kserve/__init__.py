"""KServe v2 in front of Triton: the checking fronts, and a generation model's KServe interface.

==============  ===============================================================================
front           the public fronts (HTTP and gRPC) on one event-loop thread, readiness from
                Triton's model-ready
http_front      the HTTP front: a Starlette app that reads each body (``asgi.body``), checks each
                KServe request, forwards it to Triton's internal HTTP port, and hands the answer
                back unchanged; a streaming twin's HTTP infer refused with 400
grpc_front      the gRPC front: KServe's ``GRPCInferenceService`` passed through grpc.aio, each
                inference request (unary and streamed) checked first
request_check   what a KServe v2 request must be before Triton sees it (JSON, binary data, gRPC
                messages): names, datatypes, shapes, sizes, the data carried, the request
                parameters Triton parses; ``ServedModel``, ``Refused``
generation      a generation model's KServe interface (inputs, outputs, the request parser) and
                ``EngineStreams``: its token streams answered by the engine in the gRPC front's
                loop, as Triton's own messages
signature       ``Signature``: a graph's inputs, outputs, batch dim and KV-cache pairs, read from
                the ONNX file, with their KServe/Triton datatypes
served_answers  a served model's answers over HTTP and gRPC against the same model run here
==============  ===============================================================================
"""
