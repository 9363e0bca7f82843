"""Perplexity of a KV-cache model over a text, in llama.cpp's scheme, and with --kl-divergence its
distance to a reference model: what ``llama-perplexity`` and ``llama-perplexity --kl-divergence``
report.

Either model is a folder ``export --kv-cache`` wrote, or one onnxruntime-genai's builder or
optimum's ``ORTModelForCausalLM`` export wrote (``decoder.kv_folders``: told apart by its files,
anything else refused in one line). The text (--text FILE, UTF-8; default: the GNU GPL v3 shipped
with the package, what benchmarks/results/real_checkpoints.md measured) is tokenized with the
model folder's tokenizer.json; a folder without one takes token ids (--tokens FILE). The ids are
cut into chunks of --context tokens, each run alone from an empty cache, the second half of each
scored (negative log-likelihood in float64); with --stride N, windows of --context tokens advance
by N and each scores its last N tokens (``decoder.perplexity``). With --kl-divergence REF_DIR the
reference runs the same ids: mean, median, p99 and maximum of KL(reference || model) per scored
position, the share where both pick the same top token, and the reference's own perplexity. A
progress bar goes to stderr on a terminal (or with --progress). Exit code 2 on bad input."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from rmsnorm_deploy.errors import InputError, check_interrupted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rmsnorm_deploy.decoder.perplexity import DEFAULT_CONTEXT

    parser.add_argument("model", metavar="MODEL_DIR",
                        help="folder written by `export --kv-cache` (or its model.onnx), onnxruntime-genai's builder "
                             "or optimum's ORTModelForCausalLM export")
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--text", metavar="FILE",
                      help="UTF-8 text, tokenized with the folder's tokenizer.json (default: the GNU GPL v3 shipped "
                           "with rmsnorm-deploy, Debian's /usr/share/common-licenses/GPL-3)")
    text.add_argument("--tokens", metavar="FILE",
                      help="token ids instead of a text: integers separated by spaces, commas or newlines (a "
                           "JSON list too); each chunk starts with the BOS token when the first id is the model's")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, metavar="N",
                        help=f"tokens per chunk, llama-perplexity's -c (default {DEFAULT_CONTEXT})")
    parser.add_argument("--stride", type=int, metavar="N",
                        help="sliding windows instead of chunks: windows of --context tokens advancing by N, each "
                             "scoring its last N tokens (each with at least context - N tokens before it); "
                             "1 <= N < context")
    parser.add_argument("--kl-divergence", metavar="REF_DIR",
                        help="a reference model folder (e.g. the float32 export; ours, onnxruntime-genai's or "
                             "optimum's) run on the same token ids: KL divergence of the distributions, top-1 "
                             "agreement and its perplexity")
    parser.add_argument("--providers", default="cpu", metavar="cpu|cuda|tensorrt",
                        help="ONNX Runtime execution provider(s) of both models, comma-separated (default cpu)")
    parser.add_argument("--threads", type=int,
                        help="ONNX Runtime intra-op threads, at most the CPUs this process may use (default: ONNX "
                             "Runtime's)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--progress", action="store_true",
                        help="a progress bar on stderr even when it is not a terminal (on a terminal it is shown "
                             "anyway)")


def read_token_file(path: str) -> list[int]:
    """The ids of a --tokens file, or a one-line ``InputError``."""
    from rmsnorm_deploy.decoder.perplexity import read_text

    text = read_text(path).strip().removeprefix("[").removesuffix("]")
    parts = [t for t in re.split(r"[\s,]+", text) if t]
    try:
        ids = [int(t) for t in parts]
    except ValueError:
        bad = next(t for t in parts if not t.lstrip("-").isdigit())
        raise InputError(f"--tokens {path}: {bad[:40]!r} is not a token id; give integers separated by spaces, "
                         "commas or newlines") from None
    if not ids:
        raise InputError(f"--tokens {path} holds no token ids")
    return ids


def run(args: argparse.Namespace) -> int:
    import sys
    from contextlib import ExitStack

    from rmsnorm_deploy.decoder.divergence import divergence
    from rmsnorm_deploy.decoder.kv_folders import open_kv_folder
    from rmsnorm_deploy.decoder.perplexity import (
        SHIPPED_TEXT,
        SHIPPED_TEXT_NAME,
        check_stride,
        check_windows,
        leading_bos,
        perplexity,
        read_text,
        session_logits,
        text_ids,
        windows_of,
    )
    from rmsnorm_deploy.progress import ProgressBar
    from rmsnorm_deploy.runners.onnxruntime import check_threads

    check_threads(args.threads)  # before a model is read
    if args.stride is not None:
        check_stride(args.stride, args.context)
    for flag, path in (("--text", args.text), ("--tokens", args.tokens)):
        if path is not None and not Path(path).is_file():
            raise InputError(f"{flag} {path}: no such file")
    providers = [p for p in args.providers.split(",") if p.strip()]
    given_ids = read_token_file(args.tokens) if args.tokens is not None else None
    text = read_text(args.text or SHIPPED_TEXT) if given_ids is None else None
    with ExitStack() as stack:
        model = stack.enter_context(open_kv_folder(args.model, providers, intra_op_threads=args.threads))
        reference = None
        if args.kl_divergence is not None:
            reference = stack.enter_context(open_kv_folder(args.kl_divergence, providers,
                                                           intra_op_threads=args.threads))
            if reference.layout.vocab_size != model.layout.vocab_size:
                raise InputError(f"--kl-divergence {args.kl_divergence} has a vocabulary of "
                                 f"{reference.layout.vocab_size} tokens and {args.model} of {model.layout.vocab_size}; "
                                 "compare exports of the same model")
        if given_ids is not None:
            ids, bos, source = given_ids, leading_bos(given_ids, model.special.get("bos_token_id")), args.tokens
        elif model.tokenizer is None:
            raise InputError(f"{model.folder} has no tokenizer.json to read the text with; give token ids with "
                             "--tokens FILE")
        else:
            source = args.text or SHIPPED_TEXT_NAME
            ids, bos = text_ids(model, text)
        logits_of = session_logits(model, args.context)  # the context and the ids checked before any run
        windows = windows_of(ids, args.context, bos, args.stride)
        check_windows(windows, model.layout.vocab_size)
        bar = ProgressBar("perplexity", enabled=args.progress or sys.stderr.isatty())
        bar.update(0, len(windows))

        def on_window(done: int, total: int) -> None:
            check_interrupted()  # a Ctrl-C or SIGTERM ONNX Runtime swallowed stops the command here
            bar.update(done, total)

        if reference is not None:
            result = divergence(logits_of, session_logits(reference, args.context), windows, text_tokens=len(ids),
                                bos_token_id=bos, on_chunk=on_window, stride=args.stride)
        else:
            result = perplexity(model, ids, context=args.context, bos_token_id=bos, on_chunk=on_window,
                                stride=args.stride)
    data = {"model": str(args.model), "model_kind": _kind(model), "reference": args.kl_divergence,
            "reference_kind": _kind(reference) if reference is not None else None, "text": str(source),
            "providers": list(model.runner.actual_providers), "threads": args.threads, **result.to_dict()}
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    scheme = (f"windows of {result.context} advancing by {result.stride}, the last {result.stride} of each scored"
              if result.stride is not None else
              f"chunks of {result.context}, the second half of each scored")
    print(f"{args.model}: perplexity {result.perplexity:.4f} over {result.scored_tokens} tokens ({result.chunks} "
          f"{scheme}; BOS at each window: {result.bos_token_id}; {result.seconds:.1f} s)")
    if reference is not None:
        print(f"vs {args.kl_divergence}: {result.summary()}")
    return 0


def _kind(model: object) -> str:
    """Which writer's folder it is (``decoder.kv_folders``)."""
    return getattr(model, "kind", "rmsnorm-deploy")
