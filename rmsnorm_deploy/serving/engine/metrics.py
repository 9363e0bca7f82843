"""Prometheus metrics of the generation engine, served at ``/metrics`` on the HTTP fronts (KServe's
and the OpenAI API's): ``prometheus-client`` (the ``serve`` extra) is imported when the route is made.

Counts and gauges are read from the engine when scraped (``Engine.stats``, ``Engine.token_stats``:
one source for the log, the tests and the scrape); the two latency histograms are fed per token by
the engine's ``observer``. One registry per engine, so two engines in a process never share a series.

=================================================  ======================================================
``rmsnorm_deploy_requests_total{outcome}``          ended requests: stop, length, cancelled, error, and
                                                    refused_busy (refused at once, the queue full)
``rmsnorm_deploy_queue_depth``                      requests waiting for a slot
``rmsnorm_deploy_running_streams``                  streams in the batch
``rmsnorm_deploy_prefill_tokens_total``             prompt tokens run through the model
``rmsnorm_deploy_generated_tokens_total``           tokens handed out
``rmsnorm_deploy_prefix_cache_hits_total``          requests that reused a cached prompt prefix
``rmsnorm_deploy_prefix_cache_tokens_saved_total``  prompt tokens those requests did not prefill
``rmsnorm_deploy_prefix_cache_bytes``               bytes held by the prefix store
``rmsnorm_deploy_kv_cache_tokens``                  the KV cache's budget in tokens (all slots)
``rmsnorm_deploy_speculative_proposed_tokens_total``  ``serve --speculative``: proposed tokens checked
``rmsnorm_deploy_speculative_accepted_tokens_total``  of those, tokens accepted (the acceptance rate:
                                                    accepted over proposed)
``rmsnorm_deploy_speculative_target_passes_total``  runs of the model per speculating stream after its
                                                    prefill (tokens per pass: those streams' tokens
                                                    over passes)
``rmsnorm_deploy_speculative_tokens_total``         tokens those passes made
``rmsnorm_deploy_time_to_first_token_seconds``      histogram: from submit to the first token
``rmsnorm_deploy_inter_token_seconds``              histogram: between a stream's tokens
=================================================  ======================================================
"""

from __future__ import annotations

from typing import Any

from rmsnorm_deploy.optional import require

__all__ = ["EngineMetrics", "engine_metrics", "metrics_route"]

OUTCOMES = ("stop", "length", "cancelled", "error", "refused_busy")
#: seconds: a first token on CPU takes milliseconds to seconds; a decode step milliseconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class EngineMetrics:
    """The engine's metrics in their own registry; :meth:`exposition` is the scrape's body."""

    def __init__(self, engine: Any):
        prometheus = require("prometheus_client", "the /metrics endpoint")
        self.core = require("prometheus_client.core", "the /metrics endpoint")  # the metric families
        self.prometheus, self.engine = prometheus, engine
        self.registry = prometheus.CollectorRegistry(auto_describe=True)
        self.ttft = prometheus.Histogram("rmsnorm_deploy_time_to_first_token_seconds",
                                         "Seconds from a request's submission to its first token",
                                         buckets=TTFT_BUCKETS, registry=self.registry)
        self.inter_token = prometheus.Histogram("rmsnorm_deploy_inter_token_seconds",
                                                "Seconds between consecutive tokens of a stream",
                                                buckets=INTER_TOKEN_BUCKETS, registry=self.registry)
        self.registry.register(self)
        engine.observer = self.observe

    def observe(self, first: float | None, gap: float | None) -> None:
        if first is not None:
            self.ttft.observe(first)
        if gap is not None:
            self.inter_token.observe(gap)

    def collect(self) -> Any:
        """The counts and gauges, read from the engine at scrape time (prometheus_client's collector API)."""
        core = self.core
        stats, tokens = self.engine.stats(), self.engine.token_stats()
        requests = core.CounterMetricFamily("rmsnorm_deploy_requests", "Requests by how they ended",
                                            labels=["outcome"])
        for outcome in OUTCOMES:
            requests.add_metric([outcome], stats.get(outcome, 0))
        yield requests
        yield core.GaugeMetricFamily("rmsnorm_deploy_queue_depth", "Requests waiting for a slot",
                                     value=stats["waiting"])
        yield core.GaugeMetricFamily("rmsnorm_deploy_running_streams", "Streams in the batch", value=stats["running"])
        for name, key, text in (
                ("prefill_tokens", "prefill_tokens", "Prompt tokens run through the model"),
                ("generated_tokens", "generated_tokens", "Tokens handed out"),
                ("prefix_cache_hits", "prefix_hits", "Requests that reused a cached prompt prefix"),
                ("prefix_cache_tokens_saved", "prefix_tokens_saved", "Prompt tokens not prefilled thanks to the "
                                                                     "prefix cache")):
            yield core.CounterMetricFamily(f"rmsnorm_deploy_{name}", text, value=tokens[key])
        yield core.GaugeMetricFamily("rmsnorm_deploy_prefix_cache_bytes", "Bytes held by the prefix store",
                                     value=tokens["prefix_store_bytes"])
        yield core.GaugeMetricFamily("rmsnorm_deploy_kv_cache_tokens", "The KV cache's budget in tokens",
                                     value=self.engine.options.max_batch * self.engine.slot_length)
        speculation = self.engine.speculation_stats()
        if speculation is not None:
            for name, key, text in (
                    ("proposed_tokens", "proposed", "Proposed tokens checked by speculative decoding"),
                    ("accepted_tokens", "accepted", "Proposed tokens accepted"),
                    ("target_passes", "target_passes", "Runs of the model per speculating stream after its prefill"),
                    ("tokens", "tokens", "Tokens made by those runs")):
                yield core.CounterMetricFamily(f"rmsnorm_deploy_speculative_{name}", text, value=speculation[key])

    def exposition(self) -> tuple[bytes, str]:
        """The text format and its content type."""
        return self.prometheus.generate_latest(self.registry), self.prometheus.CONTENT_TYPE_LATEST


def engine_metrics(engine: Any) -> EngineMetrics:
    """The engine's metrics, made on first use (the fronts share them)."""
    made = getattr(engine, "metrics", None)
    if made is None:
        made = engine.metrics = EngineMetrics(engine)
    return made


def metrics_route(engine: Any, path: str = "/metrics") -> Any:
    """A Starlette ``GET`` route answering the scrape."""
    from starlette.responses import Response
    from starlette.routing import Route

    metrics = engine_metrics(engine)

    async def scrape(request: Any) -> Any:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return Route(path, scrape, methods=["GET"])
