"""Serving: generation over a KV-cache graph, and the exported model behind NVIDIA Triton Inference
Server, embedded or standalone.

==============  =============================================================================
signature       ``Signature``: a graph's inputs, outputs, batch dim and KV-cache pairs, read from
                the ONNX file, with their Triton datatypes
engine          ``Engine``: the generation engine every front end submits to; one thread owns
                the session; ``Stream`` handles (thread-safe, iterable, ``async for``, cancel);
                a bounded queue (``EngineBusy``), warm-up and drain (``EngineUnavailable``),
                a failed run failing only its streams (``StreamFailed``)
slots           how the engine runs its streams: ``SlotBatch``, continuous batching in the slots
                of one preallocated KV cache (the ``--target onnxruntime`` graph, rows at their
                own positions in one run, chunked prefill); ``TurnBatch``, batch-1 turns
server          ``serve``: Triton embedded through PyTriton behind our fronts, inference through
                the ONNX Runtime runner; 127.0.0.1 by default, clean stop on SIGINT/SIGTERM;
                a KV-cache export served as a generation model (``GenerationInference``:
                ``input_ids`` in, ``output_ids`` out) and its streaming
                twin ``<name>_stream`` (``StreamingGenerationInference``: one response per
                token), both submitting to the engine; bad requests refused with HTTP 400, a full
                queue with 503; a drain of the generations in flight before a stop
process         ``ServeOptions`` and their checks, ``free_ports``, ``start_serve_process``:
                ``serve`` as a child process, handed back once ready
front           the public fronts (HTTP and gRPC) on one event-loop thread, readiness from
                Triton's model-ready
http_front      the HTTP front: a Starlette app (on uvicorn) that checks body size, encoding and
                each KServe request, forwards it to Triton's internal HTTP port, and hands the
                answer back unchanged
grpc_front      the gRPC front: KServe's ``GRPCInferenceService`` passed through grpc.aio, each
                inference request (unary and streamed) checked first
kserve_generation  a generation model's KServe interface (inputs, outputs, the request parser)
                and ``EngineStreams``: its token streams answered by the engine in the gRPC
                front's loop, as Triton's own messages, without Triton's hops
request_check   what a KServe v2 request must be before Triton sees it (JSON, binary data,
                gRPC messages): names, datatypes, shapes, sizes, the data carried; ``Refused``
leftovers       the PyTriton workspace and Triton's ``/tmp/folder*`` named per process, removed
                after any stop and, at start-up, those of ``serve`` processes that were killed
pytriton_env    what PyTriton 0.7 needs from this process: this Python's libpython on
                ``LD_LIBRARY_PATH``, tensors through DLPack under numpy 2, ``refusal``: a
                request refused with the code it names (INVALID_ARG, UNAVAILABLE, INTERNAL),
                and for the generation models answers through each request's sender and
                notices of requests Triton cancelled
repository      ``triton-repo``: a model repository for the standalone server's onnxruntime or
                tensorrt backend, ``config.pbtxt`` checked against Triton's ``ModelConfig``
served_answers  a served model's answers over HTTP and gRPC against the same model run here
openai_app      the OpenAI-compatible API (Starlette): ``/v1/models``, ``/v1/completions``,
                ``/v1/chat/completions``, streaming as server-sent events, on the same engine
                as the KServe models; refusals as OpenAI error objects (429 on a full queue)
openai_serve    how ``serve`` runs it: whether and where (``openai_placement``), the app with
                the folder's chat template, ``OpenAIServer`` (uvicorn on its own port and thread)
openai_api      its request bodies (pydantic, strict; unsupported parameters refused), its
                answers and its error object (``APIError``)
text            text in and out of the engine: ``TextStream`` (incremental decoding that never
                hands out half a character, stop strings across tokens), ``ChatTemplate`` (the
                folder's chat template through transformers, read from the folder only)
==============  =============================================================================
"""
