"""NVIDIA Triton Inference Server: embedded through PyTriton for ``serve``, standalone for ``triton-repo``.

============  ===================================================================================
binding       PyTriton's infer functions: ``BatchedInference`` (a plain graph through the ONNX
              Runtime runner), ``GenerationInference`` and its streaming twin (the engine's
              outcomes as Triton error codes); ``served_models``: what the fronts check
pytriton_env  what PyTriton 0.7 needs from this process: this Python's libpython on
              ``LD_LIBRARY_PATH``, the proxy patch loaded into each stub, ``refusal``: a request
              refused with the code it names (INVALID_ARG, UNAVAILABLE, INTERNAL)
proxy_patch   the patch itself, a module the stub loads by path: tensors through DLPack under
              numpy 2, refusals as Triton errors, answers through each request's sender and
              notices of requests Triton cancelled
process       ``ServeOptions`` and their checks, ``free_ports``, ``start_serve_process``: ``serve``
              as a child process, handed back once ready
repository    ``triton-repo``: a model repository for the standalone server's onnxruntime or
              tensorrt backend, ``config.pbtxt`` checked against Triton's ``ModelConfig``
leftovers     the PyTriton workspace and Triton's ``/tmp/folder*`` named per process, removed
              after any stop and, at start-up, those of ``serve`` processes that were killed
============  ===================================================================================
"""
