"""Prompt lookup's speed-up at the 1B shape, measured with the acceptance real text gives.

A random-weight model does not copy its prompt, so prompt lookup's proposals are all rejected on it
(``speculative.md``, "1B shape") and its speed-up on grounded text cannot be measured directly. What
a speed-up is made of can: how many proposed tokens the text lets the model accept (a property of
the checkpoint and the prompt) and what a run over several tokens costs (a property of the graph's
shape). This benchmark takes the first from a real checkpoint and the second from the 1B shape:

1. **Record**: ``generate --speculative ngram`` on real SmolLM2-135M-Instruct (``--source DIR``, a
   ``--kv-cache --target onnxruntime`` export) over ``speculative.py``'s prompts, greedy; for every
   run that checked proposals, how many tokens were proposed and how many the model kept.
2. **Replay**: on the random-weight LLaMA-3.2-1B shape (``kv_decode_quantized.LLAMA_1B``, float32,
   ``--target onnxruntime --share-buffer``, written here), the same ``Speculator`` (adaptive k,
   one-run verification, rollback) with a proposer that knows the 1B model's own greedy tokens (from
   the run without speculation) and proposes them right for exactly as many tokens as the recorded
   run kept, then a wrong one. The 1B model accepts what SmolLM2 accepted, and pays its own cost.

As a check of the method, the replay runs on SmolLM2 too: its ratio should match real lookup's.
Every generation stops where SmolLM2's answer ends (its end-of-sequence token; at 1B, the same
number of tokens). Rounds interleave the modes; ratios are taken within a round. Greedy tokens of every replay are
compared with the run without speculation (they must be identical: the proposals only decide how
many tokens a run checks, the model decides every token).

    python benchmarks/speculative_replay.py --source SMOLLM2_FP32_DIR [--rounds 2] [--new-tokens 48]

Writes ``results/speculative_replay.{json,md}``. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kv_decode_quantized import LLAMA_1B  # noqa: E402
from speculative import PROMPTS, chat_ids  # noqa: E402

from rmsnorm_deploy.decoder.loop import decode_loop  # noqa: E402
from rmsnorm_deploy.decoder.speculative import PromptLookup, Speculator  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


class RecordingLookup(PromptLookup):
    """Prompt lookup that records ``(proposed, kept)`` for every run that checked proposals."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[tuple[int, int]] = []
        self._at = self._proposed = 0

    def propose(self, ctx, k):
        proposal, q = super().propose(ctx, k)
        self._at, self._proposed = ctx.length, proposal.shape[1]
        return proposal, q

    def keep(self, length: int) -> None:
        self.runs.append((self._proposed, length - self._at))


class ReplayProposer:
    """Proposes the model's own greedy continuation ``truth`` right for as many tokens as the
    recorded run kept, then a wrong token (the proposals after it are never looked at)."""

    name = "replay"

    def __init__(self, truth: list[int], prompt: int, runs: list[tuple[int, int]], vocab: int):
        self.truth, self.prompt, self.runs, self.vocab = truth, prompt, runs, vocab
        self.index = 0

    def start(self, batch: int, sampling) -> None:
        self.index = 0

    def propose(self, ctx, k):
        if self.index >= len(self.runs):
            return np.zeros((1, 0), np.int64), None
        proposed, kept = self.runs[self.index]
        self.index += 1
        made = ctx.length - self.prompt
        n = min(k, proposed, len(self.truth) - made)
        right = self.truth[made:made + n]
        tokens = [t if i < kept else (t + 1) % self.vocab for i, t in enumerate(right)]
        return np.asarray([tokens], np.int64).reshape(1, -1), None

    def keep(self, length: int) -> None:
        pass


