"""Serving: generation over a KV-cache graph, and the exported model behind NVIDIA Triton Inference
Server, embedded or standalone.

==============  =============================================================================
signature       ``Signature``: a graph's inputs, outputs, batch dim and KV-cache pairs, read from
                the ONNX file, with their Triton datatypes
server          ``serve``: Triton embedded through PyTriton, inference through the ONNX Runtime
                runner; ports checked, 127.0.0.1 by default, clean stop on SIGINT/SIGTERM;
                a KV-cache export served as a generation model (``GenerationInference``:
                ``input_ids`` in, ``output_ids`` out, through ``generate``) and its streaming
                twin ``<name>_stream`` (``StreamingGenerationInference``: one response per
                token, through ``stream``); bad requests refused with HTTP 400; ``free_ports``;
                ``start_serve_process``: ``serve`` as a child process, handed back once ready
pytriton_env    what PyTriton 0.7 needs from this process: this Python's libpython on
                ``LD_LIBRARY_PATH``, tensors through DLPack under numpy 2, and ``refusal``:
                a request refused as INVALID_ARG (HTTP 400 / gRPC INVALID_ARGUMENT)
repository      ``triton-repo``: a model repository for the standalone server's onnxruntime or
                tensorrt backend, ``config.pbtxt`` checked against Triton's ``ModelConfig``
served_answers  a served model's answers over HTTP and gRPC against the same model run here
==============  =============================================================================
"""
