"""The engine's Prometheus metrics, scraped over HTTP from the OpenAI API's ``/metrics`` as Prometheus
would (the KServe front's ``/metrics`` is scraped in ``test_engine_server``)."""

from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("onnxruntime", reason="the engine runs ONNX Runtime")
pytest.importorskip("prometheus_client", reason="/metrics needs prometheus-client (the serve extra)")
pytest.importorskip("starlette", reason="the OpenAI API runs on Starlette (the serve extra)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.serving._openai import openai_server  # noqa: E402


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels) -> value`` of one scrape of ``/metrics``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    body = response.read().decode()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain"), body
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def _complete(port: int, prompt: list[int], max_tokens: int) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps({"model": "model", "prompt": prompt,
                                                              "max_tokens": max_tokens, "temperature": 0}),
                       {"Content-Type": "application/json"})
    return json.loads(connection.getresponse().read())


def test_a_scrape_counts_requests_tokens_latencies_and_prefix_hits(text_exports):
    with openai_server(text_exports("ort"), max_batch=2) as served:
        port = int(served.url.rsplit(":", 1)[1].split("/")[0])
        empty = scrape(port)
        assert empty[("rmsnorm_deploy_requests_total", (("outcome", "length"),))] == 0
        assert empty[("rmsnorm_deploy_kv_cache_tokens", ())] == 2 * served.engine.slot_length
        prompt = list(range(40, 80))
        answers = [_complete(port, prompt, 5) for _ in range(3)]  # the second and third reuse the first's KV
        assert len({a["choices"][0]["text"] for a in answers}) == 1
        got = scrape(port)
        stats = served.engine.token_stats()

    def value(name: str, **labels) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    finished = value("rmsnorm_deploy_requests_total", outcome="length") + value("rmsnorm_deploy_requests_total",
                                                                                outcome="stop")
    assert finished == 3 and value("rmsnorm_deploy_requests_total", outcome="error") == 0
    assert value("rmsnorm_deploy_running_streams") == 0 and value("rmsnorm_deploy_queue_depth") == 0
    assert value("rmsnorm_deploy_generated_tokens_total") == stats["generated_tokens"] == \
        sum(a["usage"]["completion_tokens"] for a in answers)
    assert value("rmsnorm_deploy_prefill_tokens_total") == 40 + 1 + 1 == stats["prefill_tokens"]
    assert value("rmsnorm_deploy_prefix_cache_hits_total") == 2
    assert value("rmsnorm_deploy_prefix_cache_tokens_saved_total") == 2 * 39
    assert value("rmsnorm_deploy_time_to_first_token_seconds_count") == 3
    assert value("rmsnorm_deploy_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert value("rmsnorm_deploy_inter_token_seconds_count") == stats["generated_tokens"] - 3
    assert value("rmsnorm_deploy_time_to_first_token_seconds_sum") > 0


def test_speculation_counters_are_the_engines_speculation_stats(engine_exports):
    """``serve --speculative``: proposed and accepted tokens, runs of the model and their tokens."""
    from rmsnorm_deploy.decoder.generate import KVCacheModel, SpeculationOptions
    from rmsnorm_deploy.serving.engine.engine import Engine, EngineOptions
    from rmsnorm_deploy.serving.engine.metrics import engine_metrics

    with KVCacheModel(engine_exports("ort")) as model:
        engine = Engine(model, EngineOptions(max_batch=1), speculation=SpeculationOptions("ngram", 3)).start()
        engine.submit([9, 8, 7, 6] * 6, max_new_tokens=20, eos_token_id=None).result(60)
        body, _ = engine_metrics(engine).exposition()
        stats = engine.speculation_stats()
        engine.drain(10)
    got = {s.name: s.value for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    assert stats["proposed"] > 0 and stats["tokens"] == 19, stats
    for name, key in (("proposed_tokens", "proposed"), ("accepted_tokens", "accepted"),
                      ("target_passes", "target_passes"), ("tokens", "tokens")):
        assert got[f"rmsnorm_deploy_speculative_{name}_total"] == stats[key], (name, got)