def timed(step, ids: list[int], new_tokens: int, speculator=None, eos=()) -> tuple[list[int], float, dict | None]:
    """Greedy tokens, decode tokens/s and speculation stats of one generation (stopping at ``eos``)."""
    result = decode_loop(step, np.asarray([ids], np.int64), max_new_tokens=new_tokens, speculation=speculator,
                         eos_token_ids=eos)
    tps = 1000.0 / result.decode_ms_per_token if result.steps else 0.0
    return result.tokens[0].tolist(), tps, (speculator.stats.to_dict() if speculator is not None else None)


def write_1b(out: Path) -> Path:
    from rmsnorm_deploy.decoder.convention import KVCacheLayout
    from rmsnorm_deploy.decoder.genai_config import write_serving_files
    from rmsnorm_deploy.decoder.ort_export import write_ort_decoder
    from rmsnorm_deploy.exporter import hf
    from rmsnorm_deploy.graph.metadata import ModelMetadata

    if (out / "model.onnx").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    loaded = hf.from_config(dict(LLAMA_1B), "float32", seed=0)
    path = out / "model.onnx"
    decoder = write_ort_decoder(loaded, path, force=True, share_buffer=True, max_length=512)
    write_serving_files(path, KVCacheLayout.from_dict(ModelMetadata.read(decoder.model).kv_cache), loaded.source,
                        force=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="real SmolLM2 export (--kv-cache --target onnxruntime)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/spec-1b"), help="where the 1B folder is written")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    args = parser.parse_args()
    from rmsnorm_deploy.decoder.generate import KVCacheModel

    names = args.prompts.split(",")
    recorded: dict[str, dict] = {}
    rows: list[dict] = []
    with KVCacheModel(args.source, intra_op_threads=args.threads) as small:
        prompts = {p: chat_ids(args.source, PROMPTS[p][1]) for p in names}
        eos = small.special.get("eos_token_id")  # the answer ends there, as generate's does
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        for p, ids in prompts.items():
            lookup = RecordingLookup()
            tokens, _, stats = timed(small.stepper, ids, args.new_tokens, Speculator(lookup, args.k), eos)
            recorded[p] = {"runs": lookup.runs, "stats": stats, "tokens": tokens}
        # the method's check on the checkpoint the acceptance came from: replay against real lookup
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for p, ids in prompts.items():
                truth, tps, _ = timed(small.stepper, ids, args.new_tokens, eos=eos)
                if truth != recorded[p]["tokens"]:
                    raise SystemExit(f"{p}: lookup changed SmolLM2's greedy tokens")
                times.setdefault((p, "none"), []).append(tps)
                _, tps, _ = timed(small.stepper, ids, args.new_tokens, Speculator(PromptLookup(), args.k), eos)
                times.setdefault((p, "ngram"), []).append(tps)
                replay = ReplayProposer(truth, len(ids), recorded[p]["runs"], small.layout.vocab_size)
                got, tps, stats = timed(small.stepper, ids, args.new_tokens, Speculator(replay, args.k), eos)
                if got != truth:
                    raise SystemExit(f"{p}: the replay changed SmolLM2's greedy tokens")
                times.setdefault((p, "replay"), []).append(tps)
                recorded[p]["small_replay_stats"] = stats
                print(f"[smollm2 round {r}] {p}: none {times[(p, 'none')][-1]:.1f} ngram {times[(p, 'ngram')][-1]:.1f}"
                      f" replay {tps:.1f} tok/s", file=sys.stderr, flush=True)
        for p in names:
            for mode in ("ngram", "replay"):
                ratios = [a / b for a, b in zip(times[(p, mode)], times[(p, "none")])]
                stats = recorded[p]["stats"] if mode == "ngram" else recorded[p]["small_replay_stats"]
                rows.append({"model": "SmolLM2-135M fp32 (real)", "prompt": p, "kind": PROMPTS[p][0], "mode": mode,
                             "tokens_per_s": statistics.median(times[(p, mode)]),
                             "none_tokens_per_s": statistics.median(times[(p, "none")]),
                             "ratio": statistics.median(ratios), "ratios": ratios,
                             "acceptance": stats["acceptance_rate"], "tokens_per_pass": stats["tokens_per_pass"],
                             "identical": True})
    folder = write_1b(args.work / "llama-1b-fp32")
    with KVCacheModel(folder, intra_op_threads=args.threads) as big:
        ids = [int(t) for t in np.random.default_rng(0).integers(10, big.layout.vocab_size, 48)]
        times = {}
        stats_of: dict[str, dict] = {}
        truth = timed(big.stepper, ids, args.new_tokens)[0]
        for r in range(args.rounds):
            clock = time.perf_counter()
            for p in names:  # as long as SmolLM2's answer, so that the replay covers every run
                length = len(recorded[p]["tokens"])
                got, tps, _ = timed(big.stepper, ids, length)
                times.setdefault((p, "none"), []).append(tps)
                replay = ReplayProposer(truth, len(ids), recorded[p]["runs"], big.layout.vocab_size)
                got, tps, stats_of[p] = timed(big.stepper, ids, length, Speculator(replay, args.k))
                if got != truth[:length]:
                    raise SystemExit(f"{p}: the replay changed the 1B model's greedy tokens")
                times.setdefault((p, "replay"), []).append(tps)
            print(f"[1b round {r}] {time.perf_counter() - clock:.0f}s "
                  + ", ".join(f"{p} {times[(p, 'replay')][-1] / times[(p, 'none')][-1]:.2f}x" for p in names),
                  file=sys.stderr, flush=True)
        for p in names:
            ratios = [a / b for a, b in zip(times[(p, "replay")], times[(p, "none")])]
            rows.append({"model": "LLaMA-3.2-1B shape fp32 (random weights)", "prompt": p, "kind": PROMPTS[p][0],
                         "mode": "replay", "tokens_per_s": statistics.median(times[(p, "replay")]),
                         "none_tokens_per_s": statistics.median(times[(p, "none")]), "ratio": statistics.median(ratios),
                         "ratios": ratios, "acceptance": stats_of[p]["acceptance_rate"],
                         "tokens_per_pass": stats_of[p]["tokens_per_pass"], "identical": True})
    setup = {"source": str(args.source), "rounds": args.rounds, "new_tokens": args.new_tokens, "answer_tokens": {p: len(recorded[p]["tokens"]) for p in names}, "k": args.k,
             "threads": args.threads, "one_b": "LLAMA_1B of kv_decode_quantized.py, float32, --target onnxruntime "
             "--share-buffer, max_length 512, seed 0; prompt: 48 random token ids"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speculative_replay.json").write_text(json.dumps({"setup": setup, "rows": rows,
                                                                "recorded": {p: recorded[p]["runs"] for p in names}},
                                                               indent=1))
    lines = ["# Prompt lookup's speed-up at the 1B shape, with real text's acceptance (`speculative_replay.py`)", "",
             f"Greedy, batch 1, {args.threads} threads, up to {args.new_tokens} new tokens, k <= {args.k}, "
             f"{args.rounds} interleaved rounds (ratios within a round, medians shown); each answer stops at SmolLM2's end of "
             "sequence (new tokens: " + ", ".join(f"{p} {len(recorded[p]['tokens'])}" for p in names) + "; the 1B "
             "replay runs as many). `ngram`: prompt lookup on "
             "the real checkpoint; `replay`: proposals right for exactly as many tokens as the lookup's run on real "
             "SmolLM2 kept (see the script's docstring). Every row's greedy tokens equal the run without speculation.",
             "", "| model | prompt | kind | mode | tok/s without | tok/s with | ratio (rounds) | acceptance | tokens/run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['prompt']} | {row['kind']} | {row['mode']} | "
                     f"{row['none_tokens_per_s']:.2f} | {row['tokens_per_s']:.2f} | {row['ratio']:.2f}x "
                     f"({', '.join(f'{x:.2f}' for x in row['ratios'])}) | {row['acceptance']:.2f} | "
                     f"{row['tokens_per_pass']:.2f} |")
    (RESULTS / "speculative_replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
