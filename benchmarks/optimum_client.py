"""optimum-onnx as a client of an ``export --kv-cache`` folder: same tokens, and a timed contender.

Runs with a Python that has optimum-onnx, which needs transformers < 4.58 and so lives in its own
environment, never beside this package (see docs/kv-cache.md for the exact commands). It does not
import rmsnorm_deploy: it sees only the folder, as an optimum user would.

    PY=/work/venv-optimum/bin/python
    rmsnorm-deploy generate FOLDER --input-ids 5,17,99,3 --max-new-tokens 16 --json > ours.json
    $PY benchmarks/optimum_client.py check FOLDER ours.json

``check`` loads FOLDER with ``ORTModelForCausalLM.from_pretrained(FOLDER)``, generates greedily
from the same prompts with transformers' ``generate`` (rows left-padded, end-of-sequence and pad
tokens from the folder's generation config, as ``rmsnorm-deploy generate`` takes them from the
folder) and compares the new tokens with ``tokens`` in the JSON ``rmsnorm-deploy generate --json``
wrote. It prints one JSON object and exits 0 when every token is equal, 1 when not, 2 on bad
input, in one line (a folder without ``model.onnx`` or one optimum cannot load, a JSON without
prompts and tokens).

``serve FOLDER [--export]`` is the worker ``benchmarks/bench_kv_decode.py --optimum-python``
drives: one JSON request per line on stdin (``{"ids": [[...]], "new_tokens": N}``), one JSON
answer per line on stdout (``{"tokens", "prefill_s", "decode_s", "step_s"}``), greedy, end-of-sequence
ignored, 2 intra-op threads, ORT_ENABLE_ALL. The prefill is the time to the first new token; the
decode time runs from there to the last token (a stopping criterion stamps each step; ``step_s``
holds each step's seconds). With
``--export`` FOLDER is a Hugging Face folder that optimum exports itself first (its own graph).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

THREADS = 2


def fail(message: str, code: int = 2) -> int:
    print(f"optimum_client: error: {message}", file=sys.stderr)
    return code


def session_options() -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return so


def load(folder: str, *, export: bool = False) -> Any:
    from optimum.onnxruntime import ORTModelForCausalLM

    return ORTModelForCausalLM.from_pretrained(folder, export=export, provider="CPUExecutionProvider",
                                               session_options=session_options())


def left_padded(rows: list[list[int]], pad: int) -> tuple[Any, Any]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.int64)
        mask[i, width - len(row):] = 1
    return ids, mask


class StepClock:
    """A stopping criterion that never stops: it stamps the time each new token is out."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def greedy(model: Any, ids: Any, mask: Any, new_tokens: int, *, eos: Any, pad: int) -> tuple[Any, float, list[float]]:
    """``new_tokens`` greedy tokens (fewer if every row ended); the prefill's seconds and each decode step's."""
    from transformers import StoppingCriteriaList

    clock = StepClock()
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                         eos_token_id=eos, pad_token_id=pad, stopping_criteria=StoppingCriteriaList([clock]))
    stamps = clock.stamps
    prefill = stamps[0] - start if stamps else 0.0
    return out[:, ids.shape[1]:], prefill, [b - a for a, b in zip(stamps, stamps[1:])]


def check(folder: str, expected_path: str) -> int:
    try:
        expected = json.loads(Path(expected_path).read_text(encoding="utf-8"))
        prompts, tokens = expected["prompts"], expected["tokens"]
        if not prompts or len(prompts) != len(tokens) or not all(isinstance(r, list) and r for r in prompts):
            raise ValueError("prompts and tokens must be lists of the same length, every prompt non-empty")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return fail(f"{expected_path}: not the JSON of `rmsnorm-deploy generate --json` ({exc!r})")
    if not (Path(folder) / "model.onnx").is_file():  # else optimum would quietly export from a Hub name
        return fail(f"{folder}: no model.onnx; give the folder `rmsnorm-deploy export --kv-cache` wrote")
    try:
        model = load(folder)
    except Exception as exc:  # noqa: BLE001 - optimum and transformers raise many types
        return fail(f"ORTModelForCausalLM cannot load {folder}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else 0
    ids, mask = left_padded(prompts, pad)
    new_tokens = max(len(t) for t in tokens)
    out, prefill, steps = greedy(model, ids, mask, new_tokens, eos=gen.eos_token_id, pad=pad)
    got = out.tolist()
    same = got == tokens
    import optimum.version
    import transformers

    print(json.dumps({"same_tokens": same, "ours": tokens, "optimum_tokens": got, "class": type(model).__name__,
                      "use_cache": bool(model.config.use_cache), "io_binding": bool(model.use_io_binding),
                      "optimum_version": optimum.version.__version__, "transformers": transformers.__version__,
                      "prefill_ms": round(prefill * 1e3, 3),
                      "decode_ms_per_token": round(sum(steps) * 1e3 / max(1, len(steps)), 3)}, indent=1))
    return 0 if same else 1


def serve(folder: str, export: bool) -> int:
    import torch

    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="optimum-export-") as tmp:
        model = load(folder, export=export)
        if export:  # optimum's own graph, saved once so that its node count can be read
            model.save_pretrained(tmp)
        print(json.dumps({"ready": True, "model": str(Path(tmp) / "model.onnx") if export else folder}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            ids = torch.tensor(request["ids"], dtype=torch.int64)
            out, prefill, steps = greedy(model, ids, torch.ones_like(ids), int(request["new_tokens"]), eos=None,
                                         pad=0)
            print(json.dumps({"tokens": out.tolist(), "prefill_s": prefill, "decode_s": sum(steps), "step_s": steps}),
                  flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="same greedy tokens as `rmsnorm-deploy generate --json`")
    c.add_argument("folder")
    c.add_argument("expected", help="the JSON `rmsnorm-deploy generate FOLDER ... --json` printed")
    s = sub.add_parser("serve", help="a timed greedy worker for bench_kv_decode.py (JSON lines)")
    s.add_argument("folder")
    s.add_argument("--export", action="store_true", help="FOLDER is a Hugging Face folder: optimum exports it")
    args = parser.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("transformers", "optimum"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if args.command == "check":
        return check(args.folder, args.expected)
    return serve(args.folder, args.export)


if __name__ == "__main__":
    sys.exit(main())
