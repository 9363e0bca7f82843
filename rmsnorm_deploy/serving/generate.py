"""Generation over a KV-cache graph (``export --kv-cache``) in ONNX Runtime.

:class:`KVCacheModel` opens a model folder (or ``.onnx`` file): it reads the KV-cache layout
from the metadata (``exporter.kv_cache``; a model without it is refused), checks the graph's
real inputs and outputs against it, and creates the session through
:class:`~rmsnorm_deploy.runners.onnxruntime.OnnxRuntimeRunner` (the requested provider or a
one-line error, never a silent fallback). Special tokens come from the folder's
``genai_config.json`` (else ``config.json``), the tokenizer from ``tokenizer.json`` through
``tokenizers`` when the folder has one.

:func:`generate` runs the loop every serving stack runs: one prefill over the (left-padded)
prompts with an empty past, then one step per new token with ``sequence = 1``. That loop is
written once (:func:`decode_steps`); :func:`stream` hands out one prompt's new tokens as the
loop makes them (the streaming endpoint), :func:`generate` collects them. Each step's
``present`` tensors stay ``OrtValue``\\ s on the provider's device and are bound as the next
step's ``past`` through IOBinding; only the last position's logits come back to numpy.
Greedy by default (``argmax``, the first index on ties, as torch); sampling with a seeded
generator, a temperature and top-k as options. A row that emits an end-of-sequence token gets
the pad token afterwards, and the loop stops when every row has ended, as transformers'
``generate`` does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from rmsnorm_deploy.errors import InputError, UserError, one_line
from rmsnorm_deploy.exporter.kv_cache import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    POSITION_IDS,
    KVCacheLayout,
    check_io,
    graph_io,
    layout_of,
    left_padded,
    position_ids_for,
)

MODEL_FILE = "model.onnx"
DEFAULT_MAX_NEW_TOKENS = 32
#: ``generate``'s default special tokens: those of the model folder (genai_config.json / config.json).
FROM_FOLDER = "from the model folder"


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy when ``do_sample`` is false; otherwise softmax(logits / temperature) over the top-k."""

    do_sample: bool = False
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UserError(f"--seed must be an integer >= 0, got {self.seed!r}")
        if not (isinstance(self.temperature, (int, float)) and np.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(f"--temperature must be a finite number > 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"--top-k must be an integer >= 0 (0: no limit), got {self.top_k!r}")


@dataclasses.dataclass
class GenerationResult:
    prompts: list[list[int]]  # the prompt token ids of each row (without padding)
    tokens: list[list[int]]  # the new tokens of each row (pad after its end-of-sequence token)
    prefill_ms: float
    decode_ms_per_token: float  # mean time of one decode step (all rows together)
    steps: int  # decode steps run after the prefill
    providers: list[str]
    text: list[str] | None = None
    #: With ``return_logits``: each step's last-position logits, [batch, vocab] float32 arrays.
    step_logits: list[np.ndarray] | None = None

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second in the decode phase, over all rows."""
        if not self.steps or self.decode_ms_per_token <= 0:
            return 0.0
        return len(self.tokens) * 1000.0 / self.decode_ms_per_token

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "tokens": self.tokens, "text": self.text, "providers": self.providers,
                "prefill_ms": round(self.prefill_ms, 3), "decode_ms_per_token": round(self.decode_ms_per_token, 3),
                "decode_steps": self.steps, "tokens_per_s": round(self.tokens_per_s, 1)}


def model_file(path: str | os.PathLike) -> Path:
    """MODEL_DIR of ``generate``: a folder with ``model.onnx`` or an ``.onnx`` file."""
    p = Path(path)
    if p.is_dir():
        p = p / MODEL_FILE
        if not p.is_file():
            raise UserError(f"{path}: no {MODEL_FILE} in this folder; give the folder `export --kv-cache` wrote")
    elif not p.is_file():
        raise UserError(f"{path}: no such file or folder")
    return p


class KVCacheModel:
    """An exported KV-cache model in an ONNX Runtime session (a context manager)."""

    def __init__(self, path: str | os.PathLike, providers: Sequence[str] = ("cpu",), *,
                 intra_op_threads: int | None = None):
        from rmsnorm_deploy.graph.metadata import ModelMetadata
        from rmsnorm_deploy.graph.onnx_file import load_onnx
        from rmsnorm_deploy.runners.onnxruntime import OnnxRuntimeRunner, provider_name

        self.path = model_file(path)
        self.folder = self.path.parent
        for p in providers:
            provider_name(p)  # an unknown provider is refused before the model is read
        graph = load_onnx(self.path, load_external=False)
        self.metadata = ModelMetadata.read(graph)
        self.layout: KVCacheLayout = layout_of(self.metadata, what=str(self.path))
        inputs, outputs = graph_io(graph)
        check_io(self.layout, inputs, outputs, what=str(self.path))
        del graph
        self.special = _special_tokens(self.folder)
        self.tokenizer = _tokenizer(self.folder)
        self.runner = OnnxRuntimeRunner(self.path, providers, intra_op_threads=intra_op_threads)
        self._device = "cuda" if any(provider_name(p) != "CPUExecutionProvider" for p in providers) else "cpu"

    def __enter__(self) -> KVCacheModel:
        self.runner.activate()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runner.deactivate()

    @property
    def session(self) -> Any:
        if not self.runner.is_active:
            raise RuntimeError("KVCacheModel used outside its `with` block")
        return self.runner.session

    # -- inputs ---------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise UserError(f"{self.folder} has no tokenizer.json; give token ids with --input-ids instead of --prompt")
        ids = self.tokenizer.encode(prompt).ids
        if not ids:
            raise InputError("the prompt encodes to no tokens")
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def check_prompts(self, rows: Sequence[Sequence[int]], max_new_tokens: int, *,
                      name: str = "--max-new-tokens") -> None:
        """Refuse (``InputError``) empty prompts, ids outside the vocabulary, and prompts that with
        ``max_new_tokens`` new tokens do not fit the model; ``name`` is what the user calls that number."""
        lay = self.layout
        if not rows:
            raise InputError("no prompt given")
        for row in rows:
            if not len(row):
                raise InputError("a prompt has no tokens")
            bad = [t for t in row if not (isinstance(t, (int, np.integer)) and 0 <= int(t) < lay.vocab_size)]
            if bad:
                raise InputError(f"token id {bad[0]!r} is outside the model's vocabulary [0, {lay.vocab_size})")
        longest = max(len(r) for r in rows)
        if longest > lay.max_length:
            raise InputError(f"the prompt has {longest} tokens, longer than the model's maximum of {lay.max_length}")
        if longest + max_new_tokens > lay.max_length:
            raise InputError(f"{longest} prompt tokens + {max_new_tokens} new tokens exceed the model's maximum of "
                             f"{lay.max_length}; lower {name} to at most {lay.max_length - longest}")

    # -- one step -------------------------------------------------------------------------------
    def _ortvalue(self, array: np.ndarray) -> Any:
        import onnxruntime as ort
        from onnx import TensorProto

        array = np.ascontiguousarray(array)
        device = self._device if array.dtype != np.int64 else "cpu"
        if array.dtype.name == "bfloat16":
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), TensorProto.BFLOAT16)
        return ort.OrtValue.ortvalue_from_numpy(array, device, 0)

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, past: list[Any]) -> tuple[np.ndarray, list[Any]]:
        """One run: last-position logits (float32 numpy) and the presents (``OrtValue``\\ s)."""
        from rmsnorm_deploy.runners.onnxruntime import ortvalue_to_numpy

        lay = self.layout
        binding = self.session.io_binding()
        keep = [self._ortvalue(input_ids), self._ortvalue(attention_mask),
                self._ortvalue(position_ids_for(attention_mask, input_ids.shape[1]))]
        for name, value in zip((INPUT_IDS, ATTENTION_MASK, POSITION_IDS), keep):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(lay.past_names(), past):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(LOGITS, "cpu")
        for name in lay.present_names():
            binding.bind_output(name, self._device)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:
            raise UserError(f"ONNX Runtime failed to run a generation step: {one_line(exc)}") from None
        outputs = binding.get_outputs()
        logits = ortvalue_to_numpy(outputs[0])[:, -1, :].astype(np.float32)
        return logits, list(outputs[1:])

    def empty_past(self, batch: int) -> list[Any]:
        from rmsnorm_deploy.exporter.kv_cache import empty_past

        return [self._ortvalue(a) for a in empty_past(self.layout, batch).values()]


def _pick(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    if not sampling.do_sample:
        return np.argmax(logits, axis=-1).astype(np.int64)
    scaled = logits.astype(np.float64) / sampling.temperature
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -sampling.top_k, axis=-1)[:, -sampling.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=p) for p in probs], dtype=np.int64)


def check_max_new_tokens(max_new_tokens: Any, *, name: str = "--max-new-tokens") -> None:
    """Refuse (``InputError``) anything but an integer >= 1; ``name`` is what the user calls it."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"{name} must be an integer >= 1, got {max_new_tokens!r}")


@dataclasses.dataclass
class DecodeClock:
    """Where :func:`decode_steps` spent its time."""

    prefill_ms: float = 0.0
    decode_s: float = 0.0
    steps: int = 0  # decode steps run after the prefill


def _prepare(model: KVCacheModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             eos_token_id: int | Sequence[int] | str | None,
             pad_token_id: int | None) -> tuple[list[list[int]], set[int], int]:
    """The checked prompts, the end-of-sequence ids and the pad id (see :func:`generate`)."""
    check_max_new_tokens(max_new_tokens)
    rows = [[int(t) for t in r] for r in prompts]
    model.check_prompts(rows, max_new_tokens)
    if eos_token_id == FROM_FOLDER:
        eos_token_id = model.special.get("eos_token_id")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    pad = pad_token_id if pad_token_id is not None else model.special.get("pad_token_id")
    if pad is None:
        pad = min(eos) if eos else 0
    return rows, eos, pad


def decode_steps(model: KVCacheModel, rows: list[list[int]], *, max_new_tokens: int, sampling: Sampling,
                 eos: set[int], pad: int, clock: DecodeClock) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The decode loop (prompts already checked): each step's new token of every row, int64 [batch],
    with the last-position logits it was picked from; the model runs the next step only when asked
    for the next token. Times go to ``clock``."""
    ids, mask = left_padded(rows, pad)
    rng = np.random.default_rng(sampling.seed)
    batch = ids.shape[0]
    finished = np.zeros(batch, dtype=bool)
    start = time.perf_counter()
    logits, past = model.step(ids, mask, model.empty_past(batch))
    clock.prefill_ms = (time.perf_counter() - start) * 1000
    made = 0
    while True:
        token = _pick(logits, sampling, rng)
        token = np.where(finished, pad, token)
        finished |= np.isin(token, list(eos))
        made += 1
        yield token, logits
        if made == max_new_tokens or finished.all():
            return
        mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        started = time.perf_counter()
        logits, past = model.step(token[:, None], mask, past)
        clock.decode_s += time.perf_counter() - started
        clock.steps += 1


def generate(model: KVCacheModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             sampling: Sampling | None = None, return_logits: bool = False,
             eos_token_id: int | Sequence[int] | str | None = FROM_FOLDER,
             pad_token_id: int | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after each prompt (see the module docstring).

    ``eos_token_id``: the end-of-sequence ids; by default (:data:`FROM_FOLDER`) the folder's,
    ``None`` to never stop early. ``pad_token_id``: by default the folder's, else the first
    end-of-sequence id, else 0.
    """
    sampling = sampling or Sampling()
    rows, eos, pad = _prepare(model, prompts, max_new_tokens, eos_token_id, pad_token_id)
    clock = DecodeClock()
    new_tokens: list[np.ndarray] = []
    step_logits: list[np.ndarray] = []
    for token, logits in decode_steps(model, rows, max_new_tokens=max_new_tokens, sampling=sampling, eos=eos,
                                      pad=pad, clock=clock):
        new_tokens.append(token)
        if return_logits:
            step_logits.append(logits)
    tokens = np.stack(new_tokens, axis=1).tolist()
    text = [model.decode(t) for t in tokens] if model.tokenizer is not None else None
    return GenerationResult(
        prompts=rows, tokens=tokens, prefill_ms=clock.prefill_ms,
        decode_ms_per_token=clock.decode_s * 1000 / clock.steps if clock.steps else 0.0, steps=clock.steps,
        providers=list(model.runner.actual_providers), text=text,
        step_logits=step_logits if return_logits else None,
    )


def stream(model: KVCacheModel, prompt: Sequence[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
           sampling: Sampling | None = None, eos_token_id: int | Sequence[int] | str | None = FROM_FOLDER,
           pad_token_id: int | None = None) -> Iterator[int]:
    """One prompt's new tokens, one at a time, as :func:`generate` makes them (the same loop, so the
    same tokens). The request is checked here, before the first token is asked for."""
    sampling = sampling or Sampling()
    rows, eos, pad = _prepare(model, [prompt], max_new_tokens, eos_token_id, pad_token_id)
    steps = decode_steps(model, rows, max_new_tokens=max_new_tokens, sampling=sampling, eos=eos, pad=pad,
                         clock=DecodeClock())
    return (int(token[0]) for token, _ in steps)


def _special_tokens(folder: Path) -> dict[str, Any]:
    """bos/eos/pad ids from ``genai_config.json`` (else ``config.json``); damaged files are an error."""
    from rmsnorm_deploy.exporter.genai_config import read_genai_config, special_tokens

    genai = read_genai_config(folder)
    if genai is not None:
        return special_tokens(genai["model"])
    path = folder / "config.json"
    if path.is_file():
        try:
            return special_tokens(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: not readable JSON ({exc})") from None
    return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _tokenizer(folder: Path) -> Any:
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from rmsnorm_deploy.optional import require

    tokenizers = require("tokenizers", "reading the model folder's tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception type
        raise UserError(f"{path}: tokenizers cannot read it ({one_line(exc)})") from None
