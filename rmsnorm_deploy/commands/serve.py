"""Serve an exported ONNX model with Triton Inference Server (embedded through PyTriton): KServe v2
over HTTP and gRPC, metrics, dynamic batching; inference through ONNX Runtime on the requested
provider (never a silent fallback). A KV-cache export is served by the generation engine:
continuous batching of every client's stream in slots of one preallocated KV cache (the --target
onnxruntime graph; the portable graph's streams take turns), a bounded queue, and on SIGTERM a
drain of the generations in flight; the OpenAI-compatible API (--openai-port) takes text on the same
engine. Our fronts on the public HTTP and gRPC ports check every request before Triton sees it.
Listens on 127.0.0.1 unless --host says otherwise; Ctrl-C or
SIGTERM stops it. Exit 2 on bad input (not a model, a port in use, an unknown provider)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR", help="an exported model folder (export/…/) or its model.onnx")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address every endpoint binds to (default 127.0.0.1: this machine only; 0.0.0.0 exposes "
                        "the server on every interface)")
    parser.add_argument("--http-port", type=int, default=8000, help="KServe v2 HTTP port (default 8000)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="KServe v2 gRPC port (default 8001)")
    parser.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (default 8002)")
    parser.add_argument("--providers", default="cpu",
                        help="ONNX Runtime providers, comma-separated, in priority order: cpu, cuda, tensorrt "
                        "(default cpu); each must really run or the server does not start")
    parser.add_argument("--model-name", default="model", help="the model's name on the server (default model)")
    parser.add_argument("--max-request-bytes", type=int, metavar="N", default=None,
                        help="the largest request the fronts accept: an HTTP body (decompressed) or a gRPC message "
                        "(default 67108864, 64 MiB); a larger one gets 413 / RESOURCE_EXHAUSTED")
    parser.add_argument("--max-batch", type=int, metavar="N",
                        help="a plain model: largest batch Triton's dynamic batcher forms (default: the model's batch "
                        "range from its metadata, else 8; 0 turns batching off); a KV-cache model: streams the "
                        "generation engine decodes together, its KV-cache slots (default 16)")
    text = parser.add_argument_group(
        "OpenAI-compatible API (KV-cache exports with a tokenizer)",
        "Text in, text out (/v1/models, /v1/completions, /v1/chat/completions, streaming) for the openai "
        "package, LangChain, LlamaIndex and curl, on the same generation engine as the KServe models (they share "
        "its batch), for a KV-cache export whose folder has tokenizer.json; a plain graph takes tensors, so it "
        "has none.")
    text.add_argument("--openai-port", type=int, metavar="PORT",
                      help="serve the OpenAI API on this port (on --host; 127.0.0.1 by default)")
    text.add_argument("--no-openai", action="store_true", help="do not serve the OpenAI API")
    engine = parser.add_argument_group("generation engine (KV-cache models)")
    engine.add_argument("--max-queue", type=int, default=64, metavar="N",
                        help="requests that may wait for a slot; one more is refused at once with HTTP 503 / gRPC "
                        "UNAVAILABLE (default 64)")
    engine.add_argument("--max-tokens-in-flight", type=int, metavar="T",
                        help="tokens the preallocated KV cache holds in all: each of the --max-batch slots holds "
                        "T / max-batch, the largest request (prompt + new tokens) (default: sized to the model and this "
                        "machine's memory, never a model-length slot per stream; serve prints it)")
    engine.add_argument("--prefill-chunk", type=int, default=32, metavar="N",
                        help="prompt tokens prefilled per decode step: how long a newcomer may stall the running "
                        "streams (default 32)")
    engine.add_argument("--prefix-cache-mb", type=int, default=256, metavar="MB",
                        help="prompt KV kept across requests beside what the slots keep themselves (a prompt that "
                        "starts with tokens computed before prefills only the rest; least recently used first out; "
                        "0: the slots' own only; default 256)")
    engine.add_argument("--speculative", metavar="ngram|DRAFT_DIR",
                        help="speculative decoding: propose tokens by prompt lookup (ngram) or with a draft model "
                        "(a folder written by `export --kv-cache` with the same tokenizer) and check several in one "
                        "run; greedy streams keep their tokens, sampled ones the model's distribution; requests with "
                        "logit_bias, penalties, min_p, a grammar or logprobs decode without it; under continuous "
                        "batching only while one stream decodes (default: off)")
    engine.add_argument("--speculative-k", type=int, metavar="K",
                        help="--speculative: at most K tokens proposed a run, fewer while they fail (default 5)")
    engine.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                        help="on SIGTERM, seconds the generations in flight may take to finish before they are "
                        "cancelled (default 30); no new request is admitted meanwhile")


def run(args: argparse.Namespace) -> int:
    from rmsnorm_deploy.runners.onnxruntime import provider_name
    from rmsnorm_deploy.serving.server import serve
    from rmsnorm_deploy.serving.triton.process import DEFAULT_MAX_REQUEST_BYTES, ServeOptions

    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    for p in providers:
        provider_name(p)  # an unknown name is a one-line error before anything loads
    options = ServeOptions(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                           metrics_port=args.metrics_port, providers=providers or ("",),
                           model_name=args.model_name, max_batch=args.max_batch, max_queue=args.max_queue,
                           max_tokens_in_flight=args.max_tokens_in_flight, prefill_chunk=args.prefill_chunk,
                           prefix_cache_mb=args.prefix_cache_mb, speculative=args.speculative,
                           speculative_k=args.speculative_k,
                           drain_timeout_s=args.drain_timeout, openai=not args.no_openai,
                           openai_port=args.openai_port,
                           max_request_bytes=DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None
                           else args.max_request_bytes)
    return serve(args.model, options, say=lambda line: print(line, flush=True))
