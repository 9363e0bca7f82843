"""The OpenAI-compatible API of ``serve``: text in, text out, on the generation engine.

========  =========================================================================================
protocol  its request bodies (pydantic, strict; unsupported parameters refused), its answers and
          its error object (``APIError``)
app       the app (Starlette): ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
          streaming as server-sent events; bodies read by ``asgi.body``; the engine's refusals
          as OpenAI error objects (429 on a full queue)
serve     how ``serve`` runs it: whether and where (``openai_placement``), the app with the
          folder's chat template, ``OpenAIServer`` (``asgi.uvicorn_thread`` on its own port)
text      text in and out of the engine: ``TextStream`` (incremental decoding that never hands
          out half a character, stop strings across tokens), ``ChatTemplate`` (the folder's chat
          template through transformers, read from the folder only)
choices   a request's ``n`` choices (each an engine stream with its ``Chooser``, seed + index) and
          its tokens' logprobs in OpenAI's chat and completions shapes (``TokenTexts``)
answers   the choices answered whole or as server-sent events; the engine's refusals as OpenAI
          errors (``openai_error``)
tools     ``tools`` / ``tool_choice``: the template's tools, calls read back (Hermes/Qwen
          ``<tool_call>``, Llama 3 JSON), ``required`` and named choices constrained
========  =========================================================================================
"""
