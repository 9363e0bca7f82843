"""The generation engine: what every front end of ``serve`` submits its generations to.

==========  ===================================================================================
engine      ``Engine``: one thread owns the session; ``Stream`` handles (thread-safe, iterable,
            ``async for``, cancel); a bounded queue (``EngineBusy``), warm-up and drain
            (``EngineUnavailable``), a failed run failing only its streams (``StreamFailed``)
slots       how the engine runs its streams: ``SlotBatch``, continuous batching in the slots
            of one preallocated KV cache (the ``--target onnxruntime`` graph, rows at their
            own positions in one run, chunked prefill); ``TurnBatch``, batch-1 turns
prefix_cache  prompt KV kept across requests: ``PrefixStore`` (an LRU of copied prefixes within
            ``--prefix-cache-mb``) beside the slots' own, ``common_prefix``
speculation  ``serve --speculative``: which streams speculate and when (``EngineSpeculation``:
            a one-slot check run while one stream decodes under continuous batching, a
            ``Speculator`` per stream taking turns), the engine's acceptance and tokens per run
metrics     the engine's Prometheus metrics (``rmsnorm_deploy_*``) and the ``/metrics`` route
            both HTTP fronts mount; prometheus-client imported when the route is made
submit      ``submit_generation``: a front's request into the engine, a ``Stream`` or a
            ``Refusal`` (invalid, busy, unavailable, cancelled, failed) that each front maps to
            its own codes; ``ending``: the refusal a stream that raised ends with
sampling    ``Chooser``: a stream's own picker for the OpenAI fields (logprobs, penalties,
            ``logit_bias``, ``top_k``, ``min_p``, a grammar), ``generate``'s sampling beneath
constraints  constrained decoding through llguidance (``Grammars``, ``Constraint``): a JSON
            schema, any JSON object, a regex, a Lark grammar; llguidance loaded on first use;
            each grammar admitted before its request is queued (limits, nothing to match),
            ``GrammarStopped`` where one cannot go on mid-answer
schema_recursion  ``endless_requirement``: a JSON schema whose requirements lead back to
            themselves without end (no finite value matches it), named by its cycle
==========  ===================================================================================
"""
