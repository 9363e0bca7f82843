"""Generate tokens with a KV-cache model (``export --kv-cache``) in ONNX Runtime.

MODEL_DIR is the folder the export wrote (or its model.onnx). The prompt is text (encoded with the
folder's tokenizer.json) or token ids; greedy decoding unless --sample. Past and present stay in
ONNX Runtime's memory between steps (IOBinding). Prints the text (or the tokens), the prefill time,
the decode time per token and the decode throughput; with --speculative, the share of proposed
tokens accepted and the tokens per run of the model. Exit code 2 on bad input: a model without a
KV cache, a prompt longer than the model's maximum, an unknown or unavailable provider, a draft
model whose tokenizer is not the model's."""

from __future__ import annotations

import argparse
import contextlib
import json

from rmsnorm_deploy.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rmsnorm_deploy.decoder.generate import DEFAULT_MAX_NEW_TOKENS, DEFAULT_SPECULATIVE_K

    parser.add_argument("model", metavar="MODEL_DIR", help="folder written by `export --kv-cache` (or its model.onnx)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (needs tokenizer.json in the folder)")
    prompt.add_argument("--input-ids", metavar="1,2,3", help="prompt token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                        help=f"tokens to generate (default {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--providers", default="cpu", metavar="cpu|cuda|tensorrt",
                        help="ONNX Runtime execution provider(s), comma-separated; every one must be what runs (default cpu)")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: all)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="then among the most likely tokens whose probability reaches p (default 1.0: all)")
    parser.add_argument("--threads", type=int,
                        help="ONNX Runtime intra-op threads, at most the CPUs this process may use (default: ONNX "
                        "Runtime's)")
    parser.add_argument("--speculative", metavar="ngram|DRAFT_DIR",
                        help="speculative decoding: propose tokens by prompt lookup (ngram) or with a draft model "
                        "(a folder written by `export --kv-cache` with the same tokenizer) and check several in one "
                        "run; greedy output is unchanged, sampling keeps the model's distribution")
    parser.add_argument("--speculative-k", type=int, metavar="K",
                        help=f"--speculative: at most K tokens proposed a run, fewer while they fail (default "
                        f"{DEFAULT_SPECULATIVE_K})")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--input-ids {text!r} is not a comma-separated list of integers, e.g. 1,2,3") from None
    if not ids:
        raise UserError("--input-ids is empty; give at least one token id")
    return ids


def run(args: argparse.Namespace) -> int:
    from rmsnorm_deploy.decoder.generate import (DEFAULT_SPECULATIVE_K, KVCacheModel, Sampling, SpeculationOptions,
                                                 generate)
    from rmsnorm_deploy.runners.onnxruntime import check_threads

    sampling = Sampling(do_sample=args.sample, seed=args.seed, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p)
    check_threads(args.threads)  # before the model is read
    if args.speculative_k is not None and args.speculative is None:
        raise UserError("--speculative-k needs --speculative ngram|DRAFT_DIR")
    k = DEFAULT_SPECULATIVE_K if args.speculative_k is None else args.speculative_k
    if k < 1:
        raise UserError(f"--speculative-k must be an integer >= 1, got {k}")
    providers = [p for p in args.providers.split(",") if p.strip()]
    ids = parse_ids(args.input_ids) if args.input_ids is not None else None
    model = KVCacheModel(args.model, providers, intra_op_threads=args.threads)
    draft = None
    if args.speculative not in (None, "ngram"):
        draft = KVCacheModel(args.speculative, providers, intra_op_threads=args.threads)
    with model, (draft or contextlib.nullcontext()):
        prompt = ids if ids is not None else model.encode(args.prompt)
        speculation = None
        if args.speculative is not None:
            speculation = SpeculationOptions(draft or "ngram", k)
        result = generate(model, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling,
                          speculation=speculation)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    if result.text is not None:
        print(result.text[0])
    else:
        print("tokens: " + ",".join(str(t) for t in result.tokens[0]))
    print(f"prefill {result.prefill_ms:.2f} ms ({len(prompt)} tokens), decode {result.decode_ms_per_token:.3f} ms/token "
          f"over {result.steps} steps, {result.tokens_per_s:.1f} tokens/s "
          f"on {','.join(result.providers)}")
    if result.speculation is not None:
        spec = result.speculation
        print(f"speculation ({spec['proposer']}, k <= {spec['max_k']}): {spec['accepted']} of {spec['proposed']} "
              f"proposed tokens accepted ({100 * spec['acceptance_rate']:.0f} %), {spec['tokens_per_pass']:.2f} "
              f"tokens per run of the model")
    return 0
