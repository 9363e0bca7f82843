"""Serving: generation over a KV-cache graph, and the exported model behind NVIDIA Triton Inference
Server, embedded or standalone. Its rooms, in import order (``tests/test_layout.py`` holds it):

==========  ===================================================================================
engine      the generation engine every front end submits to, how it runs its streams, and
            ``submit_generation`` with the one outcome type the fronts map to their codes
asgi        what both HTTP APIs share: the request body reader (size 413, slow body 408, gzip),
            uvicorn on a thread of the serving process
kserve      KServe v2: the checking HTTP and gRPC fronts before Triton, the request checks, a
            generation model's KServe interface and gRPC token streams, a graph's signature,
            the served-answers client
openai      the OpenAI-compatible API: its protocol, its app over the engine, how ``serve``
            runs it, text in and out of the engine
triton      Triton through PyTriton: the infer functions bound to it, what PyTriton needs
            (and the proxy patch its stub imports), ``serve`` as a child process and its
            options, ``triton-repo``'s model repository, what a stopped server leaves on disk
server      ``serve``: the CLI's glue that starts the engine, Triton, the fronts and the OpenAI
            API in one process and stops them cleanly
==========  ===================================================================================
"""
